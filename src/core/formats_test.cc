// Number-format tests. Expected values come from the format definitions (OCP 8-bit FP spec v1.0, OCP MX spec
// v1.0, IEEE 754 binary16/bfloat16), written here independently of core/formats.cc, and from the compiler's own
// _Float16 conversions.
#include "core/formats.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace tern {
namespace {

bool same_float(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

// --- Reference decoders, written from the specs as sign / exponent / mantissa formulas. ---

double spec_fp16(uint16_t b) {
  const int s = b >> 15, e = (b >> 10) & 0x1F, m = b & 0x3FF;
  double v;
  if (e == 31) v = m == 0 ? INFINITY : NAN;
  else if (e == 0) v = m * std::pow(2.0, -24);
  else v = (1.0 + m / 1024.0) * std::pow(2.0, e - 15);
  return s ? -v : v;
}

double spec_e4m3(uint8_t b) {  // OCP E4M3: bias 7, no inf, only S.1111.111 is NaN
  const int s = b >> 7, e = (b >> 3) & 0xF, m = b & 0x7;
  double v;
  if (e == 15 && m == 7) v = NAN;
  else if (e == 0) v = m * std::pow(2.0, -9);
  else v = (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -v : v;
}

double spec_e5m2(uint8_t b) {  // OCP E5M2: bias 15, IEEE specials
  const int s = b >> 7, e = (b >> 2) & 0x1F, m = b & 0x3;
  double v;
  if (e == 31) v = m == 0 ? INFINITY : NAN;
  else if (e == 0) v = m * std::pow(2.0, -16);
  else v = (1.0 + m / 4.0) * std::pow(2.0, e - 15);
  return s ? -v : v;
}

// OCP MX FP4 E2M1 table, codes 0..15.
constexpr float kE2m1Table[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

TEST(Formats, Bf16DecodesEveryPatternAsTheUpperHalfOfFloat32) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float expected = std::bit_cast<float>(b << 16);
    ASSERT_TRUE(same_float(bf16_to_float(static_cast<uint16_t>(b)), expected)) << std::hex << b;
  }
}

TEST(Formats, Bf16RoundTripsEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_to_float(static_cast<uint16_t>(b));
    const uint16_t back = float_to_bf16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(back))) << std::hex << b;
      EXPECT_EQ(back & 0x8000, b & 0x8000) << "NaN keeps its sign";
    } else {
      ASSERT_EQ(back, b) << std::hex << b;
    }
  }
}

TEST(Formats, Bf16RoundsTiesToEven) {
  // 1 + 2^-8 lies halfway between 1 (mantissa even) and 1 + 2^-7: goes down.
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3*2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): goes up.
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  // Just above a tie goes up.
  EXPECT_EQ(float_to_bf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)), 0x3F81);
  // Overflow: the largest float rounds to inf, like a PyTorch cast.
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
}

TEST(Formats, Fp16DecodesEveryPatternPerSpec) {
  for (uint32_t b = 0; b < 65536; ++b) {
    ASSERT_TRUE(same_float(fp16_to_float(static_cast<uint16_t>(b)), static_cast<float>(spec_fp16(b))))
        << std::hex << b;
  }
  EXPECT_EQ(fp16_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(fp16_to_float(0x0001), std::ldexp(1.0f, -24));
}

TEST(Formats, Fp16RoundTripsEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = fp16_to_float(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(f))));
    } else {
      ASSERT_EQ(float_to_fp16(f), b) << std::hex << b;
    }
  }
}

#if defined(__FLT16_MAX__)
TEST(Formats, Fp16EncodingAgreesWithTheCompilersFloat16) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> bits;
  int checked = 0;
  for (int i = 0; i < 2'000'000; ++i) {
    float f = std::bit_cast<float>(bits(rng));
    if (std::isnan(f)) continue;
    // Bias towards fp16's range so most samples exercise rounding rather than overflow or flush to zero.
    int unused_exp = 0;
    if (i % 2 == 0) f = std::ldexp(std::frexp(f, &unused_exp) * 2.0f, static_cast<int>(bits(rng) % 44) - 28);
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t expected;
    std::memcpy(&expected, &h, 2);
    ASSERT_EQ(float_to_fp16(f), expected) << f;
    ++checked;
  }
  EXPECT_GT(checked, 1'000'000);
}
#endif

// Every value halfway between two neighbouring codes must go to the code with the even mantissa; a hair above or
// below must go to the nearer one.
template <class Encode, class Decode>
void check_ties(int n_positive_finite, Encode encode, Decode decode) {
  for (int c = 0; c + 1 < n_positive_finite; ++c) {
    const double lo = decode(c), hi = decode(c + 1);
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2) << "midpoint must be exact in float";
    const int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(encode(mid), even) << "tie between codes " << c << " and " << c + 1;
    EXPECT_EQ(encode(std::nextafter(mid, -1.0f)), c) << c;
    EXPECT_EQ(encode(std::nextafter(mid, 1e30f)), c + 1) << c;
  }
}

TEST(Formats, E4m3DecodesEveryCodePerOcpTable) {
  for (uint32_t b = 0; b < 256; ++b) {
    ASSERT_TRUE(same_float(e4m3_to_float(static_cast<uint8_t>(b)), static_cast<float>(spec_e4m3(b)))) << b;
  }
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
  EXPECT_EQ(e4m3_to_float(0xFE), -448.0f);
}

TEST(Formats, E4m3RoundTripsAndRoundsTiesToEven) {
  for (uint32_t b = 0; b < 256; ++b) {
    const float f = e4m3_to_float(static_cast<uint8_t>(b));
    if (!std::isnan(f)) {
      ASSERT_EQ(float_to_e4m3(f), b) << b;
    }
  }
  check_ties(127, [](float x) { return float_to_e4m3(x); }, spec_e4m3);
  for (int c = 0; c + 1 < 127; ++c) {
    const float mid = static_cast<float>((spec_e4m3(c) + spec_e4m3(c + 1)) / 2);
    EXPECT_EQ(float_to_e4m3(-mid), 0x80 | ((c % 2 == 0) ? c : c + 1));
  }
}

TEST(Formats, E4m3Overflow) {
  // Saturating (PTX satfinite): anything past 448 clamps; NaN stays NaN.
  EXPECT_EQ(float_to_e4m3(1000.0f, Overflow::kSaturate), 0x7E);
  EXPECT_EQ(float_to_e4m3(-INFINITY, Overflow::kSaturate), 0xFE);
  EXPECT_EQ(float_to_e4m3(NAN, Overflow::kSaturate) & 0x7F, 0x7F);
  // Non-saturating (PyTorch cast): 464 is the tie between 448 and the NaN slot and goes to 448 (even);
  // beyond it the value is NaN because e4m3fn has no infinity.
  EXPECT_EQ(float_to_e4m3(464.0f, Overflow::kNonFinite), 0x7E);
  EXPECT_EQ(float_to_e4m3(465.0f, Overflow::kNonFinite), 0x7F);
  EXPECT_EQ(float_to_e4m3(-1e9f, Overflow::kNonFinite), 0xFF);
  EXPECT_EQ(float_to_e4m3(INFINITY, Overflow::kNonFinite), 0x7F);
  // Underflow: below half the smallest subnormal goes to zero, keeping the sign.
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -11)), 0x00);
  EXPECT_EQ(float_to_e4m3(-std::ldexp(1.0f, -11)), 0x80);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);  // exactly half of 2^-9: tie to even (0)
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.5f, -10)), 0x01);
}

TEST(Formats, E5m2DecodesEveryCodePerOcpTable) {
  for (uint32_t b = 0; b < 256; ++b) {
    ASSERT_TRUE(same_float(e5m2_to_float(static_cast<uint8_t>(b)), static_cast<float>(spec_e5m2(b)))) << b;
  }
  EXPECT_EQ(e5m2_to_float(0x7B), 57344.0f);
  EXPECT_EQ(e5m2_to_float(0x7C), INFINITY);
  EXPECT_EQ(e5m2_to_float(0x01), std::ldexp(1.0f, -16));
}

TEST(Formats, E5m2RoundTripsRoundsTiesAndOverflows) {
  for (uint32_t b = 0; b < 256; ++b) {
    const float f = e5m2_to_float(static_cast<uint8_t>(b));
    if (!std::isnan(f)) {
      ASSERT_EQ(float_to_e5m2(f), b) << b;
    }
  }
  check_ties(124, [](float x) { return float_to_e5m2(x); }, spec_e5m2);
  EXPECT_EQ(float_to_e5m2(1e6f, Overflow::kNonFinite), 0x7C);
  EXPECT_EQ(float_to_e5m2(1e6f, Overflow::kSaturate), 0x7B);
  EXPECT_EQ(float_to_e5m2(61440.0f, Overflow::kNonFinite), 0x7C);  // tie between 57344 and 65536 (inf): even
  EXPECT_EQ(float_to_e5m2(61439.0f, Overflow::kNonFinite), 0x7B);
}

TEST(Formats, E2m1DecodesEveryCodePerMxTable) {
  for (uint8_t c = 0; c < 16; ++c) {
    EXPECT_EQ(e2m1_to_float(c), kE2m1Table[c]) << int(c);
    EXPECT_EQ(std::signbit(e2m1_to_float(c)), c >= 8) << int(c);
  }
}

TEST(Formats, E2m1RoundsAsModelOptThresholds) {
  // ModelOpt/vLLM reference thresholds: |x|<=0.25 -> 0, (0.25,0.75) -> 0.5, [0.75,1.25] -> 1, (1.25,1.75) -> 1.5,
  // [1.75,2.5] -> 2, (2.5,3.5) -> 3, [3.5,5] -> 4, > 5 -> 6.
  const std::vector<std::pair<float, float>> cases = {
      {0.0f, 0.0f},  {0.25f, 0.0f}, {0.26f, 0.5f}, {0.74f, 0.5f}, {0.75f, 1.0f}, {1.25f, 1.0f},
      {1.26f, 1.5f}, {1.74f, 1.5f}, {1.75f, 2.0f}, {2.5f, 2.0f},  {2.51f, 3.0f}, {3.49f, 3.0f},
      {3.5f, 4.0f},  {5.0f, 4.0f},  {5.01f, 6.0f}, {6.0f, 6.0f},  {100.0f, 6.0f}, {INFINITY, 6.0f}};
  for (auto [x, want] : cases) {
    EXPECT_EQ(e2m1_to_float(float_to_e2m1(x)), want) << x;
    EXPECT_EQ(e2m1_to_float(float_to_e2m1(-x)), -want) << -x;
  }
  EXPECT_EQ(float_to_e2m1(NAN), 0x7);  // PTX satfinite maps NaN to +MAX_NORM
  EXPECT_EQ(float_to_e2m1(-0.1f), 0x8);
  check_ties(8, [](float x) { return float_to_e2m1(x); }, [](int c) { return double(kE2m1Table[c]); });
}

TEST(Formats, Ue8m0) {
  EXPECT_EQ(ue8m0_to_float(127), 1.0f);
  EXPECT_EQ(ue8m0_to_float(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(ue8m0_to_float(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(ue8m0_to_float(255)));
  for (int b = 0; b < 255; ++b) {
    EXPECT_EQ(ue8m0_to_float(b), std::ldexp(1.0f, b - 127));
    EXPECT_EQ(float_to_ue8m0(std::ldexp(1.0f, b - 127), Ue8m0Rounding::kUp), b);
    EXPECT_EQ(float_to_ue8m0(std::ldexp(1.0f, b - 127), Ue8m0Rounding::kTowardZero), b);
  }
  EXPECT_EQ(float_to_ue8m0(3.0f, Ue8m0Rounding::kUp), 129);          // 4
  EXPECT_EQ(float_to_ue8m0(3.0f, Ue8m0Rounding::kTowardZero), 128);  // 2
  EXPECT_EQ(float_to_ue8m0(1e-45f, Ue8m0Rounding::kTowardZero), 0);  // saturates at 2^-127
  EXPECT_EQ(float_to_ue8m0(INFINITY, Ue8m0Rounding::kUp), 254);
  EXPECT_EQ(float_to_ue8m0(NAN, Ue8m0Rounding::kUp), 255);
}

TEST(Formats, Fp4PackingPutsTheEvenElementInTheLowNibble) {
  uint8_t packed[2] = {0xAA, 0xAA};
  fp4_set(packed, 0, 0x1);
  fp4_set(packed, 1, 0xF);
  fp4_set(packed, 2, 0x7);
  fp4_set(packed, 3, 0x8);
  EXPECT_EQ(packed[0], 0xF1);
  EXPECT_EQ(packed[1], 0x87);
  EXPECT_EQ(fp4_get(packed, 0), 0x1);
  EXPECT_EQ(fp4_get(packed, 1), 0xF);
  EXPECT_EQ(fp4_get(packed, 2), 0x7);
  EXPECT_EQ(fp4_get(packed, 3), 0x8);
}

TEST(Formats, BulkDecodersMatchScalar) {
  std::vector<uint16_t> h(65536);
  for (uint32_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(i);
  std::vector<float> out(h.size(), 12345.0f);
  fp16_to_float(h, out);
  for (uint32_t i = 0; i < h.size(); ++i) ASSERT_TRUE(same_float(out[i], static_cast<float>(spec_fp16(i))));
  std::fill(out.begin(), out.end(), 12345.0f);
  bf16_to_float(h, out);
  for (uint32_t i = 0; i < h.size(); ++i) ASSERT_TRUE(same_float(out[i], std::bit_cast<float>(i << 16)));
  std::vector<uint8_t> e(256);
  for (uint32_t i = 0; i < 256; ++i) e[i] = static_cast<uint8_t>(i);
  std::vector<float> out8(256, 12345.0f);
  e4m3_to_float(e, out8);
  for (uint32_t i = 0; i < 256; ++i) ASSERT_TRUE(same_float(out8[i], static_cast<float>(spec_e4m3(i))));
}

}  // namespace
}  // namespace tern
