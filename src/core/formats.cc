#include "core/formats.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>

#include "core/error.h"

namespace tern {
namespace {

// A binary floating-point format narrower than float32, described by its fields. One encoder and one decoder serve
// fp16, e4m3fn, e5m2 and e2m1, so their rounding logic cannot drift apart.
struct MiniFloat {
  int exp_bits;
  int man_bits;
  int bias;
  bool ieee_specials;   // all-ones exponent is inf (mantissa 0) or NaN (fp16, e5m2)
  bool nan_all_ones;    // only S.1111.111 is NaN, no inf (e4m3fn)
  uint32_t max_finite;  // magnitude bits of the largest finite value
  uint32_t nan_bits;    // magnitude bits written for NaN
};

constexpr MiniFloat kFp16{5, 10, 15, true, false, 0x7BFF, 0x7E00};
constexpr MiniFloat kE4m3{4, 3, 7, false, true, 0x7E, 0x7F};
constexpr MiniFloat kE5m2{5, 2, 15, true, false, 0x7B, 0x7F};
constexpr MiniFloat kE2m1{2, 1, 1, false, false, 0x7, 0x7};

double decode_magnitude(const MiniFloat& f, uint32_t mag) {
  const uint32_t exp = mag >> f.man_bits;
  const uint32_t man = mag & ((1u << f.man_bits) - 1);
  const int emin = 1 - f.bias;
  if (exp == 0) return std::ldexp(static_cast<double>(man), emin - f.man_bits);
  return std::ldexp(static_cast<double>((1u << f.man_bits) | man), static_cast<int>(exp) - f.bias - f.man_bits);
}

float decode(const MiniFloat& f, uint32_t bits) {
  const int width = 1 + f.exp_bits + f.man_bits;
  const uint32_t sign = (bits >> (width - 1)) & 1;
  const uint32_t mag = bits & ((1u << (width - 1)) - 1);
  const uint32_t exp_all_ones = (1u << f.exp_bits) - 1;
  double value;
  if (f.ieee_specials && (mag >> f.man_bits) == exp_all_ones) {
    value = (mag & ((1u << f.man_bits) - 1)) == 0 ? HUGE_VAL : std::nan("");
  } else if (f.nan_all_ones && mag == (1u << (width - 1)) - 1) {
    value = std::nan("");
  } else {
    value = decode_magnitude(f, mag);
  }
  return static_cast<float>(sign ? -value : value);
}

uint32_t encode(const MiniFloat& f, float x, Overflow overflow) {
  const int width = 1 + f.exp_bits + f.man_bits;
  const uint32_t sign = std::signbit(x) ? (1u << (width - 1)) : 0u;
  const uint32_t inf_bits = ((1u << f.exp_bits) - 1) << f.man_bits;
  if (std::isnan(x)) return sign | f.nan_bits;
  const uint32_t overflow_bits = overflow == Overflow::kSaturate ? f.max_finite
                                 : f.ieee_specials                ? inf_bits
                                                                  : f.nan_bits;
  if (std::isinf(x)) return sign | overflow_bits;
  const double a = std::fabs(static_cast<double>(x));
  if (a == 0.0) return sign;

  int frexp_exp = 0;
  std::frexp(a, &frexp_exp);
  const int emin = 1 - f.bias;
  const int exp = std::max(frexp_exp - 1, emin);        // binade of a; subnormals share the lowest one
  const double ulp = std::ldexp(1.0, exp - f.man_bits);  // a / ulp is exact: a has 24 significant bits
  const double q = std::nearbyint(a / ulp);              // default rounding mode: nearest, ties to even
  if (q * ulp > decode_magnitude(f, f.max_finite)) return sign | overflow_bits;
  // q may have carried into the next binade (q == 2^(man_bits+1)); the field arithmetic below absorbs it.
  const uint32_t qi = static_cast<uint32_t>(q);
  if (qi < (1u << f.man_bits)) return sign | qi;  // subnormal (exp == emin)
  const uint32_t biased = static_cast<uint32_t>(exp + f.bias);
  return sign | ((biased << f.man_bits) + (qi - (1u << f.man_bits)));
}

}  // namespace

float bf16_to_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t float_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x0040);
  const uint32_t rounding_bias = 0x7FFF + ((bits >> 16) & 1);  // ties to even
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

float fp16_to_float(uint16_t bits) { return decode(kFp16, bits); }
uint16_t float_to_fp16(float value, Overflow overflow) {
  return static_cast<uint16_t>(encode(kFp16, value, overflow));
}

float e4m3_to_float(uint8_t bits) { return decode(kE4m3, bits); }
uint8_t float_to_e4m3(float value, Overflow overflow) {
  return static_cast<uint8_t>(encode(kE4m3, value, overflow));
}

float e5m2_to_float(uint8_t bits) { return decode(kE5m2, bits); }
uint8_t float_to_e5m2(float value, Overflow overflow) {
  return static_cast<uint8_t>(encode(kE5m2, value, overflow));
}

float e2m1_to_float(uint8_t code) { return decode(kE2m1, code & 0x0F); }
uint8_t float_to_e2m1(float value) {
  if (std::isnan(value)) return kE2m1.max_finite;  // PTX satfinite: NaN -> +MAX_NORM
  return static_cast<uint8_t>(encode(kE2m1, value, Overflow::kSaturate));
}

float ue8m0_to_float(uint8_t bits) {
  if (bits == 0xFF) return std::nanf("");
  return std::ldexp(1.0f, static_cast<int>(bits) - 127);
}

uint8_t float_to_ue8m0(float value, Ue8m0Rounding rounding) {
  if (std::isnan(value)) return 0xFF;
  const float a = std::fabs(value);
  if (std::isinf(a)) return 0xFE;
  if (a == 0.0f) return 0x00;
  int frexp_exp = 0;
  const float mantissa = std::frexp(a, &frexp_exp);  // a = mantissa * 2^frexp_exp, mantissa in [0.5, 1)
  int exp = frexp_exp - 1;                           // floor(log2 a)
  if (rounding == Ue8m0Rounding::kUp && mantissa != 0.5f) exp += 1;
  return static_cast<uint8_t>(std::clamp(exp + 127, 0, 254));
}

void bf16_to_float(std::span<const uint16_t> in, std::span<float> out) {
  TERN_CHECK(in.size() == out.size());
  for (size_t i = 0; i < in.size(); ++i) out[i] = bf16_to_float(in[i]);
}

void fp16_to_float(std::span<const uint16_t> in, std::span<float> out) {
  TERN_CHECK(in.size() == out.size());
  static const auto* table = [] {
    auto* t = new float[65536];
    for (uint32_t b = 0; b < 65536; ++b) t[b] = fp16_to_float(static_cast<uint16_t>(b));
    return t;
  }();
  for (size_t i = 0; i < in.size(); ++i) out[i] = table[in[i]];
}

void e4m3_to_float(std::span<const uint8_t> in, std::span<float> out) {
  TERN_CHECK(in.size() == out.size());
  static const auto table = [] {
    std::array<float, 256> t{};
    for (uint32_t b = 0; b < 256; ++b) t[b] = e4m3_to_float(static_cast<uint8_t>(b));
    return t;
  }();
  for (size_t i = 0; i < in.size(); ++i) out[i] = table[in[i]];
}

}  // namespace tern
