#include "layers/attention.h"

#include <cmath>
#include <string>

#include "kernels/cpu/attention.h"
#include "layers/block_ops.h"

namespace tern {

void Attention::forward(const float* x, float* y, const Batch& batch, int64_t layer, const Tracer* tracer) const {
  const int64_t m = batch.n_rows, hd = shape_.head_dim;
  const int64_t q_width = shape_.n_heads * hd, kv_width = shape_.n_kv_heads * hd;
  const int64_t q_proj_width = q_width * (shape_.gated ? 2 : 1);
  std::vector<float> q_proj(m * q_proj_width), k(m * kv_width), v(m * kv_width);
  w_.q_proj.forward(x, m, q_proj.data());
  w_.k_proj.forward(x, m, k.data());
  w_.v_proj.forward(x, m, v.data());

  // Split [query | gate] per head (gated) and normalise each head.
  std::vector<float> q(m * q_width), gate(shape_.gated ? m * q_width : 0);
  for (int64_t r = 0; r < m * shape_.n_heads; ++r) {
    const float* src = &q_proj[r * hd * (shape_.gated ? 2 : 1)];
    std::copy(src, src + hd, &q[r * hd]);
    if (shape_.gated) std::copy(src + hd, src + 2 * hd, &gate[r * hd]);
  }
  w_.q_norm.forward(q.data(), m * shape_.n_heads, q.data());
  w_.k_norm.forward(k.data(), m * shape_.n_kv_heads, k.data());

  std::vector<float> attn(m * q_width);
  for (const BatchSlice& seq : batch.sequences) {
    LayerCache& cache = seq.cache->layers[layer];
    attend_sequence(seq, cache, &q[seq.row_begin * q_width], &k[seq.row_begin * kv_width],
                    &v[seq.row_begin * kv_width], &attn[seq.row_begin * q_width]);
  }
  if (tracer) (*tracer)(trace_name(layer, "attn"), attn.data(), m, q_width);
  if (shape_.gated) {
    for (int64_t i = 0; i < m * q_width; ++i) attn[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
  }
  w_.o_proj.forward(attn.data(), m, y);
}

void Attention::attend_sequence(const BatchSlice& seq, LayerCache& cache, float* q, const float* k, const float* v,
                                float* out) const {
  const int64_t hd = shape_.head_dim, kv_width = shape_.n_kv_heads * hd;
  const int64_t total = seq.past + seq.n_rows;
  cache.k.resize(total * kv_width);
  cache.v.resize(total * kv_width);
  for (int64_t t = 0; t < seq.n_rows; ++t) {
    const int64_t pos = seq.past + t;
    rope_.apply(q + t * shape_.n_heads * hd, shape_.n_heads, hd, pos);
    float* kc = &cache.k[pos * kv_width];
    std::copy(k + t * kv_width, k + (t + 1) * kv_width, kc);
    rope_.apply(kc, shape_.n_kv_heads, hd, pos);
    std::copy(v + t * kv_width, v + (t + 1) * kv_width, &cache.v[pos * kv_width]);
  }
  const CpuAttentionShape s{.n_queries = seq.n_rows, .past = seq.past, .n_heads = shape_.n_heads,
                            .n_kv_heads = shape_.n_kv_heads, .head_dim = hd,
                            .scale = 1.0f / std::sqrt(static_cast<float>(hd))};
  cpu_attention_causal(s, q, cache.k.data(), cache.v.data(), out);
}

Expected<std::unique_ptr<Block>> Attention::place(BlockOps& ops, const RmsNorm& norm) const {
  return ops.attention(norm, *this);
}

std::vector<const Linear*> Attention::input_projections() const { return {&w_.q_proj, &w_.k_proj, &w_.v_proj}; }

}  // namespace tern
