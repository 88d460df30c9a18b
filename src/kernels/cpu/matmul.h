// CPU matrix products against weights in their stored format: y[m, n] = sum_k x[m, k] * W[n, k] (x fp32, W as the
// checkpoint holds it). Weights are converted to fp32 inside the dot product, so BF16 weights are read straight from
// the mapped file and NVFP4 weights stay packed. Every (x row, W row) pair goes through the same dot product with a
// fixed 16-lane accumulation, so a row's result does not depend on the batch it is computed in, nor on the thread
// count.
#pragma once

#include <cstdint>

namespace tern {

enum class CpuWeightFormat { kF32, kBf16, kF16, kNvfp4, kFp8Block128 };

// A [rows, cols] weight matrix in place (not owned).
struct CpuMatrix {
  CpuWeightFormat format = CpuWeightFormat::kBf16;
  int64_t rows = 0;
  int64_t cols = 0;
  const void* data = nullptr;            // f32/bf16/f16 [rows, cols], NVFP4 packed e2m1 [rows, cols/2], FP8 e4m3
  const uint8_t* block_scales = nullptr;  // NVFP4: e4m3 [rows, cols/16]
  float global_scale = 1.0f;              // NVFP4: weight_scale_2
  // FP8 (128 x 128 blocks): each row's scales, [rows, ceil(cols / 128)] fp32 (the checkpoint's weight_scale_inv row
  // of the row's block, repeated per row so that a slice of rows stays a plain pointer). Weight = e4m3 * scale.
  const float* row_block_scales = nullptr;
};

// y [m, w.rows] = x [m, w.cols] . w^T. Parallel over the rows of w.
void cpu_matmul(const float* x, int64_t m, const CpuMatrix& w, float* y);

// Row `row` of w as fp32 (NVFP4: e2m1 * (float(scale) * global_scale), ModelOpt's order; FP8: e4m3 * scale).
void cpu_matrix_row(const CpuMatrix& w, int64_t row, float* out);

// The dot products the matmul uses, exposed for tests: sum over k of a[k] * row[k].
float cpu_dot_f32(const float* a, const float* b, int64_t n);

}  // namespace tern
