// cuBLASLt's layout of NVFP4 block scales (CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3; cuBLAS documentation, "1D Block
// Scaling Factors Layout"), which the native block-scaled FP4 GEMM reads for both operands. A checkpoint stores the
// scales of a weight [rows, k] row-major as [rows, k/16] (docs/model-specs.md §1.2); cuBLASLt wants them
//   - padded to a multiple of 128 rows and of 4 block columns, the padding ZERO: the tensor cores read whole tiles,
//     and a padded scale multiplies the zero data past k, so a NaN pattern there would poison real outputs;
//   - cut into 128 x 4 tiles of 512 bytes, stored tile row by tile row (all k tiles of rows 0..127 first);
//   - inside a tile, row r and block column c at (r % 32) * 16 + (r / 32) * 4 + c: 32 lines of 16 bytes, line i
//     holding rows i, i + 32, i + 64 and i + 96 with their 4 scales each.
// "rows" is the operand's dimension that is not K: N for the weight, M for the activations. The offset functions
// are usable from host and device code, so the activation quantizer and the weight upload share one definition.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#if defined(__CUDACC__)
#define TERN_HOST_DEVICE __host__ __device__
#else
#define TERN_HOST_DEVICE
#endif

namespace tern {

inline constexpr int64_t kNvfp4ScaleTileRows = 128;
inline constexpr int64_t kNvfp4ScaleTileCols = 4;
inline constexpr int64_t kNvfp4ScaleTileBytes = kNvfp4ScaleTileRows * kNvfp4ScaleTileCols;

// Block columns of the padded layout for a row of k elements (k a multiple of 16).
TERN_HOST_DEVICE constexpr int64_t nvfp4_tiled_scale_cols(int64_t k) {
  return (k / 16 + kNvfp4ScaleTileCols - 1) / kNvfp4ScaleTileCols * kNvfp4ScaleTileCols;
}

TERN_HOST_DEVICE constexpr int64_t nvfp4_tiled_scale_rows(int64_t rows) {
  return (rows + kNvfp4ScaleTileRows - 1) / kNvfp4ScaleTileRows * kNvfp4ScaleTileRows;
}

// Bytes of the tiled scales of an operand [rows, k], padding included.
TERN_HOST_DEVICE constexpr int64_t nvfp4_tiled_scale_bytes(int64_t rows, int64_t k) {
  return nvfp4_tiled_scale_rows(rows) * nvfp4_tiled_scale_cols(k);
}

// Where the scale of (row, block) of an operand with k elements per row lives in the tiled layout.
TERN_HOST_DEVICE constexpr int64_t nvfp4_tiled_scale_offset(int64_t row, int64_t block, int64_t k) {
  const int64_t tiles_per_row = nvfp4_tiled_scale_cols(k) / kNvfp4ScaleTileCols;
  const int64_t tile = (row / kNvfp4ScaleTileRows) * tiles_per_row + block / kNvfp4ScaleTileCols;
  const int64_t r = row % kNvfp4ScaleTileRows;
  return tile * kNvfp4ScaleTileBytes + (r % 32) * 16 + (r / 32) * 4 + block % kNvfp4ScaleTileCols;
}

// Re-lays row-major block scales [rows, k/16] (a checkpoint's weight_scale) into the tiled layout, zero padded.
// Done once when a weight is uploaded.
std::vector<uint8_t> nvfp4_scales_to_tiled(std::span<const uint8_t> scales, int64_t rows, int64_t k);

}  // namespace tern
