// cuBLASLt BF16 GEMM against an fp64 CPU product of the same bf16 inputs. Tolerance and poisoning:
// gemm_test_util.h. Label: gpu.
#include "kernels/cuda/gemm/gemm_bf16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <tuple>
#include <string>
#include <vector>

#include "core/formats.h"
#include "kernels/cuda/gemm/gemm_test_util.h"

namespace tern {
namespace {

// `pad` > 0 writes into columns [pad, pad + n) of a [m, n + 2 pad] output (ldy), checking the rest stays untouched.
// alpha != 1 scales the product (the reference scaled in fp64 before the comparison's rounding).
void run_and_check(const DeviceContext& ctx, int64_t m, int64_t n, int64_t k, std::mt19937& rng, int64_t pad = 0,
                   float alpha = 1.0f) {
  const auto x = gemm_test::random_bf16(static_cast<size_t>(m * k), rng);
  const auto w = gemm_test::random_bf16(static_cast<size_t>(n * k), rng);
  const int64_t ldy = n + 2 * pad;
  DeviceBuffer dx(x.size() * 2), dw(w.size() * 2), dy(static_cast<size_t>(m * ldy) * 2);
  dx.upload(x.data(), x.size() * 2);
  dw.upload(w.data(), w.size() * 2);
  dy.fill(0xFF);
  const auto status = gemm_bf16(ctx, GemmBf16Args{.x = dx.as<uint16_t>(), .w = dw.as<uint16_t>(),
                                                  .y = dy.as<uint16_t>() + pad, .m = m, .n = n, .k = k,
                                                  .ldy = pad > 0 ? ldy : 0, .alpha = alpha});
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();
  std::vector<uint16_t> y(static_cast<size_t>(m * ldy));
  TERN_CUDA_CHECK(cudaMemcpy(y.data(), dy.data(), y.size() * 2, cudaMemcpyDeviceToHost));
  auto ref = gemm_test::reference_gemm(gemm_test::bf16_to_floats(x), gemm_test::bf16_to_floats(w), m, n, k);
  for (auto& v : ref.y) v *= alpha;
  for (auto& v : ref.abs) v *= std::fabs(alpha);
  const std::string what = std::string("bf16") + (alpha != 1.0f ? " alpha=" + std::to_string(alpha) : "") +
                           " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                           (pad > 0 ? " ldy=" + std::to_string(ldy) : "");
  gemm_test::check_gemm(gemm_test::strided_columns(y, m, n, ldy, pad, what), ref, m, n, what);
}

TEST(GemmBf16, MatchesReference) {
  DeviceContext ctx;
  std::mt19937 rng(2001);
  for (int64_t m : {1, 3, 7, 16, 17, 100, 257}) run_and_check(ctx, m, 1000, 1032, rng);
  run_and_check(ctx, 1, 4096, 4096, rng);
  run_and_check(ctx, 16, 12288, 4096, rng);
  run_and_check(ctx, 257, 2048, 6144, rng);
  // Output rows that are not 16-byte aligned: a one-column gate and odd widths.
  for (int64_t n : {1, 3, 1001}) {
    for (int64_t m : {1, 8, 33}) run_and_check(ctx, m, n, 2048, rng);
  }
  // A column slice of a wider output (fused projections write their parts side by side).
  for (int64_t pad : {3, 8}) {
    for (int64_t m : {1, 17, 300}) run_and_check(ctx, m, 512, 1024, rng, pad);
  }
  // A scaled product (an NVFP4 part's weight_scale_2 as alpha), into a column slice.
  for (int64_t m : {1, 40, 300}) run_and_check(ctx, m, 512, 1024, rng, 3, 0.0123f);
}

// Per-head products inside wider rows, as MLA's absorbed query uses them: x [m, heads, head_width] (each head's
// first k columns are its input), W [heads, n, k], y [m, heads, y_width] (each head's first n columns written).
// Every other column of y must stay untouched; each head checked against its own fp64 product.
void run_batched_and_check(const DeviceContext& ctx, int64_t m, int64_t heads, int64_t n, int64_t k,
                           int64_t head_width, int64_t y_width, std::mt19937& rng) {
  const auto x = gemm_test::random_bf16(static_cast<size_t>(m * heads * head_width), rng);
  const auto w = gemm_test::random_bf16(static_cast<size_t>(heads * n * k), rng);
  DeviceBuffer dx(x.size() * 2), dw(w.size() * 2), dy(static_cast<size_t>(m * heads * y_width) * 2);
  dx.upload(x.data(), x.size() * 2);
  dw.upload(w.data(), w.size() * 2);
  dy.fill(0xFF);
  const auto status = gemm_bf16(ctx, GemmBf16Args{.x = dx.as<uint16_t>(),
                                                  .w = dw.as<uint16_t>(),
                                                  .y = dy.as<uint16_t>(),
                                                  .m = m,
                                                  .n = n,
                                                  .k = k,
                                                  .ldy = heads * y_width,
                                                  .ldx = heads * head_width,
                                                  .batch = heads,
                                                  .x_batch_stride = head_width,
                                                  .w_batch_stride = n * k,
                                                  .y_batch_stride = y_width});
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();
  std::vector<uint16_t> y(static_cast<size_t>(m * heads * y_width));
  TERN_CUDA_CHECK(cudaMemcpy(y.data(), dy.data(), y.size() * 2, cudaMemcpyDeviceToHost));
  const std::vector<float> xf = gemm_test::bf16_to_floats(x), wf = gemm_test::bf16_to_floats(w);
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<float> xh(static_cast<size_t>(m * k));
    for (int64_t i = 0; i < m; ++i) {
      std::copy_n(xf.begin() + (i * heads + h) * head_width, k, xh.begin() + i * k);
    }
    const std::vector<float> wh(wf.begin() + h * n * k, wf.begin() + (h + 1) * n * k);
    const std::string what = "batched head " + std::to_string(h) + " of " + std::to_string(heads) +
                             " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k);
    // Head h's output columns [h * y_width, h * y_width + n) of rows heads * y_width wide.
    std::vector<uint16_t> rows(static_cast<size_t>(m * y_width));
    for (int64_t i = 0; i < m; ++i) {
      std::copy_n(y.begin() + (i * heads + h) * y_width, y_width, rows.begin() + i * y_width);
    }
    gemm_test::check_gemm(gemm_test::strided_columns(rows, m, n, y_width, 0, what),
                          gemm_test::reference_gemm(xh, wh, m, n, k), m, n, what);
  }
}

TEST(GemmBf16, BatchedPerHeadProductsMatchReference) {
  DeviceContext ctx;
  std::mt19937 rng(2002);
  // GLM-5's absorbed query (192 -> 512 of 256-wide heads into 576-wide rows) and output (512 -> 256), at decode and
  // prefill row counts; the tiny fixture's shapes.
  for (int64_t m : {1, 5, 64, 300}) {
    run_batched_and_check(ctx, m, 8, 512, 192, 256, 576, rng);
    run_batched_and_check(ctx, m, 8, 256, 512, 512, 256, rng);
    run_batched_and_check(ctx, m, 4, 32, 32, 48, 48, rng);
  }
}

// The fp32 output (a router computed in fp32): no bf16 rounding, so within fp32 accumulation of the fp64 product
// (far inside the bf16 output's tolerance, which a rounded output would exceed on most elements); the columns past n
// of each row stay poisoned.
TEST(GemmBf16, Fp32OutputIsTheUnroundedProduct) {
  DeviceContext ctx;
  std::mt19937 rng(2003);
  for (const auto& [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 256, 6144}, {37, 256, 6144}, {5, 8, 64}}) {
    const auto x = gemm_test::random_bf16(static_cast<size_t>(m * k), rng);
    const auto w = gemm_test::random_bf16(static_cast<size_t>(n * k), rng);
    const int64_t ldy = n + 4;
    DeviceBuffer dx(x.size() * 2), dw(w.size() * 2), dy(static_cast<size_t>(m * ldy) * 4);
    dx.upload(x.data(), x.size() * 2);
    dw.upload(w.data(), w.size() * 2);
    dy.fill(0xFF);  // fp32 NaN
    const auto status = gemm_bf16(ctx, GemmBf16Args{.x = dx.as<uint16_t>(), .w = dw.as<uint16_t>(), .m = m, .n = n,
                                                    .k = k, .ldy = ldy, .y_f32 = dy.as<float>()});
    ASSERT_TRUE(status.has_value()) << status.error().message;
    ctx.synchronize();
    std::vector<float> y(static_cast<size_t>(m * ldy));
    TERN_CUDA_CHECK(cudaMemcpy(y.data(), dy.data(), y.size() * 4, cudaMemcpyDeviceToHost));
    const auto ref = gemm_test::reference_gemm(gemm_test::bf16_to_floats(x), gemm_test::bf16_to_floats(w), m, n, k);
    int64_t rounded_would_fail = 0;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < ldy; ++j) {
        const float got = y[static_cast<size_t>(i * ldy + j)];
        if (j >= n) {
          ASSERT_TRUE(std::isnan(got)) << "column " << j << " past n was written";
          continue;
        }
        const size_t r = static_cast<size_t>(i * n + j);
        ASSERT_TRUE(std::isfinite(got));
        ASSERT_LE(std::abs(got - ref.y[r]), 0x1p-16 * ref.abs[r] + 1e-30) << i << "," << j;
        const double as_bf16 = bf16_to_float(float_to_bf16(got));
        if (std::abs(as_bf16 - ref.y[r]) > 0x1p-16 * ref.abs[r]) ++rounded_would_fail;
      }
    }
    EXPECT_GT(rounded_would_fail, 0) << "the check cannot tell an fp32 output from a bf16-rounded one";
  }
  const GemmBf16Args both{.x = nullptr, .w = nullptr, .y = reinterpret_cast<uint16_t*>(16), .m = 1, .n = 8, .k = 8,
                          .y_f32 = reinterpret_cast<float*>(16)};
  const auto r = gemm_bf16(ctx, both);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("exactly one of y and y_f32"), std::string::npos) << r.error().message;
}

TEST(GemmBf16, RejectsBadArguments) {
  DeviceContext ctx;
  DeviceBuffer buf(1 << 20);
  const GemmBf16Args good{.x = buf.as<uint16_t>(), .w = buf.as<uint16_t>(), .y = buf.as<uint16_t>(), .m = 4, .n = 64,
                          .k = 64};
  auto expect_error = [&](GemmBf16Args a, const std::string& needle) {
    const auto r = gemm_bf16(ctx, a);
    ASSERT_FALSE(r.has_value()) << needle;
    EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  };
  auto a = good;
  a.k = 60;
  expect_error(a, "k=60 is not a multiple of 8");
  a = good;
  a.w = nullptr;
  expect_error(a, "null pointer");
  a = good;
  a.x = buf.as<uint16_t>() + 1;
  expect_error(a, "x is not 16-byte aligned");
  a = good;
  a.k = 0;
  expect_error(a, "bad shape");
  a = good;
  a.ldx = 60;
  expect_error(a, "ldx=60 must be a multiple of 8");
  a = good;
  a.batch = 2;
  a.x_batch_stride = 64;
  a.w_batch_stride = 12;
  a.y_batch_stride = 64;
  expect_error(a, "w_batch_stride=12 must be a positive multiple of 8");
  a = good;
  a.alpha = std::nanf("");
  expect_error(a, "alpha=nan is not finite");
}

}  // namespace
}  // namespace tern
