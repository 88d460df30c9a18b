// Qwen3.5-MoE text model (and Qwen3-Next, which differs only in its fused GDN projections and its optional dense
// layers): zero-centred RMSNorms, Gated DeltaNet on "linear_attention" layers, gated attention with partial NeoX RoPE
// on "full_attention" layers, softmax top-k MoE (always renormalised for Qwen3.5) plus a sigmoid-gated shared expert.
// docs/model-specs.md §2.
#include "layers/gated_deltanet.h"
#include "models/builders.h"

namespace tern {
namespace {

Expected<std::unique_ptr<Mixer>> build_gated_deltanet(const ModelConfig& c, WeightStore& w, const WeightSchema& schema,
                                                      int64_t layer) {
  const bool next = c.architecture == Architecture::kQwen3Next;
  const int64_t h = c.hidden_size, hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, kernel = c.linear_conv_kernel_dim;
  const int64_t key_width = hk * dk, value_width = hv * dv, channels = 2 * key_width + value_width;
  auto name = [&](std::string_view rest) { return layer_tensor(schema, layer, rest); };
  GatedDeltaNetWeights g;
  // The GDN projections stay BF16 in every known NVFP4 export (W4A4 applies to NVFP4 layers only).
  if (next) {
    TERN_ASSIGN_OR_RETURN(g.in_proj_qkvz, w.linear(name("linear_attn.in_proj_qkvz"), 2 * key_width + 2 * value_width,
                                                   h));
    TERN_ASSIGN_OR_RETURN(g.in_proj_ba, w.linear(name("linear_attn.in_proj_ba"), 2 * hv, h));
  } else {
    TERN_ASSIGN_OR_RETURN(g.in_proj_qkv, w.linear(name("linear_attn.in_proj_qkv"), channels, h));
    TERN_ASSIGN_OR_RETURN(g.in_proj_z, w.linear(name("linear_attn.in_proj_z"), value_width, h));
    TERN_ASSIGN_OR_RETURN(g.in_proj_b, w.linear(name("linear_attn.in_proj_b"), hv, h));
    TERN_ASSIGN_OR_RETURN(g.in_proj_a, w.linear(name("linear_attn.in_proj_a"), hv, h));
  }
  TERN_ASSIGN_OR_RETURN(g.out_proj, w.linear(name("linear_attn.out_proj"), h, value_width));
  TERN_ASSIGN_OR_RETURN(g.conv_weight, w.vector(name("linear_attn.conv1d.weight"), {channels, 1, kernel}));
  TERN_ASSIGN_OR_RETURN(g.a_log, w.vector(name("linear_attn.A_log"), {hv}));
  TERN_ASSIGN_OR_RETURN(g.dt_bias, w.vector(name("linear_attn.dt_bias"), {hv}));
  TERN_ASSIGN_OR_RETURN(g.norm_weight, w.vector(name("linear_attn.norm.weight"), {dv}));
  // This rank's heads, as the projections were split (all of them on one device).
  const int64_t hv_rank = next ? g.in_proj_ba.out_features() / 2 : g.in_proj_b.out_features();
  GatedDeltaNetShape shape{.n_key_heads = hk * hv_rank / hv, .n_value_heads = hv_rank, .key_dim = dk, .value_dim = dv,
                           .conv_kernel = kernel, .norm_eps = static_cast<float>(c.rms_norm_eps),
                           .fused_per_key_head = next};
  return std::make_unique<GatedDeltaNet>(shape, std::move(g));
}

}  // namespace

Expected<void> qwen3_5_moe_build(CausalLm& model, WeightStore& w, const WeightSchema& schema) {
  const ModelConfig& c = model.config();
  const bool next = c.architecture == Architecture::kQwen3Next;
  TERN_TRY(build_embeddings_and_head(model, w, schema, true));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    DecoderLayer layer;
    TERN_TRY(build_layer_norms(c, w, schema, i, /*zero_centred=*/true, layer));
    if (c.layer_types[static_cast<size_t>(i)] == LayerType::kLinearAttention) {
      TERN_ASSIGN_OR_RETURN(layer.mixer, build_gated_deltanet(c, w, schema, i));
    } else {
      TERN_ASSIGN_OR_RETURN(layer.mixer, build_attention(c, w, schema, i, true));
    }
    if (c.is_moe_layer(i)) {
      TERN_ASSIGN_OR_RETURN(layer.ffn, build_moe(c, w, schema, i, next ? c.norm_topk_prob : true));
    } else {
      TERN_ASSIGN_OR_RETURN(layer.ffn, build_dense_mlp(c, w, schema, i));
    }
    model.layers.push_back(std::move(layer));
  }
  return {};
}

Expected<void> qwen3_5_moe_build_draft(CausalLm& model, WeightStore& w, const WeightSchema& schema) {
  const ModelConfig& c = model.config();
  const bool next = c.architecture == Architecture::kQwen3Next;
  const std::string& p = schema.draft_prefix;
  if (p.empty()) return make_error("the weight schema declares no draft module");
  const int64_t h = c.hidden_size, li = c.num_hidden_layers;
  auto draft = std::make_unique<DraftModule>();
  TERN_ASSIGN_OR_RETURN(draft->norm_embedding,
                        build_norm(w, p + "pre_fc_norm_embedding.weight", h, c.rms_norm_eps, true));
  TERN_ASSIGN_OR_RETURN(draft->norm_hidden, build_norm(w, p + "pre_fc_norm_hidden.weight", h, c.rms_norm_eps, true));
  TERN_ASSIGN_OR_RETURN(draft->final_norm, build_norm(w, p + "norm.weight", h, c.rms_norm_eps, true));
  TERN_ASSIGN_OR_RETURN(draft->fc, w.linear(p + "fc", h, 2 * h));
  TERN_TRY(build_layer_norms(c, w, schema, li, /*zero_centred=*/true, draft->layer));
  TERN_ASSIGN_OR_RETURN(draft->layer.mixer, build_attention(c, w, schema, li, true));
  TERN_ASSIGN_OR_RETURN(draft->layer.ffn, build_moe(c, w, schema, li, next ? c.norm_topk_prob : true));
  model.draft = std::move(draft);
  return {};
}

}  // namespace tern
