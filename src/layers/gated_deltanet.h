// Gated DeltaNet token mixer of Qwen3.5 and Qwen3-Next (docs/model-specs.md §2.4): projections, causal
// depthwise conv + SiLU, l2-normalised q/k, decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), the
// delta-rule recurrence, a gated RMSNorm per value head and out_proj. The conv and recurrent states of each sequence
// live in its LayerCache, so prefill and decode continue the same recurrence.
#pragma once

#include "layers/blocks.h"
#include "layers/linear.h"

namespace tern {

struct GatedDeltaNetShape {
  int64_t n_key_heads = 0;
  int64_t n_value_heads = 0;
  int64_t key_dim = 0;
  int64_t value_dim = 0;
  int64_t conv_kernel = 0;
  float norm_eps = 1e-6f;
  bool fused_per_key_head = false;  // Qwen3-Next: in_proj_qkvz / in_proj_ba grouped per key head
};

struct GatedDeltaNetWeights {
  Linear in_proj_qkv, in_proj_z, in_proj_b, in_proj_a;  // Qwen3.5
  Linear in_proj_qkvz, in_proj_ba;                      // Qwen3-Next
  Linear out_proj;
  std::vector<float> conv_weight;  // [conv_channels, kernel]
  std::vector<float> a_log, dt_bias;  // [n_value_heads]
  std::vector<float> norm_weight;     // [value_dim]
};

class GatedDeltaNet final : public Mixer {
 public:
  GatedDeltaNet(GatedDeltaNetShape shape, GatedDeltaNetWeights weights) : s_(shape), w_(std::move(weights)) {}
  void forward(const float* x, float* y, const Batch& batch, int64_t layer, const Tracer* tracer) const override;
  Expected<std::unique_ptr<Block>> place(BlockOps& ops, const RmsNorm& norm) const override;

  // The projections of the block's normed input, in the order a device computes them side by side (one GEMM for
  // adjacent parts of one format: cuda_ops.cc, models/selftest_plan.cc).
  std::vector<const Linear*> input_projections() const;
  const GatedDeltaNetShape& shape() const { return s_; }
  const GatedDeltaNetWeights& weights() const { return w_; }

 private:
  int64_t conv_channels() const { return 2 * s_.n_key_heads * s_.key_dim + s_.n_value_heads * s_.value_dim; }
  // qkv [m, conv_channels], z [m, Vd], b and a [m, Hv] from x.
  void project(const float* x, int64_t m, std::vector<float>& qkv, std::vector<float>& z, std::vector<float>& b,
               std::vector<float>& a) const;
  void run_sequence(const BatchSlice& seq, LayerCache& cache, const float* qkv, const float* b, const float* a,
                    float* out) const;

  GatedDeltaNetShape s_;
  GatedDeltaNetWeights w_;
};

}  // namespace tern
