// NVFP4 reference tests. Expected codes and scales below were computed by hand from ModelOpt's definition
// (docs/model-specs.md §1.4/1.5): inputs are chosen so every intermediate is exact in fp32, which makes
// the ties land exactly on the e2m1 thresholds.
#include "core/nvfp4.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/formats.h"

namespace tern {
namespace {

std::vector<uint8_t> unpack_codes(const std::vector<uint8_t>& packed, size_t n) {
  std::vector<uint8_t> codes(n);
  for (size_t i = 0; i < n; ++i) codes[i] = fp4_get(packed.data(), i);
  return codes;
}

TEST(Nvfp4, QuantizesHandComputedWeightBlocks) {
  // amax 10.5 gives weight_scale_2 = 10.5 / 2688 = 1/256 exactly.
  std::vector<float> w(64, 0.0f);
  // Block 0: amax 10.5 -> block scale 10.5 / (6/256) = 448 (e4m3 0x7E); divisor 448/256 = 1.75.
  // Entries are 1.75 * t, so w / divisor == t exactly; t sits on the e2m1 ties.
  const float t0[16] = {6.0f, -6.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.26f, -0.75f, -2.5f, 0.0f, 4.0f, 3.0f, 1.5f};
  const uint8_t want0[16] = {0x7, 0xF, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x1, 0xA, 0xC, 0x0, 0x6, 0x5, 0x3};
  for (int i = 0; i < 16; ++i) w[i] = 1.75f * t0[i];
  // Block 1: amax 1.0 -> scale 1/(6/256) = 42.67 -> e4m3 rounds to 44 (0x63); divisor 44/256 = 0.171875.
  const float w1[16] = {1.0f, 0.5f, 0.3f, -0.1f, 0.05f, 0.04f, -1.0f, 0.7f, 0.2f, -0.45f, 0.0f, 0.9f, -0.6f, 0.12f, 0.33f, -0.02f};
  // w/divisor: 5.82->6, 2.91->3, 1.745->1.5, -0.58->-0.5, 0.29->0.5, 0.233->0, -5.82->-6, 4.07->4, 1.16->1,
  // -2.62->-3, 0, 5.24->6, -3.49->-3, 0.698->0.5, 1.92->2, -0.116->-0
  const uint8_t want1[16] = {0x7, 0x5, 0x3, 0x9, 0x1, 0x0, 0xF, 0x6, 0x2, 0xD, 0x0, 0x7, 0xD, 0x1, 0x4, 0x8};
  for (int i = 0; i < 16; ++i) w[16 + i] = w1[i];
  // Block 2: all zeros -> scale 1.0 (0x38), codes 0.
  // Block 3: amax 1e-6 -> scale 4.3e-5, clamped up to 2^-9 (0x01); divisor 2^-17; 1e-6 / 2^-17 = 0.131 -> 0.
  for (int i = 0; i < 16; ++i) w[48 + i] = (i % 2 ? -1e-6f : 1e-6f);

  const Nvfp4Matrix m = nvfp4_quantize_weight(w, 1, 64);
  EXPECT_EQ(m.global_scale, 1.0f / 256.0f);
  ASSERT_EQ(m.block_scales.size(), 4u);
  EXPECT_EQ(m.block_scales[0], 0x7E);
  EXPECT_EQ(m.block_scales[1], 0x63);
  EXPECT_EQ(m.block_scales[2], 0x38);
  EXPECT_EQ(m.block_scales[3], 0x01);
  const auto codes = unpack_codes(m.packed, 64);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(codes[i], want0[i]) << "block 0 element " << i;
  for (int i = 0; i < 16; ++i) EXPECT_EQ(codes[16 + i], want1[i]) << "block 1 element " << i;
  for (int i = 32; i < 48; ++i) EXPECT_EQ(codes[i], 0) << i;
  for (int i = 48; i < 64; ++i) EXPECT_EQ(codes[i] & 0x7, 0) << i;

  // Dequantization: code value * e4m3(scale) * global scale.
  const std::vector<float> dq = nvfp4_dequantize(m);
  const float table[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int i = 0; i < 16; ++i) {
    const float mag = table[want0[i] & 7] * 1.75f;
    EXPECT_EQ(dq[i], (want0[i] & 8) ? -mag : mag) << i;
  }
  for (int i = 0; i < 16; ++i) {
    const float mag = table[want1[i] & 7] * 0.171875f;
    EXPECT_EQ(dq[16 + i], (want1[i] & 8) ? -mag : mag) << i;
  }
}

TEST(Nvfp4, PackedLayoutMatchesModelOpt) {
  // Row 0 holds e2m1 values 0.5 (code 1) and 6 (code 7) alternately; ModelOpt packs (q[1::2] << 4) | q[0::2].
  std::vector<float> w(32);
  for (int i = 0; i < 32; ++i) w[i] = (i % 2 == 0) ? 0.5f : 6.0f;
  const Nvfp4Matrix m = nvfp4_quantize_weight(w, 2, 16);
  ASSERT_EQ(m.packed.size(), 16u);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(m.packed[j], 0x71) << j;
  ASSERT_EQ(m.block_scales.size(), 2u);
}

TEST(Nvfp4, RoundTripErrorIsWithinHalfAStepOrTheSaturation) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  const int64_t rows = 48, cols = 256;
  std::vector<float> w(rows * cols);
  for (auto& v : w) v = normal(rng);
  w[5] = 0.5f;  // an outlier, as real weights have
  const Nvfp4Matrix m = nvfp4_quantize_weight(w, rows, cols);
  const std::vector<float> dq = nvfp4_dequantize(m);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < cols; ++k) {
      const float divisor = e4m3_to_float(m.block_scales[r * cols / 16 + k / 16]) * m.global_scale;
      const float x = w[r * cols + k];
      // The widest gap between neighbouring e2m1 values is 2 (between 4 and 6), so rounding moves a value by at
      // most one divisor; past 6 * divisor the value saturates to 6 * divisor.
      const float bound = std::max(divisor, std::fabs(x) - 6.0f * divisor) * 1.0001f;
      ASSERT_LE(std::fabs(dq[r * cols + k] - x), bound) << r << "," << k;
      ASSERT_TRUE(std::isfinite(dq[r * cols + k]));
    }
  }
  // Requantizing the dequantized matrix with the same global scale gives back the same codes.
  const Nvfp4Matrix again = nvfp4_quantize_weight(dq, rows, cols, m.global_scale);
  EXPECT_EQ(nvfp4_dequantize(again), dq);
}

TEST(Nvfp4, SharedGlobalScaleIsUsedAsGiven) {
  std::vector<float> w(16, 0.25f);
  const Nvfp4Matrix m = nvfp4_quantize_weight(w, 1, 16, 1.0f / 64.0f);
  EXPECT_EQ(m.global_scale, 1.0f / 64.0f);
  // block scale 0.25 / (6/64) = 2.667 -> e4m3 2.75 (0x43? 2.75 = 1.375 * 2 -> exponent 8, mantissa 3 = 0x43)
  EXPECT_EQ(m.block_scales[0], 0x43);
}

TEST(Nvfp4, QuantizesHandComputedActivationBlocks) {
  const float input_scale = 1.0f / 256.0f;  // act_global_scale = 256 exactly
  std::vector<float> x(64, 0.0f);
  // Block 0: vmax 6 -> sf = 256 * 6 * fl(1/6) = 256 exactly (e4m3 0x78); output scale 1, so x is coded as is.
  const float x0[16] = {6.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, -5.01f, -0.26f, 0.0f, 3.0f, -1.0f, 4.5f, 2.0f, -6.0f};
  const uint8_t want0[16] = {0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0xF, 0x9, 0x0, 0x5, 0xA, 0x6, 0x4, 0xF};
  for (int i = 0; i < 16; ++i) x[i] = x0[i];
  // Block 1: vmax 0.9 -> sf = 38.4 -> e4m3 40 (0x62); output scale 1/(40/256) = 6.4.
  const float x1[16] = {0.9f, 0.3f, -0.2f, 0.05f, 0.03f, -0.9f, 0.1f, 0.0f, 0.6f, -0.45f, 0.15f, 0.7f, -0.01f, 0.35f, 0.5f, 0.25f};
  // x*6.4: 5.76->6, 1.92->2, -1.28->-1.5, 0.32->0.5, 0.19->0, -5.76->-6, 0.64->0.5, 0, 3.84->4, -2.88->-3,
  // 0.96->1, 4.48->4, -0.064->-0, 2.24->2, 3.2->3, 1.6->1.5
  const uint8_t want1[16] = {0x7, 0x4, 0xB, 0x1, 0x0, 0xF, 0x1, 0x0, 0x6, 0xD, 0x2, 0x6, 0x8, 0x4, 0x5, 0x3};
  for (int i = 0; i < 16; ++i) x[16 + i] = x1[i];
  // Block 2: zeros -> sf 0, output scale 0, codes 0. Block 3: vmax 1e6 -> sf clamps to 448.
  for (int i = 0; i < 16; ++i) x[48 + i] = (i == 3) ? 1e6f : 1.0f;

  std::vector<uint8_t> packed(32, 0xEE), scales(4, 0xEE);
  nvfp4_quantize_activation_row(x.data(), 64, input_scale, packed.data(), scales.data());
  EXPECT_EQ(scales[0], 0x78);
  EXPECT_EQ(scales[1], 0x62);
  EXPECT_EQ(scales[2], 0x00);
  EXPECT_EQ(scales[3], 0x7E);
  const auto codes = unpack_codes(packed, 64);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(codes[i], want0[i]) << "block 0 element " << i;
  for (int i = 0; i < 16; ++i) EXPECT_EQ(codes[16 + i], want1[i]) << "block 1 element " << i;
  for (int i = 32; i < 48; ++i) EXPECT_EQ(codes[i], 0) << i;
  EXPECT_EQ(codes[48 + 3], 0x7);  // 1e6 * 1/(448/256) saturates at 6

  std::vector<float> fq(64, NAN);
  nvfp4_fake_quantize_activation_row(x.data(), 64, input_scale, fq.data());
  const float table[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int i = 0; i < 16; ++i) {
    const float mag = table[want0[i] & 7];
    EXPECT_EQ(fq[i], (want0[i] & 8) ? -mag : mag) << i;
  }
  for (int i = 0; i < 16; ++i) {
    const float mag = table[want1[i] & 7] * (40.0f / 256.0f);
    EXPECT_EQ(fq[16 + i], (want1[i] & 8) ? -mag : mag) << i;
  }
  for (int i = 32; i < 48; ++i) EXPECT_EQ(fq[i], 0.0f);
  EXPECT_EQ(fq[48 + 3], 6.0f * 448.0f / 256.0f);
}

}  // namespace
}  // namespace tern
