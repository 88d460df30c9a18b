// Block-wise FP8 W8A16 GEMM against an fp64 CPU product of the same bf16 activations and the weights dequantized by
// core/formats (OCP e4m3 decode times the block's scale). The decode kernel applies each scale in fp32, so its
// reference weight is e4m3 * scale exactly; the prefill kernel rounds e4m3 * scale to bf16 once (its contract,
// gemm_fp8_w8a16.h), so its reference weight is that bf16 value. Tolerance and poisoning: gemm_test_util.h. Label: gpu.
#include "kernels/cuda/gemm/gemm_fp8_w8a16.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/formats.h"
#include "kernels/cuda/gemm/gemm_test_util.h"

namespace tern {
namespace {

using gemm_test::kPoison;

constexpr int64_t kBlock = 128;

// A random weight [n, k] (rows scaled by 2^U(-6, 6), so neighbouring 128-row blocks get scales far apart) quantized
// as DeepSeek-V3 does: per 128 x 128 block, scale = amax / 448, code = e4m3(w / scale). The device holds the scales
// per row (fp8_device.cuh).
struct TestWeight {
  int64_t n = 0, k = 0;
  std::vector<uint8_t> codes;
  std::vector<float> row_scales;      // [n, ceil(k / 128)]
  std::vector<float> exact, rounded;  // [n, k]: e4m3 * scale, and that rounded to bf16
  DeviceBuffer d_codes, d_scales;
};

TestWeight make_weight(int64_t n, int64_t k, std::mt19937& rng) {
  const std::vector<float> w = gemm_test::random_row_scaled(n, k, rng);
  TestWeight t;
  t.n = n;
  t.k = k;
  const int64_t cols = (k + kBlock - 1) / kBlock;
  t.codes.resize(static_cast<size_t>(n * k));
  t.row_scales.resize(static_cast<size_t>(n * cols));
  t.exact.resize(t.codes.size());
  t.rounded.resize(t.codes.size());
  for (int64_t br = 0; br < n; br += kBlock) {
    for (int64_t bc = 0; bc < k; bc += kBlock) {
      float amax = 0.0f;
      for (int64_t r = br; r < std::min(n, br + kBlock); ++r) {
        for (int64_t c = bc; c < std::min(k, bc + kBlock); ++c) amax = std::max(amax, std::fabs(w[r * k + c]));
      }
      const float scale = amax / 448.0f;
      for (int64_t r = br; r < std::min(n, br + kBlock); ++r) {
        t.row_scales[r * cols + bc / kBlock] = scale;
        for (int64_t c = bc; c < std::min(k, bc + kBlock); ++c) {
          const size_t i = static_cast<size_t>(r * k + c);
          t.codes[i] = float_to_e4m3(w[i] / scale);
          t.exact[i] = e4m3_to_float(t.codes[i]) * scale;
          t.rounded[i] = bf16_to_float(float_to_bf16(t.exact[i]));
        }
      }
    }
  }
  t.d_codes = DeviceBuffer(t.codes.size());
  t.d_scales = DeviceBuffer(t.row_scales.size() * 4);
  t.d_codes.upload(t.codes.data(), t.codes.size());
  t.d_scales.upload(t.row_scales.data(), t.row_scales.size() * 4);
  return t;
}

Fp8WeightView view_of(const TestWeight& t) {
  return Fp8WeightView{.codes = t.d_codes.as<uint8_t>(), .row_scales = t.d_scales.as<float>(), .n = t.n, .k = t.k};
}

const char* variant_name(Fp8GemmVariant v) {
  switch (v) {
    case Fp8GemmVariant::kAuto:
      return "auto";
    case Fp8GemmVariant::kDecode:
      return "decode";
    case Fp8GemmVariant::kDequant:
      return "dequant";
    case Fp8GemmVariant::kBatch:
      return "batch";
    case Fp8GemmVariant::kSliced:
      return "sliced";
    default:
      return "prefill";
  }
}

// Which reference weight a call's rows see: the bf16-rounded one when the prefill kernel, the batch kernel or the
// dequantized path runs, else (the decode kernel) the exact one.
bool runs_prefill(Fp8GemmVariant v, int64_t m) {
  return v == Fp8GemmVariant::kPrefill || v == Fp8GemmVariant::kDequant || v == Fp8GemmVariant::kBatch ||
         (v == Fp8GemmVariant::kAuto && m > kFp8DecodeMaxM);
}

// y = x · W^T for fresh random x of m rows, every element checked. `pad` > 0 writes into columns [pad, pad + n) of
// a [m, n + 2 pad] output, checking the rest stays untouched.
std::vector<uint16_t> run_and_check(const DeviceContext& ctx, const TestWeight& w, int64_t m, Fp8GemmVariant variant,
                                    std::mt19937& rng, int64_t pad = 0) {
  const int64_t n = w.n, k = w.k, ldy = n + 2 * pad;
  const std::vector<uint16_t> x = gemm_test::random_bf16(static_cast<size_t>(m * k), rng);
  DeviceBuffer dx(x.size() * 2), dy(static_cast<size_t>(m * ldy) * 2);
  dx.upload(x.data(), x.size() * 2);
  dy.fill(0xFF);
  const GemmFp8W8a16Args args{
      .x = dx.as<uint16_t>(), .w = view_of(w), .y = dy.as<uint16_t>() + pad, .m = m, .ldy = pad > 0 ? ldy : 0};
  const auto status = gemm_fp8_w8a16(ctx, args, variant);
  EXPECT_TRUE(status.has_value()) << (status ? "" : status.error().message);
  ctx.synchronize();
  std::vector<uint16_t> full(static_cast<size_t>(m * ldy), kPoison);
  TERN_CUDA_CHECK(cudaMemcpy(full.data(), dy.data(), full.size() * 2, cudaMemcpyDeviceToHost));
  const auto ref =
      gemm_test::reference_gemm(gemm_test::bf16_to_floats(x), runs_prefill(variant, m) ? w.rounded : w.exact, m, n, k);
  const std::string what = std::string("fp8 ") + variant_name(variant) + " m=" + std::to_string(m) +
                           " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                           (pad > 0 ? " ldy=" + std::to_string(ldy) : "");
  std::vector<uint16_t> y = gemm_test::strided_columns(full, m, n, ldy, pad, what);
  gemm_test::check_gemm(y, ref, m, n, what);
  return y;
}

// The test must see both reference weights differ, or it could not tell the kernels' roundings apart.
TEST(GemmFp8W8a16, RoundedWeightDiffersFromExact) {
  std::mt19937 rng(2000);
  const TestWeight w = make_weight(256, 256, rng);
  int64_t differ = 0;
  for (size_t i = 0; i < w.exact.size(); ++i) differ += w.exact[i] != w.rounded[i];
  EXPECT_GT(differ, static_cast<int64_t>(w.exact.size() / 2));
}

// n odd or off every tile (and off the 128-row scale blocks); k a multiple of 16 but not of 64 or of 128, so the
// last scale block and the last decode step are partial.
TEST(GemmFp8W8a16, EdgeShapesBothKernels) {
  DeviceContext ctx;
  std::mt19937 rng(2001);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1000, 1040}, {1001, 784}, {17, 4128},
                                                           {64, 16},     {200, 208},  {3, 48}};
  for (const auto& [n, k] : shapes) {
    const TestWeight w = make_weight(n, k, rng);
    for (int64_t m : {1, 3, 7, 9, 16, 17, 100, 257}) {
      if (m <= kFp8DecodeMaxM) run_and_check(ctx, w, m, Fp8GemmVariant::kDecode, rng);
      if (m <= kFp8BatchMaxM) run_and_check(ctx, w, m, Fp8GemmVariant::kBatch, rng);
      run_and_check(ctx, w, m, Fp8GemmVariant::kPrefill, rng);
      run_and_check(ctx, w, m, Fp8GemmVariant::kDequant, rng);
    }
    run_and_check(ctx, w, 37, Fp8GemmVariant::kAuto, rng);    // the batch kernel
    run_and_check(ctx, w, 37, Fp8GemmVariant::kSliced, rng);  // decode over 16-row slices, the last one partial
  }
}

// A column slice of a wider output (fused projections write their parts side by side), odd and even n.
TEST(GemmFp8W8a16, StridedOutput) {
  DeviceContext ctx;
  std::mt19937 rng(2002);
  for (int64_t n : {512, 333}) {
    const TestWeight w = make_weight(n, 1024, rng);
    for (int64_t m : {1, 9}) run_and_check(ctx, w, m, Fp8GemmVariant::kDecode, rng, 2);
    for (int64_t m : {3, 33}) run_and_check(ctx, w, m, Fp8GemmVariant::kBatch, rng, 2);
    for (int64_t m : {1, 37, 300}) run_and_check(ctx, w, m, Fp8GemmVariant::kPrefill, rng, 2);
    for (int64_t m : {1, 37, 300}) run_and_check(ctx, w, m, Fp8GemmVariant::kDequant, rng, 2);
    run_and_check(ctx, w, 40, Fp8GemmVariant::kAuto, rng, 2);
  }
}

// Small enough for compute-sanitizer: both kernels, every kind of edge.
TEST(GemmFp8W8a16, SmallShapes) {
  DeviceContext ctx;
  std::mt19937 rng(2003);
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{1001, 784}, {130, 1040}, {3, 16}}) {
    const TestWeight w = make_weight(n, k, rng);
    for (int64_t m : {1, 7, 16, 17, 100}) {
      if (m <= kFp8DecodeMaxM) run_and_check(ctx, w, m, Fp8GemmVariant::kDecode, rng);
      if (m <= kFp8BatchMaxM) run_and_check(ctx, w, m, Fp8GemmVariant::kBatch, rng);
      run_and_check(ctx, w, m, Fp8GemmVariant::kPrefill, rng);
      run_and_check(ctx, w, m, Fp8GemmVariant::kDequant, rng);
    }
  }
}

// Every decode batch size.
TEST(GemmFp8W8a16, DecodeEveryM) {
  DeviceContext ctx;
  std::mt19937 rng(2004);
  const TestWeight w = make_weight(301, 2064, rng);
  for (int64_t m = 1; m <= kFp8DecodeMaxM; ++m) run_and_check(ctx, w, m, Fp8GemmVariant::kDecode, rng);
}

// Every batch-kernel size, on a weight that splits K over several blocks (partials through the workspace, each
// block of the row block's cluster adding its share of the columns) and on one with more row blocks than SMs and one
// step (no split).
TEST(GemmFp8W8a16, BatchEveryM) {
  DeviceContext ctx;
  std::mt19937 rng(2007);
  const TestWeight w = make_weight(301, 2064, rng);
  for (int64_t m = 1; m <= kFp8BatchMaxM; ++m) run_and_check(ctx, w, m, Fp8GemmVariant::kBatch, rng);
  const TestWeight wide = make_weight(34000, 48, rng);
  for (int64_t m : {5, 64}) run_and_check(ctx, wide, m, Fp8GemmVariant::kBatch, rng);
}

// Model sizes (Qwen3-8B's projections, GLM-5's shared expert and MLA projections) through kAuto.
TEST(GemmFp8W8a16, ModelSizes) {
  DeviceContext ctx;
  std::mt19937 rng(2005);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{6144, 4096}, {24576, 4096}, {4096, 12288},
                                                           {2048, 6144}, {6144, 2048},  {16384, 2048}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    const TestWeight w = make_weight(shapes[i].first, shapes[i].second, rng);
    for (int64_t m : {1, 8, 16, 24, 64}) run_and_check(ctx, w, m, Fp8GemmVariant::kAuto, rng);
    if (i % 3 == 0) run_and_check(ctx, w, 257, Fp8GemmVariant::kAuto, rng);
  }
}

// The decode kernel's cross-warp sum has a fixed order: the same input gives the same bits every run.
TEST(GemmFp8W8a16, RunsAreBitIdentical) {
  DeviceContext ctx;
  for (auto variant : {Fp8GemmVariant::kDecode, Fp8GemmVariant::kPrefill, Fp8GemmVariant::kBatch}) {
    std::mt19937 rng_w(17), rng_a(18), rng_b(18);
    const TestWeight w = make_weight(1000, 4096, rng_w);
    const int64_t m = variant == Fp8GemmVariant::kBatch ? 40 : 9;
    const auto a = run_and_check(ctx, w, m, variant, rng_a);
    const auto b = run_and_check(ctx, w, m, variant, rng_b);
    EXPECT_EQ(a, b) << variant_name(variant);
  }
}

// Bad arguments come back as errors naming the problem, before anything is launched.
TEST(GemmFp8W8a16, RejectsBadArguments) {
  DeviceContext ctx;
  std::mt19937 rng(2006);
  const TestWeight w = make_weight(64, 64, rng);
  DeviceBuffer dx(64 * 64 * 2 + 16), dy(64 * 64 * 2 + 16);
  dx.fill(0x3F);  // finite bf16 values: the good call reads x
  const GemmFp8W8a16Args good{.x = dx.as<uint16_t>(), .w = view_of(w), .y = dy.as<uint16_t>(), .m = 16};
  ASSERT_TRUE(gemm_fp8_w8a16(ctx, good).has_value());
  auto expect_error = [&](GemmFp8W8a16Args a, Fp8GemmVariant v, const std::string& needle) {
    const auto r = gemm_fp8_w8a16(ctx, a, v);
    ASSERT_FALSE(r.has_value()) << needle;
    EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  };
  auto a = good;
  a.w.k = 40;
  expect_error(a, Fp8GemmVariant::kAuto, "k=40 is not a multiple of 16");
  a = good;
  a.w.n = 0;
  expect_error(a, Fp8GemmVariant::kAuto, "bad shape");
  a = good;
  a.m = 17;
  expect_error(a, Fp8GemmVariant::kDecode, "decode kernel takes m <= 16");
  a.m = 65;
  expect_error(a, Fp8GemmVariant::kBatch, "batch kernel takes m <= 64");
  a = good;
  a.x = reinterpret_cast<const uint16_t*>(dx.as<uint8_t>() + 8);
  expect_error(a, Fp8GemmVariant::kAuto, "x is not 16-byte aligned");
  a = good;
  a.w.codes = w.d_codes.as<uint8_t>() + 8;
  expect_error(a, Fp8GemmVariant::kAuto, "weight codes are not 16-byte aligned");
  a = good;
  a.w.row_scales = nullptr;
  expect_error(a, Fp8GemmVariant::kAuto, "null pointer");
  a = good;
  a.y = reinterpret_cast<uint16_t*>(dy.as<uint8_t>() + 2);
  expect_error(a, Fp8GemmVariant::kAuto, "y is not 4-byte aligned");
  a = good;
  a.ldy = 10;
  expect_error(a, Fp8GemmVariant::kAuto, "ldy=10 is less than n=64");
  a = good;
  a.m = 0;  // nothing to do, nothing written
  EXPECT_TRUE(gemm_fp8_w8a16(ctx, a).has_value());
  ctx.synchronize();
}

}  // namespace
}  // namespace tern
