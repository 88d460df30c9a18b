// Number formats used by checkpoints and kernels: bf16, fp16, fp8 (e4m3fn, e5m2), fp4 (e2m1) and the ue8m0 block
// scale. Every float -> format conversion rounds to nearest, ties to even; what happens past the largest finite
// value is each format's own rule, chosen by `Overflow` where the ecosystem uses both (PyTorch casts produce
// inf/NaN, PTX `cvt.*.satfinite` clamps to the largest finite value).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace tern {

enum class Overflow {
  kSaturate,   // clamp to +-max finite (PTX satfinite); NaN stays NaN where the format has one
  kNonFinite,  // inf where the format has one, otherwise NaN (PyTorch's casts)
};

// bf16: the upper half of an IEEE float32. Overflow gives inf (as PyTorch); NaN stays a quiet NaN of the same sign.
float bf16_to_float(uint16_t bits);
uint16_t float_to_bf16(float value);

// fp16: IEEE binary16 (5 exponent bits, bias 15, subnormals, inf and NaN).
float fp16_to_float(uint16_t bits);
uint16_t float_to_fp16(float value, Overflow overflow = Overflow::kNonFinite);

// fp8 e4m3fn (OCP FP8 E4M3): bias 7, subnormals, no infinities, S.1111.111 is NaN, max finite 448.
// NaN encodes as 0x7F with the input's sign (0xFF when negative), as PyTorch.
float e4m3_to_float(uint8_t bits);
uint8_t float_to_e4m3(float value, Overflow overflow = Overflow::kSaturate);

// fp8 e5m2 (OCP FP8 E5M2): IEEE-like, bias 15, inf S.11111.00, NaN S.11111.{01,10,11}, max finite 57344.
// NaN encodes as 0x7F with the input's sign.
float e5m2_to_float(uint8_t bits);
uint8_t float_to_e5m2(float value, Overflow overflow = Overflow::kNonFinite);

// fp4 e2m1 (OCP MX FP4): bit 3 sign, magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; no inf or NaN. Encoding saturates to
// +-6 and maps NaN to +6, as PTX `cvt.rn.satfinite.e2m1x2.f32` does.
float e2m1_to_float(uint8_t code);
uint8_t float_to_e2m1(float value);

// ue8m0 (OCP MX E8M0 scale): value 2^(bits-127), 0xFF is NaN; no zero, no sign. Encoding takes |value| and rounds
// to a power of two up (PTX cvt.rp) or toward zero (cvt.rz), saturating to [2^-127, 2^127].
enum class Ue8m0Rounding { kUp, kTowardZero };
float ue8m0_to_float(uint8_t bits);
uint8_t float_to_ue8m0(float value, Ue8m0Rounding rounding);

// Packed fp4: two codes per byte, element 2j in the low nibble of byte j, element 2j+1 in the high nibble.
inline uint8_t fp4_get(const uint8_t* packed, size_t index) {
  const uint8_t byte = packed[index / 2];
  return (index % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
}
inline void fp4_set(uint8_t* packed, size_t index, uint8_t code) {
  uint8_t& byte = packed[index / 2];
  byte = (index % 2 == 0) ? static_cast<uint8_t>((byte & 0xF0) | (code & 0x0F))
                          : static_cast<uint8_t>((byte & 0x0F) | ((code & 0x0F) << 4));
}

// Bulk decoders for weights read from checkpoints (the CPU compute path works in float32).
void bf16_to_float(std::span<const uint16_t> in, std::span<float> out);
void fp16_to_float(std::span<const uint16_t> in, std::span<float> out);
void e4m3_to_float(std::span<const uint8_t> in, std::span<float> out);

}  // namespace tern
