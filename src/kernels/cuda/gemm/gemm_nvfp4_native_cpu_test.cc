// The host parts of the native FP4 path, which need no GPU: the re-layout of block scales into cuBLASLt's tiled
// layout, checked against a direct transcription of the cuBLAS documentation's formula ("1D Block Scaling Factors
// Layout") and the two offsets of its published example, and the architecture predicate.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kernels/cuda/gemm/gemm_nvfp4_native.h"
#include "kernels/cuda/nvfp4/nvfp4_scale_layout.h"

namespace tern {
namespace {

// The documentation's formula, written in its own terms: the scale of (outer index, block index) of an operand whose
// scale matrix has sf_inner_dim block columns (padded to 4) lives at
//   (sf_inner + sf_outer * sf_inner_dim) * 128 + (outer % 128 % 32) * 16 + (outer % 128 / 32) * 4 + block % 4
// with sf_outer = outer / 128 and sf_inner = block / 4 * 4.
int64_t documented_offset(int64_t outer, int64_t block, int64_t n_blocks) {
  const int64_t sf_inner_dim = (n_blocks + 3) / 4 * 4;
  const int64_t sf_outer = outer / 128;
  const int64_t sf_inner = block / 4 * 4;
  const int64_t tile_offset = (sf_inner + sf_outer * sf_inner_dim) * 128;
  const int64_t intra_outer = outer % 128;
  return tile_offset + (intra_outer % 32) * 16 + (intra_outer / 32) * 4 + block % 4;
}

TEST(Nvfp4ScaleLayout, DocumentedExample) {
  // cuBLAS / nvmath-python example: an NVFP4 operand of 128 x 128; block (5, 2) is at 82 and block (5, 5) at 593.
  EXPECT_EQ(nvfp4_tiled_scale_offset(5, 2, 128), 82);
  EXPECT_EQ(nvfp4_tiled_scale_offset(5, 5, 128), 593);
  EXPECT_EQ(documented_offset(5, 2, 8), 82);
  EXPECT_EQ(documented_offset(5, 5, 8), 593);
}

// Every scale lands where the documented formula puts it, every other byte of the padded buffer is zero, and no two
// scales share a byte; shapes include rows not a multiple of 128 and k/16 not a multiple of 4.
TEST(Nvfp4ScaleLayout, MatchesTheDocumentedFormula) {
  std::mt19937 rng(4242);
  std::uniform_int_distribution<int> code(1, 0x7E);  // non-zero finite e4m3, so zero padding is told apart
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 16},    {1, 64},     {5, 48},     {31, 80},
                                                           {127, 112}, {128, 64},   {129, 16},   {200, 96},
                                                           {256, 128}, {300, 1040}, {1000, 4096}};
  for (const auto& [rows, k] : shapes) {
    const int64_t n_blocks = k / 16;
    std::vector<uint8_t> scales(static_cast<size_t>(rows * n_blocks));
    for (auto& s : scales) s = static_cast<uint8_t>(code(rng));
    const std::vector<uint8_t> tiled = nvfp4_scales_to_tiled(scales, rows, k);
    const int64_t padded_rows = (rows + 127) / 128 * 128, padded_cols = (n_blocks + 3) / 4 * 4;
    ASSERT_EQ(static_cast<int64_t>(tiled.size()), padded_rows * padded_cols) << rows << " x " << k;
    ASSERT_EQ(nvfp4_tiled_scale_bytes(rows, k), padded_rows * padded_cols);
    std::vector<int> hits(tiled.size(), 0);
    int64_t wrong = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t at = documented_offset(r, b, n_blocks);
        ASSERT_GE(at, 0);
        ASSERT_LT(at, static_cast<int64_t>(tiled.size())) << rows << " x " << k << " (" << r << ", " << b << ")";
        ++hits[static_cast<size_t>(at)];
        wrong += tiled[static_cast<size_t>(at)] != scales[static_cast<size_t>(r * n_blocks + b)];
        wrong += nvfp4_tiled_scale_offset(r, b, k) != at;
      }
    }
    EXPECT_EQ(wrong, 0) << rows << " x " << k;
    int64_t shared = 0, dirty_padding = 0;
    for (size_t i = 0; i < tiled.size(); ++i) {
      shared += hits[i] > 1;
      dirty_padding += hits[i] == 0 && tiled[i] != 0;
    }
    EXPECT_EQ(shared, 0) << rows << " x " << k;
    EXPECT_EQ(dirty_padding, 0) << rows << " x " << k << ": padding must be zero";
  }
}

TEST(Nvfp4ScaleLayout, PaddingOfTheLastTile) {
  // 3 rows and 2 blocks per row: one 512-byte tile holding 6 scales, everything else zero.
  const std::vector<uint8_t> scales = {1, 2, 3, 4, 5, 6};
  const std::vector<uint8_t> tiled = nvfp4_scales_to_tiled(scales, 3, 32);
  ASSERT_EQ(tiled.size(), 512u);
  std::vector<uint8_t> expected(512, 0);
  expected[0] = 1, expected[1] = 2;    // row 0: line 0, bytes 0..1
  expected[16] = 3, expected[17] = 4;  // row 1: line 1
  expected[32] = 5, expected[33] = 6;  // row 2: line 2
  EXPECT_EQ(tiled, expected);
}

TEST(Nvfp4NativeSupport, ExactArchitecturesWithFp4TensorCores) {
  auto props = [](int major, int minor) {
    DeviceProps p;
    p.cc_major = major;
    p.cc_minor = minor;
    return p;
  };
  EXPECT_FALSE(nvfp4_native_supported(props(9, 0)));  // H100 / H200
  EXPECT_FALSE(nvfp4_native_supported(props(8, 9)));  // RTX 4090
  EXPECT_FALSE(nvfp4_native_supported(props(8, 0)));
  EXPECT_TRUE(nvfp4_native_supported(props(10, 0)));   // B200
  EXPECT_TRUE(nvfp4_native_supported(props(12, 0)));   // RTX PRO 6000 Blackwell
  EXPECT_FALSE(nvfp4_native_supported(props(13, 0)));  // unknown: not assumed
}

TEST(Nvfp4NativeWorkspace, HoldsPackedCodesAndTiledScales) {
  EXPECT_EQ(gemm_nvfp4_native_workspace_bytes(0, 64), 0u);
  // m = 3, k = 64: 96 packed bytes rounded to 256, then one 512-byte scale tile.
  EXPECT_EQ(gemm_nvfp4_native_workspace_bytes(3, 64), 256u + 512u);
  // m = 200, k = 4096: 409600 packed bytes (a multiple of 256), scales 256 rows x 256 columns.
  EXPECT_EQ(gemm_nvfp4_native_workspace_bytes(200, 4096), 409600u + 256u * 256u);
}

}  // namespace
}  // namespace tern
