#include "layers/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace tern {
namespace {

// theta^(2i / rotary_dim) for i < rotary_dim / 2, in fp32 (the exponent an fp32 division, as torch's
// arange(0, dim, 2).float() / dim).
std::vector<float> position_frequencies(int64_t rotary_dim, double theta) {
  std::vector<float> out;
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
    out.push_back(std::pow(static_cast<float>(theta), exponent));
  }
  return out;
}

double get_mscale(double scale, double mscale) { return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// The dimension (of rotary_dim) whose frequency makes `rotations` turns over `positions` positions.
double correction_dim(double rotations, int64_t rotary_dim, double theta, double positions) {
  return static_cast<double>(rotary_dim) * std::log(positions / (rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(theta));
}

RopeFrequencies yarn(const RopeConfig& r, int64_t rotary_dim) {
  const std::vector<float> pos = position_frequencies(rotary_dim, r.theta);
  const auto positions = static_cast<double>(r.original_max_position_embeddings);
  double low = correction_dim(r.beta_fast, rotary_dim, r.theta, positions);
  double high = correction_dim(r.beta_slow, rotary_dim, r.theta, positions);
  if (r.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(rotary_dim - 1));
  if (low == high) high += 0.001;  // transformers: "prevent singularity"
  const float low_f = static_cast<float>(low), span = static_cast<float>(high - low);
  const float factor = static_cast<float>(r.factor);
  RopeFrequencies out;
  for (size_t i = 0; i < pos.size(); ++i) {
    const float extrapolation = 1.0f / pos[i];
    const float interpolation = 1.0f / (factor * pos[i]);
    const float ramp = std::clamp((static_cast<float>(i) - low_f) / span, 0.0f, 1.0f);
    const float keep = 1.0f - ramp;  // the extrapolation's share
    const float a = interpolation * (1.0f - keep);
    const float b = extrapolation * keep;
    out.inv_freq.push_back(a + b);
  }
  double attention = get_mscale(r.factor, 1.0);
  if (r.attention_factor) {
    attention = *r.attention_factor;
  } else if (r.mscale.value_or(0.0) != 0.0 && r.mscale_all_dim.value_or(0.0) != 0.0) {
    attention = get_mscale(r.factor, *r.mscale) / get_mscale(r.factor, *r.mscale_all_dim);
  }
  out.attention_factor = static_cast<float>(attention);
  return out;
}

}  // namespace

Expected<RopeFrequencies> rope_frequencies(const RopeConfig& rope, int64_t rotary_dim) {
  if (rotary_dim <= 0 || rotary_dim % 2 != 0) {
    return make_error("RoPE over {} dims: not a positive even number", rotary_dim);
  }
  if (rope.type == "yarn") return yarn(rope, rotary_dim);
  if (rope.type != "default" && rope.type != "linear") {
    return make_error("rope_type '{}' is not supported yet (tern runs default, linear and yarn RoPE)", rope.type);
  }
  RopeFrequencies out;
  const float factor = rope.type == "linear" ? static_cast<float>(rope.factor) : 1.0f;
  for (float p : position_frequencies(rotary_dim, rope.theta)) {
    const float inv = 1.0f / p;
    out.inv_freq.push_back(rope.type == "linear" ? inv / factor : inv);
  }
  return out;
}

double mla_softmax_mscale(const RopeConfig& rope) {
  if (rope.type == "default" || rope.mscale_all_dim.value_or(0.0) == 0.0) return 1.0;
  const double m = get_mscale(rope.factor, *rope.mscale_all_dim);
  return m * m;
}

Rope::Rope(int64_t rotary_dim, double theta) : rotary_dim_(rotary_dim), theta_(theta) {
  for (float p : position_frequencies(rotary_dim, theta)) inv_freq_.push_back(1.0f / p);
}

Rope::Rope(int64_t rotary_dim, double theta, RopeFrequencies frequencies)
    : rotary_dim_(rotary_dim),
      theta_(theta),
      inv_freq_(std::move(frequencies.inv_freq)),
      attention_factor_(frequencies.attention_factor) {}

void Rope::apply(float* x, int64_t n_heads, int64_t head_dim, int64_t position) const {
  const int64_t half = rotary_dim_ / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(position) * inv_freq_[i];
    const float c = static_cast<float>(std::cos(static_cast<double>(angle))) * attention_factor_;
    const float s = static_cast<float>(std::sin(static_cast<double>(angle))) * attention_factor_;
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = x + h * head_dim;
      const float a = v[i], b = v[i + half];
      v[i] = a * c - b * s;
      v[i + half] = b * c + a * s;
    }
  }
}

}  // namespace tern
