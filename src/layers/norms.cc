#include "layers/norms.h"

#include <cmath>

namespace tern {
namespace {

float inverse_rms(const float* x, int64_t n, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

}  // namespace

void RmsNorm::forward(const float* x, int64_t rows, float* y) const {
  const int64_t n = static_cast<int64_t>(weight.size());
  const float offset = zero_centred ? 1.0f : 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = inverse_rms(x + r * n, n, eps);
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = (x[r * n + i] * inv) * (offset + weight[i]);
  }
}

void gated_rms_norm(const float* x, const float* z, int64_t rows, const std::vector<float>& weight, float eps,
                    float* y) {
  const int64_t n = static_cast<int64_t>(weight.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = inverse_rms(x + r * n, n, eps);
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = weight[i] * (x[r * n + i] * inv) * silu(z[r * n + i]);
  }
}

}  // namespace tern
