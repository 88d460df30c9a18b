// Helpers shared by the GEMM tests: random bf16-exact inputs, an fp64 CPU reference and the per-element check.
//
// Tolerance (per element of y[m, n]): |y - ref| <= 2^-8 |ref| + 2^-16 S, where ref = sum_k x[k] w[k] in fp64 and
// S = sum_k |x[k] w[k]|. The first term is the bf16 rounding of the output (bf16 keeps 8 significant bits, so
// rounding to nearest moves a value by at most 2^-8 of itself). The second covers fp32 accumulation, tensor-core
// additions included: each partial sum is bounded by S and rounds with a relative error near 2^-24, and the
// errors of K/16 additions with random signs grow like sqrt(K/16) (about 2^-19 S at K = 12288), leaving an 8x
// margin. It scales with the row's magnitude S rather than |ref| because ref can cancel to near zero; it stays
// far below one input's share of S (dropping one 16-element block moves y by about 16 S / K >= 2^-10 S here).
// NaN or infinity never passes, and the output is pre-filled with 0xFFFF (a bf16 NaN), so an unwritten element
// fails.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/formats.h"

namespace tern::gemm_test {

// Random bf16 values, never zero: N(0, 1) rounded to bf16.
inline std::vector<uint16_t> random_bf16(size_t count, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> out(count);
  for (auto& v : out) {
    do {
      v = float_to_bf16(dist(rng));
    } while ((v & 0x7FFF) == 0);
  }
  return out;
}

// A weight [n, k] of N(0, 1) values scaled per row by 2^U(-6, 6): quantized to NVFP4, its block scales cover a
// wide e4m3 range (subnormal scales included) and the global scale is not a round number.
inline std::vector<float> random_row_scaled(int64_t n, int64_t k, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_real_distribution<float> row_exp(-6.0f, 6.0f);
  std::vector<float> w(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r) {
    const float row_scale = std::exp2(row_exp(rng));
    for (int64_t c = 0; c < k; ++c) w[static_cast<size_t>(r * k + c)] = dist(rng) * row_scale;
  }
  return w;
}

inline std::vector<float> bf16_to_floats(const std::vector<uint16_t>& in) {
  std::vector<float> out(in.size());
  for (size_t i = 0; i < in.size(); ++i) out[i] = bf16_to_float(in[i]);
  return out;
}

struct Reference {
  std::vector<double> y;    // [m, n] sum_k x w
  std::vector<double> abs;  // [m, n] sum_k |x w|
};

// y = x[m, k] · w[n, k]^T in fp64, rows of w split over threads.
inline Reference reference_gemm(const std::vector<float>& x, const std::vector<float>& w, int64_t m, int64_t n,
                                int64_t k) {
  Reference ref{std::vector<double>(static_cast<size_t>(m * n)), std::vector<double>(static_cast<size_t>(m * n))};
  const int64_t n_threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 32);
  std::vector<std::thread> threads;
  for (int64_t t = 0; t < n_threads; ++t) {
    threads.emplace_back([&, t] {
      for (int64_t j = t; j < n; j += n_threads) {
        const float* wr = &w[static_cast<size_t>(j * k)];
        for (int64_t i = 0; i < m; ++i) {
          const float* xr = &x[static_cast<size_t>(i * k)];
          double s = 0, a = 0;
          for (int64_t q = 0; q < k; ++q) {
            const double p = static_cast<double>(xr[q]) * wr[q];
            s += p;
            a += std::fabs(p);
          }
          ref.y[static_cast<size_t>(i * n + j)] = s;
          ref.abs[static_cast<size_t>(i * n + j)] = a;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  return ref;
}

inline constexpr double kRelTol = 0x1p-8;   // bf16 output rounding
inline constexpr double kAbsTol = 0x1p-16;  // fp32 accumulation, times sum |x w|
inline constexpr uint16_t kPoison = 0xFFFF;  // a bf16 NaN

// Checks every element; reports the first few failures. Returns the number of bad elements.
inline int64_t check_gemm(const std::vector<uint16_t>& y, const Reference& ref, int64_t m, int64_t n,
                          const std::string& what) {
  int64_t bad = 0;
  double worst = 0;  // error / allowed
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const size_t idx = static_cast<size_t>(i * n + j);
      const double got = bf16_to_float(y[idx]);
      const double want = ref.y[idx];
      const double allowed = kRelTol * std::fabs(want) + kAbsTol * ref.abs[idx];
      const double err = std::fabs(got - want);
      const bool ok = std::isfinite(got) && err <= allowed;
      if (std::isfinite(got)) worst = std::max(worst, err / allowed);
      if (!ok && ++bad <= 5) {
        ADD_FAILURE() << what << ": y[" << i << "," << j << "] = " << got << ", reference " << want
                      << " (allowed error " << allowed << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << m * n << " elements wrong";
  std::printf("%-48s max error / allowed = %.3f\n", what.c_str(), worst);
  return bad;
}

// A strided output y [m, ldy] written at columns [offset, offset + n): returns those columns as [m, n] and counts
// (as failures) elements outside them that are no longer the poison pattern.
inline std::vector<uint16_t> strided_columns(const std::vector<uint16_t>& y, int64_t m, int64_t n, int64_t ldy,
                                             int64_t offset, const std::string& what) {
  std::vector<uint16_t> out(static_cast<size_t>(m * n));
  int64_t touched = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < ldy; ++j) {
      const uint16_t v = y[static_cast<size_t>(i * ldy + j)];
      if (j >= offset && j < offset + n) {
        out[static_cast<size_t>(i * n + j - offset)] = v;
      } else if (v != kPoison) {
        ++touched;
      }
    }
  }
  EXPECT_EQ(touched, 0) << what << ": elements outside the output columns were written";
  return out;
}

}  // namespace tern::gemm_test
