#include "layers/gated_deltanet.h"

#include <cmath>

#include "kernels/cpu/gated_delta.h"
#include "layers/block_ops.h"
#include "layers/norms.h"

namespace tern {
namespace {

float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

// x * rsqrt(sum(x^2) + 1e-6) over each head of `dim` elements, then * scale.
void l2_normalize_heads(float* x, int64_t n_heads, int64_t dim, float scale) {
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * dim;
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum += v[i] * v[i];
    const float inv = 1.0f / std::sqrt(sum + 1e-6f);
    for (int64_t i = 0; i < dim; ++i) v[i] = v[i] * inv * scale;
  }
}

}  // namespace

void GatedDeltaNet::project(const float* x, int64_t m, std::vector<float>& qkv, std::vector<float>& z,
                            std::vector<float>& b, std::vector<float>& a) const {
  const int64_t hk = s_.n_key_heads, hv = s_.n_value_heads, dk = s_.key_dim, dv = s_.value_dim;
  const int64_t key_width = hk * dk, value_width = hv * dv, c = conv_channels();
  qkv.resize(m * c);
  z.resize(m * value_width);
  b.resize(m * hv);
  a.resize(m * hv);
  if (!s_.fused_per_key_head) {
    w_.in_proj_qkv.forward(x, m, qkv.data());
    w_.in_proj_z.forward(x, m, z.data());
    w_.in_proj_b.forward(x, m, b.data());
    w_.in_proj_a.forward(x, m, a.data());
    return;
  }
  // Qwen3-Next: per key head [q dk | k dk | v r*dv | z r*dv] and [b r | a r]; regroup to [q all | k all | v all].
  const int64_t r = hv / hk, group = 2 * dk + 2 * r * dv;
  std::vector<float> qkvz(m * hk * group), ba(m * 2 * hv);
  w_.in_proj_qkvz.forward(x, m, qkvz.data());
  w_.in_proj_ba.forward(x, m, ba.data());
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t h = 0; h < hk; ++h) {
      const float* g = &qkvz[(t * hk + h) * group];
      float* row = &qkv[t * c];
      std::copy(g, g + dk, row + h * dk);
      std::copy(g + dk, g + 2 * dk, row + key_width + h * dk);
      std::copy(g + 2 * dk, g + 2 * dk + r * dv, row + 2 * key_width + h * r * dv);
      std::copy(g + 2 * dk + r * dv, g + group, &z[t * value_width + h * r * dv]);
      const float* gba = &ba[(t * hk + h) * 2 * r];
      std::copy(gba, gba + r, &b[t * hv + h * r]);
      std::copy(gba + r, gba + 2 * r, &a[t * hv + h * r]);
    }
  }
}

void GatedDeltaNet::forward(const float* x, float* y, const Batch& batch, int64_t layer, const Tracer* tracer) const {
  const int64_t m = batch.n_rows, value_width = s_.n_value_heads * s_.value_dim;
  std::vector<float> qkv, z, b, a;
  project(x, m, qkv, z, b, a);
  std::vector<float> core(m * value_width);
  for (const BatchSlice& seq : batch.sequences) {
    LayerCache& cache = seq.cache->layers[layer];
    run_sequence(seq, cache, &qkv[seq.row_begin * conv_channels()], &b[seq.row_begin * s_.n_value_heads],
                 &a[seq.row_begin * s_.n_value_heads], &core[seq.row_begin * value_width]);
  }
  if (tracer) (*tracer)(trace_name(layer, "gdn_core"), core.data(), m, value_width);
  gated_rms_norm(core.data(), z.data(), m * s_.n_value_heads, w_.norm_weight, s_.norm_eps, core.data());
  w_.out_proj.forward(core.data(), m, y);
}

void GatedDeltaNet::run_sequence(const BatchSlice& seq, LayerCache& cache, const float* qkv, const float* b,
                                 const float* a, float* out) const {
  const int64_t hk = s_.n_key_heads, hv = s_.n_value_heads, dk = s_.key_dim, t = seq.n_rows;
  const int64_t c = conv_channels(), key_width = hk * dk;
  if (seq.verify) {
    // One row at a time (the same arithmetic: the rule is sequential), keeping the states after each.
    cache.verified.clear();
    BatchSlice row = seq;
    row.n_rows = 1;
    row.verify = false;
    for (int64_t i = 0; i < t; ++i) {
      run_sequence(row, cache, qkv + i * c, b + i * hv, a + i * hv, out + i * hv * s_.value_dim);
      cache.verified.push_back({cache.conv_state, cache.recurrent_state});
    }
    return;
  }
  if (cache.conv_state.empty()) {
    cache.conv_state.assign(c * (s_.conv_kernel - 1), 0.0f);
    cache.recurrent_state.assign(hv * dk * s_.value_dim, 0.0f);
  }
  std::vector<float> conv(t * c);
  cpu_causal_conv1d_silu(qkv, c, t, c, w_.conv_weight.data(), s_.conv_kernel, cache.conv_state.data(), conv.data());
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  std::vector<float> g(t * hv), beta(t * hv);
  for (int64_t i = 0; i < t; ++i) {
    l2_normalize_heads(&conv[i * c], hk, dk, 1.0f);
    for (int64_t e = 0; e < key_width; ++e) conv[i * c + e] *= q_scale;
    l2_normalize_heads(&conv[i * c + key_width], hk, dk, 1.0f);
    for (int64_t j = 0; j < hv; ++j) {
      beta[i * hv + j] = 1.0f / (1.0f + std::exp(-b[i * hv + j]));
      g[i * hv + j] = -std::exp(w_.a_log[j]) * softplus(a[i * hv + j] + w_.dt_bias[j]);
    }
  }
  const CpuGatedDeltaShape shape{.n_tokens = t, .n_key_heads = hk, .n_value_heads = hv, .key_dim = dk,
                                 .value_dim = s_.value_dim};
  cpu_gated_delta_rule(shape, conv.data(), conv.data() + key_width, c, conv.data() + 2 * key_width, c, g.data(),
                       beta.data(), cache.recurrent_state.data(), out);
}

Expected<std::unique_ptr<Block>> GatedDeltaNet::place(BlockOps& ops, const RmsNorm& norm) const {
  return ops.gated_deltanet(norm, *this);
}

std::vector<const Linear*> GatedDeltaNet::input_projections() const {
  if (s_.fused_per_key_head) return {&w_.in_proj_qkvz, &w_.in_proj_ba};
  return {&w_.in_proj_qkv, &w_.in_proj_z, &w_.in_proj_b, &w_.in_proj_a};
}

}  // namespace tern
