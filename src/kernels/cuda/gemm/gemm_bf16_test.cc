// cuBLASLt BF16 GEMM against an fp64 CPU product of the same bf16 inputs. Tolerance and poisoning:
// gemm_test_util.h. Label: gpu.
#include "kernels/cuda/gemm/gemm_bf16.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/gemm/gemm_test_util.h"

namespace tern {
namespace {

// `pad` > 0 writes into columns [pad, pad + n) of a [m, n + 2 pad] output (ldy), checking the rest stays untouched.
void run_and_check(const DeviceContext& ctx, int64_t m, int64_t n, int64_t k, std::mt19937& rng, int64_t pad = 0) {
  const auto x = gemm_test::random_bf16(static_cast<size_t>(m * k), rng);
  const auto w = gemm_test::random_bf16(static_cast<size_t>(n * k), rng);
  const int64_t ldy = n + 2 * pad;
  DeviceBuffer dx(x.size() * 2), dw(w.size() * 2), dy(static_cast<size_t>(m * ldy) * 2);
  dx.upload(x.data(), x.size() * 2);
  dw.upload(w.data(), w.size() * 2);
  dy.fill(0xFF);
  const auto status = gemm_bf16(ctx, GemmBf16Args{.x = dx.as<uint16_t>(), .w = dw.as<uint16_t>(),
                                                  .y = dy.as<uint16_t>() + pad, .m = m, .n = n, .k = k,
                                                  .ldy = pad > 0 ? ldy : 0});
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();
  std::vector<uint16_t> y(static_cast<size_t>(m * ldy));
  TERN_CUDA_CHECK(cudaMemcpy(y.data(), dy.data(), y.size() * 2, cudaMemcpyDeviceToHost));
  const auto ref = gemm_test::reference_gemm(gemm_test::bf16_to_floats(x), gemm_test::bf16_to_floats(w), m, n, k);
  const std::string what = "bf16 m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
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
}

}  // namespace
}  // namespace tern
