// RMSNorm variants of Qwen3 / Qwen3.5 (docs/model-specs.md §2.3), in fp32:
//   plain:        y = w * (x * rsqrt(mean(x^2) + eps))
//   zero-centred: y = (1 + w) * (x * rsqrt(mean(x^2) + eps))          (Qwen3.5 / Qwen3-Next decoder norms, q/k norms)
//   gated:        y = w * (x * rsqrt(mean(x^2) + eps)) * silu(z)      (Gated DeltaNet output norm)
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace tern {

struct RmsNorm {
  std::vector<float> weight;
  float eps = 1e-6f;
  bool zero_centred = false;

  // rows of `dim` elements; in place allowed (x == y).
  void forward(const float* x, int64_t rows, float* y) const;
};

// Gated norm over rows of weight.size() elements: y = w * normalize(x) * silu(z). In place allowed (x == y).
void gated_rms_norm(const float* x, const float* z, int64_t rows, const std::vector<float>& weight, float eps,
                    float* y);

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace tern
