// Host dispatch the two weight-only GEMMs (gemm_fp8_w8a16, gemm_nvfp4_w4a16) share: the decode kernel run once per
// slice of rows (decode_in_slices), and the large-m path (dequant_gemm): the weight, a chunk of rows at a time,
// dequantized to bf16 in the context's weight workspace (weight_dequant_launch.h), then multiplied by cuBLASLt's
// BF16 GEMM into the chunk's columns of y. The dequantized values are the prefill kernels' (rounded to bf16 once,
// or exact), so the result differs from theirs only in the order of the fp32 sums. Host code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/gemm/gemm_bf16.h"

namespace tern {

// The decode kernel, `launch(slice)`, on each slice of at most `rows` rows of args (x and y advanced, m cut): for a
// few dozen rows, re-reading the weight per slice costs less than the larger-m paths (docs/perf/gemm.md
// §sliced-decode). Args: a weight-only GEMM's argument struct (x, y, m, ldy, w.n, w.k).
template <class Args, class Launch>
void decode_in_slices(const Args& args, int64_t rows, Launch&& launch) {
  for (int64_t m0 = 0; m0 < args.m; m0 += rows) {
    Args slice = args;
    slice.x = args.x + m0 * args.w.k;
    slice.y = args.y + m0 * (args.ldy > 0 ? args.ldy : args.w.n);
    slice.m = std::min(rows, args.m - m0);
    launch(slice);
  }
}

// Rows [begin, next part's begin) of the weight take alpha (an NVFP4 part's weight_scale_2; 1 for FP8).
struct DequantGemmPart {
  int64_t begin;
  float alpha;
};

// y[:, c] for c < n, chunk by chunk: `dequant(row0, rows, out)` queues rows [row0, row0 + rows) of the weight as
// bf16 into out ([rows, k], row-major). Chunks hold at most the workspace's rows, a multiple of 16, and never
// straddle two parts. x [m, k] and y [m, ldy] as the callers' arguments (validated by them).
template <class Dequant>
Expected<void> dequant_gemm(const DeviceContext& ctx, const uint16_t* x, int64_t m, int64_t n, int64_t k, uint16_t* y,
                            int64_t ldy, const std::vector<DequantGemmPart>& parts, Dequant&& dequant) {
  const int64_t cap = static_cast<int64_t>(ctx.weight_workspace_bytes() / 2) / k / 16 * 16;
  if (cap < 16) {
    return make_error("dequant_gemm: k={} leaves the {} MiB weight workspace less than 16 rows", k,
                      ctx.weight_workspace_bytes() >> 20);
  }
  for (size_t p = 0; p < parts.size(); ++p) {
    const int64_t end = p + 1 < parts.size() ? parts[p + 1].begin : n;
    for (int64_t row0 = parts[p].begin; row0 < end; row0 += cap) {
      const int64_t rows = std::min(cap, end - row0);
      dequant(row0, rows, ctx.weight_workspace());
      TERN_TRY(gemm_bf16(ctx, GemmBf16Args{.x = x,
                                           .w = ctx.weight_workspace(),
                                           .y = y + row0,
                                           .m = m,
                                           .n = rows,
                                           .k = k,
                                           .ldy = ldy,
                                           .alpha = parts[p].alpha}));
    }
  }
  return {};
}

}  // namespace tern
