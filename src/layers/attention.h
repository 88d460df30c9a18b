// Grouped-query attention of Qwen3 (per-head q/k RMSNorm, then RoPE) and the gated variant of Qwen3.5 / Qwen3-Next
// (q_proj yields [query | gate] per head, partial RoPE, zero-centred q/k norms, output * sigmoid(gate) before
// o_proj); docs/model-specs.md §2.5. The KV cache holds keys after norm and RoPE.
#pragma once

#include "layers/blocks.h"
#include "layers/linear.h"
#include "layers/norms.h"
#include "layers/rope.h"

namespace tern {

struct AttentionWeights {
  Linear q_proj, k_proj, v_proj, o_proj;
  RmsNorm q_norm, k_norm;
};

struct AttentionShape {
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  bool gated = false;  // Qwen3.5 / Qwen3-Next output gate
};

class Attention final : public Mixer {
 public:
  Attention(AttentionShape shape, AttentionWeights weights, Rope rope)
      : shape_(shape), w_(std::move(weights)), rope_(std::move(rope)) {}
  void forward(const float* x, float* y, const Batch& batch, int64_t layer, const Tracer* tracer) const override;
  Expected<std::unique_ptr<Block>> place(BlockOps& ops, const RmsNorm& norm) const override;

  // The projections of the block's normed input, in the order a device computes them side by side (one GEMM for
  // adjacent parts of one format: cuda_ops.cc, models/selftest_plan.cc).
  std::vector<const Linear*> input_projections() const;
  const AttentionShape& shape() const { return shape_; }
  const AttentionWeights& weights() const { return w_; }
  const Rope& rope() const { return rope_; }

 private:
  void attend_sequence(const BatchSlice& seq, LayerCache& cache, float* q, const float* k, const float* v,
                       float* out) const;

  AttentionShape shape_;
  AttentionWeights w_;
  Rope rope_;
};

}  // namespace tern
