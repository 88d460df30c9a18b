// NVFP4 as NVIDIA ModelOpt defines it (docs/model-specs.md §1): 16-element blocks of e2m1 values, an
// e4m3 scale per block and an fp32 scale per tensor. This is the reference every NVFP4 kernel is checked against.
//
//   weight:     w[n,k]  = e2m1(q[n,k]) * e4m3(block_scale[n,k/16]) * weight_scale_2
//   activation: x[m,k] ~= e2m1(q[m,k]) * e4m3(sf[m,k/16]) / (1/input_scale)       (W4A4 only)
//
// Every fp32 operation below is done in the order ModelOpt's and vLLM's reference code does it, so a value that
// lands exactly on an e2m1 rounding threshold rounds the same way here.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tern {

inline constexpr int kNvfp4BlockSize = 16;
inline constexpr float kE2m1MaxValue = 6.0f;
inline constexpr float kE4m3MaxValue = 448.0f;

// A weight matrix [rows, cols] in ModelOpt's checkpoint layout (row-major, scales not swizzled).
struct Nvfp4Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> packed;        // [rows, cols/2]  two e2m1 codes per byte, even column in the low nibble
  std::vector<uint8_t> block_scales;  // [rows, cols/16] e4m3fn
  float global_scale = 0.0f;          // weight_scale_2 = amax / (6 * 448)
};

// weight_scale_2 / input_scale from an absolute maximum: amax / (6 * 448).
float nvfp4_global_scale_from_amax(float amax);

// Quantizes w [rows, cols] (cols a multiple of 16) exactly as ModelOpt's NVFP4QTensor.quantize with the dynamic
// per-block path. global_scale < 0 means "derive it from this matrix's amax"; fused groups (q/k/v, gate/up) pass
// the group's shared value.
Nvfp4Matrix nvfp4_quantize_weight(std::span<const float> w, int64_t rows, int64_t cols, float global_scale = -1.0f);

// Dequantizes one row of `cols` elements: out[k] = e2m1 * (float(block_scale) * global_scale).
void nvfp4_dequantize_row(const uint8_t* packed_row, const uint8_t* scales_row, float global_scale, int64_t cols,
                          float* out);
std::vector<float> nvfp4_dequantize(const Nvfp4Matrix& m);

// W4A4 activation quantization of one row of n elements (n a multiple of 16), as vLLM's ref_nvfp4_quant /
// sgl-kernel's cvt_warp_fp16_to_fp4 with act_global_scale = 1 / input_scale. Writes n/2 packed bytes and n/16 e4m3
// block scales.
void nvfp4_quantize_activation_row(const float* x, int64_t n, float input_scale, uint8_t* packed, uint8_t* scales);

// The quantize-dequantize of one activation row that an emulated W4A4 GEMM consumes:
// out[k] = e2m1(q[k]) * (float(sf[k/16]) / act_global_scale).
void nvfp4_fake_quantize_activation_row(const float* x, int64_t n, float input_scale, float* out);

}  // namespace tern
