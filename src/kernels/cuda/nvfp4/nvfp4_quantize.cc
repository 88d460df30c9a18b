// Argument checks of the NVFP4 activation quantizer; the kernel is in nvfp4_quantize.cu.
#include "kernels/cuda/nvfp4/nvfp4_quantize.h"

#include <limits>

#include "kernels/cuda/nvfp4/nvfp4_scale_layout.h"

namespace tern {
namespace {

bool is_aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

Expected<void> nvfp4_quantize_validate(const Nvfp4QuantizeArgs& a) {
  constexpr const char* kName = "nvfp4_quantize_activations";
  if (a.m < 0 || a.k <= 0) return make_error("{}: bad shape m={} k={}", kName, a.m, a.k);
  if (a.k % 16 != 0) return make_error("{}: k={} is not a multiple of the NVFP4 block (16)", kName, a.k);
  // One thread per (padded) block: the grid must stay within 2^31 blocks of 256 threads, indices within int64.
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (a.m > kMaxDim || a.k > kMaxDim || nvfp4_tiled_scale_bytes(a.m, a.k) / 256 >= kMaxDim) {
    return make_error("{}: shape too large (m={} k={})", kName, a.m, a.k);
  }
  if (a.x == nullptr || a.input_scale == nullptr || a.packed == nullptr || a.scales == nullptr) {
    return make_error("{}: null pointer (x, input_scale, packed or scales)", kName);
  }
  if (!is_aligned(a.x, 16)) return make_error("{}: x is not 16-byte aligned", kName);
  if (!is_aligned(a.packed, 8)) return make_error("{}: packed is not 8-byte aligned", kName);
  if (!is_aligned(a.input_scale, 4)) return make_error("{}: input_scale is not 4-byte aligned", kName);
  if (a.layout != Nvfp4ScaleLayout::kRowMajor && a.layout != Nvfp4ScaleLayout::kTiled128x4) {
    return make_error("{}: unknown scale layout", kName);
  }
  return {};
}

}  // namespace

Expected<void> nvfp4_quantize_activations(const DeviceContext& ctx, const Nvfp4QuantizeArgs& args) {
  TERN_TRY(nvfp4_quantize_validate(args));
  if (args.m == 0) return {};
  nvfp4_quantize_launch(ctx, args);
  return {};
}

}  // namespace tern
