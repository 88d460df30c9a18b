// Whole rows of a quantized weight dequantized to a bf16 matrix in global memory, for the weight-only GEMMs' large-m
// path (gemm_fp8_w8a16, gemm_nvfp4_w4a16): dequantize a chunk of rows into a workspace, then cuBLASLt's BF16 GEMM.
// Each value is the one the prefill kernels put in shared memory, bit for bit: FP8 e4m3 * row scale in fp32 rounded
// to bf16 once; NVFP4 e2m1 * e4m3 block scale (exact in bf16), its weight_scale_2 left to the GEMM's alpha.
// Unchecked launches on ctx.stream() (the callers validate); each kernel waits for the stream's previous kernel
// before it writes (launch.cuh), so a workspace the previous GEMM reads is not overwritten under it.
#pragma once

#include <cstdint>

#include "kernels/cuda/device.h"

namespace tern {

// out [rows, k] bf16 = codes [rows, k] (e4m3) times row_scales [rows, ceil(k / 128)]; k a multiple of 16, codes
// and out 16-byte aligned.
void fp8_dequant_rows_launch(const DeviceContext& ctx, const uint8_t* codes, const float* row_scales, int64_t rows,
                             int64_t k, uint16_t* out);

// out [rows, k] bf16 = packed [rows, k / 2] (e2m1 pairs, even k low) times scales [rows, k / 16] (e4m3); k a
// multiple of 16, packed 8-byte and out 16-byte aligned.
void nvfp4_dequant_rows_launch(const DeviceContext& ctx, const uint8_t* packed, const uint8_t* scales, int64_t rows,
                               int64_t k, uint16_t* out);

}  // namespace tern
