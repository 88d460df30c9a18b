// Pieces the architecture builders share: embeddings + final norm + lm_head, norms, attention, MLPs and MoE blocks
// read from a WeightStore by their checkpoint names.
#pragma once

#include <memory>
#include <string>

#include "layers/attention.h"
#include "layers/moe.h"
#include "models/causal_lm.h"
#include "models/weight_schema.h"

namespace tern {

// "<text_prefix>layers.<i>.<rest>"
std::string layer_tensor(const WeightSchema& schema, int64_t layer, std::string_view rest);

Expected<void> build_embeddings_and_head(CausalLm& model, WeightStore& w, const WeightSchema& schema,
                                         bool zero_centred);
Expected<RmsNorm> build_norm(WeightStore& w, const std::string& name, int64_t dim, double eps, bool zero_centred);
// Qwen3 attention (plain q/k norms, full RoPE) or, with `gated`, Qwen3.5's (zero-centred norms, partial RoPE).
Expected<std::unique_ptr<Mixer>> build_attention(const ModelConfig& c, WeightStore& w, const WeightSchema& schema,
                                                 int64_t layer, bool gated);
Expected<MlpWeights> build_mlp_weights(WeightStore& w, const std::string& prefix, int64_t hidden,
                                       int64_t intermediate);
// The input and post-attention norms of a decoder layer.
Expected<void> build_layer_norms(const ModelConfig& c, WeightStore& w, const WeightSchema& schema, int64_t layer,
                                 bool zero_centred, DecoderLayer& out);
// The dense MLP of a decoder layer (`mlp.{gate,up,down}_proj`, intermediate_size wide).
Expected<std::unique_ptr<FeedForward>> build_dense_mlp(const ModelConfig& c, WeightStore& w, const WeightSchema& schema,
                                                       int64_t layer);
// Routed experts of `layer` (+ the shared expert when the config has one).
Expected<std::unique_ptr<FeedForward>> build_moe(const ModelConfig& c, WeightStore& w, const WeightSchema& schema,
                                                 int64_t layer, bool renormalize);

}  // namespace tern
