// The sparse Mixture-of-Experts block in the registry (docs/model-specs.md §2.6, layers/moe.h):
//   moe  dims {tokens, hidden, inter, n_experts, top_k, format, shared}: softmax router, top-k renormalised,
//        SwiGLU experts of width `inter` with weights in `format` (0 bf16, 1 NVFP4 as ModelOpt exports them, W4A16
//        semantics, 2 block-wise FP8 as DeepSeek-V3's checkpoints hold them, W8A16 semantics), plus with shared = 1
//        a bf16 shared expert of width `inter` scaled by sigmoid(its gate), with shared = 2 one added unweighted.
//        Output y [tokens, hidden].
//        dims {tokens, hidden, inter, n_experts, top_k, format, shared, sigmoid, n_group, topk_group, bias}: with
//        sigmoid = 1 DeepSeek-V3 / GLM-5's router instead (§3.4): experts chosen on score + e_score_correction_bias
//        (bias = 1: a random one from the seed, large enough to change choices; 0: none) within the best topk_group
//        of n_group groups, weighted by their renormalised scores times routed_scaling 2.5 (both models' factor);
//        sigmoid = 0 is the softmax router (n_group = topk_group = 1, bias = 0).
//        dims {... the 11 above ..., expert_begin, local_experts}: one expert-parallel rank's block: the implementation
//        holds experts [expert_begin, expert_begin + local_experts) of the router's n_experts and its output sums
//        only the pairs routed to them (plus the shared expert); every other expert's weights are NaN.
// The harness draws fresh, non-zero, bf16-exact activations and weights from the seed. Router rows (and the shared
// expert gate) are one-hot with a power-of-two value, so the logits are exact in every format: a GPU that rounds
// them to bf16 (as transformers does) selects the experts the fp32 CPU layer selects, and the comparison measures
// the experts' arithmetic rather than near-ties of the router. The last expert repeats expert 1's router row, an
// exact tie every implementation must give to expert 1 (with a correction bias, expert 1's bias is repeated too).
// With the sigmoid router a token whose selection has a near-tie (two choice values or group worths at the edge of
// the selection within 1e-5) is drawn again, so an fp32 implementation selects what the fp64 reference selects.
// The reference is computed in fp64 from the spec formula; the CPU implementation ("cpu") runs layers/moe.h
// Moe::forward in fp32.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/error.h"
#include "layers/moe.h"
#include "ops/registry.h"

namespace tern {

struct MoeInputs : OpInputs {
  int64_t tokens = 0, hidden = 0, inter = 0, n_experts = 0, top_k = 0;
  bool nvfp4 = false, fp8 = false, shared = false;
  bool shared_gate = true;  // the shared expert scaled by sigmoid(its gate), or added unweighted
  // The router: softmax, or sigmoid (MoeShape's fields) with an optional correction bias [n_experts].
  bool sigmoid = false;
  int64_t n_group = 1, topk_group = 1;
  float routed_scaling = 1.0f;
  std::vector<float> correction_bias;
  // The experts the implementation holds (expert parallelism): [expert_begin, expert_begin + held()); local_experts
  // 0: all of them.
  int64_t expert_begin = 0, local_experts = 0;
  int64_t held() const { return local_experts > 0 ? local_experts : n_experts; }
  bool holds(int64_t e) const { return e >= expert_begin && e < expert_begin + held(); }
  std::vector<uint16_t> x;       // [tokens, hidden] bf16
  std::vector<uint16_t> router;  // [n_experts + 1, hidden] bf16; row n_experts is the shared expert gate
  // Routed experts, bf16, NVFP4 or FP8. gate_up [E][2 * inter][hidden]: gate rows first, then up (NVFP4: one
  // weight_scale_2 per expert for both, as ModelOpt exports them; FP8: gate and up quantized as the checkpoint's two
  // tensors, each in its own 128 x 128 blocks); down [E][hidden][inter].
  std::vector<uint16_t> gate_up_bf16, down_bf16;
  std::vector<uint8_t> gate_up_packed, gate_up_scales, down_packed, down_scales;  // FP8: e4m3 codes in *_packed
  std::vector<float> gate_up_global, down_global;  // [E]
  std::vector<float> gate_up_row_scales, down_row_scales;  // FP8: [E][rows][ceil(cols / 128)], each row's block scales
  std::vector<uint16_t> shared_gate_up, shared_down;  // bf16 [2 * inter, hidden], [hidden, inter] (with shared)
};

// Adds the harness and the CPU implementation ("cpu").
Expected<void> moe_register_cpu(Registry& registry);

// How a case routes: the default is the Qwen block (softmax router, shared expert behind its gate).
struct MoeCaseRouting {
  bool sigmoid = false;
  int64_t n_group = 1, topk_group = 1;
  bool correction_bias = false;
  bool shared_gate = true;
  // Expert parallelism: the block holds experts [expert_begin, expert_begin + local_experts) (0 local: all).
  int64_t expert_begin = 0, local_experts = 0;
};

// The routed experts' weight format, as dims[5] encodes it.
enum class MoeCaseFormat { kBf16 = 0, kNvfp4 = 1, kFp8 = 2 };

SelfTestCase moe_case(int64_t tokens, int64_t hidden, int64_t inter, int64_t n_experts, int64_t top_k,
                      MoeCaseFormat format, bool shared, const MoeCaseRouting& routing = {});
SelfTestCase moe_case(int64_t tokens, int64_t hidden, int64_t inter, int64_t n_experts, int64_t top_k, bool nvfp4,
                      bool shared, const MoeCaseRouting& routing = {});

// The CPU layer over the inputs' weights (it points into `inputs`, which must outlive it).
std::unique_ptr<Moe> moe_cpu_layer(const MoeInputs& inputs);

}  // namespace tern
