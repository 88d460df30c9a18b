#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/error.h"
#include "core/formats.h"

namespace tern {
namespace {

constexpr int kLanes = 16;

// Every dot product accumulates into 16 lanes (element k goes to lane k % 16) and reduces them in one fixed order,
// so each format gives bit-identical results wherever it is called from.
inline float reduce_lanes(const float* acc) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// e2m1 code pairs of one packed byte (low nibble = even element).
struct E2m1PairTable {
  std::array<std::array<float, 2>, 256> v;
  E2m1PairTable() {
    for (int b = 0; b < 256; ++b) v[b] = {e2m1_to_float(static_cast<uint8_t>(b & 0xF)),
                                          e2m1_to_float(static_cast<uint8_t>(b >> 4))};
  }
};
const E2m1PairTable& e2m1_pairs() {
  static const E2m1PairTable table;
  return table;
}

float e4m3_table_value(uint8_t bits) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = e4m3_to_float(static_cast<uint8_t>(b));
    return t;
  }();
  return table[bits];
}

}  // namespace

namespace cpu_detail {

__attribute__((target_clones("arch=x86-64-v3", "default")))
float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  const int64_t full = n / kLanes * kLanes;
  for (int64_t k = 0; k < full; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[k + l] * b[k + l];
  }
  for (int64_t k = full; k < n; ++k) acc[k - full] += a[k] * b[k];
  return reduce_lanes(acc);
}

__attribute__((target_clones("arch=x86-64-v3", "default")))
float dot_bf16(const float* a, const uint16_t* b, int64_t n) {
  float acc[kLanes] = {};
  const int64_t full = n / kLanes * kLanes;
  for (int64_t k = 0; k < full; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[k + l] * bf16_bits_to_float(b[k + l]);
  }
  for (int64_t k = full; k < n; ++k) acc[k - full] += a[k] * bf16_bits_to_float(b[k]);
  return reduce_lanes(acc);
}

}  // namespace cpu_detail

namespace {
using cpu_detail::dot_bf16;
using cpu_detail::dot_f32;

float dot_f16(const float* a, const uint16_t* b, int64_t n) {
  float acc[kLanes] = {};
  for (int64_t k = 0; k < n; ++k) acc[k % kLanes] += a[k] * fp16_to_float(b[k]);
  return reduce_lanes(acc);
}

}  // namespace

namespace cpu_detail {
// cols is a multiple of 16 for NVFP4 (checked by the caller). An e2m1 code c placed at bit 22 of a float
// ((c & 7) << 22, sign (c & 8) << 28) is its value times 2^-126 (code 1 lands on the subnormal 2^-127), so one
// exact multiply by 2^126 decodes it without a table; then * (float(scale) * global_scale), ModelOpt's order.
// Even and odd elements of a block accumulate in lanes 0-7 and 8-15.
__attribute__((target_clones("arch=x86-64-v3", "default")))
float dot_nvfp4(const float* a, const uint8_t* packed, const uint8_t* scales, float global_scale, int64_t n) {
  float acc[kLanes] = {};
  for (int64_t blk = 0; blk < n / kLanes; ++blk) {
    const float scale = e4m3_table_value(scales[blk]) * global_scale;
    const uint8_t* p = packed + blk * (kLanes / 2);
    const float* x = a + blk * kLanes;
    for (int j = 0; j < kLanes / 2; ++j) {
      const uint32_t lo = p[j] & 0xFu, hi = static_cast<uint32_t>(p[j]) >> 4;
      const float w_lo = std::bit_cast<float>(((lo & 7u) << 22) | ((lo & 8u) << 28)) * 0x1p126f * scale;
      const float w_hi = std::bit_cast<float>(((hi & 7u) << 22) | ((hi & 8u) << 28)) * 0x1p126f * scale;
      acc[j] += x[2 * j] * w_lo;
      acc[kLanes / 2 + j] += x[2 * j + 1] * w_hi;
    }
  }
  return reduce_lanes(acc);
}

#if defined(__x86_64__)
// AVX2 + FMA: one block per iteration. The 16 nibbles are looked up as 2 * e2m1 (an exact small integer, in int8)
// with one byte shuffle, widened to fp32 and multiplied by scale / 2, which equals e2m1 * scale exactly.
__attribute__((target("avx2,fma")))
float dot_nvfp4_avx2(const float* a, const uint8_t* packed, const uint8_t* scales, float global_scale, int64_t n) {
  const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < n / kLanes; ++blk) {
    const __m256 half_scale = _mm256_set1_ps(e4m3_table_value(scales[blk]) * global_scale * 0.5f);
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + blk * (kLanes / 2)));
    const __m128i lo = _mm_and_si128(bytes, low_mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
    const __m128i codes = _mm_unpacklo_epi8(lo, hi);  // element order
    const __m128i twice = _mm_shuffle_epi8(table, codes);
    const __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(twice)), half_scale);
    const __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(twice, 8))), half_scale);
    const float* x = a + blk * kLanes;
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x), w0, acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w1, acc1);
  }
  float acc[kLanes];
  _mm256_storeu_ps(acc, acc0);
  _mm256_storeu_ps(acc + 8, acc1);
  return reduce_lanes(acc);
}
#endif

}  // namespace cpu_detail

namespace {

bool cpu_has_avx2_fma() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

float dot_nvfp4(const float* a, const uint8_t* packed, const uint8_t* scales, float global_scale, int64_t n) {
#if defined(__x86_64__)
  if (cpu_has_avx2_fma()) return cpu_detail::dot_nvfp4_avx2(a, packed, scales, global_scale, n);
#endif
  return cpu_detail::dot_nvfp4(a, packed, scales, global_scale, n);
}

float dot_row(const float* x, const CpuMatrix& w, int64_t row) {
  const int64_t k = w.cols;
  switch (w.format) {
    case CpuWeightFormat::kF32:
      return dot_f32(x, static_cast<const float*>(w.data) + row * k, k);
    case CpuWeightFormat::kBf16:
      return dot_bf16(x, static_cast<const uint16_t*>(w.data) + row * k, k);
    case CpuWeightFormat::kF16:
      return dot_f16(x, static_cast<const uint16_t*>(w.data) + row * k, k);
    case CpuWeightFormat::kNvfp4:
      return dot_nvfp4(x, static_cast<const uint8_t*>(w.data) + row * (k / 2), w.block_scales + row * (k / 16),
                       w.global_scale, k);
  }
  return 0.0f;
}

}  // namespace

float cpu_dot_f32(const float* a, const float* b, int64_t n) { return dot_f32(a, b, n); }

void cpu_matmul(const float* x, int64_t m, const CpuMatrix& w, float* y) {
  TERN_CHECK(w.format != CpuWeightFormat::kNvfp4 || w.cols % 16 == 0, "NVFP4 matrix cols {} not a multiple of 16",
             w.cols);
  // Rows of x are taken in chunks that stay in cache while a block of weight rows streams past them.
  constexpr int64_t kRowChunk = 32;
  constexpr int64_t kWeightBlock = 16;
  const int64_t n = w.rows, k = w.cols;
  const int64_t n_blocks = (n + kWeightBlock - 1) / kWeightBlock;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < n_blocks; ++nb) {
    const int64_t r0 = nb * kWeightBlock, r1 = std::min(n, r0 + kWeightBlock);
    for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
      const int64_t m1 = std::min(m, m0 + kRowChunk);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t i = m0; i < m1; ++i) y[i * n + r] = dot_row(x + i * k, w, r);
      }
    }
  }
}

void cpu_matrix_row(const CpuMatrix& w, int64_t row, float* out) {
  const int64_t k = w.cols;
  switch (w.format) {
    case CpuWeightFormat::kF32:
      std::memcpy(out, static_cast<const float*>(w.data) + row * k, static_cast<size_t>(k) * sizeof(float));
      return;
    case CpuWeightFormat::kBf16: {
      const uint16_t* p = static_cast<const uint16_t*>(w.data) + row * k;
      for (int64_t i = 0; i < k; ++i) out[i] = bf16_bits_to_float(p[i]);
      return;
    }
    case CpuWeightFormat::kF16: {
      const uint16_t* p = static_cast<const uint16_t*>(w.data) + row * k;
      for (int64_t i = 0; i < k; ++i) out[i] = fp16_to_float(p[i]);
      return;
    }
    case CpuWeightFormat::kNvfp4: {
      const auto& pairs = e2m1_pairs().v;
      const uint8_t* packed = static_cast<const uint8_t*>(w.data) + row * (k / 2);
      const uint8_t* scales = w.block_scales + row * (k / 16);
      for (int64_t i = 0; i < k; i += 2) {
        const float scale = e4m3_table_value(scales[i / 16]) * w.global_scale;
        out[i] = pairs[packed[i / 2]][0] * scale;
        out[i + 1] = pairs[packed[i / 2]][1] * scale;
      }
      return;
    }
  }
}

}  // namespace tern
