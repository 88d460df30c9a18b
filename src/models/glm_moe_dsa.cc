// GLM-5 (glm_moe_dsa) and DeepSeek-V3 (deepseek_v3): multi-head latent attention (layers/mla.h), with GLM-5's DSA
// indexer; the first first_k_dense_replace layers a dense SwiGLU MLP, the others an MoE with sigmoid noaux_tc
// routing and ungated shared experts; plain RMSNorms. docs/model-specs.md §3.
#include "layers/mla.h"
#include "models/builders.h"

namespace tern {
namespace {

// Layer `layer`'s MLA; its indexer is the config's indexer_types[layer], or full for the MTP layer (layer
// num_hidden_layers, past the config's per-layer lists).
Expected<std::unique_ptr<Mixer>> build_mla(const ModelConfig& c, WeightStore& w, const WeightSchema& schema,
                                           int64_t layer, bool latent_fp8, int64_t& last_full_indexer) {
  auto name = [&](std::string_view rest) { return layer_tensor(schema, layer, rest); };
  const int64_t h = c.hidden_size, nh = c.num_attention_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  MlaWeights m;
  // transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps, 1e-6.
  constexpr double kLatentEps = 1e-6;
  if (c.q_lora_rank > 0) {
    TERN_ASSIGN_OR_RETURN(m.q_a_proj, w.linear(name("self_attn.q_a_proj"), c.q_lora_rank, h));
    TERN_ASSIGN_OR_RETURN(m.q_a_norm, build_norm(w, name("self_attn.q_a_layernorm.weight"), c.q_lora_rank,
                                                 kLatentEps, false));
    TERN_ASSIGN_OR_RETURN(m.q_b_proj, w.linear(name("self_attn.q_b_proj"), nh * qk, c.q_lora_rank));
  } else {
    TERN_ASSIGN_OR_RETURN(m.q_proj, w.linear(name("self_attn.q_proj"), nh * qk, h));
  }
  TERN_ASSIGN_OR_RETURN(m.kv_a_proj, w.linear(name("self_attn.kv_a_proj_with_mqa"),
                                              c.kv_lora_rank + c.qk_rope_head_dim, h));
  TERN_ASSIGN_OR_RETURN(m.kv_a_norm, build_norm(w, name("self_attn.kv_a_layernorm.weight"), c.kv_lora_rank,
                                                kLatentEps, false));
  TERN_ASSIGN_OR_RETURN(m.kv_b_proj, w.linear(name("self_attn.kv_b_proj"),
                                              nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank));
  TERN_ASSIGN_OR_RETURN(m.o_proj, w.linear(name("self_attn.o_proj"), h, nh * c.v_head_dim));
  MlaShape s{.n_heads = m.o_proj.in_features() / c.v_head_dim,
             .q_lora_rank = c.q_lora_rank,
             .kv_lora_rank = c.kv_lora_rank,
             .qk_nope_head_dim = c.qk_nope_head_dim,
             .qk_rope_head_dim = c.qk_rope_head_dim,
             .v_head_dim = c.v_head_dim,
             // Under a scaled RoPE (DeepSeek-V3's yarn) times get_mscale(factor, mscale_all_dim)^2.
             .scale = static_cast<float>(mla_softmax_mscale(c.rope) / std::sqrt(static_cast<double>(qk))),
             .rope_interleaved = c.rope.interleaved};
  TERN_ASSIGN_OR_RETURN(RopeFrequencies frequencies, rope_frequencies(c.rope, c.qk_rope_head_dim));
  if (latent_fp8) {
    if (c.kv_lora_rank % kLatentFp8Tile != 0) {
      return make_error("an FP8 latent cache needs kv_lora_rank a multiple of {} (one scale per {} values); this model's "
                        "is {}", kLatentFp8Tile, kLatentFp8Tile, c.kv_lora_rank);
    }
    // The tile scales as the engines these checkpoints come from keep them: fp32 for GLM-5, powers of two for
    // DeepSeek (docs/model-specs.md §3.2).
    s.latent_fp8 = c.architecture == Architecture::kDeepseekV3 ? LatentFp8Scales::kPow2 : LatentFp8Scales::kFp32;
  }
  if (c.index_topk > 0) {
    if (c.q_lora_rank <= 0) return make_error("a DSA indexer needs the query LoRA (q_lora_rank > 0) it reads");
    s.index_topk = c.index_topk;
    s.index_heads = c.index_n_heads;
    s.index_head_dim = c.index_head_dim;
    s.indexer_rope_interleaved = c.indexer_rope_interleave;
    if (layer >= c.num_hidden_layers || c.indexer_types[static_cast<size_t>(layer)] == IndexerType::kFull) {
      const int64_t d = c.index_head_dim;
      MlaIndexerWeights ix;
      TERN_ASSIGN_OR_RETURN(ix.wq_b, w.linear(name("self_attn.indexer.wq_b"), c.index_n_heads * d, c.q_lora_rank));
      TERN_ASSIGN_OR_RETURN(ix.wk, w.linear(name("self_attn.indexer.wk"), d, h));
      TERN_ASSIGN_OR_RETURN(ix.k_norm.weight, w.vector(name("self_attn.indexer.k_norm.weight"), {d}));
      TERN_ASSIGN_OR_RETURN(ix.k_norm.bias, w.vector(name("self_attn.indexer.k_norm.bias"), {d}));
      TERN_ASSIGN_OR_RETURN(ix.weights_proj, w.linear(name("self_attn.indexer.weights_proj"), c.index_n_heads, h));
      m.indexer = std::move(ix);
      last_full_indexer = layer;
    } else {
      if (last_full_indexer < 0) return make_error("layer {}: a shared DSA layer with no full one before it", layer);
      s.selection_layer = last_full_indexer;
    }
  }
  return std::make_unique<MlaAttention>(s, std::move(m),
                                        Rope(c.qk_rope_head_dim, c.rope.theta, std::move(frequencies)));
}

Expected<std::unique_ptr<FeedForward>> build_sigmoid_moe(const ModelConfig& c, WeightStore& w,
                                                         const WeightSchema& schema, int64_t layer) {
  auto group = std::find_if(schema.expert_groups.begin(), schema.expert_groups.end(),
                            [&](const ExpertGroupSpec& g) { return g.layer == layer; });
  if (group == schema.expert_groups.end()) return make_error("layer {} has no expert group in the schema", layer);
  if (c.n_group < 1 || c.num_experts % c.n_group != 0 || c.topk_group < 1 || c.topk_group > c.n_group) {
    return make_error("{} experts in {} groups of which {} are kept cannot be routed", c.num_experts, c.n_group,
                      c.topk_group);
  }
  MoeWeights m;
  TERN_ASSIGN_OR_RETURN(m.router, w.linear(layer_tensor(schema, layer, "mlp.gate"), c.num_experts, c.hidden_size));
  if (c.topk_method == "noaux_tc") {
    TERN_ASSIGN_OR_RETURN(m.correction_bias,
                          w.vector(layer_tensor(schema, layer, "mlp.gate.e_score_correction_bias"), {c.num_experts}));
  }
  TERN_ASSIGN_OR_RETURN(WeightStore::Experts experts, w.experts(*group));
  m.first_expert = experts.first;
  m.experts = std::move(experts.experts);
  if (c.n_shared_experts > 0) {
    TERN_ASSIGN_OR_RETURN(MlpWeights shared, build_mlp_weights(w, layer_tensor(schema, layer, "mlp.shared_experts"),
                                                               c.hidden_size, c.n_shared_experts *
                                                                                  c.moe_intermediate_size));
    m.shared_expert = std::make_unique<Mlp>(std::move(shared));
  }
  const MoeShape shape{.top_k = c.num_experts_per_tok, .renormalize = c.norm_topk_prob, .sigmoid = true,
                       .n_group = c.n_group, .topk_group = c.topk_group,
                       .routed_scaling = static_cast<float>(c.routed_scaling_factor), .shared_gate = false};
  return std::make_unique<Moe>(shape, std::move(m));
}

}  // namespace

Expected<void> glm_moe_dsa_build(CausalLm& model, WeightStore& w, const WeightSchema& schema,
                                 bool latent_fp8) {
  const ModelConfig& c = model.config();
  if (c.router_scoring != RouterScoring::kSigmoid) return make_error("MLA models with softmax routing are not supported");
  TERN_TRY(build_embeddings_and_head(model, w, schema, false));
  int64_t last_full_indexer = -1;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    DecoderLayer layer;
    TERN_TRY(build_layer_norms(c, w, schema, i, /*zero_centred=*/false, layer));
    TERN_ASSIGN_OR_RETURN(layer.mixer, build_mla(c, w, schema, i, latent_fp8, last_full_indexer));
    if (c.is_moe_layer(i)) {
      TERN_ASSIGN_OR_RETURN(layer.ffn, build_sigmoid_moe(c, w, schema, i));
    } else {
      TERN_ASSIGN_OR_RETURN(layer.ffn, build_dense_mlp(c, w, schema, i));
    }
    model.layers.push_back(std::move(layer));
  }
  return {};
}

Expected<void> glm_moe_dsa_build_draft(CausalLm& model, WeightStore& w, const WeightSchema& schema, bool latent_fp8) {
  const ModelConfig& c = model.config();
  if (!schema.draft_in_text_layers) return make_error("the weight schema declares no DeepSeek-style draft layer");
  const std::string& p = schema.draft_prefix;
  const int64_t h = c.hidden_size, li = c.num_hidden_layers;
  auto draft = std::make_unique<DraftModule>();
  TERN_ASSIGN_OR_RETURN(draft->norm_embedding, build_norm(w, p + "enorm.weight", h, c.rms_norm_eps, false));
  TERN_ASSIGN_OR_RETURN(draft->norm_hidden, build_norm(w, p + "hnorm.weight", h, c.rms_norm_eps, false));
  TERN_ASSIGN_OR_RETURN(draft->final_norm, build_norm(w, p + "shared_head.norm.weight", h, c.rms_norm_eps, false));
  TERN_ASSIGN_OR_RETURN(draft->fc, w.linear(p + "eh_proj", h, 2 * h));
  TERN_TRY(build_layer_norms(c, w, schema, li, /*zero_centred=*/false, draft->layer));
  int64_t last_full_indexer = -1;
  TERN_ASSIGN_OR_RETURN(draft->layer.mixer, build_mla(c, w, schema, li, latent_fp8, last_full_indexer));
  TERN_ASSIGN_OR_RETURN(draft->layer.ffn, build_sigmoid_moe(c, w, schema, li));
  model.draft = std::move(draft);
  return {};
}

}  // namespace tern
