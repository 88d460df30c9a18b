// The NVFP4 activation quantizer against core/nvfp4.h nvfp4_quantize_activation_row, byte for byte: the packed e2m1
// codes and the e4m3 block scales, in both scale layouts (the tiled one through nvfp4_scales_to_tiled, whose index
// mapping gemm_nvfp4_native_cpu_test checks against the cuBLAS documentation). Rows mix zeros, huge and tiny
// (subnormal bf16) magnitudes, outliers and per-block ranges; input scales are ModelOpt's amax / (6 * 448), one that
// saturates the block scales and one that pushes them into e4m3's subnormals and to zero. Outputs are poisoned with
// two patterns (an unwritten byte cannot match both) and guard bytes past each buffer must stay untouched.
// Label: gpu.
#include "kernels/cuda/nvfp4/nvfp4_quantize.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/formats.h"
#include "core/nvfp4.h"
#include "kernels/cuda/nvfp4/nvfp4_scale_layout.h"

namespace tern {
namespace {

constexpr size_t kGuard = 64;

// One row of `k` bf16 values of the given kind (never NaN or infinite).
void fill_row(int kind, std::vector<uint16_t>& row, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-20.0f, 20.0f);
  const int64_t k = static_cast<int64_t>(row.size());
  float block_scale = 1.0f;
  for (int64_t i = 0; i < k; ++i) {
    if (i % 16 == 0) block_scale = std::exp2(exponent(rng));
    float v = normal(rng);
    switch (kind) {
      case 0:
        v = 0.0f;
        break;  // all zeros
      case 1:
        v = (i / 16) % 3 == 1 ? 0.0f : v * 3.0f;
        break;  // every third block zero
      case 2:
        v *= 0x1p100f;
        break;  // huge
      case 3:
        v *= 0x1p-128f;
        break;  // tiny, many bf16 subnormals
      case 4:
        v *= block_scale;
        break;  // a different range per block
      case 5:
        v *= (i % 16 == 5) ? 1000.0f : 1.0f;
        break;  // one outlier per block
      default:
        break;  // N(0, 1)
    }
    row[static_cast<size_t>(i)] = float_to_bf16(v);
  }
}

std::vector<uint16_t> make_activations(int64_t m, int64_t k, std::mt19937& rng) {
  std::vector<uint16_t> x(static_cast<size_t>(m * k));
  std::vector<uint16_t> row(static_cast<size_t>(k));
  for (int64_t r = 0; r < m; ++r) {
    fill_row(static_cast<int>((r + m) % 7), row, rng);
    std::copy(row.begin(), row.end(), x.begin() + r * k);
  }
  return x;
}

struct Quantized {
  std::vector<uint8_t> packed;  // [m, k/2]
  std::vector<uint8_t> scales;  // [m, k/16] row-major
};

Quantized reference_quantize(const std::vector<uint16_t>& x, int64_t m, int64_t k, float input_scale) {
  Quantized q{std::vector<uint8_t>(static_cast<size_t>(m * k / 2)),
              std::vector<uint8_t>(static_cast<size_t>(m * k / 16))};
  std::vector<float> row(static_cast<size_t>(k));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < k; ++i) row[static_cast<size_t>(i)] = bf16_to_float(x[static_cast<size_t>(r * k + i)]);
    nvfp4_quantize_activation_row(row.data(), k, input_scale, &q.packed[static_cast<size_t>(r * k / 2)],
                                  &q.scales[static_cast<size_t>(r * k / 16)]);
  }
  return q;
}

// Uploads one poisoned buffer of `bytes` plus guard bytes.
DeviceBuffer poisoned(size_t bytes, uint8_t poison) {
  DeviceBuffer b(bytes + kGuard);
  b.fill(poison);
  return b;
}

// Downloads `bytes` and checks the guard bytes after them still hold the poison.
std::vector<uint8_t> download(const DeviceBuffer& b, size_t bytes, uint8_t poison, const std::string& what) {
  std::vector<uint8_t> all(b.size_bytes());
  TERN_CUDA_CHECK(cudaMemcpy(all.data(), b.data(), all.size(), cudaMemcpyDeviceToHost));
  const auto past_end =
      std::count_if(all.begin() + static_cast<int64_t>(bytes), all.end(), [poison](uint8_t v) { return v != poison; });
  EXPECT_EQ(past_end, 0) << what << ": bytes written past the end";
  all.resize(bytes);
  return all;
}

// Counts differing bytes, reporting the first few.
int64_t compare(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, const std::string& what) {
  EXPECT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (got[i] != want[i] && ++bad <= 5) {
      ADD_FAILURE() << what << ": byte " << i << " is 0x" << std::hex << int{got[i]} << ", reference 0x"
                    << int{want[i]};
    }
  }
  EXPECT_EQ(bad, 0) << what;
  return bad;
}

void run_and_compare(const DeviceContext& ctx, const std::vector<uint16_t>& x, int64_t m, int64_t k, float input_scale,
                     Nvfp4ScaleLayout layout) {
  const Quantized ref = reference_quantize(x, m, k, input_scale);
  const bool tiled = layout == Nvfp4ScaleLayout::kTiled128x4;
  const std::vector<uint8_t> want_scales = tiled ? nvfp4_scales_to_tiled(ref.scales, m, k) : ref.scales;
  DeviceBuffer dx(x.size() * 2), dscale(sizeof(float));
  dx.upload(x.data(), x.size() * 2);
  dscale.upload(&input_scale, sizeof(float));
  for (const uint8_t poison : {uint8_t{0xA5}, uint8_t{0x5A}}) {
    const std::string what = "m=" + std::to_string(m) + " k=" + std::to_string(k) +
                             " input_scale=" + std::to_string(input_scale) + (tiled ? " tiled" : " row-major") +
                             " poison " + std::to_string(poison);
    DeviceBuffer packed = poisoned(ref.packed.size(), poison), scales = poisoned(want_scales.size(), poison);
    const auto status = nvfp4_quantize_activations(ctx, {.x = dx.as<uint16_t>(),
                                                         .input_scale = dscale.as<float>(),
                                                         .packed = packed.as<uint8_t>(),
                                                         .scales = scales.as<uint8_t>(),
                                                         .m = m,
                                                         .k = k,
                                                         .layout = layout});
    ASSERT_TRUE(status.has_value()) << what << ": " << status.error().message;
    ctx.synchronize();
    compare(download(packed, ref.packed.size(), poison, what), ref.packed, what + " packed");
    compare(download(scales, want_scales.size(), poison, what), want_scales, what + " scales");
  }
}

float amax_of(const std::vector<uint16_t>& x) {
  float amax = 0.0f;
  for (uint16_t v : x) amax = std::max(amax, std::fabs(bf16_to_float(v)));
  return amax;
}

TEST(Nvfp4Quantize, MatchesTheCpuReferenceBitForBit) {
  DeviceContext ctx;
  std::mt19937 rng(3101);
  for (int64_t m : {1, 3, 7, 127, 129, 300}) {
    for (int64_t k : {16, 48, 64, 80, 1040, 4096}) {
      const std::vector<uint16_t> x = make_activations(m, k, rng);
      // ModelOpt's calibration on this very batch; a scale calibrated on N(0, 1) data, which saturates the huge rows'
      // block scales at 448 and their codes at 6; and a large one that drives block scales into e4m3's subnormals
      // and to zero.
      const float amax = std::max(amax_of(x), 1e-30f);
      for (float input_scale : {nvfp4_global_scale_from_amax(amax), nvfp4_global_scale_from_amax(4.0f), 3.0e4f}) {
        for (auto layout : {Nvfp4ScaleLayout::kRowMajor, Nvfp4ScaleLayout::kTiled128x4}) {
          run_and_compare(ctx, x, m, k, input_scale, layout);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// The model's activation sizes, tiled as the GEMM consumes them.
TEST(Nvfp4Quantize, ModelSizes) {
  DeviceContext ctx;
  std::mt19937 rng(3102);
  for (auto [m, k] : std::vector<std::pair<int64_t, int64_t>>{{1, 4096}, {16, 2048}, {200, 4096}, {513, 12288}}) {
    const std::vector<uint16_t> x = make_activations(m, k, rng);
    run_and_compare(ctx, x, m, k, nvfp4_global_scale_from_amax(amax_of(x)), Nvfp4ScaleLayout::kTiled128x4);
  }
}

TEST(Nvfp4Quantize, RejectsBadArguments) {
  DeviceContext ctx;
  DeviceBuffer x(64 * 64 * 2 + 16), scale(16), packed(64 * 32 + 16), scales(16384);
  const float one = 1.0f;
  x.fill(0x3F);
  scale.upload(&one, sizeof(one));
  const Nvfp4QuantizeArgs good{.x = x.as<uint16_t>(),
                               .input_scale = scale.as<float>(),
                               .packed = packed.as<uint8_t>(),
                               .scales = scales.as<uint8_t>(),
                               .m = 64,
                               .k = 64,
                               .layout = Nvfp4ScaleLayout::kTiled128x4};
  ASSERT_TRUE(nvfp4_quantize_activations(ctx, good).has_value());
  auto expect_error = [&](Nvfp4QuantizeArgs a, const std::string& needle) {
    const auto r = nvfp4_quantize_activations(ctx, a);
    ASSERT_FALSE(r.has_value()) << needle;
    EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  };
  auto a = good;
  a.k = 40;
  expect_error(a, "k=40 is not a multiple of the NVFP4 block");
  a = good;
  a.m = -1;
  expect_error(a, "bad shape");
  a = good;
  a.input_scale = nullptr;
  expect_error(a, "null pointer");
  a = good;
  a.x = reinterpret_cast<const uint16_t*>(x.as<uint8_t>() + 8);
  expect_error(a, "x is not 16-byte aligned");
  a = good;
  a.packed = packed.as<uint8_t>() + 4;
  expect_error(a, "packed is not 8-byte aligned");
  a = good;
  a.m = 0;  // nothing to do
  EXPECT_TRUE(nvfp4_quantize_activations(ctx, a).has_value());
  ctx.synchronize();
}

}  // namespace
}  // namespace tern
