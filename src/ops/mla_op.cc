#include "ops/mla_op.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "core/formats.h"
#include "core/latent_fp8.h"
#include "ops/harness_util.h"

namespace tern {
namespace {

// Every fourth key repeats the one before it (the exact ties of indexer_select's inputs).
constexpr int64_t kIndexerTiePeriod = 4;

bool repeats_previous_key(int64_t position) {
  return position % kIndexerTiePeriod == kIndexerTiePeriod - 1;
}

std::vector<float> widen(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(v[i]);
  return out;
}

// Checks the batch part of a case's dims (the first three) into `batch`.
bool batch_of(const std::vector<int64_t>& d, MlaBatchShape& batch) {
  if (d[0] < 1 || d[1] < 1 || d[2] < 0) return false;
  batch = {.n_seqs = d[0], .query_len = d[1], .past = d[2]};
  return true;
}

// ---------------------------------------------------------------------------------------------------------------
// mla_attention

// An FP8 case's cache: each row of `latent` (random, tile t of a row scaled by kTileMagnitude[(t + row) % 4]) packed
// into its entry, and `latent` replaced by the values the entries hold.
void fp8_latent(MlaAttentionInputs& in) {
  constexpr float kTileMagnitude[] = {1.0f, 1.0f / 64, 40.0f, 0.25f};
  const int64_t rows = in.batch.cache_begin(in.batch.n_seqs), w = in.width(), lora = in.kv_lora_rank;
  const int64_t entry = latent_fp8_bytes(lora, in.rope_dim);
  const LatentFp8Scales scales = in.cache == MlaCacheCase::kFp8Pow2 ? LatentFp8Scales::kPow2 : LatentFp8Scales::kFp32;
  in.latent_fp8.resize(static_cast<size_t>(rows * entry));
  std::vector<float> row(static_cast<size_t>(w)), read(static_cast<size_t>(w));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < w; ++e) {
      row[e] = bf16_to_float(in.latent[r * w + e]) * (e < lora ? kTileMagnitude[(e / kLatentFp8Tile + r) % 4] : 1.0f);
    }
    uint8_t* bytes = &in.latent_fp8[r * entry];
    latent_fp8_pack(row.data(), row.data() + lora, lora, in.rope_dim, scales, bytes);
    latent_fp8_unpack(bytes, lora, in.rope_dim, read.data(), read.data() + lora);
    for (int64_t e = 0; e < w; ++e) in.latent[r * w + e] = float_to_bf16(read[e]);  // exact: bf16 values
  }
}

Expected<std::unique_ptr<OpInputs>> mla_attention_make(const SelfTestCase& c, uint64_t seed) {
  constexpr const char* kLayout =
      "{n_seqs, query_len, past, n_heads, kv_lora_rank, rope_dim, topk, qk_head_dim[, cache 0/1/2]}";
  if (c.dims.size() != 8 && c.dims.size() != 9) return make_error("case '{}' needs dims {}", c.label, kLayout);
  const auto& d = c.dims;
  auto in = std::make_unique<MlaAttentionInputs>();
  if (!batch_of(d, in->batch) || d[3] < 1 || d[4] < 1 || d[5] < 0 || d[6] < 0 || d[7] < 1 ||
      (d.size() == 9 && (d[8] < 0 || d[8] > 2))) {
    return make_error("mla_attention case '{}': bad dims (layout {})", c.label, kLayout);
  }
  in->n_heads = d[3], in->kv_lora_rank = d[4], in->rope_dim = d[5], in->topk = d[6];
  in->scale = 1.0f / std::sqrt(static_cast<float>(d[7]));
  in->cache = d.size() == 9 ? static_cast<MlaCacheCase>(d[8]) : MlaCacheCase::kBf16;
  if (in->cache != MlaCacheCase::kBf16 && (in->kv_lora_rank % kLatentFp8Tile != 0 || in->rope_dim % 2 != 0)) {
    return make_error("mla_attention case '{}': an FP8 cache needs kv_lora_rank a multiple of {} and an even rope_dim",
                      c.label, kLatentFp8Tile);
  }
  const MlaBatchShape& b = in->batch;
  // q at scale 2 spreads the scores over a few units at the models' widths (latent 576, qk_head_dim 256), so the
  // softmax is neither flat nor one-hot.
  in->q = hashed_bf16_vector(seed, 1, b.tokens() * in->n_heads * in->width(), 2.0f);
  in->latent = hashed_bf16_vector(seed, 2, b.cache_begin(b.n_seqs) * in->width(), 1.0f);
  if (in->cache != MlaCacheCase::kBf16) fp8_latent(*in);
  if (in->topk > 0) {
    std::mt19937_64 rng(seed ^ 0x6d6c6173ull);
    in->selected.assign(static_cast<size_t>(b.tokens() * in->topk), -1);
    std::vector<int32_t> keys;
    for (int64_t t = 0; t < b.tokens(); ++t) {
      const int64_t n = b.row_keys(t), m = std::min(in->topk, n);
      keys.resize(static_cast<size_t>(n));
      std::iota(keys.begin(), keys.end(), 0);
      for (int64_t i = 0; i < m; ++i) {  // the first m of a partial Fisher-Yates shuffle, then in order
        std::uniform_int_distribution<int64_t> pick(i, n - 1);
        std::swap(keys[i], keys[pick(rng)]);
      }
      std::sort(keys.begin(), keys.begin() + m);
      std::copy_n(keys.begin(), m, in->selected.begin() + t * in->topk);
    }
  }
  return in;
}

// The keys row t attends: its selection's entries before the -1 tail, or every causal key.
std::vector<int64_t> attended_keys(const MlaAttentionInputs& in, int64_t t) {
  std::vector<int64_t> keys;
  if (in.topk == 0) {
    keys.resize(static_cast<size_t>(in.batch.row_keys(t)));
    std::iota(keys.begin(), keys.end(), 0);
    return keys;
  }
  for (int64_t e = 0; e < in.topk && in.selected[t * in.topk + e] >= 0; ++e)
    keys.push_back(in.selected[t * in.topk + e]);
  return keys;
}

// fp64 dot product of two float vectors (bf16 values widened, so every product is exact), in four interleaved
// partial sums so that the additions do not wait on each other.
double dot_f64(const float* a, const float* b, int64_t n) {
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t e = 0;
  for (; e + 4 <= n; e += 4) {
    for (int64_t i = 0; i < 4; ++i) acc[i] += double(a[e + i]) * double(b[e + i]);
  }
  for (; e < n; ++e) acc[0] += double(a[e]) * double(b[e]);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// Straight from the formula in fp64: scores over the row's keys, max-shifted exponentials, weighted sum of c. Rows
// and heads in parallel (each output element is computed by one thread, so the result does not depend on them).
std::vector<float> mla_attention_reference(const OpInputs& base) {
  const auto& in = static_cast<const MlaAttentionInputs&>(base);
  const MlaBatchShape& b = in.batch;
  const int64_t w = in.width(), lora = in.kv_lora_rank, heads = in.n_heads;
  const std::vector<float> q = widen(in.q), latent = widen(in.latent);
  std::vector<float> out(static_cast<size_t>(in.tokens() * heads * lora));
#pragma omp parallel for schedule(dynamic)
  for (int64_t th = 0; th < in.tokens() * heads; ++th) {
    const int64_t t = th / heads;
    const float* cache = &latent[b.cache_begin(t / b.query_len) * w];
    const float* qh = &q[th * w];
    const std::vector<int64_t> keys = attended_keys(in, t);
    std::vector<double> scores(keys.size()), acc(static_cast<size_t>(lora), 0.0);
    double big = -INFINITY;
    for (size_t j = 0; j < keys.size(); ++j) {
      scores[j] = dot_f64(qh, cache + keys[j] * w, w) * double(in.scale);
      big = std::max(big, scores[j]);
    }
    double sum = 0.0;
    for (size_t j = 0; j < keys.size(); ++j) {
      const double p = std::exp(scores[j] - big);
      sum += p;
      const float* lat = cache + keys[j] * w;
      for (int64_t e = 0; e < lora; ++e) acc[e] += p * lat[e];
    }
    for (int64_t e = 0; e < lora; ++e) out[th * lora + e] = static_cast<float>(acc[e] / sum);
  }
  return out;
}

// fp32, as MlaAttention::attend_absorbed computes one head (its q_lat . c + q_pe . k_pe is one dot over the latent).
Expected<RunOutput> mla_attention_cpu(const OpInputs& base) {
  const auto& in = static_cast<const MlaAttentionInputs&>(base);
  const MlaBatchShape& b = in.batch;
  const int64_t w = in.width(), lora = in.kv_lora_rank;
  const std::vector<float> q = widen(in.q), latent = widen(in.latent);
  RunOutput out{.values = std::vector<float>(static_cast<size_t>(in.tokens() * in.n_heads * lora))};
  poison_f32(out.values);
  const auto start = std::chrono::steady_clock::now();
  std::vector<float> p;
  for (int64_t s = 0; s < b.n_seqs; ++s) {
    const float* cache = &latent[b.cache_begin(s) * w];
    for (int64_t i = 0; i < b.query_len; ++i) {
      const int64_t t = s * b.query_len + i;
      const std::vector<int64_t> keys = attended_keys(in, t);
      for (int64_t h = 0; h < in.n_heads; ++h) {
        const float* qh = &q[(t * in.n_heads + h) * w];
        p.assign(keys.size(), 0.0f);
        float big = -INFINITY;
        for (size_t j = 0; j < keys.size(); ++j) {
          const float* lat = cache + keys[j] * w;
          float dot = 0.0f;
          for (int64_t e = 0; e < w; ++e) dot += qh[e] * lat[e];
          p[j] = dot * in.scale;
          big = std::max(big, p[j]);
        }
        float sum = 0.0f;
        for (float& v : p) sum += (v = std::exp(v - big));
        float* o = &out.values[(t * in.n_heads + h) * lora];
        std::fill(o, o + lora, 0.0f);
        for (size_t j = 0; j < keys.size(); ++j) {
          const float* lat = cache + keys[j] * w;
          const float pj = p[j] / sum;
          for (int64_t e = 0; e < lora; ++e) o[e] += pj * lat[e];
        }
      }
    }
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// indexer_select

// The fp64 scores of row t (of sequence s) over its keys; q and keys widened to float.
std::vector<double> indexer_row_scores(const IndexerSelectInputs& in, const std::vector<float>& q,
                                       const std::vector<float>& keys, int64_t s, int64_t t) {
  const int64_t hd = in.head_dim, n = in.batch.row_keys(t), k0 = in.batch.cache_begin(s);
  const double scale = 1.0 / std::sqrt(double(hd)), head_weight = 1.0 / std::sqrt(double(in.n_heads));
  std::vector<double> scores(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    double sum = 0.0;
    for (int64_t h = 0; h < in.n_heads; ++h) {
      const double dot = dot_f64(&q[(t * in.n_heads + h) * hd], &keys[(k0 + j) * hd], hd);
      sum += double(bf16_to_float(in.weights[t * in.n_heads + h])) * head_weight * std::max(dot * scale, 0.0);
    }
    scores[j] = sum;
  }
  return scores;
}

Expected<std::unique_ptr<OpInputs>> indexer_select_make(const SelfTestCase& c, uint64_t seed) {
  constexpr const char* kLayout = "{n_seqs, query_len, past, n_heads, head_dim, topk}";
  if (c.dims.size() != 6) return make_error("case '{}' needs dims {}", c.label, kLayout);
  const auto& d = c.dims;
  auto in = std::make_unique<IndexerSelectInputs>();
  if (!batch_of(d, in->batch) || d[3] < 1 || d[4] < 1 || d[5] < 1) {
    return make_error("indexer_select case '{}': bad dims (layout {})", c.label, kLayout);
  }
  in->n_heads = d[3], in->head_dim = d[4], in->topk = d[5];
  const MlaBatchShape& b = in->batch;
  const int64_t hd = in->head_dim;
  in->q = hashed_bf16_vector(seed, 11, b.tokens() * in->n_heads * hd, 1.0f);
  in->weights = hashed_bf16_vector(seed, 12, b.tokens() * in->n_heads, 1.0f);  // mixed signs, as weights_proj's
  in->keys = hashed_bf16_vector(seed, 13, b.cache_begin(b.n_seqs) * hd, 1.0f);
  for (int64_t s = 0; s < b.n_seqs; ++s) {
    for (int64_t j = 0; j < b.seq_len(s); ++j) {
      if (!repeats_previous_key(j)) continue;
      const auto row = in->keys.begin() + (b.cache_begin(s) + j) * hd;
      std::copy(row - hd, row, row);
    }
  }
  in->scores.resize(static_cast<size_t>(b.tokens()));
  const std::vector<float> q = widen(in->q), keys = widen(in->keys);
#pragma omp parallel for schedule(dynamic)
  for (int64_t t = 0; t < b.tokens(); ++t) {
    if (b.row_keys(t) > in->topk) in->scores[t] = indexer_row_scores(*in, q, keys, t / b.query_len, t);
  }
  return in;
}

// Every row judged by indexer_select_output: zero error.
std::vector<float> indexer_select_reference(const OpInputs& base) {
  return std::vector<float>(static_cast<size_t>(static_cast<const IndexerSelectInputs&>(base).tokens()), 0.0f);
}

// One row's verdict (see the header): never written, +inf for a broken list, else the relative score gap.
float judge_row(const IndexerSelectInputs& in, int64_t t, const int32_t* sel) {
  const int64_t n = in.batch.row_keys(t), listed = std::min(n, in.topk);
  if (std::find(sel, sel + in.topk, kIndexerSelectPoison) != sel + in.topk) return std::bit_cast<float>(kPoisonF32Bits);
  constexpr float kBroken = std::numeric_limits<float>::infinity();
  for (int64_t e = 0; e < in.topk; ++e) {
    if (e >= listed) {
      if (sel[e] != -1) return kBroken;  // the tail
    } else if (sel[e] < 0 || sel[e] >= n || (e > 0 && sel[e] <= sel[e - 1])) {
      return kBroken;  // out of the causal range, a duplicate or not ascending
    }
  }
  if (n <= in.topk) return 0.0f;  // 0..n-1 exactly, by the checks above
  std::vector<char> chosen(static_cast<size_t>(n), 0);
  for (int64_t e = 0; e < listed; ++e) chosen[sel[e]] = 1;
  for (int64_t e = 0; e < listed; ++e) {
    if (repeats_previous_key(sel[e]) && !chosen[sel[e] - 1]) return kBroken;  // an exact tie given to the later key
  }
  const std::vector<double>& sc = in.scores[t];
  double worst_in = INFINITY, best_out = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    if (chosen[j]) {
      worst_in = std::min(worst_in, sc[j]);
    } else {
      best_out = std::max(best_out, sc[j]);
    }
  }
  const auto [lo, hi] = std::minmax_element(sc.begin(), sc.end());
  const double range = *hi - *lo;
  return range > 0.0 ? static_cast<float>(std::max(0.0, best_out - worst_in) / range) : 0.0f;
}

Expected<RunOutput> indexer_select_cpu_run(const OpInputs& base) {
  const auto& in = static_cast<const IndexerSelectInputs&>(base);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> selected = indexer_select_cpu(in);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return RunOutput{.values = indexer_select_output(in, selected), .seconds = seconds};
}

}  // namespace

int64_t MlaBatchShape::cache_begin(int64_t s) const {
  // sum over r < s of (past + 7 r + query_len)
  return s * (past + query_len) + kMlaCasePastStep * s * (s - 1) / 2;
}

int64_t MlaBatchShape::row_keys(int64_t t) const {
  return seq_past(t / query_len) + t % query_len + 1;
}

std::vector<float> indexer_select_output(const IndexerSelectInputs& in, std::span<const int32_t> selected) {
  std::vector<float> out(static_cast<size_t>(in.tokens()));
  if (selected.size() != static_cast<size_t>(in.tokens() * in.topk)) {
    std::fill(out.begin(), out.end(), std::numeric_limits<float>::infinity());
    return out;
  }
  for (int64_t t = 0; t < in.tokens(); ++t) out[t] = judge_row(in, t, &selected[t * in.topk]);
  return out;
}

// fp32 as MlaAttention::select: per key the heads' weighted relu'd dot products, then a partial sort with ties to
// the earlier key, listed ascending.
std::vector<int32_t> indexer_select_cpu(const IndexerSelectInputs& in) {
  const MlaBatchShape& b = in.batch;
  const int64_t hd = in.head_dim, hn = in.n_heads;
  const std::vector<float> q = widen(in.q), w = widen(in.weights), k = widen(in.keys);
  const float head_weight = 1.0f / std::sqrt(static_cast<float>(hn)), scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<int32_t> out(static_cast<size_t>(in.tokens() * in.topk), -1);
  std::vector<float> score;
  std::vector<int32_t> chosen;
  for (int64_t s = 0; s < b.n_seqs; ++s) {
    const float* keys = &k[b.cache_begin(s) * hd];
    for (int64_t i = 0; i < b.query_len; ++i) {
      const int64_t t = s * b.query_len + i, n = b.row_keys(t);
      chosen.resize(static_cast<size_t>(n));
      std::iota(chosen.begin(), chosen.end(), 0);
      if (n > in.topk) {
        score.assign(static_cast<size_t>(n), 0.0f);
        for (int64_t j = 0; j < n; ++j) {
          float sum = 0.0f;
          for (int64_t h = 0; h < hn; ++h) {
            const float* qh = &q[(t * hn + h) * hd];
            float dot = 0.0f;
            for (int64_t e = 0; e < hd; ++e) dot += qh[e] * keys[j * hd + e];
            sum += w[t * hn + h] * head_weight * std::max(dot * scale, 0.0f);
          }
          score[j] = sum;
        }
        std::partial_sort(chosen.begin(), chosen.begin() + in.topk, chosen.end(),
                          [&](int32_t x, int32_t y) { return score[x] > score[y] || (score[x] == score[y] && x < y); });
        chosen.resize(static_cast<size_t>(in.topk));
        std::sort(chosen.begin(), chosen.end());
      }
      std::copy(chosen.begin(), chosen.end(), out.begin() + t * in.topk);
    }
  }
  return out;
}

Expected<void> mla_register_cpu(Registry& r) {
  TERN_TRY(r.add_harness(
      OpHarness{.op = "mla_attention", .make_inputs = mla_attention_make, .reference = mla_attention_reference}));
  TERN_TRY(r.add_harness(
      OpHarness{.op = "indexer_select", .make_inputs = indexer_select_make, .reference = indexer_select_reference}));
  auto cpu_only = [](const DeviceDescription& d, const SelfTestCase&) -> std::string {
    return d.backend == Backend::kCpu ? "" : "runs on the CPU backend only";
  };
  // fp32 against fp64, as the attention op's CPU implementation: scores, exponentials and sums over a few thousand
  // keys stay far below 1e-5 of the output's scale, which still rejects a wrong scale, key or selection by orders of
  // magnitude.
  constexpr Tolerance kFp32{.rel = 1e-5, .abs = 0.0};
  TERN_TRY(r.add(Implementation{.op = "mla_attention",
                                .name = "cpu",
                                .backend = Backend::kCpu,
                                .tolerance = kFp32,
                                .unsupported_reason = cpu_only,
                                .run = mla_attention_cpu}));
  return r.add(Implementation{.op = "indexer_select",
                              .name = "cpu",
                              .backend = Backend::kCpu,
                              .tolerance = kIndexerSelectTolerance,
                              .unsupported_reason = cpu_only,
                              .run = indexer_select_cpu_run});
}

SelfTestCase mla_attention_case(int64_t n_seqs, int64_t query_len, int64_t past, int64_t n_heads, int64_t kv_lora_rank,
                                int64_t rope_dim, int64_t topk, int64_t qk_head_dim, MlaCacheCase cache) {
  SelfTestCase c{
      fmt::format("seqs={} q={} past={}+7i heads={} lora={} rope={} {} qk={}", n_seqs, query_len, past, n_heads,
                  kv_lora_rank, rope_dim, topk > 0 ? fmt::format("topk={}", topk) : std::string("causal"), qk_head_dim),
      {n_seqs, query_len, past, n_heads, kv_lora_rank, rope_dim, topk, qk_head_dim}};
  if (cache != MlaCacheCase::kBf16) {
    c.label += cache == MlaCacheCase::kFp8 ? " cache=fp8" : " cache=fp8-pow2";
    c.dims.push_back(static_cast<int64_t>(cache));
  }
  return c;
}

SelfTestCase indexer_select_case(int64_t n_seqs, int64_t query_len, int64_t past, int64_t n_heads, int64_t head_dim,
                                 int64_t topk) {
  return {
      fmt::format("seqs={} q={} past={}+7i heads={} hd={} topk={}", n_seqs, query_len, past, n_heads, head_dim, topk),
      {n_seqs, query_len, past, n_heads, head_dim, topk}};
}

}  // namespace tern
