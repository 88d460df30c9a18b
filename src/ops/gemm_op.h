// The GEMM ops of the registry: y[M, N] = x[M, K] . W[N, K]^T with W as checkpoints store it.
//   gemm_bf16:     W BF16
//   gemm_nvfp4:    W ModelOpt NVFP4 (packed e2m1, e4m3 block scales, fp32 global scale), W4A16 semantics
//   gemm_fp8:      W block-wise FP8 (e4m3 codes, an fp32 scale per 128 x 128 block, held per row), W8A16 semantics
// A case's dims are {M, N, K}. The harness draws bf16-exact activations and weights (NVFP4 weights quantized from
// random values with core/nvfp4, FP8 ones per 128 x 128 block with scale = amax / 448 as DeepSeek-V3's are) and
// computes the reference in fp64 from the dequantized weights.
//   rms_norm_gemv: a decode step's RMSNorm fused in front of a BF16 product, for one row of x[K]:
//                  h = x + residual, x' = h * 1/sqrt(mean(h^2) + eps) * (offset + w) (offset 1 when zero-centred),
//                  y[N] = x' . W[N, K]^T. Case dims {N, K, form, residual}: form 0 plain, 1 zero-centred (rms_norm's
//                  RmsNormForm; the gated norm is not fused), residual 0 or 1; K a positive multiple of 8. Output
//                  (floats): [h (K values, only with a residual) | x' (K) | y (N)]. The reference is fp64 with x'
//                  unrounded; the CPU implementation ("cpu") is RmsNorm then cpu_matmul in fp32.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "ops/elementwise_op.h"
#include "ops/registry.h"

namespace tern {

enum class GemmWeight { kBf16, kNvfp4, kFp8 };

struct GemmInputs : OpInputs {
  int64_t m = 0, n = 0, k = 0;
  bool nvfp4 = false;
  bool fp8 = false;
  std::vector<float> x;               // [M, K], bf16-exact
  std::vector<uint16_t> x_bf16;       // the same values as bf16 bits (GPU implementations take bf16)
  std::vector<uint16_t> w_bf16;       // gemm_bf16: [N, K]
  std::vector<uint8_t> w_packed;      // gemm_nvfp4: [N, K/2]; gemm_fp8: e4m3 codes [N, K]
  std::vector<uint8_t> w_scales;      // gemm_nvfp4: [N, K/16]
  float w_global_scale = 1.0f;
  std::vector<float> w_row_scales;    // gemm_fp8: [N, ceil(K/128)]
};

// Fills `inputs` for a case {M, N, K} from `seed` with weights of the given format; shared with the W4A4 harness.
Expected<void> gemm_fill_inputs(const SelfTestCase& c, uint64_t seed, GemmWeight weight, GemmInputs& inputs);

struct RmsNormGemvInputs : OpInputs {
  int64_t n = 0, k = 0;
  RmsNormForm form = RmsNormForm::kPlain;  // kPlain or kZeroCentred
  bool residual = false;
  float eps = 1e-6f;
  std::vector<uint16_t> x, residual_in;  // [K] bf16 (residual_in only when used)
  std::vector<uint16_t> norm_weight;     // [K] bf16
  std::vector<uint16_t> w_bf16;          // [N, K] bf16
};

// Floats in an rms_norm_gemv output: [h | x' | y] (h only with a residual).
int64_t rms_norm_gemv_output_size(const RmsNormGemvInputs& inputs);

// Adds the four harnesses (gemm_bf16, gemm_nvfp4, gemm_fp8, rms_norm_gemv) and their CPU implementations ("cpu").
Expected<void> gemm_register_cpu(Registry& registry);

// Self-test cases for a set of linear-layer shapes {N, K} at the batch sizes the engine will run.
std::vector<SelfTestCase> gemm_selftest_cases(const std::vector<std::pair<int64_t, int64_t>>& shapes,
                                              const std::vector<int64_t>& batch_sizes);

// An rms_norm_gemv case (one row), labelled like "N=4096 K=4096 zero-centred +residual".
SelfTestCase rms_norm_gemv_case(int64_t n, int64_t k, RmsNormForm form, bool residual);

}  // namespace tern
