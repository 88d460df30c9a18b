// Host (core/formats) against device (CUDA's conversion intrinsics) over every code and millions of floats,
// including every midpoint between neighbouring codes. Label: gpu.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "core/formats.h"
#include "kernels/cuda/format_probe.h"

namespace tern {
namespace {

bool same_value(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b));
}

template <class Decode>
void add_midpoints(std::vector<float>& v, int n_codes, Decode decode) {
  for (int c = 0; c < n_codes; ++c) {
    for (int d : {c + 1}) {
      if (d >= n_codes) continue;
      const float a = decode(c), b = decode(d);
      if (!std::isfinite(a) || !std::isfinite(b)) continue;
      const float mid = (a + b) / 2;
      for (float x : {mid, std::nextafter(mid, -INFINITY), std::nextafter(mid, INFINITY)}) {
        v.push_back(x);
        v.push_back(-x);
      }
    }
  }
}

std::vector<float> probe_inputs() {
  std::vector<float> v;
  for (uint32_t b = 0; b < 65536; ++b) v.push_back(std::bit_cast<float>(b << 16));  // every bf16 value
  for (uint32_t b = 0; b < 65536; ++b) v.push_back(fp16_to_float(static_cast<uint16_t>(b)));
  add_midpoints(v, 65536 / 2, [](int c) { return fp16_to_float(static_cast<uint16_t>(c)); });
  add_midpoints(v, 128, [](int c) { return e4m3_to_float(static_cast<uint8_t>(c)); });
  add_midpoints(v, 128, [](int c) { return e5m2_to_float(static_cast<uint8_t>(c)); });
  add_midpoints(v, 8, [](int c) { return e2m1_to_float(static_cast<uint8_t>(c)); });
  for (float x : {464.0f, 465.0f, 480.0f, 61440.0f, 57344.0f, 5.0f, 6.5f, 7.0f, INFINITY, -INFINITY, NAN}) {
    v.push_back(x);
    v.push_back(-x);
  }
  std::mt19937 rng(20261129);
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_real_distribution<float> moderate(-600.0f, 600.0f);
  for (int i = 0; i < 4'000'000; ++i) v.push_back(std::bit_cast<float>(bits(rng)));
  for (int i = 0; i < 4'000'000; ++i) v.push_back(moderate(rng));
  return v;
}

TEST(CudaFormats, HostEncodersMatchCudaIntrinsics) {
  const std::vector<float> in = probe_inputs();
  const DeviceEncodings dev = cuda_probe_encode(in);
  ASSERT_EQ(dev.bf16.size(), in.size());
  int64_t mismatches = 0;
  auto expect_code = [&](const char* what, float x, uint32_t host, uint32_t device, auto decode) {
    if (host == device || same_value(decode(host), decode(device))) return;
    if (++mismatches <= 20) {
      ADD_FAILURE() << what << " of " << x << " (0x" << std::hex << std::bit_cast<uint32_t>(x) << "): host 0x" << host
                    << ", device 0x" << device;
    }
  };
  auto dec16 = [](uint32_t c) { return fp16_to_float(static_cast<uint16_t>(c)); };
  auto decb16 = [](uint32_t c) { return bf16_to_float(static_cast<uint16_t>(c)); };
  auto dec43 = [](uint32_t c) { return e4m3_to_float(static_cast<uint8_t>(c)); };
  auto dec52 = [](uint32_t c) { return e5m2_to_float(static_cast<uint8_t>(c)); };
  auto dec21 = [](uint32_t c) { return e2m1_to_float(static_cast<uint8_t>(c)); };
  auto dec80 = [](uint32_t c) { return ue8m0_to_float(static_cast<uint8_t>(c)); };
  for (size_t i = 0; i < in.size(); ++i) {
    const float x = in[i];
    expect_code("bf16", x, float_to_bf16(x), dev.bf16[i], decb16);
    expect_code("fp16", x, float_to_fp16(x, Overflow::kNonFinite), dev.fp16[i], dec16);
    expect_code("e4m3 satfinite", x, float_to_e4m3(x, Overflow::kSaturate), dev.e4m3_satfinite[i], dec43);
    expect_code("e4m3 nonfinite", x, float_to_e4m3(x, Overflow::kNonFinite), dev.e4m3_nonfinite[i], dec43);
    expect_code("e5m2 satfinite", x, float_to_e5m2(x, Overflow::kSaturate), dev.e5m2_satfinite[i], dec52);
    expect_code("e5m2 nonfinite", x, float_to_e5m2(x, Overflow::kNonFinite), dev.e5m2_nonfinite[i], dec52);
    expect_code("e2m1", x, float_to_e2m1(x), dev.e2m1[i], dec21);
    expect_code("ue8m0 up", x, float_to_ue8m0(x, Ue8m0Rounding::kUp), dev.ue8m0_up[i], dec80);
    expect_code("ue8m0 toward zero", x, float_to_ue8m0(x, Ue8m0Rounding::kTowardZero), dev.ue8m0_toward_zero[i],
                dec80);
  }
  EXPECT_EQ(mismatches, 0) << "of " << in.size() << " inputs";
}

TEST(CudaFormats, HostDecodersMatchCudaIntrinsics) {
  const DeviceDecodings dev = cuda_probe_decode();
  for (int c = 0; c < 256; ++c) {
    EXPECT_TRUE(same_value(e4m3_to_float(static_cast<uint8_t>(c)), dev.e4m3[c])) << "e4m3 code " << c;
    EXPECT_TRUE(same_value(e5m2_to_float(static_cast<uint8_t>(c)), dev.e5m2[c])) << "e5m2 code " << c;
    EXPECT_TRUE(same_value(ue8m0_to_float(static_cast<uint8_t>(c)), dev.ue8m0[c])) << "ue8m0 code " << c;
  }
  for (int c = 0; c < 16; ++c) {
    EXPECT_TRUE(same_value(e2m1_to_float(static_cast<uint8_t>(c)), dev.e2m1[c])) << "e2m1 code " << c;
  }
}

}  // namespace
}  // namespace tern
