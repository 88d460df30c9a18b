// Qwen3 (dense): GQA attention with per-head RMSNorm on q and k before RoPE, SwiGLU MLP, plain RMSNorms.
// Also the shared builders of the Qwen family (builders.h).
#include <fmt/format.h>

#include "models/builders.h"

namespace tern {

std::string layer_tensor(const WeightSchema& schema, int64_t layer, std::string_view rest) {
  return fmt::format("{}{}", schema.layer_prefix(layer), rest);
}

Expected<RmsNorm> build_norm(WeightStore& w, const std::string& name, int64_t dim, double eps, bool zero_centred) {
  TERN_ASSIGN_OR_RETURN(std::vector<float> weight, w.vector(name, {dim}));
  return RmsNorm{std::move(weight), static_cast<float>(eps), zero_centred};
}

Expected<void> build_embeddings_and_head(CausalLm& model, WeightStore& w, const WeightSchema& schema,
                                         bool zero_centred) {
  const ModelConfig& c = model.config();
  const std::string& p = schema.text_prefix;
  TERN_ASSIGN_OR_RETURN(model.embed_tokens, w.dense_matrix(p + "embed_tokens.weight", c.vocab_size, c.hidden_size));
  // The vocabulary rows this rank holds (all of them on one device): embed_tokens and lm_head split alike.
  TERN_ASSIGN_OR_RETURN(const std::vector<ShardPiece> rows,
                        shard_pieces(Shard::vocab(), c.vocab_size, w.shard_rank(), p + "embed_tokens.weight"));
  model.vocab = {rows.empty() ? c.vocab_size : rows.front().offset, c.vocab_size};
  TERN_ASSIGN_OR_RETURN(model.final_norm, build_norm(w, p + "norm.weight", c.hidden_size, c.rms_norm_eps,
                                                     zero_centred));
  if (schema.tied_embeddings && !w.contains("lm_head.weight")) {
    model.lm_head = Linear("lm_head", model.embed_tokens);
    return {};
  }
  TERN_ASSIGN_OR_RETURN(model.lm_head, w.linear("lm_head", c.vocab_size, c.hidden_size));
  return {};
}

Expected<std::unique_ptr<Mixer>> build_attention(const ModelConfig& c, WeightStore& w, const WeightSchema& schema,
                                                 int64_t layer, bool gated) {
  const int64_t h = c.hidden_size, hd = c.head_dim, nq = c.num_attention_heads, nkv = c.num_key_value_heads;
  auto name = [&](std::string_view rest) { return layer_tensor(schema, layer, rest); };
  AttentionWeights a;
  TERN_ASSIGN_OR_RETURN(a.q_proj, w.linear(name("self_attn.q_proj"), nq * hd * (gated ? 2 : 1), h));
  TERN_ASSIGN_OR_RETURN(a.k_proj, w.linear(name("self_attn.k_proj"), nkv * hd, h));
  TERN_ASSIGN_OR_RETURN(a.v_proj, w.linear(name("self_attn.v_proj"), nkv * hd, h));
  TERN_ASSIGN_OR_RETURN(a.o_proj, w.linear(name("self_attn.o_proj"), h, nq * hd));
  TERN_ASSIGN_OR_RETURN(a.q_norm, build_norm(w, name("self_attn.q_norm.weight"), hd, c.rms_norm_eps, gated));
  TERN_ASSIGN_OR_RETURN(a.k_norm, build_norm(w, name("self_attn.k_norm.weight"), hd, c.rms_norm_eps, gated));
  const int64_t rotary_dim = c.rope.rotary_dim > 0 ? c.rope.rotary_dim : hd;
  TERN_ASSIGN_OR_RETURN(RopeFrequencies frequencies, rope_frequencies(c.rope, rotary_dim));
  // This rank's heads, as the projections were split (all of them on one device; KV heads possibly replicated).
  AttentionShape shape{.n_heads = a.q_proj.out_features() / (hd * (gated ? 2 : 1)),
                       .n_kv_heads = a.k_proj.out_features() / hd, .head_dim = hd, .gated = gated};
  return std::make_unique<Attention>(shape, std::move(a), Rope(rotary_dim, c.rope.theta, std::move(frequencies)));
}

Expected<MlpWeights> build_mlp_weights(WeightStore& w, const std::string& prefix, int64_t hidden,
                                       int64_t intermediate) {
  MlpWeights m;
  TERN_ASSIGN_OR_RETURN(m.gate_proj, w.linear(prefix + ".gate_proj", intermediate, hidden));
  TERN_ASSIGN_OR_RETURN(m.up_proj, w.linear(prefix + ".up_proj", intermediate, hidden));
  TERN_ASSIGN_OR_RETURN(m.down_proj, w.linear(prefix + ".down_proj", hidden, intermediate));
  return m;
}

Expected<void> build_layer_norms(const ModelConfig& c, WeightStore& w, const WeightSchema& schema, int64_t layer,
                                 bool zero_centred, DecoderLayer& out) {
  TERN_ASSIGN_OR_RETURN(out.input_norm, build_norm(w, layer_tensor(schema, layer, "input_layernorm.weight"),
                                                   c.hidden_size, c.rms_norm_eps, zero_centred));
  TERN_ASSIGN_OR_RETURN(out.post_attention_norm,
                        build_norm(w, layer_tensor(schema, layer, "post_attention_layernorm.weight"), c.hidden_size,
                                   c.rms_norm_eps, zero_centred));
  return {};
}

Expected<std::unique_ptr<FeedForward>> build_dense_mlp(const ModelConfig& c, WeightStore& w, const WeightSchema& schema,
                                                       int64_t layer) {
  TERN_ASSIGN_OR_RETURN(MlpWeights mlp, build_mlp_weights(w, layer_tensor(schema, layer, "mlp"), c.hidden_size,
                                                          c.intermediate_size));
  return std::make_unique<Mlp>(std::move(mlp));
}

Expected<void> qwen3_build(CausalLm& model, WeightStore& w, const WeightSchema& schema) {
  const ModelConfig& c = model.config();
  TERN_TRY(build_embeddings_and_head(model, w, schema, false));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    DecoderLayer layer;
    TERN_TRY(build_layer_norms(c, w, schema, i, /*zero_centred=*/false, layer));
    TERN_ASSIGN_OR_RETURN(layer.mixer, build_attention(c, w, schema, i, false));
    TERN_ASSIGN_OR_RETURN(layer.ffn, build_dense_mlp(c, w, schema, i));
    model.layers.push_back(std::move(layer));
  }
  return {};
}

}  // namespace tern
