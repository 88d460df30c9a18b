// Argument checks and dispatch for the FP8 W8A16 GEMM; the kernels are in gemm_fp8_w8a16.cu.
#include "kernels/cuda/gemm/gemm_fp8_w8a16.h"

#include <algorithm>
#include <limits>

#include "kernels/cuda/gemm/dequant_gemm.h"
#include "kernels/cuda/gemm/weight_dequant_launch.h"

namespace tern {
namespace {

bool is_aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

int64_t fp8_scale_blocks(int64_t k) { return (k + 127) / 128; }  // row scales per row

Expected<void> fp8_validate(const GemmFp8W8a16Args& a, Fp8GemmVariant variant) {
  const Fp8WeightView& w = a.w;
  if (a.m < 0 || w.n <= 0 || w.k <= 0) return make_error("gemm_fp8_w8a16: bad shape m={} n={} k={}", a.m, w.n, w.k);
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max() / 2;
  if (a.m > kMaxDim || w.n > kMaxDim || w.k > kMaxDim || w.n * w.k > std::numeric_limits<int64_t>::max() / 2) {
    return make_error("gemm_fp8_w8a16: dimension too large (m={} n={} k={})", a.m, w.n, w.k);
  }
  if (w.k % 16 != 0) return make_error("gemm_fp8_w8a16: k={} is not a multiple of 16", w.k);
  if (a.x == nullptr || a.y == nullptr || w.codes == nullptr || w.row_scales == nullptr) {
    return make_error("gemm_fp8_w8a16: null pointer (x, y, weight codes or row scales)");
  }
  if (!is_aligned(a.x, 16)) return make_error("gemm_fp8_w8a16: x is not 16-byte aligned");
  if (!is_aligned(w.codes, 16)) return make_error("gemm_fp8_w8a16: weight codes are not 16-byte aligned");
  if (!is_aligned(w.row_scales, 4)) return make_error("gemm_fp8_w8a16: row scales are not 4-byte aligned");
  if (!is_aligned(a.y, 4)) return make_error("gemm_fp8_w8a16: y is not 4-byte aligned");
  if (a.ldy != 0 && a.ldy < w.n) return make_error("gemm_fp8_w8a16: ldy={} is less than n={}", a.ldy, w.n);
  if (variant == Fp8GemmVariant::kBatch && a.m > kFp8BatchMaxM) {
    return make_error("gemm_fp8_w8a16: the batch kernel takes m <= {}, got m={}", kFp8BatchMaxM, a.m);
  }
  if (variant == Fp8GemmVariant::kDecode && a.m > kFp8DecodeMaxM) {
    return make_error("gemm_fp8_w8a16: the decode kernel takes m <= {}, got m={}", kFp8DecodeMaxM, a.m);
  }
  return {};
}

}  // namespace

Expected<void> gemm_fp8_w8a16(const DeviceContext& ctx, const GemmFp8W8a16Args& args, Fp8GemmVariant variant) {
  TERN_TRY(fp8_validate(args, variant));
  if (args.m == 0) return {};
  const bool decode =
      variant == Fp8GemmVariant::kDecode || (variant == Fp8GemmVariant::kAuto && args.m <= kFp8DecodeMaxM);
  if (decode) {
    fp8_w8a16_launch_decode(ctx, args);
    return {};
  }
  // Up to 64 rows the batch kernel reads the weight once for all of them (docs/perf/gemm.md §batch).
  if (variant == Fp8GemmVariant::kBatch || (variant == Fp8GemmVariant::kAuto && args.m <= kFp8BatchMaxM)) {
    fp8_w8a16_launch_batch(ctx, args);
    return {};
  }
  if (variant == Fp8GemmVariant::kSliced) {
    decode_in_slices(args, kFp8DecodeMaxM, [&](const GemmFp8W8a16Args& slice) { fp8_w8a16_launch_decode(ctx, slice); });
    return {};
  }
  if (variant == Fp8GemmVariant::kPrefill) {
    fp8_w8a16_launch_prefill(ctx, args);
    return {};
  }
  // Past a few dozen rows cuBLASLt on the dequantized weight beats the prefill kernel several times over
  // (docs/perf/gemm.md §dequant-gemm).
  const Fp8WeightView& w = args.w;
  return dequant_gemm(ctx, args.x, args.m, w.n, w.k, args.y, args.ldy > 0 ? args.ldy : w.n, {{0, 1.0f}},
                      [&](int64_t row0, int64_t rows, uint16_t* out) {
                        fp8_dequant_rows_launch(ctx, w.codes + row0 * w.k,
                                                w.row_scales + row0 * fp8_scale_blocks(w.k), rows, w.k, out);
                      });
}

}  // namespace tern
