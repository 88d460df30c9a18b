// Feed-forward blocks: the SwiGLU MLP y = down(silu(gate(x)) * up(x)), and the sparse MoE of Qwen3-MoE / Qwen3.5 /
// Qwen3-Next (docs/model-specs.md §2.6): softmax router in fp32, top-k, optional renormalisation, routed SwiGLU
// experts weighted by their probability, plus an optional shared expert scaled by sigmoid(shared_expert_gate(x));
// and DeepSeek-V3 / GLM-5's (§3.4): sigmoid scores, the experts chosen on score + e_score_correction_bias within
// the best topk_group of n_group groups, weighted by their unbiased scores (renormalised, + 1e-20), times
// routed_scaling_factor, plus the shared experts unweighted.
#pragma once

#include <memory>
#include <vector>

#include "layers/blocks.h"
#include "layers/linear.h"

namespace tern {

struct MlpWeights {
  Linear gate_proj, up_proj, down_proj;
};

void mlp_forward(const MlpWeights& w, const float* x, int64_t rows, float* y);

class Mlp final : public FeedForward {
 public:
  explicit Mlp(MlpWeights weights) : w_(std::move(weights)) {}
  void forward(const float* x, float* y, int64_t rows, const std::string& trace_prefix,
               const Tracer* tracer) const override;
  Expected<std::unique_ptr<Block>> place(BlockOps& ops, const RmsNorm& norm) const override;

  // The projections of the block's normed input, in the order a device computes them side by side (one GEMM for
  // adjacent parts of one format: cuda_ops.cc, models/selftest_plan.cc).
  std::vector<const Linear*> input_projections() const;
  const MlpWeights& weights() const { return w_; }

 private:
  MlpWeights w_;
};

struct MoeWeights {
  Linear router;                       // [num_experts, hidden]
  // The routed experts this rank holds: all of them (each whole, or its tensor-parallel slice), or under expert
  // parallelism the router's experts [first_expert, first_expert + experts.size()); pairs routed to the others add
  // nothing here (another rank adds them, in the block's all-reduce).
  std::vector<MlpWeights> experts;
  int64_t first_expert = 0;
  std::unique_ptr<Mlp> shared_expert;  // null when absent
  Linear shared_expert_gate;           // [1, hidden], used when shared_expert is set and MoeShape::shared_gate
  std::vector<float> correction_bias;  // [num_experts] sigmoid routing's e_score_correction_bias (empty: none)
};

struct MoeShape {
  int64_t top_k = 0;
  bool renormalize = true;  // norm_topk_prob (always on for Qwen3.5)
  bool sigmoid = false;     // DeepSeek-V3 / GLM-5 routing instead of softmax
  int64_t n_group = 1, topk_group = 1;
  float routed_scaling = 1.0f;
  bool shared_gate = true;  // the shared expert behind sigmoid(shared_expert_gate(x)) (Qwen), or unweighted
};

class Moe final : public FeedForward {
 public:
  Moe(MoeShape shape, MoeWeights weights) : s_(shape), w_(std::move(weights)) {}
  void forward(const float* x, float* y, int64_t rows, const std::string& trace_prefix,
               const Tracer* tracer) const override;
  Expected<std::unique_ptr<Block>> place(BlockOps& ops, const RmsNorm& norm) const override;

  // The projections of the block's normed input, in the order a device computes them side by side (one GEMM for
  // adjacent parts of one format: cuda_ops.cc, models/selftest_plan.cc).
  // With a shared expert: its gate and up first (their rows 16-byte aligned for silu_mul), the router, the
  // shared expert's gate.
  std::vector<const Linear*> input_projections() const;
  const MoeShape& shape() const { return s_; }
  const MoeWeights& weights() const { return w_; }

 private:
  MoeShape s_;
  MoeWeights w_;
};

}  // namespace tern
