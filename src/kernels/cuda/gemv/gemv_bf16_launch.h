// The BF16 GEMV's argument struct and its unchecked launcher. The .cu side cannot include core/error.h (nvcc rejects
// fmt's consteval format strings), and gemm_bf16.h (GemmBf16Args) does, so the launcher takes its own copy of the
// arguments; validation lives in gemv_bf16.cc and callers use gemv_bf16() from gemv_bf16.h.
#pragma once

#include <climits>
#include <cstdint>

#include "kernels/cuda/device.h"

namespace tern {

// The most rows of x one GEMV call takes: its accumulators (rows x 4 output columns per thread) live in registers.
inline constexpr int64_t kGemvMaxRows = 8;

// The MoE block's combine as the epilogue of its shared expert's down projection (gemv_bf16_launch's combine): each
// row i of x is a token, and y[i, c] = bf16(sum of topk_weights[i, j] * expert_out[pair_row[i, j], c] over the
// token's top_k pairs in ascending expert id order, fp32, then + sigmoid(gate[i]) * bf16(product[i, c]), or
// + bf16(product[i, c]) unweighted when gate is null), moe_combine's arithmetic (moe_launch.h) with the product,
// rounded as it would have been stored, as shared_out.
inline constexpr int kGemvCombineMaxTopK = 32;

struct GemvMoeCombine {
  const uint16_t* expert_out = nullptr;  // [pairs, n] bf16 (permuted rows); null: no combine
  const int32_t* pair_row = nullptr;     // [m, top_k]
  const int32_t* topk_ids = nullptr;     // [m, top_k]: only the summation order is taken from them
  const float* topk_weights = nullptr;   // [m, top_k]
  int top_k = 0;                         // 1 .. kGemvCombineMaxTopK
  const uint16_t* gate = nullptr;        // optional [m] bf16 at gate_stride elements apart; null: unweighted
  int64_t gate_stride = 1;
  int32_t expert_begin = 0, expert_end = INT32_MAX;  // the experts whose pairs are summed (MoeCombineArgs)
};

// y[m, ldy] (columns [0, n)) = x[m, k] . w[n, k]^T, bf16 row-major, fp32 accumulation.
struct GemvBf16Params {
  const uint16_t* x = nullptr;  // [m, k], 16-byte aligned
  const uint16_t* w = nullptr;  // [n, k], 16-byte aligned
  uint16_t* y = nullptr;        // [m, ldy], 2-byte aligned
  int m = 0;                    // 1 .. kGemvMaxRows
  int64_t n = 0;                // 1 .. 2^31 - 1
  int64_t k = 0;                // a positive multiple of 8, at most 2^31 - 1
  int64_t ldy = 0;              // >= n (the launcher does not read 0 as n)
  int group_threads = 0;        // 0: gemv_bf16_group_threads() chooses; tests force 32, 64, 128 or 256
  // Optional RMSNorm of x before the product, with rms_norm's arithmetic (elementwise_launch.h): h = x + residual in
  // fp32, x' = bf16((h * (1 / sqrt(mean(h^2) + eps))) * (offset + norm_weight)), offset 1 when zero-centred; the
  // product uses x'. Block 0 writes bf16(h) to h_out and x' to x_out where set; neither may overlap x or residual,
  // which every block reads.
  const uint16_t* norm_weight = nullptr;  // [k]; null: no norm
  const uint16_t* residual = nullptr;     // optional [m, k]
  float norm_eps = 1e-6f;
  bool norm_zero_centred = false;
  uint16_t* h_out = nullptr;  // optional [m, k]
  uint16_t* x_out = nullptr;  // optional [m, k]
  // Optional SiLU-and-mul of x before the product, with silu_mul's arithmetic (silu_mul.cuh), instead of the norm:
  // x holds m rows of [gate | up], silu_ldx elements apart, and the product uses x'[i, c] = bf16(silu(g) * u) with
  // g = x[i * silu_ldx + c] and u = x[i * silu_ldx + k + c], the bits silu_mul would have written.
  int64_t silu_ldx = 0;  // 0: none; else >= 2k and a multiple of 8 (16-byte rows)
};

// Threads of a block that share one group of output columns, splitting k between them (32, 64, 128 or 256). One row
// of x: the whole block, or as many threads as k has chunks (the widest group was the fastest on every Qwen
// projection measured; see docs/perf/gpu.md §gemv-group). More rows: the fewest that
// still give the grid about two blocks per SM and do not leave most threads without a chunk of k (the warp and
// shared-memory sums grow with the rows).
int gemv_bf16_group_threads(int m, int64_t n, int64_t k, int num_sms);

// Where the GEMV beats cuBLASLt (docs/perf/gpu.md §gemv-rows): at one row on every shape; up to four rows on the
// small projections (at most kGemvPreferredSmallWeights weights: routers, the MoE's shared expert, GDN's b|a), where
// cuBLASLt's kernels for a few rows are 1.2-3x slower; from two rows on larger ones its tensor-core kernels win on
// most shapes. Models and the self-test's "gemv" implementation call the GEMV where this holds.
inline constexpr int64_t kGemvPreferredMaxRows = 1;
inline constexpr int64_t kGemvPreferredSmallMaxRows = 4;
inline constexpr int64_t kGemvPreferredSmallWeights = int64_t{1} << 22;
inline bool gemv_bf16_preferred(int64_t m, int64_t n, int64_t k) {
  return m <= kGemvPreferredMaxRows || (m <= kGemvPreferredSmallMaxRows && n * k <= kGemvPreferredSmallWeights);
}

// Unchecked launch on ctx.stream() for arguments gemv_bf16() has validated (group_threads 0 or one of the four).
// combine (optional, with the SiLU prologue only): the MoE combine epilogue, in a kernel of its own so the others
// carry none of it.
void gemv_bf16_launch(const DeviceContext& ctx, const GemvBf16Params& p, const GemvMoeCombine* combine = nullptr);

}  // namespace tern
