// The block-wise FP8 W8A16 kernels' argument structs and their unchecked launchers. The .cu side cannot include
// core/error.h (nvcc rejects fmt's consteval format strings), so validation lives in gemm_fp8_w8a16.cc and callers
// use gemm_fp8_w8a16() from gemm_fp8_w8a16.h.
#pragma once

#include <cstdint>

#include "kernels/cuda/device.h"

namespace tern {

// A device-resident block-wise FP8 weight [n, k] (k a multiple of 16): e4m3 codes and one fp32 scale per row and
// 128-column block (fp8_device.cuh). Linears over the same input may be stacked by rows, their scale rows with them.
struct Fp8WeightView {
  const uint8_t* codes = nullptr;     // [n, k] e4m3fn, row-major
  const float* row_scales = nullptr;  // [n, ceil(k / 128)]: weight = e4m3 * scale
  int64_t n = 0;
  int64_t k = 0;
};

struct GemmFp8W8a16Args {
  const uint16_t* x = nullptr;  // [m, k] bf16, row-major
  Fp8WeightView w;
  uint16_t* y = nullptr;  // [m, ldy] bf16, row-major; columns [0, n) are written
  int64_t m = 0;
  int64_t ldy = 0;        // row stride of y in elements; 0 means n
};

enum class Fp8GemmVariant {
  kAuto,       // decode for m <= kFp8DecodeMaxM, kBatch up to kFp8BatchMaxM, then kDequant
  kDecode,     // m <= kFp8DecodeMaxM only
  kBatch,      // m <= kFp8BatchMaxM: the weight read once for all rows
  kSliced,     // the decode kernel per 16-row slice, any m
  kPrefill,    // the prefill kernel, any m
  kDequant,    // the weight dequantized to bf16 a chunk at a time, then cuBLASLt (dequant_gemm.h), any m
};

inline constexpr int64_t kFp8DecodeMaxM = 16;
inline constexpr int64_t kFp8BatchMaxM = 64;

// Unchecked launches on ctx.stream(), for arguments gemm_fp8_w8a16() has validated (m >= 1).
void fp8_w8a16_launch_decode(const DeviceContext& ctx, const GemmFp8W8a16Args& args);
void fp8_w8a16_launch_batch(const DeviceContext& ctx, const GemmFp8W8a16Args& args);
void fp8_w8a16_launch_prefill(const DeviceContext& ctx, const GemmFp8W8a16Args& args);

}  // namespace tern
