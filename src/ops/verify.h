// Judges a kernel's output against its reference, for the start-up self-test and the conformance tests. Output
// buffers are filled with a poison pattern before the kernel runs, so an element the kernel never wrote is told
// apart from one it computed as NaN. Every verdict that rejects says why in one line.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace tern {

// A float NaN with a payload no arithmetic produces; bf16 outputs use its upper half.
inline constexpr uint32_t kPoisonF32Bits = 0x7FBADBADu;
inline constexpr uint16_t kPoisonBf16Bits = 0x7FBA;

// |out - ref| <= abs + rel * max|ref| for every element (rel covers a format's rounding relative to the output's
// scale; abs covers outputs whose reference is all near zero).
struct Tolerance {
  double rel = 0.0;
  double abs = 0.0;
};

struct Verdict {
  bool pass = false;
  std::string reason;      // empty when pass
  double max_error = 0.0;  // max |out - ref| over the finite, written elements
  double bound = 0.0;      // the allowed error
};

void poison_f32(std::span<float> out);

// `out` as written by the implementation (float32, or bf16 widened by the caller with unwritten elements kept as
// the poison pattern), `ref` from the reference.
Verdict verify_output(std::span<const float> out, std::span<const float> ref, Tolerance tolerance);

// Two runs of a deterministic kernel on the same inputs must agree bit for bit; a difference points to a race.
Verdict verify_repeatable(std::span<const float> first, std::span<const float> second);

}  // namespace tern
