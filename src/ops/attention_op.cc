#include "ops/attention_op.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "core/formats.h"
#include "kernels/cpu/attention.h"

namespace tern {
namespace {

// center + scale * uniform(-1, 1), nudged away from zero, rounded to bf16.
std::vector<uint16_t> random_bf16(std::mt19937_64& rng, int64_t n, float scale) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> out(static_cast<size_t>(n));
  for (auto& v : out) {
    const float x = scale * u(rng);
    v = float_to_bf16(x + (x >= 0.0f ? 1e-3f : -1e-3f));
  }
  return out;
}

std::vector<float> widen(const uint16_t* p, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(p[i]);
  return out;
}

Expected<std::unique_ptr<OpInputs>> attention_make(const SelfTestCase& c, uint64_t seed) {
  constexpr const char* kLayout = "{n_seqs, query_len, past, n_heads, n_kv_heads, head_dim, gated}";
  if (c.dims.size() != 7) return make_error("case '{}' needs dims {}", c.label, kLayout);
  const auto& d = c.dims;
  if (d[0] < 1 || d[1] < 1 || d[2] < 0 || d[3] < 1 || d[4] < 1 || d[3] % d[4] != 0 || d[5] < 2 || d[5] % 2 != 0 ||
      d[6] < 0 || d[6] > 1) {
    return make_error("attention case '{}': bad dims (layout {})", c.label, kLayout);
  }
  auto in = std::make_unique<AttentionInputs>();
  in->n_seqs = d[0], in->query_len = d[1], in->past = d[2], in->n_heads = d[3], in->n_kv_heads = d[4];
  in->head_dim = d[5];
  in->gated = d[6] == 1;
  in->scale = 1.0f / std::sqrt(static_cast<float>(in->head_dim));
  std::mt19937_64 rng(seed ^ 0x61747465ull);
  // q at scale 2 spreads the scores over a few units, so the softmax is neither flat nor one-hot.
  in->q = random_bf16(rng, in->tokens() * in->n_heads * in->head_dim, 2.0f);
  if (in->gated) in->gate = random_bf16(rng, in->tokens() * in->n_heads * in->head_dim, 4.0f);
  const int64_t rows = in->cache_begin(in->n_seqs);
  in->k = random_bf16(rng, rows * in->n_kv_heads * in->head_dim, 1.0f);
  in->v = random_bf16(rng, rows * in->n_kv_heads * in->head_dim, 1.0f);
  return in;
}

// Straight from the formula in fp64: scores, max-shifted exponentials, weighted sum of v, gate.
std::vector<float> attention_reference(const OpInputs& base) {
  const auto& in = static_cast<const AttentionInputs&>(base);
  const int64_t hd = in.head_dim, group = in.n_heads / in.n_kv_heads;
  std::vector<float> out(static_cast<size_t>(in.tokens() * in.n_heads * hd));
  std::vector<double> scores, acc(static_cast<size_t>(hd));
  for (int64_t s = 0; s < in.n_seqs; ++s) {
    const int64_t kv0 = in.cache_begin(s);
    for (int64_t i = 0; i < in.query_len; ++i) {
      const int64_t t = s * in.query_len + i, n_keys = in.seq_past(s) + i + 1;
      for (int64_t h = 0; h < in.n_heads; ++h) {
        const int64_t q_off = (t * in.n_heads + h) * hd, kvh = h / group;
        scores.assign(static_cast<size_t>(n_keys), 0.0);
        double big = -INFINITY;
        for (int64_t j = 0; j < n_keys; ++j) {
          const int64_t k_off = ((kv0 + j) * in.n_kv_heads + kvh) * hd;
          double dot = 0.0;
          for (int64_t e = 0; e < hd; ++e)
            dot += double(bf16_to_float(in.q[q_off + e])) * bf16_to_float(in.k[k_off + e]);
          scores[j] = dot * double(in.scale);
          big = std::max(big, scores[j]);
        }
        double sum = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < n_keys; ++j) {
          const double p = std::exp(scores[j] - big);
          sum += p;
          const int64_t v_off = ((kv0 + j) * in.n_kv_heads + kvh) * hd;
          for (int64_t e = 0; e < hd; ++e) acc[e] += p * bf16_to_float(in.v[v_off + e]);
        }
        for (int64_t e = 0; e < hd; ++e) {
          double y = acc[e] / sum;
          if (in.gated) y /= 1.0 + std::exp(-double(bf16_to_float(in.gate[q_off + e])));
          out[q_off + e] = static_cast<float>(y);
        }
      }
    }
  }
  return out;
}

Expected<RunOutput> attention_cpu(const OpInputs& base) {
  const auto& in = static_cast<const AttentionInputs&>(base);
  const int64_t width = in.n_heads * in.head_dim, kv_width = in.n_kv_heads * in.head_dim;
  const std::vector<float> q = widen(in.q.data(), static_cast<int64_t>(in.q.size()));
  const std::vector<float> k = widen(in.k.data(), static_cast<int64_t>(in.k.size()));
  const std::vector<float> v = widen(in.v.data(), static_cast<int64_t>(in.v.size()));
  RunOutput out{.values = std::vector<float>(static_cast<size_t>(in.tokens() * width))};
  poison_f32(out.values);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < in.n_seqs; ++s) {
    const CpuAttentionShape shape{.n_queries = in.query_len,
                                  .past = in.seq_past(s),
                                  .n_heads = in.n_heads,
                                  .n_kv_heads = in.n_kv_heads,
                                  .head_dim = in.head_dim,
                                  .scale = in.scale};
    const int64_t t0 = s * in.query_len, kv0 = in.cache_begin(s);
    cpu_attention_causal(shape, &q[t0 * width], &k[kv0 * kv_width], &v[kv0 * kv_width], &out.values[t0 * width]);
  }
  if (in.gated) {  // as layers/attention.cc
    for (size_t i = 0; i < out.values.size(); ++i)
      out.values[i] *= 1.0f / (1.0f + std::exp(-bf16_to_float(in.gate[i])));
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace

int64_t AttentionInputs::cache_begin(int64_t s) const {
  // sum over r < s of (past + 7 r + query_len)
  return s * (past + query_len) + kAttentionCasePastStep * s * (s - 1) / 2;
}

Expected<void> attention_register_cpu(Registry& r) {
  TERN_TRY(
      r.add_harness(OpHarness{.op = "attention", .make_inputs = attention_make, .reference = attention_reference}));
  // fp32 against fp64: scores, exponentials and sums over up to ~32k keys stay within ~1e-6 of the output's scale
  // (measured ~1e-7); 1e-5 leaves margin and still rejects a wrong scale, mask or head mapping by orders of magnitude.
  constexpr Tolerance kFp32{.rel = 1e-5, .abs = 0.0};
  return r.add(Implementation{
      .op = "attention",
      .name = "cpu",
      .backend = Backend::kCpu,
      .tolerance = kFp32,
      .unsupported_reason = [](const DeviceDescription& d, const SelfTestCase&) -> std::string {
        return d.backend == Backend::kCpu ? "" : "runs on the CPU backend only";
      },
      .run = attention_cpu,
  });
}

SelfTestCase attention_case(int64_t n_seqs, int64_t query_len, int64_t past, int64_t n_heads, int64_t n_kv_heads,
                            int64_t head_dim, bool gated) {
  return {fmt::format("seqs={} q={} past={}+7i heads={}/{} hd={}{}", n_seqs, query_len, past, n_heads, n_kv_heads,
                      head_dim, gated ? " gated" : ""),
          {n_seqs, query_len, past, n_heads, n_kv_heads, head_dim, gated ? 1 : 0}};
}

}  // namespace tern
