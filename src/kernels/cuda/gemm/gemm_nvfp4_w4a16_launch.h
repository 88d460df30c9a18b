// The NVFP4 W4A16 kernels' argument structs and their unchecked launchers. The .cu side cannot include
// core/error.h (nvcc rejects fmt's consteval format strings), so validation lives in gemm_nvfp4_w4a16.cc and
// callers use gemm_nvfp4_w4a16() from gemm_nvfp4_w4a16.h.
#pragma once

#include <cstdint>

#include "kernels/cuda/device.h"

namespace tern {

inline constexpr int kNvfp4MaxExtraParts = 3;

// A device-resident NVFP4 weight [n, k] (k a multiple of 16). It may be several linears over the same input stacked
// by rows (q|k|v, gate|up), each with its own weight_scale_2: the rows from part_begin[i] on (ascending, in (0, n);
// 0 ends the list) take part_scale[i] instead of global_scale.
struct Nvfp4WeightView {
  const uint8_t* packed = nullptr;  // [n, k/2] two e2m1 codes per byte, even k in the low nibble
  const uint8_t* scales = nullptr;  // [n, k/16] e4m3fn block scales, row-major, not swizzled
  float global_scale = 0.0f;        // weight_scale_2 (of the first part)
  int64_t n = 0;
  int64_t k = 0;
  int64_t part_begin[kNvfp4MaxExtraParts] = {};
  float part_scale[kNvfp4MaxExtraParts] = {};
};

struct GemmNvfp4W4a16Args {
  const uint16_t* x = nullptr;  // [m, k] bf16, row-major
  Nvfp4WeightView w;
  uint16_t* y = nullptr;  // [m, ldy] bf16, row-major; columns [0, n) are written
  int64_t m = 0;
  int64_t ldy = 0;        // row stride of y in elements; 0 means n
};

enum class Nvfp4GemmVariant {
  kAuto,     // decode for m <= kNvfp4DecodeMaxM, kBatch up to kNvfp4BatchMaxM (kSliced where the weight does not fit
             // it), then kDequant
  kDecode,   // m <= kNvfp4DecodeMaxM only
  kBatch,    // m <= kNvfp4BatchMaxM, k % 32 == 0, packed 16-byte and scales 2-byte aligned: the weight read once
  kSliced,   // the decode kernel per 16-row slice, any m
  kPrefill,  // the prefill kernel, any m
  kDequant,  // the weight dequantized to bf16 a chunk at a time, then cuBLASLt (dequant_gemm.h), any m
};

inline constexpr int64_t kNvfp4DecodeMaxM = 16;
inline constexpr int64_t kNvfp4BatchMaxM = 64;

// Unchecked launches on ctx.stream(), for arguments gemm_nvfp4_w4a16() has validated (m >= 1).
void nvfp4_w4a16_launch_decode(const DeviceContext& ctx, const GemmNvfp4W4a16Args& args);
void nvfp4_w4a16_launch_batch(const DeviceContext& ctx, const GemmNvfp4W4a16Args& args);
void nvfp4_w4a16_launch_prefill(const DeviceContext& ctx, const GemmNvfp4W4a16Args& args);

}  // namespace tern
