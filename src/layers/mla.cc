#include "layers/mla.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "layers/block_ops.h"

namespace tern {

void LayerNorm::forward(const float* x, int64_t rows, float* y) const {
  const int64_t dim = static_cast<int64_t>(weight.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = x + r * dim;
    float* o = y + r * dim;
    float mean = 0.0f;
    for (int64_t i = 0; i < dim; ++i) mean += v[i];
    mean /= static_cast<float>(dim);
    float var = 0.0f;
    for (int64_t i = 0; i < dim; ++i) var += (v[i] - mean) * (v[i] - mean);
    const float inv = 1.0f / std::sqrt(var / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) o[i] = (v[i] - mean) * inv * weight[i] + bias[i];
  }
}

// The first qk_rope_head_dim values of each of n_vectors vectors (stride apart) rotated for `position`: GPT-J pairs
// (x[2i], x[2i + 1]) or NeoX halves (x[i], x[i + d/2]), frequency i either way.
void MlaAttention::rope(float* v, int64_t n_vectors, int64_t stride, int64_t position, bool interleaved) const {
  if (!interleaved) {
    rope_.apply(v, n_vectors, stride, position);
    return;
  }
  const std::vector<float>& inv_freq = rope_.inv_freq();
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float angle = static_cast<float>(position) * inv_freq[i];
    const float c = static_cast<float>(std::cos(static_cast<double>(angle))) * rope_.attention_factor();
    const float s = static_cast<float>(std::sin(static_cast<double>(angle))) * rope_.attention_factor();
    for (int64_t h = 0; h < n_vectors; ++h) {
      float* p = v + h * stride + 2 * i;
      const float a = p[0], b = p[1];
      p[0] = a * c - b * s;
      p[1] = b * c + a * s;
    }
  }
}

std::vector<std::vector<int32_t>> MlaAttention::select(const BatchSlice& seq, LayerCache& cache, const float* x,
                                                       const float* cq) const {
  const int64_t total = seq.past + seq.n_rows;
  std::vector<std::vector<int32_t>> keys(static_cast<size_t>(seq.n_rows));
  if (s_.index_topk <= 0) {  // plain causal
    for (int64_t t = 0; t < seq.n_rows; ++t) {
      keys[t].resize(static_cast<size_t>(seq.past + t + 1));
      std::iota(keys[t].begin(), keys[t].end(), 0);
    }
    return keys;
  }
  if (!w_.indexer) {  // a shared layer: the nearest full layer's selection of this step
    return seq.cache->layers[static_cast<size_t>(s_.selection_layer)].selected;
  }
  const MlaIndexerWeights& ix = *w_.indexer;
  const int64_t hi = s_.index_heads, d = s_.index_head_dim, m = seq.n_rows;
  // This step's keys: LayerNorm(wk(x)), roped, appended to the indexer's key cache (cache.v).
  std::vector<float> k(m * d), q(m * hi * d), w(m * hi);
  ix.wk.forward(x, m, k.data());
  ix.k_norm.forward(k.data(), m, k.data());
  ix.wq_b.forward(cq, m, q.data());
  ix.weights_proj.forward(x, m, w.data());
  cache.v.resize(static_cast<size_t>(total * d));
  for (int64_t t = 0; t < m; ++t) {
    const int64_t pos = seq.past + t;
    rope(&k[t * d], 1, d, pos, s_.indexer_rope_interleaved);
    rope(&q[t * hi * d], hi, d, pos, s_.indexer_rope_interleaved);
    std::copy(&k[t * d], &k[(t + 1) * d], &cache.v[pos * d]);
  }
  const float head_weight = 1.0f / std::sqrt(static_cast<float>(hi)), scale = 1.0f / std::sqrt(static_cast<float>(d));
  // topk = min(index_topk, T) over the T keys, the future ones at -inf: every causal key while there are at most
  // topk of them, else the topk best, ties to the earlier key.
  const int64_t topk = std::min(s_.index_topk, total);
  std::vector<float> score;
  for (int64_t t = 0; t < m; ++t) {
    const int64_t n = seq.past + t + 1;
    std::vector<int32_t>& chosen = keys[t];
    chosen.resize(static_cast<size_t>(n));
    std::iota(chosen.begin(), chosen.end(), 0);
    if (n <= topk) continue;
    score.assign(static_cast<size_t>(n), 0.0f);
    for (int64_t s = 0; s < n; ++s) {
      float sum = 0.0f;
      for (int64_t h = 0; h < hi; ++h) {
        const float* qh = &q[(t * hi + h) * d];
        const float* ks = &cache.v[s * d];
        float dot = 0.0f;
        for (int64_t i = 0; i < d; ++i) dot += qh[i] * ks[i];
        sum += w[t * hi + h] * head_weight * std::max(dot * scale, 0.0f);
      }
      score[s] = sum;
    }
    std::partial_sort(chosen.begin(), chosen.begin() + topk, chosen.end(),
                      [&](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); });
    chosen.resize(static_cast<size_t>(topk));
    std::sort(chosen.begin(), chosen.end());
  }
  cache.selected = keys;
  return keys;
}

namespace {

// Softmax of p in place (the max subtracted first); returns nothing, p sums to 1 afterwards.
void softmax_in_place(std::vector<float>& p) {
  float mx = -INFINITY;
  for (float v : p) mx = std::max(mx, v);
  float sum = 0.0f;
  for (float& v : p) sum += (v = std::exp(v - mx));
  for (float& v : p) v /= sum;
}

}  // namespace

void MlaAttention::attend_expanded(const BatchSlice& seq, const LayerCache& cache, const float* q,
                                   const std::vector<std::vector<int32_t>>& keys, float* out) const {
  const int64_t h = s_.n_heads, nope = s_.qk_nope_head_dim, rp = s_.qk_rope_head_dim, qk = nope + rp;
  const int64_t vd = s_.v_head_dim, lora = s_.kv_lora_rank, latent = lora + rp, total = seq.past + seq.n_rows;
  // Every cached token's K (nope part) and V, expanded from the latent.
  std::vector<float> c(total * lora), kv(total * h * (nope + vd));
  for (int64_t s = 0; s < total; ++s) std::copy(&cache.k[s * latent], &cache.k[s * latent + lora], &c[s * lora]);
  w_.kv_b_proj.forward(c.data(), total, kv.data());
  std::vector<float> p;
  for (int64_t t = 0; t < seq.n_rows; ++t) {
    const std::vector<int32_t>& sel = keys[t];
    for (int64_t hd = 0; hd < h; ++hd) {
      const float* qh = &q[(t * h + hd) * qk];
      p.assign(sel.size(), 0.0f);
      for (size_t j = 0; j < sel.size(); ++j) {
        const int64_t s = sel[j];
        const float* kn = &kv[(s * h + hd) * (nope + vd)];
        const float* kp = &cache.k[s * latent + lora];
        float dot = 0.0f;
        for (int64_t i = 0; i < nope; ++i) dot += qh[i] * kn[i];
        for (int64_t i = 0; i < rp; ++i) dot += qh[nope + i] * kp[i];
        p[j] = dot * s_.scale;
      }
      softmax_in_place(p);
      float* o = &out[(t * h + hd) * vd];
      for (size_t j = 0; j < sel.size(); ++j) {
        const float* vv = &kv[(sel[j] * h + hd) * (nope + vd) + nope];
        for (int64_t i = 0; i < vd; ++i) o[i] += p[j] * vv[i];
      }
    }
  }
}

void MlaAttention::attend_absorbed(const BatchSlice& seq, const LayerCache& cache, const float* q,
                                   const std::vector<std::vector<int32_t>>& keys, float* out) const {
  const int64_t h = s_.n_heads, nope = s_.qk_nope_head_dim, rp = s_.qk_rope_head_dim, qk = nope + rp;
  const int64_t vd = s_.v_head_dim, lora = s_.kv_lora_rank, latent = lora + rp;
  // kv_b_proj as fp32 rows: head hd's key rows W_UK [nope, lora] at hd * (nope + vd), its value rows W_UV [vd, lora]
  // after them.
  const int64_t wrows = w_.kv_b_proj.out_features();
  std::vector<float> wkv(wrows * lora);
  for (int64_t r = 0; r < wrows; ++r) cpu_matrix_row(w_.kv_b_proj.matrix(), r, &wkv[r * lora]);
  std::vector<float> q_lat(lora), o_lat(lora), p;
  for (int64_t t = 0; t < seq.n_rows; ++t) {
    const std::vector<int32_t>& sel = keys[t];
    for (int64_t hd = 0; hd < h; ++hd) {
      const float* qh = &q[(t * h + hd) * qk];
      const float* w_uk = &wkv[hd * (nope + vd) * lora];
      const float* w_uv = w_uk + nope * lora;
      std::fill(q_lat.begin(), q_lat.end(), 0.0f);
      for (int64_t i = 0; i < nope; ++i) {
        for (int64_t l = 0; l < lora; ++l) q_lat[l] += qh[i] * w_uk[i * lora + l];
      }
      p.assign(sel.size(), 0.0f);
      for (size_t j = 0; j < sel.size(); ++j) {
        const float* lat = &cache.k[sel[j] * latent];
        float dot = 0.0f;
        for (int64_t l = 0; l < lora; ++l) dot += q_lat[l] * lat[l];
        for (int64_t i = 0; i < rp; ++i) dot += qh[nope + i] * lat[lora + i];
        p[j] = dot * s_.scale;
      }
      softmax_in_place(p);
      std::fill(o_lat.begin(), o_lat.end(), 0.0f);
      for (size_t j = 0; j < sel.size(); ++j) {
        const float* lat = &cache.k[sel[j] * latent];
        for (int64_t l = 0; l < lora; ++l) o_lat[l] += p[j] * lat[l];
      }
      float* o = &out[(t * h + hd) * vd];
      for (int64_t i = 0; i < vd; ++i) {
        float sum = 0.0f;
        for (int64_t l = 0; l < lora; ++l) sum += w_uv[i * lora + l] * o_lat[l];
        o[i] = sum;
      }
    }
  }
}

void MlaAttention::forward(const float* x, float* y, const Batch& batch, int64_t layer, const Tracer* tracer) const {
  const int64_t m = batch.n_rows, h = s_.n_heads, nope = s_.qk_nope_head_dim, rp = s_.qk_rope_head_dim;
  const int64_t qk = nope + rp, vd = s_.v_head_dim, lora = s_.kv_lora_rank, latent = lora + rp;
  std::vector<float> cq, q(m * h * qk), kv_a(m * latent);
  if (s_.q_lora_rank > 0) {
    cq.resize(m * s_.q_lora_rank);
    w_.q_a_proj.forward(x, m, cq.data());
    w_.q_a_norm.forward(cq.data(), m, cq.data());
    w_.q_b_proj.forward(cq.data(), m, q.data());
  } else {
    w_.q_proj.forward(x, m, q.data());
  }
  w_.kv_a_proj.forward(x, m, kv_a.data());
  std::vector<float> attn(m * h * vd, 0.0f);
  std::vector<uint8_t> entry(s_.latent_fp8 ? static_cast<size_t>(latent_fp8_bytes(lora, rp)) : 0);
  for (const BatchSlice& seq : batch.sequences) {
    LayerCache& cache = seq.cache->layers[layer];
    const int64_t total = seq.past + seq.n_rows;
    // The latent of the new rows: normed c and roped k_pe, appended to the cache (cache.k).
    cache.k.resize(static_cast<size_t>(total * latent));
    for (int64_t t = 0; t < seq.n_rows; ++t) {
      const int64_t row = seq.row_begin + t, pos = seq.past + t;
      float* lat = &cache.k[pos * latent];
      w_.kv_a_norm.forward(&kv_a[row * latent], 1, lat);
      std::copy(&kv_a[row * latent + lora], &kv_a[(row + 1) * latent], lat + lora);
      rope(lat + lora, 1, rp, pos, s_.rope_interleaved);
      if (s_.latent_fp8) {  // what the token's FP8 entry holds
        latent_fp8_pack(lat, lat + lora, lora, rp, *s_.latent_fp8, entry.data());
        latent_fp8_unpack(entry.data(), lora, rp, lat, lat + lora);
      }
      rope(&q[row * h * qk + nope], h, qk, pos, s_.rope_interleaved);
    }
    const auto keys = select(seq, cache, x + seq.row_begin * w_.kv_a_proj.in_features(),
                             cq.empty() ? nullptr : &cq[seq.row_begin * s_.q_lora_rank]);
    const bool absorbed = s_.form == MlaForm::kAbsorbed || (s_.form == MlaForm::kAuto && seq.past > 0);
    const float* q_seq = &q[seq.row_begin * h * qk];
    float* out = &attn[seq.row_begin * h * vd];
    if (absorbed) {
      attend_absorbed(seq, cache, q_seq, keys, out);
    } else {
      attend_expanded(seq, cache, q_seq, keys, out);
    }
  }
  if (tracer) (*tracer)(trace_name(layer, "attn"), attn.data(), m, h * vd);
  w_.o_proj.forward(attn.data(), m, y);
}

Expected<std::unique_ptr<Block>> MlaAttention::place(BlockOps& ops, const RmsNorm& norm) const {
  return ops.mla(norm, *this);
}

}  // namespace tern
