// The FP8 latent cache entry (core/latent_fp8.h) against its definition, computed here without the packer: each
// tile's scale from its amax, each code the e4m3 value nearest c / s (ties to an even code, checked against the
// neighbouring codes by value), the bytes where the layout puts them, the values read back (code x scale rounded to
// fp32 then bf16) and the round trip within e4m3's and bf16's rounding bounds.
#include "core/latent_fp8.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/formats.h"

namespace tern {
namespace {

constexpr int64_t kLora = 512, kRope = 64;

struct Entry {
  std::vector<float> c, k_pe;
};

// Tiles of very different magnitudes (one all zero), so scales span many binades.
Entry random_entry(std::mt19937& rng) {
  Entry e{std::vector<float>(kLora), std::vector<float>(kRope)};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float tile_scale[] = {1.0f, 3e-3f, 0.0f, 250.0f};
  for (int64_t i = 0; i < kLora; ++i) e.c[i] = normal(rng) * tile_scale[i / kLatentFp8Tile];
  for (float& v : e.k_pe) v = normal(rng);
  return e;
}

float scale_of(const uint8_t* bytes, int64_t tile) {
  float s;
  std::memcpy(&s, bytes + kLora + 4 * tile, 4);
  return s;
}

// Whether `code` holds the e4m3 value nearest x: no other finite code is closer, and a tie goes to the even code.
bool nearest_e4m3(uint8_t code, float x) {
  const double got = e4m3_to_float(code), err = std::fabs(got - x);
  for (int other = 0; other < 256; ++other) {
    const float v = e4m3_to_float(static_cast<uint8_t>(other));
    if (std::isnan(v)) continue;
    const double e = std::fabs(static_cast<double>(v) - x);
    if (e < err) return false;
    if (e == err && v != got && (other & 1) == 0 && (code & 1) == 1) return false;
  }
  return true;
}

TEST(LatentFp8, EntryIs656BytesForGlm5) { EXPECT_EQ(latent_fp8_bytes(kLora, kRope), 656); }

TEST(LatentFp8, PackFollowsTheLayout) {
  std::mt19937 rng(20261204);
  for (const LatentFp8Scales mode : {LatentFp8Scales::kFp32, LatentFp8Scales::kPow2}) {
    const Entry e = random_entry(rng);
    std::vector<uint8_t> bytes(latent_fp8_bytes(kLora, kRope), 0xA5);
    latent_fp8_pack(e.c.data(), e.k_pe.data(), kLora, kRope, mode, bytes.data());
    for (int64_t t = 0; t < kLora / kLatentFp8Tile; ++t) {
      float amax = 0.0f;
      for (int64_t i = 0; i < kLatentFp8Tile; ++i) amax = std::max(amax, std::fabs(e.c[t * kLatentFp8Tile + i]));
      float want = std::max(amax / 448.0f, FLT_MIN);
      if (mode == LatentFp8Scales::kPow2) want = std::exp2(std::ceil(std::log2(want)));
      const float s = scale_of(bytes.data(), t);
      EXPECT_EQ(s, want) << "tile " << t;
      for (int64_t i = 0; i < kLatentFp8Tile; ++i) {
        const int64_t j = t * kLatentFp8Tile + i;
        ASSERT_TRUE(nearest_e4m3(bytes[j], e.c[j] / s)) << "value " << j << " = " << e.c[j] << ", code "
                                                         << int{bytes[j]};
      }
    }
    for (int64_t i = 0; i < kRope; ++i) {
      uint16_t bits;
      std::memcpy(&bits, bytes.data() + kLora + 4 * (kLora / kLatentFp8Tile) + 2 * i, 2);
      EXPECT_EQ(bits, float_to_bf16(e.k_pe[i])) << "k_pe " << i;
    }
  }
}

TEST(LatentFp8, RoundTripWithinTheFormatsRounding) {
  std::mt19937 rng(20261205);
  for (const LatentFp8Scales mode : {LatentFp8Scales::kFp32, LatentFp8Scales::kPow2}) {
    const Entry e = random_entry(rng);
    std::vector<uint8_t> bytes(latent_fp8_bytes(kLora, kRope));
    latent_fp8_pack(e.c.data(), e.k_pe.data(), kLora, kRope, mode, bytes.data());
    std::vector<float> c(kLora, std::nanf("")), k_pe(kRope, std::nanf(""));
    latent_fp8_unpack(bytes.data(), kLora, kRope, c.data(), k_pe.data());
    for (int64_t i = 0; i < kLora; ++i) {
      // The value read is the product code x scale (exact in double), rounded to fp32, then to bf16.
      const double s = scale_of(bytes.data(), i / kLatentFp8Tile);
      const auto product = static_cast<float>(static_cast<double>(e4m3_to_float(bytes[i])) * s);
      EXPECT_EQ(c[i], bf16_to_float(float_to_bf16(product))) << "c " << i;
      // e4m3: 3 mantissa bits (half an ulp is 2^-4 relative) down to 2^-6, then steps of 2^-9, in units of s; bf16
      // adds half an ulp of 2^-8 relative.
      const double bound = std::max(0x1p-4 * std::fabs(e.c[i]), 0x1p-10 * s) * (1 + 1e-6) + 0x1p-8 * std::fabs(c[i]);
      ASSERT_TRUE(std::isfinite(c[i])) << i;
      EXPECT_LE(std::fabs(c[i] - e.c[i]), bound) << "c " << i;
    }
    // bf16: 7 mantissa bits, half an ulp is at most 2^-8 relative.
    for (int64_t i = 0; i < kRope; ++i) EXPECT_LE(std::fabs(k_pe[i] - e.k_pe[i]), 0x1p-8 * std::fabs(e.k_pe[i]));
    // The all-zero tile stays zero, with a finite scale.
    for (int64_t i = 2 * kLatentFp8Tile; i < 3 * kLatentFp8Tile; ++i) EXPECT_EQ(c[i], 0.0f);
  }
}

// A NaN value is NaN when read back; the rest of its tile keeps the scale of its finite values.
TEST(LatentFp8, NanStaysNanAndLeavesItsTileAlone) {
  std::mt19937 rng(20261206);
  Entry e = random_entry(rng);
  std::vector<uint8_t> bytes(latent_fp8_bytes(kLora, kRope));
  e.c[5] = 0.0f;
  latent_fp8_pack(e.c.data(), e.k_pe.data(), kLora, kRope, LatentFp8Scales::kFp32, bytes.data());
  const float scale_without = scale_of(bytes.data(), 0);
  e.c[5] = std::nanf("");
  latent_fp8_pack(e.c.data(), e.k_pe.data(), kLora, kRope, LatentFp8Scales::kFp32, bytes.data());
  EXPECT_EQ(scale_of(bytes.data(), 0), scale_without);
  std::vector<float> c(kLora), k_pe(kRope);
  latent_fp8_unpack(bytes.data(), kLora, kRope, c.data(), k_pe.data());
  EXPECT_TRUE(std::isnan(c[5]));
  for (int64_t i = 0; i < kLatentFp8Tile; ++i) {
    if (i != 5) {
      EXPECT_TRUE(std::isfinite(c[i])) << i;
    }
  }
}

}  // namespace
}  // namespace tern
