#include "ops/verify.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>

namespace tern {

void poison_f32(std::span<float> out) { std::fill(out.begin(), out.end(), std::bit_cast<float>(kPoisonF32Bits)); }

Verdict verify_output(std::span<const float> out, std::span<const float> ref, Tolerance tolerance) {
  Verdict v;
  if (out.size() != ref.size()) {
    v.reason = fmt::format("output has {} elements, the reference {}", out.size(), ref.size());
    return v;
  }
  double ref_max = 0.0;
  for (float r : ref) ref_max = std::max(ref_max, std::fabs(static_cast<double>(r)));
  v.bound = tolerance.abs + tolerance.rel * ref_max;
  bool all_zero = true;
  size_t worst = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const float o = out[i];
    if (std::bit_cast<uint32_t>(o) == kPoisonF32Bits) {
      v.reason = fmt::format("element {} of {} was never written", i, out.size());
      return v;
    }
    if (!std::isfinite(o)) {
      v.reason = fmt::format("non-finite value {} at element {}", o, i);
      return v;
    }
    all_zero = all_zero && o == 0.0f;
    const double err = std::fabs(static_cast<double>(o) - static_cast<double>(ref[i]));
    if (err > v.max_error) {
      v.max_error = err;
      worst = i;
    }
  }
  if (all_zero && ref_max > 0.0) {
    v.reason = "output is all zeros";
    return v;
  }
  if (v.max_error > v.bound) {
    v.reason = fmt::format("max error {:.3g} at element {} (got {}, want {}) exceeds the tolerance {:.3g}", v.max_error,
                           worst, out[worst], ref[worst], v.bound);
    return v;
  }
  v.pass = true;
  return v;
}

Verdict verify_repeatable(std::span<const float> first, std::span<const float> second) {
  Verdict v;
  if (first.size() != second.size()) {
    v.reason = "the two runs produced outputs of different sizes";
    return v;
  }
  for (size_t i = 0; i < first.size(); ++i) {
    if (std::bit_cast<uint32_t>(first[i]) != std::bit_cast<uint32_t>(second[i])) {
      v.reason = fmt::format("two runs on the same input differ at element {} ({} vs {}): a race?", i, first[i],
                             second[i]);
      return v;
    }
  }
  v.pass = true;
  return v;
}

}  // namespace tern
