#include "layers/rope.h"

#include <cmath>

namespace tern {

Rope::Rope(int64_t rotary_dim, double theta) : rotary_dim_(rotary_dim), theta_(theta) {
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
    inv_freq_.push_back(1.0f / std::pow(static_cast<float>(theta), exponent));
  }
}

void Rope::apply(float* x, int64_t n_heads, int64_t head_dim, int64_t position) const {
  const int64_t half = rotary_dim_ / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(position) * inv_freq_[i];
    const float c = static_cast<float>(std::cos(static_cast<double>(angle)));
    const float s = static_cast<float>(std::sin(static_cast<double>(angle)));
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = x + h * head_dim;
      const float a = v[i], b = v[i + half];
      v[i] = a * c - b * s;
      v[i + half] = b * c + a * s;
    }
  }
}

}  // namespace tern
