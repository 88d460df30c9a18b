// Argument checks and dispatch for the NVFP4 W4A16 GEMM; the kernels are in gemm_nvfp4_w4a16.cu.
#include "kernels/cuda/gemm/gemm_nvfp4_w4a16.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cuda/gemm/dequant_gemm.h"
#include "kernels/cuda/gemm/weight_dequant_launch.h"

namespace tern {
namespace {

bool is_aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// The batch kernel loads 32 codes of a row at once (weight_batch.cuh).
bool nvfp4_batch_fits(const Nvfp4WeightView& w) {
  return w.k % 32 == 0 && is_aligned(w.packed, 16) && is_aligned(w.scales, 2);
}

Expected<void> nvfp4_validate(const GemmNvfp4W4a16Args& a, Nvfp4GemmVariant variant) {
  const Nvfp4WeightView& w = a.w;
  if (a.m < 0 || w.n <= 0 || w.k <= 0) {
    return make_error("gemm_nvfp4_w4a16: bad shape m={} n={} k={}", a.m, w.n, w.k);
  }
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max() / 2;
  if (a.m > kMaxDim || w.n > kMaxDim || w.k > kMaxDim) {
    return make_error("gemm_nvfp4_w4a16: dimension too large (m={} n={} k={})", a.m, w.n, w.k);
  }
  if (w.k % 16 != 0) return make_error("gemm_nvfp4_w4a16: k={} is not a multiple of the NVFP4 block (16)", w.k);
  if (a.x == nullptr || a.y == nullptr || w.packed == nullptr || w.scales == nullptr) {
    return make_error("gemm_nvfp4_w4a16: null pointer (x, y, weight or weight_scale)");
  }
  if (!is_aligned(a.x, 16)) return make_error("gemm_nvfp4_w4a16: x is not 16-byte aligned");
  if (!is_aligned(w.packed, 8)) return make_error("gemm_nvfp4_w4a16: packed weight is not 8-byte aligned");
  if (!is_aligned(a.y, 4)) return make_error("gemm_nvfp4_w4a16: y is not 4-byte aligned");
  if (a.ldy != 0 && a.ldy < w.n) return make_error("gemm_nvfp4_w4a16: ldy={} is less than n={}", a.ldy, w.n);
  if (!std::isfinite(w.global_scale)) {
    return make_error("gemm_nvfp4_w4a16: weight_scale_2 is not finite ({})", w.global_scale);
  }
  int64_t last = 0;
  for (int i = 0; i < kNvfp4MaxExtraParts && w.part_begin[i] != 0; ++i) {
    if (w.part_begin[i] <= last || w.part_begin[i] >= w.n) {
      return make_error("gemm_nvfp4_w4a16: part {} begins at row {}, not after row {} and before n={}", i + 1,
                        w.part_begin[i], last, w.n);
    }
    if (!std::isfinite(w.part_scale[i])) {
      return make_error("gemm_nvfp4_w4a16: weight_scale_2 of part {} is not finite ({})", i + 1, w.part_scale[i]);
    }
    last = w.part_begin[i];
  }
  if (variant == Nvfp4GemmVariant::kDecode && a.m > kNvfp4DecodeMaxM) {
    return make_error("gemm_nvfp4_w4a16: the decode kernel takes m <= {}, got m={}", kNvfp4DecodeMaxM, a.m);
  }
  if (variant == Nvfp4GemmVariant::kBatch && a.m > kNvfp4BatchMaxM) {
    return make_error("gemm_nvfp4_w4a16: the batch kernel takes m <= {}, got m={}", kNvfp4BatchMaxM, a.m);
  }
  if (variant == Nvfp4GemmVariant::kBatch && !nvfp4_batch_fits(w)) {
    return make_error("gemm_nvfp4_w4a16: the batch kernel needs k % 32 == 0 (k={}), 16-byte aligned packed rows and "
                      "2-byte aligned scales", w.k);
  }
  return {};
}

}  // namespace

Expected<void> gemm_nvfp4_w4a16(const DeviceContext& ctx, const GemmNvfp4W4a16Args& args, Nvfp4GemmVariant variant) {
  TERN_TRY(nvfp4_validate(args, variant));
  if (args.m == 0) return {};
  const bool decode = variant == Nvfp4GemmVariant::kDecode ||
                      (variant == Nvfp4GemmVariant::kAuto && args.m <= kNvfp4DecodeMaxM);
  if (decode) {
    nvfp4_w4a16_launch_decode(ctx, args);
    return {};
  }
  const bool auto_small = variant == Nvfp4GemmVariant::kAuto && args.m <= kNvfp4BatchMaxM;
  if (variant == Nvfp4GemmVariant::kBatch || (auto_small && nvfp4_batch_fits(args.w))) {
    nvfp4_w4a16_launch_batch(ctx, args);
    return {};
  }
  if (variant == Nvfp4GemmVariant::kSliced || auto_small) {
    decode_in_slices(args, kNvfp4DecodeMaxM,
                     [&](const GemmNvfp4W4a16Args& slice) { nvfp4_w4a16_launch_decode(ctx, slice); });
    return {};
  }
  if (variant == Nvfp4GemmVariant::kPrefill) {
    nvfp4_w4a16_launch_prefill(ctx, args);
    return {};
  }
  // Past a few dozen rows cuBLASLt on the dequantized weight beats the prefill kernel several times over
  // (docs/perf/gemm.md §dequant-gemm); each part's weight_scale_2 is its GEMM's alpha.
  const Nvfp4WeightView& w = args.w;
  std::vector<DequantGemmPart> parts{{0, w.global_scale}};
  for (int i = 0; i < kNvfp4MaxExtraParts && w.part_begin[i] != 0; ++i) {
    parts.push_back({w.part_begin[i], w.part_scale[i]});
  }
  return dequant_gemm(ctx, args.x, args.m, w.n, w.k, args.y, args.ldy > 0 ? args.ldy : w.n, parts,
                      [&](int64_t row0, int64_t rows, uint16_t* out) {
                        nvfp4_dequant_rows_launch(ctx, w.packed + row0 * (w.k / 2), w.scales + row0 * (w.k / 16),
                                                  rows, w.k, out);
                      });
}

}  // namespace tern
