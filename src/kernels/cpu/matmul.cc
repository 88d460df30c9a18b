#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <array>
#include <bit>
#include <limits>
#include <vector>
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

// Blocks past the last whole 128-column group (the AVX-512 tiles' tail): per block, sum x * e2m1 in order, then
// multiply by the block's scale.
float nvfp4_tail_dot(const float* x, const uint8_t* packed, const uint8_t* scales, float global_scale, int64_t k) {
  constexpr int64_t kGroupBlocks = 8;
  float sum = 0.0f;
  for (int64_t b = k / 16 / kGroupBlocks * kGroupBlocks; b < k / 16; ++b) {
    float partial = 0.0f;
    for (int e = 0; e < 16; ++e) partial += x[b * 16 + e] * e2m1_pairs().v[packed[b * 8 + e / 2]][e & 1];
    sum += partial * (e4m3_table_value(scales[b]) * global_scale);
  }
  return sum;
}

#if defined(__x86_64__)
// AVX-512 NVFP4 tiles: RX rows of x against RW weight rows, each weight byte decoded once per tile. The columns go
// in groups of 128 (8 blocks, one 64-byte load); within a group, nibble n of dword d of the load is element 8d + n,
// so shifting the load by 4t bits puts element 8d + t (low word) and 8d + 4 + t (high word) at the bottom of each
// 16-bit word, where one vpermw turns them into bf16 e2m1 values, i.e. the top halves of their fp32 values. x is
// handed over transposed to match (nvfp4_transpose_x). A block's scale multiplies its partial sum once: lane d
// accumulates sum_n x * e2m1 over half a block, then total += partial * scale. Every (x row, weight row) pair does
// the same operations in the same order whatever RX and RW are, so results do not depend on the batch.
constexpr int64_t kGroup = 128;

// GCC 12's AVX-512 intrinsics start some results from a deliberately self-initialized "undefined" vector, which
// -Wuninitialized reports once they are inlined here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define TERN_AVX512 __attribute__((target("avx512f,avx512bw"), always_inline)) inline

// 16 lanes, lane d = float(e4m3 scale of block d / 2) * global_scale. An e4m3 byte shifted left by 20 is its value
// times 2^-120 as an fp32 (subnormals included), so one exact multiply by 2^120 decodes it.
TERN_AVX512 __m512 nvfp4_group_scales(const uint8_t* scales, __m512 global_scale) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales));
  const __m512i s = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));
  const __m512i mag = _mm512_and_si512(s, _mm512_set1_epi32(0x7F));
  const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(mag, 20),
                                       _mm512_slli_epi32(_mm512_and_si512(s, _mm512_set1_epi32(0x80)), 24));
  __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
  f = _mm512_mask_mov_ps(f, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                         _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  return _mm512_mul_ps(f, global_scale);
}

template <int RX, int RW>
__attribute__((target("avx512f,avx512bw")))
void nvfp4_tile_avx512(const float* xt, int64_t k, const CpuMatrix& w, int64_t row0, float* y, int64_t y_stride) {
  // bf16 of e2m1(i & 15) for i < 32: vpermw reads five index bits, the fifth belongs to the next nibble.
  alignas(64) static constexpr uint16_t kTable[32] = {
      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040,
      0xC080, 0xC0C0, 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0,
      0xC000, 0xC040, 0xC080, 0xC0C0};
  const __m512i table = _mm512_load_si512(kTable);
  const __m512i high_words = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 global_scale = _mm512_set1_ps(w.global_scale);
  const uint8_t* packed = static_cast<const uint8_t*>(w.data) + row0 * (k / 2);
  const uint8_t* scales = w.block_scales + row0 * (k / 16);
  __m512 total[RX][RW];
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < RW; ++j) total[i][j] = _mm512_setzero_ps();
  const int64_t n_groups = k / kGroup;
  for (int64_t g = 0; g < n_groups; ++g) {
    __m512 lo_sum[RX][RW], hi_sum[RX][RW];
    __m512i bytes[RW];
    for (int j = 0; j < RW; ++j) bytes[j] = _mm512_loadu_si512(packed + j * (k / 2) + g * (kGroup / 2));
    const float* xg = xt + g * kGroup;
    for (int t = 0; t < 4; ++t) {
      for (int j = 0; j < RW; ++j) {
        const __m512i words = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes[j], 4 * t), table);
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
        const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(words, high_words));
        for (int i = 0; i < RX; ++i) {
          const __m512 x_lo = _mm512_loadu_ps(xg + i * k + t * 16);
          const __m512 x_hi = _mm512_loadu_ps(xg + i * k + (4 + t) * 16);
          lo_sum[i][j] = t == 0 ? _mm512_mul_ps(x_lo, lo) : _mm512_fmadd_ps(x_lo, lo, lo_sum[i][j]);
          hi_sum[i][j] = t == 0 ? _mm512_mul_ps(x_hi, hi) : _mm512_fmadd_ps(x_hi, hi, hi_sum[i][j]);
        }
      }
    }
    for (int j = 0; j < RW; ++j) {
      const __m512 s = nvfp4_group_scales(scales + j * (k / 16) + g * (kGroup / 16), global_scale);
      for (int i = 0; i < RX; ++i)
        total[i][j] = _mm512_fmadd_ps(_mm512_add_ps(lo_sum[i][j], hi_sum[i][j]), s, total[i][j]);
    }
  }
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < RW; ++j) {
      const float tail = nvfp4_tail_dot(xt + i * k, packed + j * (k / 2), scales + j * (k / 16), w.global_scale, k);
      y[i * y_stride + j] = _mm512_reduce_add_ps(total[i][j]) + tail;
    }
}
#undef TERN_AVX512
#pragma GCC diagnostic pop
#endif

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

// FP8 e4m3 with a scale per 128 columns: each weight dequantized as e4m3 * scale (the fp32 product) first, so the
// sum is the one over the dequantized row.
float dot_fp8_block128(const float* x, const uint8_t* codes, const float* scales, int64_t k) {
  float acc = 0.0f;
  for (int64_t i = 0; i < k; ++i) acc += x[i] * (e4m3_table_value(codes[i]) * scales[i / 128]);
  return acc;
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
    case CpuWeightFormat::kFp8Block128:
      return dot_fp8_block128(x, static_cast<const uint8_t*>(w.data) + row * k,
                              w.row_block_scales + row * ((k + 127) / 128), k);
  }
  return 0.0f;
}


#if defined(__x86_64__)
bool cpu_has_avx512bw() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has;
}

// x row in the column order the AVX-512 tiles read: within each 128-column group, xt[16n + d] = x[8d + n].
void nvfp4_transpose_x(const float* x, int64_t k, float* xt) {
  const int64_t whole = k / kGroup * kGroup;
  for (int64_t g = 0; g < whole; g += kGroup)
    for (int n = 0; n < 8; ++n)
      for (int d = 0; d < 16; ++d) xt[g + n * 16 + d] = x[g + 8 * d + n];
  std::copy(x + whole, x + k, xt + whole);
}

// Fewer x rows leave registers for more weight rows, whose independent sums hide the FMA latency.
template <int RX>
void nvfp4_rows_avx512(const float* xt, const CpuMatrix& w, int64_t r0, int64_t r1, float* y) {
  constexpr int kRw = RX == 1 ? 4 : RX == 2 ? 2 : 1;
  int64_t r = r0;
  for (; r + kRw <= r1; r += kRw) nvfp4_tile_avx512<RX, kRw>(xt, w.cols, w, r, y + r, w.rows);
  for (; r < r1; ++r) nvfp4_tile_avx512<RX, 1>(xt, w.cols, w, r, y + r, w.rows);
}

void nvfp4_matmul_avx512(const float* x, int64_t m, const CpuMatrix& w, float* y) {
  constexpr int64_t kMaxRx = 8;  // x rows per weight pass: 8 rows x 3 accumulators fill the 32 registers
  constexpr int64_t kWeightBlock = 16;
  const int64_t n = w.rows, k = w.cols;
  std::vector<float> xt(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m; ++i) nvfp4_transpose_x(x + i * k, k, xt.data() + i * k);
  const int64_t n_blocks = (n + kWeightBlock - 1) / kWeightBlock;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < n_blocks; ++nb) {
    const int64_t r0 = nb * kWeightBlock, r1 = std::min(n, r0 + kWeightBlock);
    for (int64_t m0 = 0; m0 < m; m0 += kMaxRx) {
      const float* xs = xt.data() + m0 * k;
      float* ys = y + m0 * n;
      switch (std::min(kMaxRx, m - m0)) {
        case 1: nvfp4_rows_avx512<1>(xs, w, r0, r1, ys); break;
        case 2: nvfp4_rows_avx512<2>(xs, w, r0, r1, ys); break;
        case 3: nvfp4_rows_avx512<3>(xs, w, r0, r1, ys); break;
        case 4: nvfp4_rows_avx512<4>(xs, w, r0, r1, ys); break;
        case 5: nvfp4_rows_avx512<5>(xs, w, r0, r1, ys); break;
        case 6: nvfp4_rows_avx512<6>(xs, w, r0, r1, ys); break;
        case 7: nvfp4_rows_avx512<7>(xs, w, r0, r1, ys); break;
        default: nvfp4_rows_avx512<8>(xs, w, r0, r1, ys); break;
      }
    }
  }
}
#endif
}  // namespace

float cpu_dot_f32(const float* a, const float* b, int64_t n) { return dot_f32(a, b, n); }

void cpu_matmul(const float* x, int64_t m, const CpuMatrix& w, float* y) {
  TERN_CHECK(w.format != CpuWeightFormat::kNvfp4 || w.cols % 16 == 0, "NVFP4 matrix cols {} not a multiple of 16",
             w.cols);
#if defined(__x86_64__)
  if (w.format == CpuWeightFormat::kNvfp4 && cpu_has_avx512bw()) return nvfp4_matmul_avx512(x, m, w, y);
#endif
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
    case CpuWeightFormat::kFp8Block128: {
      const uint8_t* codes = static_cast<const uint8_t*>(w.data) + row * k;
      const float* scales = w.row_block_scales + row * ((k + 127) / 128);
      for (int64_t i = 0; i < k; ++i) out[i] = e4m3_table_value(codes[i]) * scales[i / 128];
      return;
    }
  }
}

}  // namespace tern
