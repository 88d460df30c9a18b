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
};

// Queues the product on ctx.stream(). Errors name the bad argument: non-positive sizes, null or unaligned pointers
// (x and W 16 bytes, y 2), ldy < n, k not a multiple of 8 (rows of x and W must be 16-byte aligned for cuBLASLt's fast kernels), or no
// cuBLASLt algorithm for the shape. m == 0 is a no-op.
Expected<void> gemm_bf16(const DeviceContext& ctx, const GemmBf16Args& args);

}  // namespace tern
