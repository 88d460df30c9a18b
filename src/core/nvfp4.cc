#include "core/nvfp4.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/formats.h"

namespace tern {

float nvfp4_global_scale_from_amax(float amax) { return amax / (kE2m1MaxValue * kE4m3MaxValue); }

Nvfp4Matrix nvfp4_quantize_weight(std::span<const float> w, int64_t rows, int64_t cols, float global_scale) {
  TERN_CHECK(cols % kNvfp4BlockSize == 0, "NVFP4 needs a multiple of 16 columns, got {}", cols);
  TERN_CHECK(static_cast<int64_t>(w.size()) == rows * cols);
  Nvfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.packed.assign(static_cast<size_t>(rows * cols / 2), 0);
  m.block_scales.assign(static_cast<size_t>(rows * cols / kNvfp4BlockSize), 0);
  if (global_scale < 0.0f) {
    float amax = 0.0f;
    for (float v : w) amax = std::max(amax, std::fabs(v));
    global_scale = nvfp4_global_scale_from_amax(amax);
  }
  m.global_scale = global_scale;

  const float scale_denominator = kE2m1MaxValue * global_scale;  // ModelOpt: amax / (6.0 * wsf2)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols / kNvfp4BlockSize; ++b) {
      const float* block = w.data() + r * cols + b * kNvfp4BlockSize;
      float block_amax = 0.0f;
      for (int i = 0; i < kNvfp4BlockSize; ++i) block_amax = std::max(block_amax, std::fabs(block[i]));
      float scale = block_amax / scale_denominator;
      if (scale == 0.0f) scale = 1.0f;           // an all-zero block gets scale 1
      scale = std::max(scale, 0x1p-9f);          // the smallest e4m3 subnormal, so tiny blocks do not flush to 0
      const uint8_t scale_code = float_to_e4m3(scale, Overflow::kNonFinite);
      m.block_scales[static_cast<size_t>(r * (cols / kNvfp4BlockSize) + b)] = scale_code;
      const float divisor = e4m3_to_float(scale_code) * global_scale;
      for (int i = 0; i < kNvfp4BlockSize; ++i) {
        fp4_set(m.packed.data() + r * cols / 2, static_cast<size_t>(b * kNvfp4BlockSize + i),
                float_to_e2m1(block[i] / divisor));
      }
    }
  }
  return m;
}

void nvfp4_dequantize_row(const uint8_t* packed_row, const uint8_t* scales_row, float global_scale, int64_t cols,
                          float* out) {
  for (int64_t b = 0; b < cols / kNvfp4BlockSize; ++b) {
    const float scale = e4m3_to_float(scales_row[b]) * global_scale;
    for (int i = 0; i < kNvfp4BlockSize; ++i) {
      const int64_t k = b * kNvfp4BlockSize + i;
      out[k] = e2m1_to_float(fp4_get(packed_row, static_cast<size_t>(k))) * scale;
    }
  }
}

std::vector<float> nvfp4_dequantize(const Nvfp4Matrix& m) {
  std::vector<float> out(static_cast<size_t>(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r) {
    nvfp4_dequantize_row(m.packed.data() + r * m.cols / 2, m.block_scales.data() + r * m.cols / kNvfp4BlockSize,
                         m.global_scale, m.cols, out.data() + r * m.cols);
  }
  return out;
}

namespace {

// 1/x, and 0 for x == 0 (vLLM's get_reciprocal).
float reciprocal_or_zero(float x) { return x == 0.0f ? 0.0f : 1.0f / x; }

// One 16-element block: returns the e4m3 scale code and writes the e2m1 codes.
uint8_t quantize_activation_block(const float* x, float act_global_scale, uint8_t* codes) {
  float vmax = 0.0f;
  for (int i = 0; i < kNvfp4BlockSize; ++i) vmax = std::max(vmax, std::fabs(x[i]));
  float scale = act_global_scale * (vmax * reciprocal_or_zero(kE2m1MaxValue));
  scale = std::clamp(scale, -kE4m3MaxValue, kE4m3MaxValue);
  const uint8_t scale_code = float_to_e4m3(scale, Overflow::kSaturate);
  const float output_scale = reciprocal_or_zero(e4m3_to_float(scale_code) * reciprocal_or_zero(act_global_scale));
  for (int i = 0; i < kNvfp4BlockSize; ++i) {
    codes[i] = float_to_e2m1(std::clamp(x[i] * output_scale, -kE2m1MaxValue, kE2m1MaxValue));
  }
  return scale_code;
}

}  // namespace

void nvfp4_quantize_activation_row(const float* x, int64_t n, float input_scale, uint8_t* packed, uint8_t* scales) {
  TERN_CHECK(n % kNvfp4BlockSize == 0, "NVFP4 needs a multiple of 16 elements, got {}", n);
  const float act_global_scale = 1.0f / input_scale;
  uint8_t codes[kNvfp4BlockSize];
  for (int64_t b = 0; b < n / kNvfp4BlockSize; ++b) {
    scales[b] = quantize_activation_block(x + b * kNvfp4BlockSize, act_global_scale, codes);
    for (int i = 0; i < kNvfp4BlockSize; ++i) fp4_set(packed, static_cast<size_t>(b * kNvfp4BlockSize + i), codes[i]);
  }
}

void nvfp4_fake_quantize_activation_row(const float* x, int64_t n, float input_scale, float* out) {
  TERN_CHECK(n % kNvfp4BlockSize == 0, "NVFP4 needs a multiple of 16 elements, got {}", n);
  const float act_global_scale = 1.0f / input_scale;
  uint8_t codes[kNvfp4BlockSize];
  for (int64_t b = 0; b < n / kNvfp4BlockSize; ++b) {
    const uint8_t scale_code = quantize_activation_block(x + b * kNvfp4BlockSize, act_global_scale, codes);
    const float block_scale = e4m3_to_float(scale_code) / act_global_scale;
    for (int i = 0; i < kNvfp4BlockSize; ++i) out[b * kNvfp4BlockSize + i] = e2m1_to_float(codes[i]) * block_scale;
  }
}

}  // namespace tern
