// Block-wise FP8 weight-only GEMM (W8A16): y[M,N] = x[M,K] · dequant(W)^T with x and y bf16 row-major and W as
// e4m3 codes [N, K] with an fp32 scale per row and 128-column block (the checkpoint's weight_scale_inv of DeepSeek-V3,
// GLM-5-FP8 and Qwen3-FP8, expanded per row; docs/model-specs.md §1.7). Accumulation in fp32, y rounded to bf16 once.
//
// Two kernels (fp8_device.cuh): decode (M <= 16) streams the codes once with 16-byte loads, converts them exactly
// to bf16 mma fragments and scales each 64-k step's sums in fp32; prefill dequantizes W tiles (e4m3 * scale rounded
// to bf16) into shared memory and runs mma.sync on them (the NVFP4 prefill kernel's pipeline, dequant_prefill.cuh).
// Past 64 rows kAuto dequantizes the weight (the same bf16 values) into the context's workspace and runs cuBLASLt on
// it (dequant_gemm.h); the prefill kernel remains a forced variant.
#pragma once

#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/gemm/gemm_fp8_w8a16_launch.h"

namespace tern {

// Queues the product on ctx.stream(). Any n >= 1 works; k must be a multiple of 16. Errors name the bad argument:
// shape, null or misaligned pointer (x and codes 16 bytes, row scales 4, y 4), or m over the decode kernel's limit
// when kDecode is forced. m == 0 is a no-op.
Expected<void> gemm_fp8_w8a16(const DeviceContext& ctx, const GemmFp8W8a16Args& args,
                              Fp8GemmVariant variant = Fp8GemmVariant::kAuto);

}  // namespace tern
