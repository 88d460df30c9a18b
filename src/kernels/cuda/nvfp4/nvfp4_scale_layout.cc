#include "kernels/cuda/nvfp4/nvfp4_scale_layout.h"

#include "core/error.h"

namespace tern {

std::vector<uint8_t> nvfp4_scales_to_tiled(std::span<const uint8_t> scales, int64_t rows, int64_t k) {
  TERN_CHECK(rows >= 0 && k > 0 && k % 16 == 0, "NVFP4 scales need rows >= 0 and k a multiple of 16 (rows={} k={})",
             rows, k);
  const int64_t n_blocks = k / 16;
  TERN_CHECK(static_cast<int64_t>(scales.size()) == rows * n_blocks, "NVFP4 scales: {} bytes for [{}, {}]",
             scales.size(), rows, n_blocks);
  std::vector<uint8_t> tiled(static_cast<size_t>(nvfp4_tiled_scale_bytes(rows, k)), 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < n_blocks; ++b) {
      tiled[static_cast<size_t>(nvfp4_tiled_scale_offset(r, b, k))] = scales[static_cast<size_t>(r * n_blocks + b)];
    }
  }
  return tiled;
}

}  // namespace tern
