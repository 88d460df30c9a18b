// The GEMM ops of the registry: y[M, N] = x[M, K] . W[N, K]^T with W as checkpoints store it.
//   gemm_bf16:  W BF16
//   gemm_nvfp4: W ModelOpt NVFP4 (packed e2m1, e4m3 block scales, fp32 global scale), W4A16 semantics
// A case's dims are {M, N, K}. The harness draws bf16-exact activations and weights (NVFP4 weights quantized from
// random values with core/nvfp4) and computes the reference in fp64 from the dequantized weights.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "ops/registry.h"

namespace tern {

struct GemmInputs : OpInputs {
  int64_t m = 0, n = 0, k = 0;
  bool nvfp4 = false;
  std::vector<float> x;               // [M, K], bf16-exact
  std::vector<uint16_t> x_bf16;       // the same values as bf16 bits (GPU implementations take bf16)
  std::vector<uint16_t> w_bf16;       // gemm_bf16: [N, K]
  std::vector<uint8_t> w_packed;      // gemm_nvfp4: [N, K/2]
  std::vector<uint8_t> w_scales;      // gemm_nvfp4: [N, K/16]
  float w_global_scale = 1.0f;
};

// Fills `inputs` for a case {M, N, K} from `seed` (NVFP4 weights when `nvfp4`); shared with the W4A4 harness.
Expected<void> gemm_fill_inputs(const SelfTestCase& c, uint64_t seed, bool nvfp4, GemmInputs& inputs);

// Adds the two harnesses and the CPU implementations ("cpu") to the registry.
Expected<void> gemm_register_cpu(Registry& registry);

// Self-test cases for a set of linear-layer shapes {N, K} at the batch sizes the engine will run.
std::vector<SelfTestCase> gemm_selftest_cases(const std::vector<std::pair<int64_t, int64_t>>& shapes,
                                              const std::vector<int64_t>& batch_sizes);

}  // namespace tern
