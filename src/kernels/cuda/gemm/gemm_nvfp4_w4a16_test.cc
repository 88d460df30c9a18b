// NVFP4 W4A16 GEMM against an fp64 CPU product of the same bf16 activations and the weights dequantized by
// core/nvfp4 (the ModelOpt reference). Tolerance and poisoning: gemm_test_util.h. Label: gpu.
#include "kernels/cuda/gemm/gemm_nvfp4_w4a16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/nvfp4.h"
#include "kernels/cuda/gemm/gemm_test_util.h"

namespace tern {
namespace {

using gemm_test::kPoison;

// A random weight [n, k]: N(0, 1) scaled per row by 2^U(-6, 6), so block scales cover a wide e4m3 range
// (subnormal scales included) and the global scale is not a round number.
struct TestWeight {
  Nvfp4Matrix q;
  std::vector<float> dequant;  // [n, k], the reference's view of the weight
  DeviceBuffer packed, scales;
  std::vector<int64_t> part_begin;  // stacked parts after the first (stack_weights): first row and global scale
  std::vector<float> part_scale;
};

TestWeight make_weight(int64_t n, int64_t k, std::mt19937& rng) {
  const std::vector<float> w = gemm_test::random_row_scaled(n, k, rng);
  TestWeight t;
  t.q = nvfp4_quantize_weight(w, n, k);
  t.dequant = nvfp4_dequantize(t.q);
  t.packed = DeviceBuffer(t.q.packed.size());
  t.scales = DeviceBuffer(t.q.block_scales.size());
  t.packed.upload(t.q.packed.data(), t.q.packed.size());
  t.scales.upload(t.q.block_scales.data(), t.q.block_scales.size());
  return t;
}

// Weights of the same k quantized apart, so each has its own global scale, stacked by rows as one weight (a fused
// q|k|v or gate|up).
TestWeight stack_weights(const std::vector<int64_t>& rows, int64_t k, std::mt19937& rng) {
  TestWeight t;
  t.q.cols = k;
  for (const int64_t n : rows) {
    const TestWeight part = make_weight(n, k, rng);
    if (t.q.rows == 0) {
      t.q.global_scale = part.q.global_scale;
    } else {
      t.part_begin.push_back(t.q.rows);
      t.part_scale.push_back(part.q.global_scale);
    }
    t.q.rows += n;
    t.q.packed.insert(t.q.packed.end(), part.q.packed.begin(), part.q.packed.end());
    t.q.block_scales.insert(t.q.block_scales.end(), part.q.block_scales.begin(), part.q.block_scales.end());
    t.dequant.insert(t.dequant.end(), part.dequant.begin(), part.dequant.end());
  }
  t.packed = DeviceBuffer(t.q.packed.size());
  t.scales = DeviceBuffer(t.q.block_scales.size());
  t.packed.upload(t.q.packed.data(), t.q.packed.size());
  t.scales.upload(t.q.block_scales.data(), t.q.block_scales.size());
  return t;
}

Nvfp4WeightView view_of(const TestWeight& t) {
  Nvfp4WeightView v{.packed = t.packed.as<uint8_t>(),
                    .scales = t.scales.as<uint8_t>(),
                    .global_scale = t.q.global_scale,
                    .n = t.q.rows,
                    .k = t.q.cols};
  for (size_t i = 0; i < t.part_begin.size(); ++i) {
    v.part_begin[i] = t.part_begin[i];
    v.part_scale[i] = t.part_scale[i];
  }
  return v;
}

const char* variant_name(Nvfp4GemmVariant v) {
  switch (v) {
    case Nvfp4GemmVariant::kAuto:
      return "auto";
    case Nvfp4GemmVariant::kDecode:
      return "decode";
    case Nvfp4GemmVariant::kDequant:
      return "dequant";
    case Nvfp4GemmVariant::kBatch:
      return "batch";
    case Nvfp4GemmVariant::kSliced:
      return "sliced";
    default:
      return "prefill";
  }
}

// Runs y = x · W^T for fresh random x of m rows and checks every element. Returns y for callers that compare runs.
// `pad` > 0 writes into columns [pad, pad + n) of a [m, n + 2 pad] output (ldy), checking the rest stays untouched.
std::vector<uint16_t> run_and_check(const DeviceContext& ctx, const TestWeight& w, int64_t m, Nvfp4GemmVariant variant,
                                    std::mt19937& rng, int64_t pad = 0) {
  const int64_t n = w.q.rows, k = w.q.cols, ldy = n + 2 * pad;
  const std::vector<uint16_t> x = gemm_test::random_bf16(static_cast<size_t>(m * k), rng);
  DeviceBuffer dx(x.size() * 2), dy(static_cast<size_t>(m * ldy) * 2);
  dx.upload(x.data(), x.size() * 2);
  dy.fill(0xFF);
  const GemmNvfp4W4a16Args args{
      .x = dx.as<uint16_t>(), .w = view_of(w), .y = dy.as<uint16_t>() + pad, .m = m, .ldy = pad > 0 ? ldy : 0};
  const auto status = gemm_nvfp4_w4a16(ctx, args, variant);
  EXPECT_TRUE(status.has_value()) << (status ? "" : status.error().message);
  ctx.synchronize();
  std::vector<uint16_t> full(static_cast<size_t>(m * ldy), kPoison);
  TERN_CUDA_CHECK(cudaMemcpy(full.data(), dy.data(), full.size() * 2, cudaMemcpyDeviceToHost));
  const auto ref = gemm_test::reference_gemm(gemm_test::bf16_to_floats(x), w.dequant, m, n, k);
  const std::string what = std::string(variant_name(variant)) + " m=" + std::to_string(m) + " n=" + std::to_string(n) +
                           " k=" + std::to_string(k) + (pad > 0 ? " ldy=" + std::to_string(ldy) : "");
  std::vector<uint16_t> y = gemm_test::strided_columns(full, m, n, ldy, pad, what);
  gemm_test::check_gemm(y, ref, m, n, what);
  return y;
}

const std::vector<int64_t> kOddM = {1, 3, 7, 16, 17, 100, 257};

// n odd or not a multiple of any tile; k a multiple of 16 but not of 32 or of the 128-k decode step.
TEST(GemmNvfp4W4a16, EdgeShapesBothKernels) {
  DeviceContext ctx;
  std::mt19937 rng(1001);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1000, 1040}, {1001, 784},  {17, 4128},
                                                           {64, 16},     {1000, 4096}, {3, 48}};
  for (const auto& [n, k] : shapes) {
    const TestWeight w = make_weight(n, k, rng);
    for (int64_t m : kOddM) {
      if (m <= kNvfp4DecodeMaxM) run_and_check(ctx, w, m, Nvfp4GemmVariant::kDecode, rng);
      if (m <= kNvfp4BatchMaxM && k % 32 == 0) run_and_check(ctx, w, m, Nvfp4GemmVariant::kBatch, rng);
      run_and_check(ctx, w, m, Nvfp4GemmVariant::kPrefill, rng);
      run_and_check(ctx, w, m, Nvfp4GemmVariant::kDequant, rng);
    }
    run_and_check(ctx, w, 37, Nvfp4GemmVariant::kAuto, rng);  // the batch kernel, or 16-row decode slices past it
    run_and_check(ctx, w, 37, Nvfp4GemmVariant::kSliced, rng);
  }
}

// Linears stacked as one weight, each part with its own weight_scale_2 (a fused q|k|v, gate|up, or GDN's four input
// projections): every column is scaled by its part's, in both kernels and the dequantized path (one cuBLASLt GEMM
// per part, its scale the GEMM's alpha), at part sizes that split tiles and warps.
TEST(GemmNvfp4W4a16, StackedPartsKeepTheirGlobalScales) {
  DeviceContext ctx;
  std::mt19937 rng(1009);
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> stacks = {
      {{300, 100, 52}, 1024}, {{512, 512}, 784}, {{64, 64, 16, 8}, 2048}, {{4096, 1024, 1024}, 512}};
  for (const auto& [rows, k] : stacks) {
    const TestWeight w = stack_weights(rows, k, rng);
    for (const float s : w.part_scale) ASSERT_NE(s, w.q.global_scale) << "parts must differ in scale to test them";
    for (int64_t m : {1, 9, 16}) run_and_check(ctx, w, m, Nvfp4GemmVariant::kDecode, rng);
    if (w.q.cols % 32 == 0) {
      for (int64_t m : {17, 64}) run_and_check(ctx, w, m, Nvfp4GemmVariant::kBatch, rng, 2);
    }
    for (int64_t m : {1, 37, 300}) run_and_check(ctx, w, m, Nvfp4GemmVariant::kPrefill, rng);
    for (int64_t m : {1, 37, 300}) run_and_check(ctx, w, m, Nvfp4GemmVariant::kDequant, rng, 2);
    run_and_check(ctx, w, 40, Nvfp4GemmVariant::kAuto, rng, 2);
  }
}

// A column slice of a wider output (fused projections write their parts side by side), odd and even n.
TEST(GemmNvfp4W4a16, StridedOutput) {
  DeviceContext ctx;
  std::mt19937 rng(1007);
  for (int64_t n : {512, 333}) {
    const TestWeight w = make_weight(n, 1024, rng);
    for (int64_t m : {1, 9}) run_and_check(ctx, w, m, Nvfp4GemmVariant::kDecode, rng, 2);
    for (int64_t m : {3, 33}) run_and_check(ctx, w, m, Nvfp4GemmVariant::kBatch, rng, 2);
    for (int64_t m : {1, 37, 300}) run_and_check(ctx, w, m, Nvfp4GemmVariant::kPrefill, rng, 2);
    for (int64_t m : {1, 37, 300}) run_and_check(ctx, w, m, Nvfp4GemmVariant::kDequant, rng, 2);
    run_and_check(ctx, w, 40, Nvfp4GemmVariant::kAuto, rng, 2);
  }
}

// Small enough for compute-sanitizer (memcheck, racecheck, initcheck): both kernels, every kind of edge.
TEST(GemmNvfp4W4a16, SmallShapes) {
  DeviceContext ctx;
  std::mt19937 rng(1005);
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{1001, 784}, {130, 1040}, {3, 16}}) {
    const TestWeight w = make_weight(n, k, rng);
    for (int64_t m : {1, 7, 16, 17, 100}) {
      if (m <= kNvfp4DecodeMaxM) run_and_check(ctx, w, m, Nvfp4GemmVariant::kDecode, rng);
      if (m <= kNvfp4BatchMaxM && k % 32 == 0) run_and_check(ctx, w, m, Nvfp4GemmVariant::kBatch, rng);
      run_and_check(ctx, w, m, Nvfp4GemmVariant::kPrefill, rng);
      run_and_check(ctx, w, m, Nvfp4GemmVariant::kDequant, rng);
    }
  }
}

// Every decode batch size, on a weight whose k needs the 8-byte load path and one with the 16-byte path.
TEST(GemmNvfp4W4a16, DecodeEveryM) {
  DeviceContext ctx;
  std::mt19937 rng(1002);
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{272, 1552}, {301, 2048}}) {
    const TestWeight w = make_weight(n, k, rng);
    for (int64_t m = 1; m <= kNvfp4DecodeMaxM; ++m) run_and_check(ctx, w, m, Nvfp4GemmVariant::kDecode, rng);
  }
}

// Every batch-kernel size, on a weight that splits K over several blocks (partials through the workspace, each
// block of the row block's cluster adding its share of the columns) and on one with more row blocks than SMs and one
// step (no split).
TEST(GemmNvfp4W4a16, BatchEveryM) {
  DeviceContext ctx;
  std::mt19937 rng(1009);
  const TestWeight w = make_weight(301, 2080, rng);
  for (int64_t m = 1; m <= kNvfp4BatchMaxM; ++m) run_and_check(ctx, w, m, Nvfp4GemmVariant::kBatch, rng);
  const TestWeight wide = make_weight(34000, 96, rng);
  for (int64_t m : {5, 64}) run_and_check(ctx, wide, m, Nvfp4GemmVariant::kBatch, rng);
}

// The model sizes the kernels exist for (dense 4096-wide projections and MoE experts), through kAuto.
TEST(GemmNvfp4W4a16, ModelSizes) {
  DeviceContext ctx;
  std::mt19937 rng(1003);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{4096, 4096}, {12288, 4096}, {4096, 12288},
                                                           {1024, 4096}, {4096, 1024},  {2048, 6144}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    const TestWeight w = make_weight(shapes[i].first, shapes[i].second, rng);
    for (int64_t m : {1, 7, 16, 24, 64}) run_and_check(ctx, w, m, Nvfp4GemmVariant::kAuto, rng);
    if (i % 3 == 0) run_and_check(ctx, w, 257, Nvfp4GemmVariant::kAuto, rng);
  }
}

// The decode sizes of the dense projections the decode kernel is tuned for (M = 1 and 8), and shapes that reach each
// of its loops on a 132-SM GPU (one and two token tiles): off every tile and step size (the checked loop, 16-row
// tiles), 32-row tiles unchecked (24576 x 4096, Qwen3-8B's gate|up) and checked (24592 x 4128: rows past n, a
// partial step), and 16-row tiles unchecked in blocks whose last tiles lie past n (8208 x 512: 513 tiles, four a
// block). The launch shape (rows per warp, warps per tile) follows from n, k and the SM count.
TEST(GemmNvfp4W4a16, DecodeModelShapes) {
  DeviceContext ctx;
  std::mt19937 rng(1008);
  for (int64_t n : {2048, 4096, 6144}) {
    for (int64_t k : {2048, 4096}) {
      const TestWeight w = make_weight(n, k, rng);
      for (int64_t m : {1, 8}) run_and_check(ctx, w, m, Nvfp4GemmVariant::kDecode, rng);
    }
  }
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{
           {6000, 4128}, {12000, 1056}, {24576, 4096}, {24592, 4128}, {8208, 512}}) {
    const TestWeight w = make_weight(n, k, rng);
    for (int64_t m : {1, 9, 16}) run_and_check(ctx, w, m, Nvfp4GemmVariant::kDecode, rng);
  }
}

// The decode kernel's cross-warp sum has a fixed order: the same input gives the same bits every run.
TEST(GemmNvfp4W4a16, RunsAreBitIdentical) {
  DeviceContext ctx;
  for (auto variant : {Nvfp4GemmVariant::kDecode, Nvfp4GemmVariant::kPrefill, Nvfp4GemmVariant::kBatch}) {
    std::mt19937 rng_w(7), rng_a(8), rng_b(8);
    const TestWeight w = make_weight(1000, 4096, rng_w);
    const int64_t m = variant == Nvfp4GemmVariant::kBatch ? 40 : 9;
    const auto a = run_and_check(ctx, w, m, variant, rng_a);
    const auto b = run_and_check(ctx, w, m, variant, rng_b);
    EXPECT_EQ(a, b) << variant_name(variant);
  }
}

// Bad arguments come back as errors naming the problem, before anything is launched.
TEST(GemmNvfp4W4a16, RejectsBadArguments) {
  DeviceContext ctx;
  std::mt19937 rng(1004);
  const TestWeight w = make_weight(64, 64, rng);
  DeviceBuffer dx(64 * 64 * 2 + 16), dy(64 * 64 * 2 + 16);
  dx.fill(0x3F);  // finite bf16 values: the good call reads x
  const GemmNvfp4W4a16Args good{.x = dx.as<uint16_t>(), .w = view_of(w), .y = dy.as<uint16_t>(), .m = 16};
  ASSERT_TRUE(gemm_nvfp4_w4a16(ctx, good).has_value());
  auto expect_error = [&](GemmNvfp4W4a16Args a, Nvfp4GemmVariant v, const std::string& needle) {
    const auto r = gemm_nvfp4_w4a16(ctx, a, v);
    ASSERT_FALSE(r.has_value()) << needle;
    EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  };
  auto a = good;
  a.w.k = 40;
  expect_error(a, Nvfp4GemmVariant::kAuto, "k=40 is not a multiple of the NVFP4 block");
  a = good;
  a.w.n = 0;
  expect_error(a, Nvfp4GemmVariant::kAuto, "bad shape");
  a = good;
  a.m = -1;
  expect_error(a, Nvfp4GemmVariant::kAuto, "bad shape");
  a = good;
  a.m = 17;
  expect_error(a, Nvfp4GemmVariant::kDecode, "decode kernel takes m <= 16");
  a.m = 65;
  expect_error(a, Nvfp4GemmVariant::kBatch, "batch kernel takes m <= 64");
  a = good;
  a.w.k = 48;
  expect_error(a, Nvfp4GemmVariant::kBatch, "batch kernel needs k % 32 == 0 (k=48)");
  a = good;
  a.x = reinterpret_cast<const uint16_t*>(dx.as<uint8_t>() + 8);
  expect_error(a, Nvfp4GemmVariant::kAuto, "x is not 16-byte aligned");
  a = good;
  a.w.packed = w.packed.as<uint8_t>() + 4;
  expect_error(a, Nvfp4GemmVariant::kAuto, "packed weight is not 8-byte aligned");
  a = good;
  a.y = reinterpret_cast<uint16_t*>(dy.as<uint8_t>() + 2);
  expect_error(a, Nvfp4GemmVariant::kAuto, "y is not 4-byte aligned");
  a = good;
  a.w.scales = nullptr;
  expect_error(a, Nvfp4GemmVariant::kAuto, "null pointer");
  a = good;
  a.w.global_scale = NAN;
  expect_error(a, Nvfp4GemmVariant::kAuto, "weight_scale_2 is not finite");
  a = good;
  a.w.part_begin[0] = 40;
  a.w.part_scale[0] = 0.5f;
  a.w.part_begin[1] = 30;
  expect_error(a, Nvfp4GemmVariant::kAuto, "part 2 begins at row 30, not after row 40");
  a.w.part_begin[1] = 64;
  expect_error(a, Nvfp4GemmVariant::kAuto, "part 2 begins at row 64, not after row 40 and before n=64");
  a.w.part_begin[1] = 0;
  a.w.part_scale[0] = INFINITY;
  expect_error(a, Nvfp4GemmVariant::kAuto, "weight_scale_2 of part 1 is not finite");
  a = good;
  a.m = 0;  // nothing to do, nothing written
  EXPECT_TRUE(gemm_nvfp4_w4a16(ctx, a).has_value());
  ctx.synchronize();
}

}  // namespace
}  // namespace tern
