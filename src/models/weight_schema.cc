#include "models/weight_schema.h"

#include <fmt/format.h>

namespace tern {
namespace {

// Builds the schema layer by layer; each add_* mirrors one HF module and its parameter names.
class SchemaBuilder {
 public:
  SchemaBuilder(const ModelConfig& c, std::string_view prefix, bool with_draft) : c_(c) {
    schema_.text_prefix = prefix;
    schema_.num_layers = c.num_hidden_layers;
    if (with_draft && c.attention == AttentionKind::kMla) {  // DeepSeek-V3 / GLM-5: the extra decoder layer
      schema_.draft_in_text_layers = true;
      schema_.draft_prefix = fmt::format("{}layers.{}.", prefix, c.num_hidden_layers);
    } else if (with_draft) {
      schema_.draft_prefix = "mtp.";
    }
  }

  WeightSchema build() {
    const int64_t h = c_.hidden_size;
    param("embed_tokens.weight", {c_.vocab_size, h}, Shard::vocab());
    for (int64_t i = 0; i < c_.num_hidden_layers; ++i) add_layer(i);
    param("norm.weight", {h});
    schema_.tied_embeddings = c_.tie_word_embeddings;
    if (!schema_.draft_prefix.empty()) add_draft();
    schema_.linears.push_back({"lm_head", c_.vocab_size, h, LinearRole::kLmHead, -1, false, Shard::vocab()});
    add_skipped();
    return std::move(schema_);
  }

 private:
  std::string layer_name(int64_t layer, std::string_view rest) const {
    return fmt::format("{}{}", schema_.layer_prefix(layer), rest);
  }
  // Without a shard argument a tensor is replicated (norms, routers, MLA's latent projections, the indexer).
  void param(std::string_view rest, std::vector<int64_t> shape, Shard shard = {}) {
    schema_.params.push_back({schema_.text_prefix + std::string(rest), std::move(shape), std::move(shard)});
  }
  void layer_param(int64_t layer, std::string_view rest, std::vector<int64_t> shape, Shard shard = {}) {
    schema_.params.push_back({layer_name(layer, rest), std::move(shape), std::move(shard)});
  }
  void linear(int64_t layer, std::string_view rest, int64_t out, int64_t in, LinearRole role, Shard shard = {},
              bool bias = false) {
    schema_.linears.push_back({layer_name(layer, rest), out, in, role, layer, bias, std::move(shard)});
  }
  void state(int64_t layer, std::string_view rest, std::vector<int64_t> shape, Shard shard) {
    schema_.states.push_back({layer_name(layer, rest), std::move(shape), std::move(shard)});
  }

  // The draft module (MTP): [norm(embedding) ; norm(hidden)] -> fc -> one MoE decoder layer -> norm, sharing
  // embed_tokens and lm_head with the model. Qwen3.5 / Qwen3-Next (`mtp.*`): pre_fc_norm_embedding,
  // pre_fc_norm_hidden, fc, a full-attention layer, norm. DeepSeek-V3 / GLM-5 (decoder layer num_hidden_layers of
  // the text model): enorm, hnorm, eh_proj, an MLA layer (with the indexer, where the model has one),
  // shared_head.norm; the checkpoint's copies of embedding and lm_head there are skipped (add_skipped). fc and the
  // norms are replicated on every rank (fc is 2 * hidden^2: small beside the layer); the layer splits as the
  // model's own layers do.
  void add_draft() {
    const int64_t h = c_.hidden_size, i = c_.num_hidden_layers;
    const std::string& p = schema_.draft_prefix;
    const bool nextn = schema_.draft_in_text_layers;
    const std::vector<const char*> norms =
        nextn ? std::vector<const char*>{"enorm.weight", "hnorm.weight", "shared_head.norm.weight"}
              : std::vector<const char*>{"pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"};
    for (const char* norm : norms) schema_.params.push_back({p + norm, {h}, Shard{}});
    schema_.linears.push_back({p + (nextn ? "eh_proj" : "fc"), h, 2 * h, LinearRole::kDraftInput, i, false, Shard{}});
    layer_param(i, "input_layernorm.weight", {h});
    layer_param(i, "post_attention_layernorm.weight", {h});
    if (nextn) {
      add_mla(i);
    } else {
      add_attention(i);
    }
    add_moe(i);
  }

  void add_layer(int64_t i) {
    layer_param(i, "input_layernorm.weight", {c_.hidden_size});
    layer_param(i, "post_attention_layernorm.weight", {c_.hidden_size});
    if (c_.layer_types[static_cast<size_t>(i)] == LayerType::kLinearAttention) {
      add_gated_deltanet(i);
    } else if (c_.attention == AttentionKind::kMla) {
      add_mla(i);
    } else {
      add_attention(i);
    }
    if (c_.is_moe_layer(i)) {
      add_moe(i);
    } else {
      add_mlp(i, "mlp", c_.intermediate_size, LinearRole::kMlp);
    }
  }

  // Qwen3 attention, and the gated variant of Qwen3-Next / Qwen3.5 whose q_proj also yields the output gate
  // ([query | gate] per head, so a head's 2 * head_dim rows move together). Column-parallel by heads, KV heads
  // replicated when fewer than the ranks, o_proj row-parallel; q_norm / k_norm act per head and are replicated.
  void add_attention(int64_t i) {
    const int64_t h = c_.hidden_size, hd = c_.head_dim, nq = c_.num_attention_heads, nkv = c_.num_key_value_heads;
    const int64_t q_rows = hd * (c_.attention == AttentionKind::kGatedGqa ? 2 : 1);
    const bool bias = c_.attention_bias;
    const Shard kv = Shard::output({{nkv, hd, true}});
    linear(i, "self_attn.q_proj", nq * q_rows, h, LinearRole::kAttention, Shard::output({{nq, q_rows}}), bias);
    linear(i, "self_attn.k_proj", nkv * hd, h, LinearRole::kAttention, kv, bias);
    linear(i, "self_attn.v_proj", nkv * hd, h, LinearRole::kAttention, kv, bias);
    linear(i, "self_attn.o_proj", h, nq * hd, LinearRole::kAttention, Shard::input({{nq, hd}}), bias);
    layer_param(i, "self_attn.q_norm.weight", {hd});
    layer_param(i, "self_attn.k_norm.weight", {hd});
    for (const char* cache : {"self_attn.k_cache", "self_attn.v_cache"}) {
      state(i, cache, {nkv, hd}, Shard::output({{nkv, 1, true}}));
    }
  }

  // Gated DeltaNet: Qwen3.5 keeps q/k/v, z, b and a in separate projections; Qwen3-Next fuses them per key head.
  // Split by heads: the q, k channels by key heads and v, z, b, a, A_log, dt_bias by value heads, each part of
  // in_proj_qkv and of the conv1d channels [q | k | v] divided on its own; out_proj row-parallel by value heads;
  // the gated norm (per value head) replicated.
  void add_gated_deltanet(int64_t i) {
    const int64_t h = c_.hidden_size, kernel = c_.linear_conv_kernel_dim;
    const int64_t n_k = c_.linear_num_key_heads, dk = c_.linear_key_head_dim;
    const int64_t n_v = c_.linear_num_value_heads, dv = c_.linear_value_head_dim;
    const int64_t key_dim = n_k * dk, value_dim = n_v * dv;
    const std::vector<ShardSegment> qkv = {{n_k, dk}, {n_k, dk}, {n_v, dv}};
    const auto role = LinearRole::kLinearAttention;
    if (c_.architecture == Architecture::kQwen3Next) {  // per key head [q dk | k dk | v r*dv | z r*dv], [b r | a r]
      const int64_t r = n_k > 0 ? n_v / n_k : 0;
      linear(i, "linear_attn.in_proj_qkvz", 2 * key_dim + 2 * value_dim, h, role,
             Shard::output({{n_k, 2 * dk + 2 * r * dv}}));
      linear(i, "linear_attn.in_proj_ba", 2 * n_v, h, role, Shard::output({{n_k, 2 * r}}));
    } else {
      linear(i, "linear_attn.in_proj_qkv", 2 * key_dim + value_dim, h, role, Shard::output(qkv));
      linear(i, "linear_attn.in_proj_z", value_dim, h, role, Shard::output({{n_v, dv}}));
      linear(i, "linear_attn.in_proj_b", n_v, h, role, Shard::output({{n_v, 1}}));
      linear(i, "linear_attn.in_proj_a", n_v, h, role, Shard::output({{n_v, 1}}));
    }
    layer_param(i, "linear_attn.conv1d.weight", {2 * key_dim + value_dim, 1, kernel}, Shard::output(qkv));
    layer_param(i, "linear_attn.dt_bias", {n_v}, Shard::output({{n_v, 1}}));
    layer_param(i, "linear_attn.A_log", {n_v}, Shard::output({{n_v, 1}}));
    layer_param(i, "linear_attn.norm.weight", {dv});
    linear(i, "linear_attn.out_proj", h, value_dim, role, Shard::input({{n_v, dv}}));
    state(i, "linear_attn.conv_state", {2 * key_dim + value_dim, kernel - 1}, Shard::output(qkv));
    state(i, "linear_attn.recurrent_state", {n_v, dv, dk}, Shard::output({{n_v, 1}}));
  }

  // Multi-head latent attention (DeepSeek-V3, GLM-5), plus GLM-5's DSA indexer. The latent projections, their
  // norms, the latent cache and the whole indexer are replicated; q(_b)_proj and kv_b_proj split by heads, o_proj
  // row-parallel by heads.
  void add_mla(int64_t i) {
    const int64_t h = c_.hidden_size, n_heads = c_.num_attention_heads;
    const int64_t qk_head_dim = c_.qk_nope_head_dim + c_.qk_rope_head_dim;
    const auto role = LinearRole::kAttention;
    const Shard q_heads = Shard::output({{n_heads, qk_head_dim}});
    if (c_.q_lora_rank > 0) {
      linear(i, "self_attn.q_a_proj", c_.q_lora_rank, h, role);
      layer_param(i, "self_attn.q_a_layernorm.weight", {c_.q_lora_rank});
      linear(i, "self_attn.q_b_proj", n_heads * qk_head_dim, c_.q_lora_rank, role, q_heads);
    } else {
      linear(i, "self_attn.q_proj", n_heads * qk_head_dim, h, role, q_heads);
    }
    linear(i, "self_attn.kv_a_proj_with_mqa", c_.kv_lora_rank + c_.qk_rope_head_dim, h, role);
    layer_param(i, "self_attn.kv_a_layernorm.weight", {c_.kv_lora_rank});
    const int64_t kv_b_rows = c_.qk_nope_head_dim + c_.v_head_dim;
    linear(i, "self_attn.kv_b_proj", n_heads * kv_b_rows, c_.kv_lora_rank, role, Shard::output({{n_heads, kv_b_rows}}));
    linear(i, "self_attn.o_proj", h, n_heads * c_.v_head_dim, role, Shard::input({{n_heads, c_.v_head_dim}}));
    state(i, "self_attn.latent_cache", {c_.kv_lora_rank + c_.qk_rope_head_dim}, Shard::replicated());
    if (c_.architecture == Architecture::kGlmMoeDsa) {
      const int64_t index_dim = c_.index_head_dim;
      linear(i, "self_attn.indexer.wq_b", c_.index_n_heads * index_dim, c_.q_lora_rank, LinearRole::kIndexer);
      linear(i, "self_attn.indexer.wk", index_dim, h, LinearRole::kIndexer);
      layer_param(i, "self_attn.indexer.k_norm.weight", {index_dim});
      layer_param(i, "self_attn.indexer.k_norm.bias", {index_dim});
      linear(i, "self_attn.indexer.weights_proj", c_.index_n_heads, h, LinearRole::kIndexer);
      state(i, "self_attn.indexer.key_cache", {index_dim}, Shard::replicated());
    }
  }

  // Dense and shared-expert MLPs: gate/up column-parallel, down row-parallel, over the intermediate width.
  void add_mlp(int64_t i, std::string_view name, int64_t intermediate, LinearRole role) {
    const int64_t h = c_.hidden_size;
    linear(i, fmt::format("{}.gate_proj", name), intermediate, h, role, Shard::output({{intermediate, 1}}));
    linear(i, fmt::format("{}.up_proj", name), intermediate, h, role, Shard::output({{intermediate, 1}}));
    linear(i, fmt::format("{}.down_proj", name), h, intermediate, role, Shard::input({{intermediate, 1}}));
  }

  void add_moe(int64_t i) {
    const int64_t h = c_.hidden_size;
    linear(i, "mlp.gate", c_.num_experts, h, LinearRole::kRouter);
    if (c_.router_scoring == RouterScoring::kSigmoid && c_.topk_method == "noaux_tc") {
      layer_param(i, "mlp.gate.e_score_correction_bias", {c_.num_experts});
    }
    const int64_t inter = c_.moe_intermediate_size;  // the router is replicated, each expert split inside
    schema_.expert_groups.push_back({layer_name(i, "mlp.experts"), i, c_.num_experts, h, inter,
                                     Shard::output({{inter, 1}}), Shard::input({{inter, 1}}),
                                     Shard::output({{c_.num_experts, 1}})});
    if (c_.shared_expert_intermediate_size > 0) {  // Qwen3-Next / Qwen3.5: one shared expert behind a sigmoid gate
      add_mlp(i, "mlp.shared_expert", c_.shared_expert_intermediate_size, LinearRole::kSharedExpert);
      linear(i, "mlp.shared_expert_gate", 1, h, LinearRole::kSharedExpertGate);
    } else if (c_.n_shared_experts > 0) {  // DeepSeek-V3 / GLM-5: shared experts fused into one wider MLP
      add_mlp(i, "mlp.shared_experts", c_.n_shared_experts * c_.moe_intermediate_size, LinearRole::kSharedExpert);
    }
  }

  void add_skipped() {
    if (c_.has_vision) {
      for (std::string_view p : {"model.visual.", "model.vision_tower.", "visual."}) {
        schema_.skipped_prefixes.emplace_back(p);
        schema_.skipped_reasons.emplace_back("vision tower (tern serves the text model)");
      }
    }
    if (schema_.draft_prefix.empty()) {
      schema_.skipped_prefixes.emplace_back("mtp.");  // Qwen3.5 / Qwen3-Next multi-token prediction
      schema_.skipped_reasons.emplace_back(
          "multi-token-prediction layers (used only as the draft model of --speculative-algorithm mtp)");
    }
    for (int64_t m = 0; m < c_.num_mtp_layers; ++m) {  // DeepSeek-V3 / GLM-5 keep MTP as extra decoder layers
      const std::string layer = fmt::format("{}layers.{}.", schema_.text_prefix, c_.num_hidden_layers + m);
      if (m == 0 && schema_.draft_in_text_layers) {  // the draft module: all but its copies of embedding and head
        for (const char* copy : {"embed_tokens.", "shared_head.head."}) {
          schema_.skipped_prefixes.push_back(layer + copy);
          schema_.skipped_reasons.emplace_back("the MTP layer's copy of the model's embedding or lm_head (the "
                                               "model's own is used)");
        }
        continue;
      }
      schema_.skipped_prefixes.push_back(layer);
      schema_.skipped_reasons.emplace_back(
          "multi-token-prediction layers (used only as the draft model of --speculative-algorithm mtp)");
    }
  }

  const ModelConfig& c_;
  WeightSchema schema_;
};

}  // namespace

std::string weight_schema_text_prefix(const SafetensorsSet& tensors) {
  for (const TensorView* t : tensors.tensors()) {
    if (t->name.starts_with("model.language_model.")) return "model.language_model.";
  }
  return "model.";
}

std::string weight_schema_default_text_prefix(const ModelConfig& config) {
  return config.has_vision ? "model.language_model." : "model.";
}

std::string WeightSchema::layer_prefix(int64_t layer) const {
  if (layer >= num_layers && !draft_prefix.empty() && !draft_in_text_layers) {
    return fmt::format("{}layers.{}.", draft_prefix, layer - num_layers);
  }
  return fmt::format("{}layers.{}.", text_prefix, layer);
}

Expected<ExpertGroupRank> expert_group_rank(const ExpertGroupSpec& g, ShardRank rank) {
  if (!rank.expert_parallel) return ExpertGroupRank{0, g.num_experts, g.gate_up_shard, g.down_shard};
  if (g.num_experts % rank.world != 0) {
    return make_error("{}: {} experts do not divide among {} expert-parallel ranks (use a tensor-parallel size that "
                      "divides {}, or split every expert instead: no --enable-expert-parallel)", g.prefix,
                      g.num_experts, rank.world, g.num_experts);
  }
  TERN_ASSIGN_OR_RETURN(const std::vector<ShardPiece> pieces,
                        shard_pieces(g.experts_shard, g.num_experts, rank, g.prefix));
  return ExpertGroupRank{pieces.front().offset, pieces.front().length, Shard::replicated(), Shard::replicated()};
}

bool weight_schema_has_draft(const ModelConfig& config) {
  const Architecture a = config.architecture;
  return (a == Architecture::kQwen35Moe || a == Architecture::kQwen3Next || a == Architecture::kGlmMoeDsa ||
          a == Architecture::kDeepseekV3) &&
         config.num_mtp_layers > 0 && config.num_experts > 0;
}

WeightSchema weight_schema_build(const ModelConfig& config, std::string_view text_prefix, bool with_draft) {
  return SchemaBuilder(config, text_prefix, with_draft && weight_schema_has_draft(config)).build();
}

}  // namespace tern
