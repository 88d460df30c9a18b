// Each CPU kernel against a direct fp64 loop over the defining formula, on random non-zero inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/formats.h"
#include "core/nvfp4.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gated_delta.h"
#include "kernels/cpu/matmul.h"

namespace tern {
namespace cpu_detail {  // the portable NVFP4 dot product (matmul.cc), which AVX2 machines do not dispatch to
float dot_nvfp4(const float* a, const uint8_t* packed, const uint8_t* scales, float global_scale, int64_t n);
}  // namespace cpu_detail
namespace {

std::vector<float> random_vector(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double rel) {
  ASSERT_EQ(got.size(), want.size());
  double max_ref = 0.0;
  for (double w : want) max_ref = std::max(max_ref, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << i;
    ASSERT_NEAR(got[i], want[i], rel * max_ref) << "element " << i;
  }
}

// y = x . W^T with W given as fp32 values (already decoded), in fp64.
std::vector<double> naive_matmul(const std::vector<float>& x, int64_t m, const std::vector<float>& w, int64_t n,
                                 int64_t k) {
  std::vector<double> y(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = 0; r < n; ++r) {
      double s = 0.0;
      for (int64_t j = 0; j < k; ++j) s += double(x[i * k + j]) * double(w[r * k + j]);
      y[i * n + r] = s;
    }
  return y;
}

TEST(CpuMatmul, Bf16MatchesNaiveLoop) {
  const int64_t m = 5, n = 37, k = 83;  // k not a multiple of 16: the tail path
  const auto x = random_vector(m * k, 1);
  const auto wf = random_vector(n * k, 2);
  std::vector<uint16_t> wb(wf.size());
  std::vector<float> wd(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) {
    wb[i] = float_to_bf16(wf[i]);
    wd[i] = bf16_to_float(wb[i]);
  }
  std::vector<float> y(m * n);
  cpu_matmul(x.data(), m, {CpuWeightFormat::kBf16, n, k, wb.data()}, y.data());
  expect_close(y, naive_matmul(x, m, wd, n, k), 1e-5);
}

TEST(CpuMatmul, F32AndF16MatchNaiveLoop) {
  const int64_t m = 3, n = 20, k = 48;
  const auto x = random_vector(m * k, 3);
  const auto wf = random_vector(n * k, 4);
  std::vector<float> y(m * n);
  cpu_matmul(x.data(), m, {CpuWeightFormat::kF32, n, k, wf.data()}, y.data());
  expect_close(y, naive_matmul(x, m, wf, n, k), 1e-5);
  std::vector<uint16_t> wh(wf.size());
  std::vector<float> wd(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) {
    wh[i] = float_to_fp16(wf[i]);
    wd[i] = fp16_to_float(wh[i]);
  }
  cpu_matmul(x.data(), m, {CpuWeightFormat::kF16, n, k, wh.data()}, y.data());
  expect_close(y, naive_matmul(x, m, wd, n, k), 1e-5);
}

TEST(CpuMatmul, Nvfp4MatchesDequantizedReference) {
  const int64_t m = 4, n = 24, k = 64;
  const auto x = random_vector(m * k, 5);
  const auto wf = random_vector(n * k, 6, 0.1f);
  const Nvfp4Matrix q = nvfp4_quantize_weight(wf, n, k);
  const std::vector<float> wd = nvfp4_dequantize(q);  // core/nvfp4.h: the reference decoding
  std::vector<float> y(m * n);
  CpuMatrix w{CpuWeightFormat::kNvfp4, n, k, q.packed.data(), q.block_scales.data(), q.global_scale};
  cpu_matmul(x.data(), m, w, y.data());
  expect_close(y, naive_matmul(x, m, wd, n, k), 1e-5);
  std::vector<float> row(k);
  cpu_matrix_row(w, 7, row.data());
  for (int64_t j = 0; j < k; ++j) ASSERT_EQ(row[j], wd[7 * k + j]);
}

// Block-wise FP8 (DeepSeek-V3 / GLM-5-FP8): e4m3 codes times one scale per 128 columns of a row (the loader expands
// the checkpoint's 128 x 128 grid per row). k = 300 leaves a partial last block.
TEST(CpuMatmul, Fp8BlockMatchesDequantizedReference) {
  const int64_t m = 3, n = 19, k = 300, blocks = 3;
  const auto x = random_vector(m * k, 21);
  std::mt19937 rng(22);
  std::vector<uint8_t> codes(static_cast<size_t>(n * k));
  for (auto& c : codes) {
    do c = static_cast<uint8_t>(rng() & 0xFF); while ((c & 0x7F) == 0x7F);  // every finite e4m3 code, no NaN
  }
  std::uniform_real_distribution<float> su(1e-3f, 2e-2f);
  std::vector<float> scales(static_cast<size_t>(n * blocks));
  for (float& v : scales) v = su(rng);
  std::vector<float> wd(codes.size());
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < k; ++j) wd[r * k + j] = e4m3_to_float(codes[r * k + j]) * scales[r * blocks + j / 128];
  }
  CpuMatrix w{.format = CpuWeightFormat::kFp8Block128, .rows = n, .cols = k, .data = codes.data()};
  w.row_block_scales = scales.data();
  std::vector<float> y(m * n);
  cpu_matmul(x.data(), m, w, y.data());
  expect_close(y, naive_matmul(x, m, wd, n, k), 1e-5);
  std::vector<float> row(k);
  cpu_matrix_row(w, 11, row.data());
  for (int64_t j = 0; j < k; ++j) ASSERT_EQ(row[j], wd[11 * k + j]) << j;
}

// Shapes that exercise every path of the NVFP4 matmul: whole 128-column groups plus leftover 16-column blocks,
// x-row counts 1..11 (one and two passes of up to 8 rows), weight-row counts that leave a partial tile.
TEST(CpuMatmul, Nvfp4WideShapesMatchDequantizedReference) {
  const int64_t n = 23, k = 3 * 128 + 48;
  const auto wf = random_vector(n * k, 31, 0.05f);
  const Nvfp4Matrix q = nvfp4_quantize_weight(wf, n, k);
  const std::vector<float> wd = nvfp4_dequantize(q);
  const CpuMatrix w{CpuWeightFormat::kNvfp4, n, k, q.packed.data(), q.block_scales.data(), q.global_scale};
  for (int64_t m : {1, 2, 3, 5, 8, 11}) {
    const auto x = random_vector(m * k, 32 + static_cast<uint32_t>(m));
    std::vector<float> y(m * n);
    cpu_matmul(x.data(), m, w, y.data());
    expect_close(y, naive_matmul(x, m, wd, n, k), 1e-5);
  }
}

// Scales that are negative, subnormal or NaN in e4m3 decode as the reference decodes them.
TEST(CpuMatmul, Nvfp4UnusualScalesMatchDequantizedReference) {
  const int64_t n = 4, k = 256;
  const auto wf = random_vector(n * k, 41, 0.1f);
  Nvfp4Matrix q = nvfp4_quantize_weight(wf, n, k);
  q.block_scales[1] = 0x83;   // negative subnormal: -3 * 2^-9
  q.block_scales[2] = 0x05;   // subnormal
  q.block_scales[17] = 0xB8;  // -1.0
  q.block_scales[40] = 0x7F;  // NaN: only row 2 becomes NaN
  const std::vector<float> wd = nvfp4_dequantize(q);
  const auto x = random_vector(k, 42);
  std::vector<float> y(n);
  cpu_matmul(x.data(), 1, {CpuWeightFormat::kNvfp4, n, k, q.packed.data(), q.block_scales.data(), q.global_scale},
             y.data());
  ASSERT_TRUE(std::isnan(y[2]));
  std::vector<double> want = naive_matmul(x, 1, wd, n, k);
  y.erase(y.begin() + 2);
  want.erase(want.begin() + 2);
  expect_close(y, want, 1e-5);
}

TEST(CpuMatmul, Nvfp4RowResultIndependentOfBatch) {
  const int64_t m = 19, n = 37, k = 2 * 128 + 32;
  const auto x = random_vector(m * k, 51);
  const auto wf = random_vector(n * k, 52, 0.1f);
  const Nvfp4Matrix q = nvfp4_quantize_weight(wf, n, k);
  const CpuMatrix w{CpuWeightFormat::kNvfp4, n, k, q.packed.data(), q.block_scales.data(), q.global_scale};
  std::vector<float> all(m * n);
  cpu_matmul(x.data(), m, w, all.data());
  for (int64_t i0 = 0; i0 < m; i0 += 4) {  // batches of 1..4 rows starting anywhere
    const int64_t rows = std::min<int64_t>(1 + i0 % 4, m - i0);
    std::vector<float> part(rows * n);
    cpu_matmul(x.data() + i0 * k, rows, w, part.data());
    for (int64_t i = 0; i < rows * n; ++i) ASSERT_EQ(part[i], all[i0 * n + i]) << "row " << i0 + i / n;
  }
}

TEST(CpuMatmul, PortableNvfp4DotMatchesDequantizedReference) {
  const int64_t k = 256;
  const auto x = random_vector(k, 21);
  const auto wf = random_vector(2 * k, 22, 0.3f);
  const Nvfp4Matrix q = nvfp4_quantize_weight(wf, 2, k);
  const std::vector<float> wd = nvfp4_dequantize(q);
  for (int64_t r = 0; r < 2; ++r) {
    double want = 0.0, max_term = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      want += double(x[j]) * wd[r * k + j];
      max_term = std::max(max_term, std::abs(double(x[j]) * wd[r * k + j]));
    }
    const float got = cpu_detail::dot_nvfp4(x.data(), &q.packed[r * k / 2], &q.block_scales[r * k / 16],
                                            q.global_scale, k);
    ASSERT_NEAR(got, want, 1e-5 * max_term * k);
    ASSERT_NE(got, 0.0f);
  }
}

TEST(CpuMatmul, RowResultIndependentOfBatch) {
  const int64_t m = 70, n = 33, k = 96;  // more rows than one chunk
  const auto x = random_vector(m * k, 7);
  const auto wf = random_vector(n * k, 8);
  std::vector<float> all(m * n), one(n);
  CpuMatrix w{CpuWeightFormat::kF32, n, k, wf.data()};
  cpu_matmul(x.data(), m, w, all.data());
  for (int64_t i = 0; i < m; i += 13) {
    cpu_matmul(x.data() + i * k, 1, w, one.data());
    for (int64_t r = 0; r < n; ++r) ASSERT_EQ(one[r], all[i * n + r]);
  }
}

TEST(CpuAttention, CausalGqaMatchesNaiveLoop) {
  CpuAttentionShape s{.n_queries = 6, .past = 3, .n_heads = 4, .n_kv_heads = 2, .head_dim = 16, .scale = 0.25f};
  const int64_t total = s.past + s.n_queries;
  const auto q = random_vector(s.n_queries * s.n_heads * s.head_dim, 9);
  const auto k = random_vector(total * s.n_kv_heads * s.head_dim, 10);
  const auto v = random_vector(total * s.n_kv_heads * s.head_dim, 11);
  std::vector<float> out(q.size());
  cpu_attention_causal(s, q.data(), k.data(), v.data(), out.data());
  std::vector<double> want(q.size());
  const int64_t hd = s.head_dim;
  for (int64_t t = 0; t < s.n_queries; ++t)
    for (int64_t h = 0; h < s.n_heads; ++h) {
      const int64_t kvh = h / 2, n_keys = s.past + t + 1;
      std::vector<double> p(n_keys);
      double mx = -1e300, sum = 0;
      for (int64_t j = 0; j < n_keys; ++j) {
        double d = 0;
        for (int64_t e = 0; e < hd; ++e) d += double(q[(t * 4 + h) * hd + e]) * k[(j * 2 + kvh) * hd + e];
        p[j] = d * s.scale;
        mx = std::max(mx, p[j]);
      }
      for (auto& x : p) sum += (x = std::exp(x - mx));
      for (int64_t e = 0; e < hd; ++e) {
        double o = 0;
        for (int64_t j = 0; j < n_keys; ++j) o += p[j] / sum * v[(j * 2 + kvh) * hd + e];
        want[(t * 4 + h) * hd + e] = o;
      }
    }
  expect_close(out, want, 1e-5);
}

TEST(CpuGatedDelta, ConvWithStateMatchesWholeSequence) {
  const int64_t t = 7, ch = 5, kernel = 4;
  const auto x = random_vector(t * ch, 12);
  const auto w = random_vector(ch * kernel, 13);
  std::vector<double> want(t * ch);
  for (int64_t i = 0; i < t; ++i)
    for (int64_t c = 0; c < ch; ++c) {
      double a = 0;
      for (int64_t j = 0; j < kernel; ++j) {
        const int64_t src = i - (kernel - 1) + j;
        if (src >= 0) a += double(w[c * kernel + j]) * x[src * ch + c];
      }
      want[i * ch + c] = a / (1 + std::exp(-a));
    }
  // In two pieces (4 then 3 tokens), the state carrying the history.
  std::vector<float> state(ch * (kernel - 1), 0.0f), y(t * ch);
  cpu_causal_conv1d_silu(x.data(), ch, 4, ch, w.data(), kernel, state.data(), y.data());
  cpu_causal_conv1d_silu(x.data() + 4 * ch, ch, 3, ch, w.data(), kernel, state.data(), y.data() + 4 * ch);
  expect_close(y, want, 1e-5);
}

TEST(CpuGatedDelta, RecurrenceMatchesNaiveLoop) {
  CpuGatedDeltaShape s{.n_tokens = 5, .n_key_heads = 1, .n_value_heads = 2, .key_dim = 8, .value_dim = 6};
  const int64_t hv = 2, dk = 8, dv = 6, t = 5;
  const auto q = random_vector(t * dk, 14, 0.3f), k = random_vector(t * dk, 15, 0.3f);
  const auto v = random_vector(t * hv * dv, 16);
  auto g = random_vector(t * hv, 17, 0.5f), beta = random_vector(t * hv, 18);
  for (float& x : g) x = -std::abs(x);
  for (float& x : beta) x = 1.0f / (1.0f + std::exp(-x));
  std::vector<double> want(t * hv * dv), st(hv * dk * dv, 0.0);
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < hv; ++j) {
      double* S = &st[j * dk * dv];
      for (int64_t a = 0; a < dk * dv; ++a) S[a] *= std::exp(double(g[i * hv + j]));
      for (int64_t e = 0; e < dv; ++e) {
        double mem = 0;
        for (int64_t d = 0; d < dk; ++d) mem += S[d * dv + e] * k[i * dk + d];
        const double delta = beta[i * hv + j] * (v[(i * hv + j) * dv + e] - mem);
        for (int64_t d = 0; d < dk; ++d) S[d * dv + e] += k[i * dk + d] * delta;
      }
      for (int64_t e = 0; e < dv; ++e) {
        double o = 0;
        for (int64_t d = 0; d < dk; ++d) o += S[d * dv + e] * q[i * dk + d];
        want[(i * hv + j) * dv + e] = o;
      }
    }
  std::vector<float> state(hv * dk * dv, 0.0f), out(t * hv * dv);
  cpu_gated_delta_rule(s, q.data(), k.data(), dk, v.data(), hv * dv, g.data(), beta.data(), state.data(), out.data());
  expect_close(out, want, 1e-5);
}

}  // namespace
}  // namespace tern
