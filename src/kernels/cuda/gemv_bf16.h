// BF16 GEMV for decode: y[m, n] = x[m, k] . W[n, k]^T for 1 <= m <= kGemvMaxRows, with the arguments and semantics
// of gemm_bf16 (gemm_bf16.h): bf16 row-major operands, W in nn.Linear layout, fp32 accumulation, y rounded to bf16
// once. One kernel that streams W near copy speed; for more rows gemm_bf16 (cuBLASLt) is the one to call.
#pragma once

#include "core/error.h"
#include "kernels/cuda/gemm_bf16.h"
#include "kernels/cuda/gemv_bf16_launch.h"

namespace tern {

// Queues the product on ctx.stream(). Errors name the bad argument: non-positive sizes, m over kGemvMaxRows, a
// dimension over 2^31 - 1, k not a multiple of 8, null or unaligned pointers (x and W 16 bytes, y 2), ldy < n.
// m == 0 is a no-op.
Expected<void> gemv_bf16(const DeviceContext& ctx, const GemmBf16Args& args);

}  // namespace tern
