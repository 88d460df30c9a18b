// BF16 GEMV against an fp64 CPU product of the same bf16 inputs, with the tolerance, the NaN poison and the
// untouched-columns check of the cuBLASLt GEMM's test (gemm_test_util.h). Shapes: every m in 1..8 over small odd
// shapes (the tails of k and n), each group size forced, and the decode projections of Qwen3-8B and
// Qwen3.5-35B-A3B (lm_heads included); the RMSNorm and SiLU-and-mul prologues. Label: gpu.
#include "kernels/cuda/gemv/gemv_bf16.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/elementwise/elementwise.h"
#include "kernels/cuda/gemm/gemm_test_util.h"

namespace tern {
namespace {

// A bf16 operand on the host (bits and their float values) and on the device.
struct Operand {
  std::vector<uint16_t> bits;
  std::vector<float> values;
  DeviceBuffer device;
};

// N(0, 1) values rounded to bf16, never zero (as gemm_test::random_bf16), generated in parallel slices seeded from
// `rng`: an lm_head has 10^8 - 10^9 weights.
Operand random_operand(size_t count, std::mt19937& rng) {
  Operand op{std::vector<uint16_t>(count), std::vector<float>(count), DeviceBuffer(std::max<size_t>(count * 2, 16))};
  const size_t n_threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 32);
  const size_t slice = (count + n_threads - 1) / n_threads;
  std::vector<std::thread> threads;
  for (size_t t = 0; t < n_threads; ++t) {
    threads.emplace_back([&op, count, slice, t, seed = rng()] {
      std::mt19937 local(seed);
      std::normal_distribution<float> dist(0.0f, 1.0f);
      for (size_t i = t * slice; i < std::min(count, (t + 1) * slice); ++i) {
        uint16_t v;
        do {
          v = float_to_bf16(dist(local));
        } while ((v & 0x7FFF) == 0);
        op.bits[i] = v;
        op.values[i] = bf16_to_float(v);
      }
    });
  }
  for (auto& th : threads) th.join();
  op.device.upload(op.bits.data(), count * 2);
  return op;
}

struct Case {
  int64_t m, n, k;
  int64_t pad = 0;        // > 0: write columns [pad, pad + n) of a [m, n + 2 pad] output
  int group_threads = 0;  // > 0: launch with this group size (unchecked launcher), else gemv_bf16() chooses
};

// Runs one case with fresh x against the weight `w` ([n, k]) and checks every element of y.
void run_and_check(const DeviceContext& ctx, const Operand& w, const Case& c, std::mt19937& rng) {
  const Operand x = random_operand(static_cast<size_t>(c.m * c.k), rng);
  const int64_t ldy = c.n + 2 * c.pad;
  DeviceBuffer dy(static_cast<size_t>(c.m * ldy) * 2);
  dy.fill(0xFF);
  uint16_t* y = dy.as<uint16_t>() + c.pad;
  if (c.group_threads > 0) {
    gemv_bf16_launch(ctx, GemvBf16Params{.x = x.device.as<uint16_t>(),
                                         .w = w.device.as<uint16_t>(),
                                         .y = y,
                                         .m = static_cast<int>(c.m),
                                         .n = c.n,
                                         .k = c.k,
                                         .ldy = ldy,
                                         .group_threads = c.group_threads});
  } else {
    const auto status = gemv_bf16(ctx, GemmBf16Args{.x = x.device.as<uint16_t>(),
                                                    .w = w.device.as<uint16_t>(),
                                                    .y = y,
                                                    .m = c.m,
                                                    .n = c.n,
                                                    .k = c.k,
                                                    .ldy = c.pad > 0 ? ldy : 0});
    ASSERT_TRUE(status.has_value()) << status.error().message;
  }
  ctx.synchronize();
  std::vector<uint16_t> host(static_cast<size_t>(c.m * ldy));
  TERN_CUDA_CHECK(cudaMemcpy(host.data(), dy.data(), host.size() * 2, cudaMemcpyDeviceToHost));
  const auto ref = gemm_test::reference_gemm(x.values, w.values, c.m, c.n, c.k);
  const std::string what = "gemv m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
                           (c.pad > 0 ? " ldy=" + std::to_string(ldy) : "") +
                           (c.group_threads > 0 ? " T=" + std::to_string(c.group_threads) : "");
  gemm_test::check_gemm(gemm_test::strided_columns(host, c.m, c.n, ldy, c.pad, what), ref, c.m, c.n, what);
}

// Every listed m over one weight shape (one weight, fresh x for each m).
void run_shape(const DeviceContext& ctx, int64_t n, int64_t k, const std::vector<int64_t>& ms, std::mt19937& rng) {
  const Operand w = random_operand(static_cast<size_t>(n * k), rng);
  for (int64_t m : ms) run_and_check(ctx, w, Case{.m = m, .n = n, .k = k}, rng);
}

TEST(GemvBf16, MatchesReferenceOnSmallOddShapes) {
  DeviceContext ctx;
  std::mt19937 rng(2002);
  // k = 8 and 24: fewer chunks than one warp; 1032 and 4104: an odd chunk count per thread. n = 1, 3, 37: a
  // partial column group; 1000: several blocks.
  for (int64_t n : {1, 3, 37, 1000}) {
    for (int64_t k : {8, 24, 1032, 4104}) run_shape(ctx, n, k, {1, 2, 3, 4, 5, 6, 7, 8}, rng);
  }
}

// The RMSNorm fused in front: h_out must be bf16(x + residual) exactly; x_out the reference norm, computed here in
// fp64 from the same bf16 inputs, within one bf16 step (the kernel's fp32 sum of squares runs in its own order, so a
// value on a rounding boundary may round the other way); y the fp64 product of the reference's normed rows within
// the GEMM tolerance. Every output starts as NaN.
void check_rmsnorm_case(const DeviceContext& ctx, int64_t m, int64_t n, int64_t k, bool residual, bool zero_centred,
                        std::mt19937& rng) {
  const std::string what = "gemv+rmsnorm m=" + std::to_string(m) + " n=" + std::to_string(n) +
                           " k=" + std::to_string(k) + (residual ? " +residual" : "") + (zero_centred ? " (1+w)" : "");
  const Operand x = random_operand(static_cast<size_t>(m * k), rng),
                r = random_operand(static_cast<size_t>(m * k), rng);
  const Operand w = random_operand(static_cast<size_t>(n * k), rng), nw = random_operand(static_cast<size_t>(k), rng);
  constexpr float kEps = 1e-6f;
  std::vector<float> h(static_cast<size_t>(m * k)), xn(h.size());
  for (int64_t i = 0; i < m; ++i) {
    double ss = 0;
    for (int64_t e = 0; e < k; ++e) {
      const size_t at = static_cast<size_t>(i * k + e);
      h[at] = x.values[at] + (residual ? r.values[at] : 0.0f);  // the fp32 sum of two bf16 values, as the kernel
      ss += static_cast<double>(h[at]) * h[at];
    }
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(k) + kEps);
    for (int64_t e = 0; e < k; ++e) {
      const size_t at = static_cast<size_t>(i * k + e);
      const double offset = zero_centred ? 1.0 : 0.0;
      xn[at] = bf16_to_float(float_to_bf16(static_cast<float>(h[at] * inv * (offset + nw.values[e]))));
    }
  }
  DeviceBuffer dy(static_cast<size_t>(m * n) * 2), dh(h.size() * 2), dx(h.size() * 2);
  for (const DeviceBuffer* b : {&dy, &dh, &dx}) b->fill(0xFF);
  const auto status = gemv_bf16_rmsnorm(
      ctx,
      GemmBf16Args{
          .x = x.device.as<uint16_t>(), .w = w.device.as<uint16_t>(), .y = dy.as<uint16_t>(), .m = m, .n = n, .k = k},
      GemvNormArgs{.weight = nw.device.as<uint16_t>(),
                   .residual = residual ? r.device.as<uint16_t>() : nullptr,
                   .eps = kEps,
                   .zero_centred = zero_centred,
                   .h_out = dh.as<uint16_t>(),
                   .x_out = dx.as<uint16_t>()});
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();
  std::vector<uint16_t> y(static_cast<size_t>(m * n)), h_got(h.size()), x_got(h.size());
  TERN_CUDA_CHECK(cudaMemcpy(y.data(), dy.data(), y.size() * 2, cudaMemcpyDeviceToHost));
  TERN_CUDA_CHECK(cudaMemcpy(h_got.data(), dh.data(), h_got.size() * 2, cudaMemcpyDeviceToHost));
  TERN_CUDA_CHECK(cudaMemcpy(x_got.data(), dx.data(), x_got.size() * 2, cudaMemcpyDeviceToHost));
  int64_t bad_h = 0, bad_x = 0;
  for (size_t at = 0; at < h.size(); ++at) {
    bad_h += h_got[at] != float_to_bf16(h[at]);
    const uint16_t want = float_to_bf16(xn[at]);
    const bool finite = std::isfinite(bf16_to_float(x_got[at]));
    const bool same_sign = (x_got[at] & 0x8000) == (want & 0x8000);
    bad_x += !finite || !same_sign || std::abs(int{x_got[at] & 0x7FFF} - int{want & 0x7FFF}) > 1;
  }
  EXPECT_EQ(bad_h, 0) << what << ": h_out differs from bf16(x + residual)";
  EXPECT_EQ(bad_x, 0) << what << ": x_out more than one bf16 step from the reference norm";
  gemm_test::check_gemm(y, gemm_test::reference_gemm(xn, w.values, m, n, k), m, n, what);
}

TEST(GemvBf16, RmsNormPrologueMatchesReference) {
  DeviceContext ctx;
  std::mt19937 rng(2010);
  struct Shape {
    int64_t m, n, k;
  };
  // k = 1032 and 4104: an odd chunk count per thread; n = 37, 257: partial column groups; m up to 3.
  for (const Shape& s : {Shape{1, 37, 1032}, Shape{1, 4096, 4096}, Shape{2, 1000, 2048}, Shape{3, 257, 4104}}) {
    for (bool residual : {false, true}) {
      for (bool zero_centred : {false, true}) check_rmsnorm_case(ctx, s.m, s.n, s.k, residual, zero_centred, rng);
    }
  }
}

TEST(GemvBf16, RmsNormRejectsOverlapsAndBadArguments) {
  DeviceContext ctx;
  DeviceBuffer buf(1 << 16);
  auto* p = buf.as<uint16_t>();
  const GemmBf16Args args{.x = p, .w = p + 4096, .y = p + 8192, .m = 1, .n = 8, .k = 64};
  auto expect_error = [&](const GemvNormArgs& n, const std::string& text) {
    const auto status = gemv_bf16_rmsnorm(ctx, args, n);
    ASSERT_FALSE(status.has_value()) << text;
    EXPECT_NE(status.error().message.find(text), std::string::npos) << status.error().message;
  };
  expect_error(GemvNormArgs{}, "the norm weight is a null pointer");
  expect_error(GemvNormArgs{.weight = p + 1}, "the norm weight is not 16-byte aligned");
  expect_error(GemvNormArgs{.weight = p + 2048, .eps = 0.0f}, "eps=0 must be positive and finite");
  expect_error(GemvNormArgs{.weight = p + 2048, .h_out = p + 32}, "must not overlap x or residual");
  expect_error(GemvNormArgs{.weight = p + 2048, .residual = p + 1024, .x_out = p + 1024}, "must not overlap");
}

// The SiLU-and-mul prologue. x is m rows of [gate | up] (random non-zero bf16) at row stride ldx; the elements of a
// row past 2k are NaN, so reading them fails. y is checked twice, from a NaN-filled buffer each time:
//   - against the fp64 product of the act computed here as silu_mul rounds it (fp32 silu with expf, times up in
//     fp32, one bf16 rounding), within the GEMM tolerance (the host's expf may differ from the device's in the
//     last fp32 bit, which can move a rare act by one bf16 step; the tolerance covers that, not a wrong formula);
//   - bit for bit against silu_mul (elementwise.cu) into a separate act buffer followed by the plain GEMV with the
//     same group size: the same x bits give the same sums in the same order, so any difference is a wrong act.
struct SiluCase {
  int64_t m, n, k, ldx;
  int group_threads = 0;  // > 0: both launches forced to this group size (unchecked launcher)
};

std::vector<uint16_t> download_bf16(const DeviceBuffer& d, size_t count) {
  std::vector<uint16_t> host(count);
  TERN_CUDA_CHECK(cudaMemcpy(host.data(), d.data(), count * 2, cudaMemcpyDeviceToHost));
  return host;
}

// The act of row-strided [gate | up] values with silu_mul's rounding, as floats [m, k].
std::vector<float> silu_act_host(const std::vector<float>& gate_up, int64_t m, int64_t k, int64_t ldx) {
  std::vector<float> act(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t c = 0; c < k; ++c) {
      const float g = gate_up[static_cast<size_t>(i * ldx + c)], u = gate_up[static_cast<size_t>(i * ldx + k + c)];
      const float silu = g / (1.0f + std::exp(-g));
      act[static_cast<size_t>(i * k + c)] = bf16_to_float(float_to_bf16(silu * u));
    }
  }
  return act;
}

// One product of `w` ([n, k]) by the act of x: gemv_bf16_silu_mul, or the launcher with silu_ldx when a group
// size is forced, else gemv_bf16 / the plain launcher on a given act. Returns y [m, n].
std::vector<uint16_t> run_gemv(const DeviceContext& ctx, const uint16_t* x, const Operand& w, const SiluCase& c,
                               int64_t silu_ldx) {
  DeviceBuffer dy(static_cast<size_t>(c.m * c.n) * 2);
  dy.fill(0xFF);
  const GemmBf16Args args{.x = x, .w = w.device.as<uint16_t>(), .y = dy.as<uint16_t>(), .m = c.m, .n = c.n, .k = c.k};
  if (c.group_threads > 0) {
    gemv_bf16_launch(ctx, GemvBf16Params{.x = x,
                                         .w = args.w,
                                         .y = args.y,
                                         .m = static_cast<int>(c.m),
                                         .n = c.n,
                                         .k = c.k,
                                         .ldy = c.n,
                                         .group_threads = c.group_threads,
                                         .silu_ldx = silu_ldx});
  } else {
    const auto status = silu_ldx > 0 ? gemv_bf16_silu_mul(ctx, args, silu_ldx) : gemv_bf16(ctx, args);
    EXPECT_TRUE(status.has_value()) << status.error().message;
  }
  ctx.synchronize();
  return download_bf16(dy, static_cast<size_t>(c.m * c.n));
}

void check_silu_case(const DeviceContext& ctx, const Operand& w, const SiluCase& c, std::mt19937& rng) {
  const std::string what = "gemv+silu m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) +
                           " k=" + std::to_string(c.k) + " ldx=" + std::to_string(c.ldx) +
                           (c.group_threads > 0 ? " T=" + std::to_string(c.group_threads) : "");
  Operand x = random_operand(static_cast<size_t>(c.m * c.ldx), rng);
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t e = 2 * c.k; e < c.ldx; ++e) x.bits[static_cast<size_t>(i * c.ldx + e)] = gemm_test::kPoison;
  }
  x.device.upload(x.bits.data(), x.bits.size() * 2);
  const std::vector<float> act = silu_act_host(x.values, c.m, c.k, c.ldx);

  const std::vector<uint16_t> fused = run_gemv(ctx, x.device.as<uint16_t>(), w, c, c.ldx);
  gemm_test::check_gemm(fused, gemm_test::reference_gemm(act, w.values, c.m, c.n, c.k), c.m, c.n, what);

  DeviceBuffer dact(static_cast<size_t>(c.m * c.k) * 2);
  dact.fill(0xFF);
  const auto status = silu_mul(ctx, SiluMulArgs{.gate_up = x.device.as<uint16_t>(),
                                                .y = dact.as<uint16_t>(),
                                                .rows = c.m,
                                                .inter = c.k,
                                                .gate_up_stride = c.ldx});
  ASSERT_TRUE(status.has_value()) << status.error().message;
  const std::vector<uint16_t> unfused = run_gemv(ctx, dact.as<uint16_t>(), w, c, 0);
  int64_t differ = 0;
  for (size_t at = 0; at < fused.size(); ++at) differ += fused[at] != unfused[at];
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << fused.size()
                       << " outputs differ from silu_mul followed by gemv_bf16";
}

TEST(GemvBf16, SiluMulPrologueMatchesReference) {
  DeviceContext ctx;
  std::mt19937 rng(2011);
  // k = 8 and 24: fewer chunks than one warp; 1032 and 4104: an odd chunk count per thread; n = 1, 37: a partial
  // column group; 1000: several blocks. Odd m read rows 2k + 24 apart (a slice of a wider output), even m 2k.
  for (int64_t n : {1, 37, 1000}) {
    for (int64_t k : {8, 24, 1032, 4104}) {
      const Operand w = random_operand(static_cast<size_t>(n * k), rng);
      for (int64_t m = 1; m <= kGemvMaxRows; ++m) {
        check_silu_case(ctx, w, SiluCase{.m = m, .n = n, .k = k, .ldx = 2 * k + (m % 2 == 1 ? 24 : 0)}, rng);
      }
    }
  }
}

TEST(GemvBf16, SiluMulEveryGroupSizeMatches) {
  DeviceContext ctx;
  std::mt19937 rng(2012);
  for (auto [n, k] : {std::pair<int64_t, int64_t>{37, 4104}, {1000, 2048}, {3, 24}}) {
    const Operand w = random_operand(static_cast<size_t>(n * k), rng);
    for (int threads : {32, 64, 128, 256}) {
      for (int64_t m : {1, 4, 8}) {
        check_silu_case(ctx, w, SiluCase{.m = m, .n = n, .k = k, .ldx = 2 * k + 8, .group_threads = threads}, rng);
      }
    }
  }
}

TEST(GemvBf16, SiluMulMatchesReferenceOnQwenDownShapes) {
  DeviceContext ctx;
  std::mt19937 rng(2013);
  // Qwen3-8B's down_proj (intermediate 12288 -> 4096) and Qwen3.5-35B-A3B's shared-expert down (512 -> 2048).
  for (auto [n, k] : {std::pair<int64_t, int64_t>{4096, 12288}, {2048, 512}}) {
    const Operand w = random_operand(static_cast<size_t>(n * k), rng);
    for (int64_t m : {1, 2, 8}) check_silu_case(ctx, w, SiluCase{.m = m, .n = n, .k = k, .ldx = 2 * k}, rng);
  }
}

TEST(GemvBf16, SiluMulRejectsBadArguments) {
  DeviceContext ctx;
  DeviceBuffer bx(1 << 12), bw(1 << 14), by(1 << 12);
  bx.fill(0);
  bw.fill(0);
  const GemmBf16Args good{
      .x = bx.as<uint16_t>(), .w = bw.as<uint16_t>(), .y = by.as<uint16_t>(), .m = 4, .n = 64, .k = 64};
  ASSERT_TRUE(gemv_bf16_silu_mul(ctx, good, 128).has_value());  // each case below differs in one argument
  auto expect_error = [&](GemmBf16Args a, int64_t ldx, const std::string& needle) {
    const auto r = gemv_bf16_silu_mul(ctx, a, ldx);
    ASSERT_FALSE(r.has_value()) << needle;
    EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  };
  expect_error(good, 120, "ldx=120 is less than 2k=128");
  expect_error(good, 0, "ldx=0 is less than 2k=128");
  expect_error(good, 132, "ldx=132 is not a multiple of 8");
  auto a = good;
  a.k = 60;
  expect_error(a, 120, "k=60 is not a multiple of 8");
  a = good;
  a.x = bx.as<uint16_t>() + 4;
  expect_error(a, 128, "x is not 16-byte aligned");
  a = good;
  a.m = kGemvMaxRows + 1;
  expect_error(a, 128, "m=9 is more rows than the GEMV takes");
  a = good;
  a.w = nullptr;
  expect_error(a, 128, "w is a null pointer");
  a = good;
  a.m = 0;
  EXPECT_TRUE(gemv_bf16_silu_mul(ctx, a, 128).has_value());  // no rows: a no-op, not an error
  ctx.synchronize();
}

TEST(GemvBf16, WritesOnlyItsColumnsOfAWiderOutput) {
  DeviceContext ctx;
  std::mt19937 rng(2003);
  // Odd pads leave every row of y 2-byte aligned only, as a part of a fused projection can be.
  for (int64_t n : {1, 37, 1000}) {
    const Operand w = random_operand(static_cast<size_t>(n * 1032), rng);
    for (int64_t pad : {3, 8}) {
      for (int64_t m : {1, 5, 8}) run_and_check(ctx, w, Case{.m = m, .n = n, .k = 1032, .pad = pad}, rng);
    }
  }
}

TEST(GemvBf16, EveryGroupSizeMatchesReference) {
  DeviceContext ctx;
  std::mt19937 rng(2004);
  for (auto [n, k] : {std::pair<int64_t, int64_t>{37, 4104}, {1000, 2048}, {3, 24}}) {
    const Operand w = random_operand(static_cast<size_t>(n * k), rng);
    for (int threads : {32, 64, 128, 256}) {
      for (int64_t m : {1, 4, 8}) {
        run_and_check(ctx, w, Case{.m = m, .n = n, .k = k, .pad = 3, .group_threads = threads}, rng);
      }
    }
  }
}

TEST(GemvBf16, MatchesReferenceOnQwen3_8bShapes) {
  DeviceContext ctx;
  std::mt19937 rng(2005);
  // qkv, o_proj, gate|up, down_proj, lm_head (hidden 4096, 32 q / 8 kv heads of 128, intermediate 12288).
  for (auto [n, k] :
       {std::pair<int64_t, int64_t>{6144, 4096}, {4096, 4096}, {24576, 4096}, {4096, 12288}, {151936, 4096}}) {
    run_shape(ctx, n, k, {1, 8}, rng);
  }
}

TEST(GemvBf16, MatchesReferenceOnQwen3_5_35bA3bShapes) {
  DeviceContext ctx;
  std::mt19937 rng(2006);
  // The BF16 projections outside the routed experts (hidden 2048), as the CUDA model fuses them:
  //   attention q|gate, k, v (16 heads x 256 x 2 + 2 x 256 + 2 x 256) and o_proj (16 x 256 -> 2048);
  //   GDN in_proj_qkv (2 x 16 x 128 + 32 x 128), in_proj_z (32 x 128), in_proj_b|a (2 x 32), out_proj (4096 -> 2048);
  //   the router with the shared expert's gate (256 + 1), the shared expert's gate|up (2 x 512) and down (512 ->
  //   2048); the lm_head (vocabulary 248320).
  for (auto [n, k] : {std::pair<int64_t, int64_t>{9216, 2048},
                      {2048, 4096},
                      {8192, 2048},
                      {4096, 2048},
                      {64, 2048},
                      {257, 2048},
                      {1024, 2048},
                      {2048, 512},
                      {248320, 2048}}) {
    run_shape(ctx, n, k, {1, 3, 8}, rng);
  }
}

TEST(GemvBf16, ZeroRowsWritesNothing) {
  DeviceContext ctx;
  DeviceBuffer buf(1 << 16);
  buf.fill(0xFF);
  const auto status = gemv_bf16(
      ctx, GemmBf16Args{
               .x = buf.as<uint16_t>(), .w = buf.as<uint16_t>(), .y = buf.as<uint16_t>(), .m = 0, .n = 64, .k = 64});
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();
  std::vector<uint16_t> host(buf.size_bytes() / 2);
  TERN_CUDA_CHECK(cudaMemcpy(host.data(), buf.data(), buf.size_bytes(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::count(host.begin(), host.end(), gemm_test::kPoison), static_cast<std::ptrdiff_t>(host.size()));
}

TEST(GemvBf16, RejectsBadArguments) {
  DeviceContext ctx;
  DeviceBuffer bx(1 << 12), bw(1 << 14), by(1 << 12);
  bx.fill(0);
  bw.fill(0);
  const GemmBf16Args good{
      .x = bx.as<uint16_t>(), .w = bw.as<uint16_t>(), .y = by.as<uint16_t>(), .m = 4, .n = 64, .k = 64};
  ASSERT_TRUE(gemv_bf16(ctx, good).has_value());  // each case below differs from this in one argument
  auto expect_error = [&](GemmBf16Args a, const std::string& needle) {
    const auto r = gemv_bf16(ctx, a);
    ASSERT_FALSE(r.has_value()) << needle;
    EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  };
  auto a = good;
  a.m = kGemvMaxRows + 1;
  expect_error(a, "m=9 is more rows than the GEMV takes");
  a = good;
  a.m = -1;
  expect_error(a, "bad shape");
  a = good;
  a.n = 0;
  expect_error(a, "bad shape");
  a = good;
  a.k = 0;
  expect_error(a, "bad shape");
  a = good;
  a.n = int64_t{1} << 31;
  expect_error(a, "dimension over 2^31-1");
  a = good;
  a.k = 60;
  expect_error(a, "k=60 is not a multiple of 8");
  a = good;
  a.x = nullptr;
  expect_error(a, "x is a null pointer");
  a = good;
  a.w = nullptr;
  expect_error(a, "w is a null pointer");
  a = good;
  a.y = nullptr;
  expect_error(a, "y is a null pointer");
  a = good;
  a.x = bx.as<uint16_t>() + 4;
  expect_error(a, "x is not 16-byte aligned");
  a = good;
  a.w = bw.as<uint16_t>() + 1;
  expect_error(a, "w is not 16-byte aligned");
  a = good;
  a.y = reinterpret_cast<uint16_t*>(by.as<char>() + 1);
  expect_error(a, "y is not 2-byte aligned");
  a = good;
  a.ldy = 63;
  expect_error(a, "ldy=63 is less than n=64");
  ctx.synchronize();
}

// The group size is host arithmetic (no device needed): always one of the four sizes, grown from one warp only
// while the grid has fewer than two blocks per SM and k has more chunks than the group has threads.
TEST(GemvBf16, GroupSizeFollowsTheShape) {
  EXPECT_EQ(gemv_bf16_group_threads(2, 1, 8, 132), 32);          // one chunk: one warp
  EXPECT_EQ(gemv_bf16_group_threads(2, 24576, 4096, 132), 32);   // 768 blocks already
  EXPECT_EQ(gemv_bf16_group_threads(2, 6144, 4096, 132), 64);    // 192 -> 384 blocks
  EXPECT_EQ(gemv_bf16_group_threads(8, 4096, 4096, 132), 128);   // 128 -> 256 -> 512 blocks
  EXPECT_EQ(gemv_bf16_group_threads(2, 2048, 512, 132), 64);     // 64 chunks: no more threads than that
  EXPECT_EQ(gemv_bf16_group_threads(2, 257, 2048, 132), 256);    // 65 blocks at most
  EXPECT_EQ(gemv_bf16_group_threads(1, 24576, 4096, 132), 256);  // one row: the whole block
  EXPECT_EQ(gemv_bf16_group_threads(1, 2048, 512, 132), 64);     // ... but no more threads than chunks
  EXPECT_EQ(gemv_bf16_group_threads(1, 1, 8, 132), 32);
  for (int m : {1, 2, 8}) {
    for (int64_t n : {1, 3, 64, 1000, 4096, 151936}) {
      for (int64_t k : {8, 64, 512, 2048, 4104, 12288}) {
        const int t = gemv_bf16_group_threads(m, n, k, 188);
        EXPECT_TRUE(t == 32 || t == 64 || t == 128 || t == 256) << m << " " << n << " " << k << ": " << t;
      }
    }
  }
}

}  // namespace
}  // namespace tern
