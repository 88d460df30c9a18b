#include "kernels/cpu/gated_delta.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace tern {

void cpu_causal_conv1d_silu(const float* x, int64_t x_stride, int64_t t, int64_t channels, const float* weight,
                            int64_t kernel, float* state, float* y) {
  const int64_t hist = kernel - 1;
#pragma omp parallel
  {
    std::vector<float> window(static_cast<size_t>(hist + t));
#pragma omp for schedule(static)
    for (int64_t c = 0; c < channels; ++c) {
      // window = [state history..., new inputs...] for this channel
      for (int64_t j = 0; j < hist; ++j) window[j] = state[c * hist + j];
      for (int64_t i = 0; i < t; ++i) window[hist + i] = x[i * x_stride + c];
      const float* w = weight + c * kernel;
      for (int64_t i = 0; i < t; ++i) {
        float acc = 0.0f;
        for (int64_t j = 0; j < kernel; ++j) acc += w[j] * window[i + j];
        y[i * channels + c] = acc / (1.0f + std::exp(-acc));
      }
      for (int64_t j = 0; j < hist; ++j) state[c * hist + j] = window[t + j];
    }
  }
}

void cpu_gated_delta_rule(const CpuGatedDeltaShape& s, const float* q, const float* k, int64_t qk_stride,
                          const float* v, int64_t v_stride, const float* g, const float* beta, float* state,
                          float* out) {
  const int64_t dk = s.key_dim, dv = s.value_dim, hv = s.n_value_heads;
  const int64_t ratio = s.n_value_heads / s.n_key_heads;
#pragma omp parallel
  {
    std::vector<float> delta(static_cast<size_t>(dv));
#pragma omp for schedule(static)
    for (int64_t j = 0; j < hv; ++j) {
      float* st = state + j * dk * dv;
      const int64_t kh = j / ratio;
      for (int64_t t = 0; t < s.n_tokens; ++t) {
        const float* qt = q + t * qk_stride + kh * dk;
        const float* kt = k + t * qk_stride + kh * dk;
        const float* vt = v + t * v_stride + j * dv;
        const float decay = std::exp(g[t * hv + j]), b = beta[t * hv + j];
        for (int64_t i = 0; i < dk * dv; ++i) st[i] *= decay;
        std::copy(vt, vt + dv, delta.begin());
        for (int64_t d = 0; d < dk; ++d) {
          for (int64_t e = 0; e < dv; ++e) delta[e] -= st[d * dv + e] * kt[d];
        }
        for (int64_t e = 0; e < dv; ++e) delta[e] *= b;
        float* ot = out + (t * hv + j) * dv;
        std::fill(ot, ot + dv, 0.0f);
        for (int64_t d = 0; d < dk; ++d) {
          float* row = st + d * dv;
          for (int64_t e = 0; e < dv; ++e) {
            row[e] += kt[d] * delta[e];
            ot[e] += row[e] * qt[d];
          }
        }
      }
    }
  }
}

}  // namespace tern
