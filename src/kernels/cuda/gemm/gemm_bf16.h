// Dense BF16 GEMM through cuBLASLt: y[M,N] = x[M,K] · W[N,K]^T, everything bf16 row-major (W as checkpoints store
// an nn.Linear weight), fp32 accumulation. The BF16 layers of a model and the ceiling the NVFP4 kernels are
// compared against.
#pragma once

#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/device.h"

namespace tern {

struct GemmBf16Args {
  const uint16_t* x = nullptr;  // [m, k] bf16, row-major
  const uint16_t* w = nullptr;  // [n, k] bf16, row-major
  uint16_t* y = nullptr;        // [m, ldy] bf16, row-major; columns [0, n) are written
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t ldy = 0;              // row stride of y in elements; 0 means n
  int64_t ldx = 0;              // row stride of x in elements; 0 means k
  // batch > 1: that many independent products of the same shape, product b reading x + b * x_batch_stride and
  // w + b * w_batch_stride and writing y + b * y_batch_stride (elements). Per-head products over the heads of one
  // projection output (MLA's absorbed query and output: x rows ldx = heads * head width apart, a head's columns
  // x_batch_stride = head width further).
  int64_t batch = 1;
  int64_t x_batch_stride = 0, w_batch_stride = 0, y_batch_stride = 0;
  // Instead of y: an fp32 output [m, ldy] (4-byte aligned), the fp32 accumulators unrounded (a router that the
  // reference model computes in fp32).
  float* y_f32 = nullptr;
  // y = alpha · x · W^T, alpha applied to the fp32 sums before the output's rounding (an NVFP4 weight's
  // weight_scale_2 when its dequantized codes are the W here). Finite.
  float alpha = 1.0f;
};

// Queues the product on ctx.stream(). Errors name the bad argument: non-positive sizes, null or unaligned pointers
// (x and W 16 bytes, y 2), ldy < n, ldx < k, strides that are not multiples of 8, k not a multiple of 8 (rows of x and W must be 16-byte aligned for cuBLASLt's fast kernels), or no
// cuBLASLt algorithm for the shape. m == 0 is a no-op.
Expected<void> gemm_bf16(const DeviceContext& ctx, const GemmBf16Args& args);

}  // namespace tern
