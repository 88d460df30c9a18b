#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/matmul.h"

namespace tern {

void cpu_attention_causal(const CpuAttentionShape& s, const float* q, const float* k, const float* v, float* out) {
  const int64_t hd = s.head_dim, group = s.n_heads / s.n_kv_heads;
  const int64_t kv_stride = s.n_kv_heads * hd, q_stride = s.n_heads * hd;
  const int64_t n_work = s.n_queries * s.n_heads;
#pragma omp parallel
  {
    std::vector<float> scores(static_cast<size_t>(s.past + s.n_queries));
#pragma omp for schedule(static)
    for (int64_t w = 0; w < n_work; ++w) {
      const int64_t t = w / s.n_heads, h = w % s.n_heads, kvh = h / group;
      const int64_t n_keys = s.past + t + 1;
      const float* qv = q + t * q_stride + h * hd;
      float max_score = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n_keys; ++j) {
        scores[j] = cpu_dot_f32(qv, k + j * kv_stride + kvh * hd, hd) * s.scale;
        max_score = std::max(max_score, scores[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < n_keys; ++j) {
        scores[j] = std::exp(scores[j] - max_score);
        sum += scores[j];
      }
      const float inv = 1.0f / sum;
      float* o = out + t * q_stride + h * hd;
      std::fill(o, o + hd, 0.0f);
      for (int64_t j = 0; j < n_keys; ++j) {
        const float p = scores[j] * inv;
        const float* vv = v + j * kv_stride + kvh * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] += p * vv[d];
      }
    }
  }
}

}  // namespace tern
