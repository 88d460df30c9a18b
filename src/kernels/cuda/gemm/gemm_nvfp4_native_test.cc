// The native block-scaled FP4 GEMM on the GPU (label gpu).
//   - On a device with FP4 tensor cores (nvfp4_native_supported): every element of y against an fp64 product of the
//     activations quantize-dequantized by core/nvfp4 (nvfp4_fake_quantize_activation_row) and the weight dequantized
//     by core/nvfp4, with gemm_test_util's bf16 tolerance, poisoned output and untouched columns around a strided y.
//     Skipped elsewhere.
//   - On a device without them (the H200): the call returns an error naming cuBLASLt and leaves y unwritten.
//   - On any device: bad arguments are rejected before anything is queued.
#include "kernels/cuda/gemm/gemm_nvfp4_native.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/nvfp4.h"
#include "kernels/cuda/gemm/gemm_test_util.h"
#include "kernels/cuda/nvfp4/nvfp4_scale_layout.h"

namespace tern {
namespace {

using gemm_test::kPoison;

// A random NVFP4 weight [n, k] (rows scaled by 2^U(-6, 6), as the W4A16 test draws them) with its scales tiled.
struct NativeWeight {
  Nvfp4Matrix q;
  std::vector<float> dequant;  // [n, k]
  DeviceBuffer packed, scales;
};

NativeWeight make_weight(int64_t n, int64_t k, std::mt19937& rng) {
  const std::vector<float> w = gemm_test::random_row_scaled(n, k, rng);
  NativeWeight t;
  t.q = nvfp4_quantize_weight(w, n, k);
  t.dequant = nvfp4_dequantize(t.q);
  const std::vector<uint8_t> tiled = nvfp4_scales_to_tiled(t.q.block_scales, n, k);
  t.packed = DeviceBuffer(t.q.packed.size());
  t.scales = DeviceBuffer(tiled.size());
  t.packed.upload(t.q.packed.data(), t.q.packed.size());
  t.scales.upload(tiled.data(), tiled.size());
  return t;
}

Nvfp4NativeWeightView view_of(const NativeWeight& w) {
  return {.packed = w.packed.as<uint8_t>(),
          .scales_tiled = w.scales.as<uint8_t>(),
          .global_scale = w.q.global_scale,
          .n = w.q.rows,
          .k = w.q.cols};
}

// Activations on the device with their calibrated input_scale (ModelOpt: amax / (6 * 448)) and the workspace.
struct NativeActivations {
  std::vector<uint16_t> x;
  float input_scale = 0.0f;
  DeviceBuffer dx, dscale, workspace;
};

NativeActivations make_activations(int64_t m, int64_t k, std::mt19937& rng) {
  NativeActivations a;
  a.x = gemm_test::random_bf16(static_cast<size_t>(m * k), rng);
  float amax = 0.0f;
  for (uint16_t v : a.x) amax = std::max(amax, std::fabs(bf16_to_float(v)));
  a.input_scale = nvfp4_global_scale_from_amax(amax);
  a.dx = DeviceBuffer(a.x.size() * 2);
  a.dscale = DeviceBuffer(sizeof(float));
  a.workspace = DeviceBuffer(std::max<size_t>(gemm_nvfp4_native_workspace_bytes(m, k), 16));
  a.dx.upload(a.x.data(), a.x.size() * 2);
  a.dscale.upload(&a.input_scale, sizeof(float));
  return a;
}

GemmNvfp4NativeArgs args_of(const NativeWeight& w, const NativeActivations& a, uint16_t* y, int64_t m, int64_t ldy) {
  return {.x = a.dx.as<uint16_t>(),
          .w = view_of(w),
          .input_scale = a.input_scale,
          .input_scale_device = a.dscale.as<float>(),
          .y = y,
          .m = m,
          .ldy = ldy,
          .workspace = a.workspace.data(),
          .workspace_bytes = a.workspace.size_bytes()};
}

// The reference's activations: each row quantize-dequantized as the W4A4 semantics define.
std::vector<float> fake_quantized(const NativeActivations& a, int64_t m, int64_t k) {
  std::vector<float> x = gemm_test::bf16_to_floats(a.x), out(x.size());
  for (int64_t r = 0; r < m; ++r) nvfp4_fake_quantize_activation_row(&x[r * k], k, a.input_scale, &out[r * k]);
  return out;
}

// y = x . W^T into columns [pad, pad + n) of a poisoned [m, n + 2 pad] output, checked element by element.
void run_and_check(const DeviceContext& ctx, const NativeWeight& w, int64_t m, std::mt19937& rng, int64_t pad = 0) {
  const int64_t n = w.q.rows, k = w.q.cols, ldy = n + 2 * pad;
  const NativeActivations a = make_activations(m, k, rng);
  DeviceBuffer dy(static_cast<size_t>(m * ldy) * 2);
  dy.fill(0xFF);
  const auto status = gemm_nvfp4_native(ctx, args_of(w, a, dy.as<uint16_t>() + pad, m, pad > 0 ? ldy : 0));
  const std::string what = "native m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                           (pad > 0 ? " ldy=" + std::to_string(ldy) : "");
  ASSERT_TRUE(status.has_value()) << what << ": " << status.error().message;
  ctx.synchronize();
  std::vector<uint16_t> full(static_cast<size_t>(m * ldy));
  TERN_CUDA_CHECK(cudaMemcpy(full.data(), dy.data(), full.size() * 2, cudaMemcpyDeviceToHost));
  const auto ref = gemm_test::reference_gemm(fake_quantized(a, m, k), w.dequant, m, n, k);
  gemm_test::check_gemm(gemm_test::strided_columns(full, m, n, ldy, pad, what), ref, m, n, what);
}

TEST(GemmNvfp4Native, MatchesTheW4a4Reference) {
  DeviceContext ctx;
  if (!nvfp4_native_supported(ctx.props())) GTEST_SKIP() << ctx.props().name << " has no FP4 tensor cores";
  std::mt19937 rng(2101);
  // n not a multiple of 128 (ragged scale tiles), k/16 not a multiple of 4 (padded scale columns), model sizes.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{8, 32},      {136, 96},    {1000, 1024},
                                                           {1000, 4128}, {4096, 4096}, {2048, 6144}};
  for (const auto& [n, k] : shapes) {
    const NativeWeight w = make_weight(n, k, rng);
    for (int64_t m : {1, 7, 16, 100, 257}) run_and_check(ctx, w, m, rng);
  }
}

TEST(GemmNvfp4Native, StridedOutput) {
  DeviceContext ctx;
  if (!nvfp4_native_supported(ctx.props())) GTEST_SKIP() << ctx.props().name << " has no FP4 tensor cores";
  std::mt19937 rng(2102);
  const NativeWeight w = make_weight(520, 1024, rng);
  for (int64_t m : {1, 37, 300}) run_and_check(ctx, w, m, rng, 8);  // 8 bf16: y stays 16-byte aligned
}

// A workspace smaller than the rows need runs them a chunk at a time (the model passes its context's fixed workspace):
// chunks of one row, of 100 rows (less than one 128-row scale tile) and of 256 (two tiles), over 300 rows.
TEST(GemmNvfp4Native, ChunkedThroughASmallWorkspace) {
  DeviceContext ctx;
  if (!nvfp4_native_supported(ctx.props())) GTEST_SKIP() << ctx.props().name << " has no FP4 tensor cores";
  std::mt19937 rng(2105);
  const int64_t n = 264, k = 1024, m = 300;
  const NativeWeight w = make_weight(n, k, rng);
  for (const int64_t rows : {int64_t{1}, int64_t{100}, int64_t{256}}) {
    const NativeActivations a = make_activations(m, k, rng);
    DeviceBuffer dy(static_cast<size_t>(m * n) * 2);
    dy.fill(0xFF);
    GemmNvfp4NativeArgs args = args_of(w, a, dy.as<uint16_t>(), m, 0);
    args.workspace_bytes = gemm_nvfp4_native_workspace_bytes(rows, k);
    const auto status = gemm_nvfp4_native(ctx, args);
    const std::string what = "chunks of " + std::to_string(rows) + " rows";
    ASSERT_TRUE(status.has_value()) << what << ": " << status.error().message;
    ctx.synchronize();
    std::vector<uint16_t> y(static_cast<size_t>(m * n));
    TERN_CUDA_CHECK(cudaMemcpy(y.data(), dy.data(), y.size() * 2, cudaMemcpyDeviceToHost));
    const auto ref = gemm_test::reference_gemm(fake_quantized(a, m, k), w.dequant, m, n, k);
    gemm_test::check_gemm(gemm_test::strided_columns(y, m, n, n, 0, what), ref, m, n, what);
  }
}

// What the H200 (sm_90) must do: refuse with cuBLASLt's verdict, write nothing.
TEST(GemmNvfp4Native, DeviceWithoutFp4TensorCoresGetsAClearError) {
  DeviceContext ctx;
  if (nvfp4_native_supported(ctx.props())) GTEST_SKIP() << ctx.props().name << " has FP4 tensor cores";
  std::mt19937 rng(2103);
  const NativeWeight w = make_weight(256, 512, rng);
  const int64_t m = 16;
  const NativeActivations a = make_activations(m, 512, rng);
  DeviceBuffer dy(static_cast<size_t>(m * 256) * 2);
  dy.fill(0xFF);
  const auto status = gemm_nvfp4_native(ctx, args_of(w, a, dy.as<uint16_t>(), m, 0));
  ctx.synchronize();
  ASSERT_FALSE(status.has_value()) << "cuBLASLt ran a block-scaled FP4 GEMM on " << ctx.props().name;
  EXPECT_NE(status.error().message.find("cuBLASLt"), std::string::npos) << status.error().message;
  std::printf("%s\n", status.error().message.c_str());
  std::vector<uint16_t> y(static_cast<size_t>(m * 256));
  TERN_CUDA_CHECK(cudaMemcpy(y.data(), dy.data(), y.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(std::all_of(y.begin(), y.end(), [](uint16_t v) { return v == kPoison; })) << "y was written";
}

TEST(GemmNvfp4Native, RejectsBadArguments) {
  DeviceContext ctx;
  std::mt19937 rng(2104);
  const NativeWeight w = make_weight(64, 64, rng);
  const NativeActivations a = make_activations(16, 64, rng);
  DeviceBuffer dy(64 * 64 * 2 + 16);
  const GemmNvfp4NativeArgs good = args_of(w, a, dy.as<uint16_t>(), 16, 0);
  auto expect_error = [&](GemmNvfp4NativeArgs args, const std::string& needle) {
    const auto r = gemm_nvfp4_native(ctx, args);
    ASSERT_FALSE(r.has_value()) << needle;
    EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  };
  auto b = good;
  b.w.k = 48;
  expect_error(b, "k=48 is not a multiple of 32");
  b = good;
  b.w.n = 0;
  expect_error(b, "bad shape");
  b = good;
  b.ldy = 68;
  expect_error(b, "ldy=68 is not a multiple of 8");
  b = good;
  b.ldy = 32;
  expect_error(b, "ldy=32 is less than n=64");
  b = good;
  b.y = reinterpret_cast<uint16_t*>(dy.as<uint8_t>() + 8);
  expect_error(b, "y is not 16-byte aligned");
  b = good;
  b.w.scales_tiled = nullptr;
  expect_error(b, "null pointer");
  b = good;
  b.workspace_bytes = 100;
  expect_error(b, "workspace of 100 bytes");
  b = good;
  b.input_scale = NAN;
  expect_error(b, "input_scale must be positive and finite");
  b = good;
  b.input_scale = 0.0f;
  expect_error(b, "input_scale must be positive and finite");
  b = good;
  b.w.global_scale = INFINITY;
  expect_error(b, "weight_scale_2 is not finite");
  b = good;
  b.m = 0;  // nothing to do, on any device
  EXPECT_TRUE(gemm_nvfp4_native(ctx, b).has_value());
  ctx.synchronize();
}

}  // namespace
}  // namespace tern
