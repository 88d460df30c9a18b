// NVFP4 weight-only GEMM (W4A16): y[M,N] = x[M,K] · dequant(W)^T with x and y bf16 row-major and W in ModelOpt's
// checkpoint layout (docs/model-specs.md §1): packed e2m1 [N, K/2] with even k in the low nibble, e4m3
// block scales [N, K/16], fp32 weight_scale_2. Products are exact (bf16 x times e2m1·e4m3, exact in bf16) and
// accumulate in fp32; weight_scale_2 is applied to the fp32 sum; y is rounded to bf16 once.
//
// Two kernels: decode (M <= 16) streams the packed weight once with 16-byte loads and dequantizes into tensor-core
// fragments in registers; prefill dequantizes W tiles to bf16 in shared memory and runs mma.sync on them. Past 64
// rows kAuto dequantizes the weight (the same bf16 values) into the context's workspace and runs cuBLASLt on it,
// weight_scale_2 as its alpha (dequant_gemm.h); the prefill kernel remains a forced variant.
#pragma once

#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/gemm/gemm_nvfp4_w4a16_launch.h"

namespace tern {

// Queues the product on ctx.stream(). Any n >= 1 works; k must be a multiple of 16 (the NVFP4 block). Errors name
// the bad argument: shape, null or misaligned pointer (x 16 bytes, packed 8, y 4), a non-finite global scale, or
// m over the decode kernel's limit when kDecode is forced. m == 0 is a no-op.
Expected<void> gemm_nvfp4_w4a16(const DeviceContext& ctx, const GemmNvfp4W4a16Args& args,
                                Nvfp4GemmVariant variant = Nvfp4GemmVariant::kAuto);

}  // namespace tern
