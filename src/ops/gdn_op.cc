#include "ops/gdn_op.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <limits>

#include "core/formats.h"
#include "kernels/cpu/gated_delta.h"
#include "layers/norms.h"
#include "ops/harness_util.h"

namespace tern {
namespace {

// scale * uniform(-1, 1), nudged away from zero (the nudge from stream + 100), rounded to bf16.
std::vector<uint16_t> random_bf16_vector(uint64_t seed, uint64_t stream, int64_t n, float scale) {
  std::vector<uint16_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = hashed_bf16_nudge_stream(seed, stream, i, scale);
  return out;
}

// The op's `count` dims, then optionally a verification flag (0 or 1); returns the flag.
Expected<bool> check_dims(const SelfTestCase& c, size_t count, const char* layout) {
  if (c.dims.size() != count && c.dims.size() != count + 1) {
    return make_error("case '{}' needs dims {} (and optionally a verification flag)", c.label, layout);
  }
  for (size_t i = 0; i < count; ++i) {
    if (c.dims[i] <= 0) return make_error("case '{}': dims {} must be positive", c.label, layout);
  }
  if (c.dims[0] > 4096 || c.dims[1] > 65536) return make_error("case '{}': batch too large", c.label);
  if (c.dims.size() == count) return false;
  if (c.dims[count] != 0 && c.dims[count] != 1) {
    return make_error("case '{}': the verification flag after dims {} must be 0 or 1", c.label, layout);
  }
  return c.dims[count] == 1;
}

template <class F>
RunOutput cpu_run_timed(F&& body) {
  const auto start = std::chrono::steady_clock::now();
  RunOutput out{.values = body()};
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

// The rows of sequence s and whether it starts from zero.
struct SeqRows {
  int64_t begin, len, slot;
  bool fresh;
};
SeqRows seq_rows(const GdnBatch& b, int64_t s) {
  return {b.query_start[s], b.query_start[s + 1] - b.query_start[s], b.state_slot[s], b.seq_past[s] == 0};
}

// ---------------------------------------------------------------------------------------------------------------
// gdn_conv

Expected<std::unique_ptr<OpInputs>> conv_make(const SelfTestCase& c, uint64_t seed) {
  TERN_ASSIGN_OR_RETURN(const bool verify, check_dims(c, 4, "{n_seqs, max_query_len, channels, kernel}"));
  if (c.dims[3] < 2 || c.dims[3] > 8) return make_error("gdn_conv case '{}': kernel must be in [2, 8]", c.label);
  auto in = std::make_unique<GdnConvInputs>();
  in->batch = gdn_batch_make(c.dims[0], c.dims[1], seed, verify);
  in->channels = c.dims[2];
  in->kernel = c.dims[3];
  in->x_stride = in->channels + 24;  // a row stride that is not the width
  in->x = random_bf16_vector(seed, 1, in->batch.tokens * in->x_stride, 2.0f);
  in->weight.resize(static_cast<size_t>(in->channels * in->kernel));
  for (size_t i = 0; i < in->weight.size(); ++i) in->weight[i] = hash_uniform(seed, 2, static_cast<int64_t>(i)) - 0.5f;
  const int64_t hist = in->kernel - 1;
  in->conv_state = random_bf16_vector(seed, 3, in->batch.n_slots * in->channels * hist, 2.0f);
  for (int64_t s = 0; s < in->batch.n_seqs; ++s) {
    const SeqRows r = seq_rows(in->batch, s);
    if (!r.fresh) continue;
    auto first = in->conv_state.begin() + r.slot * in->channels * hist;
    std::fill(first, first + in->channels * hist, uint16_t{0x7FC0});  // NaN: must be ignored
  }
  return in;
}

std::vector<float> conv_reference(const OpInputs& base) {
  const auto& in = static_cast<const GdnConvInputs&>(base);
  const int64_t hist = in.kernel - 1, ch = in.channels, y_size = in.batch.tokens * ch;
  std::vector<float> out(static_cast<size_t>(y_size + in.conv_state.size()));
  for (size_t i = 0; i < in.conv_state.size(); ++i) out[y_size + i] = bf16_to_float(in.conv_state[i]);
  for (int64_t s = 0; s < in.batch.n_seqs; ++s) {
    const SeqRows r = seq_rows(in.batch, s);
    float* state = &out[y_size + r.slot * ch * hist];
    for (int64_t c = 0; c < ch; ++c) {
      std::vector<double> window(static_cast<size_t>(hist + r.len));  // inputs before the rows, then the rows
      for (int64_t j = 0; j < hist; ++j) window[j] = r.fresh ? 0.0 : state[c * hist + j];
      for (int64_t t = 0; t < r.len; ++t) window[hist + t] = bf16_to_float(in.x[(r.begin + t) * in.x_stride + c]);
      for (int64_t t = 0; t < r.len; ++t) {
        double acc = 0.0;
        for (int64_t j = 0; j < in.kernel; ++j) acc += double(in.weight[c * in.kernel + j]) * window[t + j];
        out[(r.begin + t) * ch + c] = static_cast<float>(acc / (1.0 + std::exp(-acc)));
        // A verification row's state: the window after the row.
        if (const int32_t rs = in.batch.row_slot(s, t); rs >= 0) {
          for (int64_t j = 0; j < hist; ++j) out[y_size + (rs * ch + c) * hist + j] = float(window[t + 1 + j]);
        }
      }
      for (int64_t j = 0; j < hist; ++j) state[c * hist + j] = static_cast<float>(window[r.len + j]);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// gdn_delta_rule

Expected<std::unique_ptr<OpInputs>> delta_rule_make(const SelfTestCase& c, uint64_t seed) {
  TERN_ASSIGN_OR_RETURN(const bool verify,
                        check_dims(c, 6, "{n_seqs, max_query_len, n_key_heads, n_value_heads, key_dim, value_dim}"));
  if (c.dims[3] % c.dims[2] != 0) return make_error("gdn_delta_rule case '{}': Hv must be a multiple of Hk", c.label);
  auto in = std::make_unique<GdnDeltaRuleInputs>();
  in->batch = gdn_batch_make(c.dims[0], c.dims[1], seed, verify);
  in->n_key_heads = c.dims[2];
  in->n_value_heads = c.dims[3];
  in->key_dim = c.dims[4];
  in->value_dim = c.dims[5];
  in->qkv_stride = in->width() + 8;
  in->ab_stride = in->n_value_heads + 3;
  const int64_t tokens = in->batch.tokens, hv = in->n_value_heads;
  // q, k, v as SiLU'd conv outputs (mostly within +-2); a, b as raw projections.
  in->qkv = random_bf16_vector(seed, 1, tokens * in->qkv_stride, 2.0f);
  in->a = random_bf16_vector(seed, 2, tokens * in->ab_stride, 3.0f);
  in->b = random_bf16_vector(seed, 3, tokens * in->ab_stride, 4.0f);
  // The checkpoints' ranges (Mamba2-style init): A = exp(A_log) in [1, 16], softplus(dt_bias) in [1e-3, 1e-1],
  // so the per-token decay exp(g) spans ~0.05 .. ~1.
  for (int64_t j = 0; j < hv; ++j) {
    in->a_log.push_back(std::log(1.0f + 15.0f * hash_uniform(seed, 4, j)));
    const float dt = std::exp(std::log(1e-3f) + hash_uniform(seed, 5, j) * std::log(100.0f));
    in->dt_bias.push_back(std::log(std::expm1(dt)));
  }
  const int64_t head_state = in->key_dim * in->value_dim, slot_state = hv * head_state;
  in->state.resize(static_cast<size_t>(in->batch.n_slots * slot_state));
  for (size_t i = 0; i < in->state.size(); ++i) in->state[i] = hash_uniform(seed, 6, int64_t(i)) - 0.5f;
  for (int64_t s = 0; s < in->batch.n_seqs; ++s) {
    const SeqRows r = seq_rows(in->batch, s);
    if (!r.fresh) continue;
    std::fill_n(in->state.begin() + r.slot * slot_state, slot_state, std::numeric_limits<float>::quiet_NaN());
  }
  return in;
}

double softplus_f64(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

// One token of one head in fp64: S = S e^g; delta = beta (v - S^T k); S += k delta^T; o = S^T q.
void delta_rule_step_f64(std::vector<double>& s, const std::vector<double>& q, const std::vector<double>& k,
                         const uint16_t* v, double decay, double beta, int64_t dv, float* o) {
  const int64_t dk = static_cast<int64_t>(q.size());
  for (double& x : s) x *= decay;
  for (int64_t e = 0; e < dv; ++e) {
    double kv = 0.0;
    for (int64_t d = 0; d < dk; ++d) kv += s[d * dv + e] * k[d];
    const double delta = beta * (double(bf16_to_float(v[e])) - kv);
    double acc = 0.0;
    for (int64_t d = 0; d < dk; ++d) {
      s[d * dv + e] += k[d] * delta;
      acc += s[d * dv + e] * q[d];
    }
    o[e] = static_cast<float>(acc);
  }
}

// x * rsqrt(sum x^2 + 1e-6) * scale in fp64.
std::vector<double> l2norm_f64(const uint16_t* x, int64_t n, double scale) {
  std::vector<double> out(static_cast<size_t>(n));
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += double(bf16_to_float(x[i])) * bf16_to_float(x[i]);
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(x[i]) / std::sqrt(sum + 1e-6) * scale;
  return out;
}

std::vector<float> delta_rule_reference(const OpInputs& base) {
  const auto& in = static_cast<const GdnDeltaRuleInputs&>(base);
  const int64_t hk = in.n_key_heads, hv = in.n_value_heads, dk = in.key_dim, dv = in.value_dim;
  const int64_t out_size = in.batch.tokens * hv * dv, head_state = dk * dv;
  std::vector<float> out(static_cast<size_t>(out_size) + in.state.size());
  std::copy(in.state.begin(), in.state.end(), out.begin() + out_size);
  for (int64_t s = 0; s < in.batch.n_seqs; ++s) {
    const SeqRows r = seq_rows(in.batch, s);
    for (int64_t j = 0; j < hv; ++j) {
      float* slot = &out[out_size + (r.slot * hv + j) * head_state];
      std::vector<double> st(static_cast<size_t>(head_state), 0.0);
      if (!r.fresh) std::copy(slot, slot + head_state, st.begin());
      const int64_t kh = j / (hv / hk);
      const double a_coef = -std::exp(double(in.a_log[j]));
      for (int64_t t = r.begin; t < r.begin + r.len; ++t) {
        const uint16_t* row = &in.qkv[t * in.qkv_stride];
        const auto q = l2norm_f64(row + kh * dk, dk, 1.0 / std::sqrt(double(dk)));
        const auto k = l2norm_f64(row + hk * dk + kh * dk, dk, 1.0);
        const double g = a_coef * softplus_f64(double(bf16_to_float(in.a[t * in.ab_stride + j])) + in.dt_bias[j]);
        const double beta = 1.0 / (1.0 + std::exp(-double(bf16_to_float(in.b[t * in.ab_stride + j]))));
        delta_rule_step_f64(st, q, k, row + 2 * hk * dk + j * dv, std::exp(g), beta, dv, &out[(t * hv + j) * dv]);
        if (const int32_t rs = in.batch.row_slot(s, t - r.begin); rs >= 0) {
          float* row_state = &out[out_size + (rs * hv + j) * head_state];
          for (int64_t i = 0; i < head_state; ++i) row_state[i] = static_cast<float>(st[i]);
        }
      }
      for (int64_t i = 0; i < head_state; ++i) slot[i] = static_cast<float>(st[i]);
    }
  }
  return out;
}

// layers/gated_deltanet.cc's preparation in fp32: q, k l2-normalised per head (q then scaled), g and beta.
void delta_rule_prepare_f32(const GdnDeltaRuleInputs& in, const SeqRows& r, std::vector<float>& qkv,
                            std::vector<float>& g, std::vector<float>& beta) {
  const int64_t hk = in.n_key_heads, hv = in.n_value_heads, dk = in.key_dim, w = in.width();
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  auto softplus = [](float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); };
  qkv.assign(static_cast<size_t>(r.len * w), 0.0f);
  g.assign(static_cast<size_t>(r.len * hv), 0.0f);
  beta.assign(g.size(), 0.0f);
  for (int64_t t = 0; t < r.len; ++t) {
    float* row = &qkv[t * w];
    for (int64_t c = 0; c < w; ++c) row[c] = bf16_to_float(in.qkv[(r.begin + t) * in.qkv_stride + c]);
    for (int64_t h = 0; h < 2 * hk; ++h) {  // q heads then k heads
      float* x = row + h * dk;
      float sum = 0.0f;
      for (int64_t i = 0; i < dk; ++i) sum += x[i] * x[i];
      const float inv = 1.0f / std::sqrt(sum + 1e-6f), scale = h < hk ? q_scale : 1.0f;
      for (int64_t i = 0; i < dk; ++i) x[i] = x[i] * inv * scale;
    }
    for (int64_t j = 0; j < hv; ++j) {
      const int64_t ab = (r.begin + t) * in.ab_stride + j;
      beta[t * hv + j] = 1.0f / (1.0f + std::exp(-bf16_to_float(in.b[ab])));
      g[t * hv + j] = -std::exp(in.a_log[j]) * softplus(bf16_to_float(in.a[ab]) + in.dt_bias[j]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// gdn_delta_rule_norm

Expected<std::unique_ptr<OpInputs>> delta_rule_norm_make(const SelfTestCase& c, uint64_t seed) {
  TERN_ASSIGN_OR_RETURN(std::unique_ptr<OpInputs> base, delta_rule_make(c, seed));
  auto in = std::make_unique<GdnDeltaRuleNormInputs>();
  static_cast<GdnDeltaRuleInputs&>(*in) = std::move(static_cast<GdnDeltaRuleInputs&>(*base));
  const int64_t width = in->n_value_heads * in->value_dim;
  in->gate_stride = width + 16;  // z sits in a wider projection row, as in the model
  in->gate = random_bf16_vector(seed, 7, in->batch.tokens * in->gate_stride, 4.0f);
  in->weight.resize(static_cast<size_t>(in->value_dim));
  for (int64_t e = 0; e < in->value_dim; ++e) in->weight[e] = float_to_bf16(0.5f + hash_uniform(seed, 8, e));
  return in;
}

// The delta rule's fp64 reference, then the gated norm of every [dv] row of its output in fp64.
std::vector<float> delta_rule_norm_reference(const OpInputs& base) {
  const auto& in = static_cast<const GdnDeltaRuleNormInputs&>(base);
  std::vector<float> out = delta_rule_reference(in);
  const int64_t hv = in.n_value_heads, dv = in.value_dim;
  for (int64_t t = 0; t < in.batch.tokens; ++t) {
    for (int64_t j = 0; j < hv; ++j) {
      float* row = &out[(t * hv + j) * dv];
      double sum = 0.0;
      for (int64_t e = 0; e < dv; ++e) sum += double(row[e]) * row[e];
      const double inv = 1.0 / std::sqrt(sum / double(dv) + double(in.eps));
      for (int64_t e = 0; e < dv; ++e) {
        const double z = bf16_to_float(in.gate[t * in.gate_stride + j * dv + e]);
        row[e] = static_cast<float>(row[e] * inv * bf16_to_float(in.weight[e]) * (z / (1.0 + std::exp(-z))));
      }
    }
  }
  return out;
}

// The CPU path: its delta rule, then layers' gated_rms_norm on the output rows.
std::vector<float> delta_rule_norm_cpu(const OpInputs& base) {
  const auto& in = static_cast<const GdnDeltaRuleNormInputs&>(base);
  std::vector<float> out = gdn_delta_rule_cpu(in);
  const int64_t width = in.n_value_heads * in.value_dim;
  std::vector<float> z(static_cast<size_t>(in.batch.tokens * width)), weight(static_cast<size_t>(in.value_dim));
  for (int64_t t = 0; t < in.batch.tokens; ++t) {
    for (int64_t i = 0; i < width; ++i) z[t * width + i] = bf16_to_float(in.gate[t * in.gate_stride + i]);
  }
  for (int64_t e = 0; e < in.value_dim; ++e) weight[e] = bf16_to_float(in.weight[e]);
  gated_rms_norm(out.data(), z.data(), in.batch.tokens * in.n_value_heads, weight, in.eps, out.data());
  return out;
}

std::string cpu_only(const DeviceDescription& d, const SelfTestCase&) {
  return d.backend == Backend::kCpu ? "" : "runs on the CPU backend only";
}

Expected<void> add_op(Registry& r, std::string op, decltype(OpHarness::make_inputs) make,
                      decltype(OpHarness::reference) reference, Tolerance tolerance,
                      std::function<std::vector<float>(const OpInputs&)> run) {
  TERN_TRY(r.add_harness(OpHarness{.op = op, .make_inputs = std::move(make), .reference = std::move(reference)}));
  return r.add(Implementation{.op = op, .name = "cpu", .backend = Backend::kCpu, .tolerance = tolerance,
                              .unsupported_reason = cpu_only,
                              .run = [run = std::move(run)](const OpInputs& in) -> Expected<RunOutput> {
                                return cpu_run_timed([&] { return run(in); });
                              }});
}

}  // namespace

GdnBatch gdn_batch_make(int64_t n_seqs, int64_t max_query_len, uint64_t seed, bool verify) {
  GdnBatch b{.n_seqs = n_seqs, .max_query_len = max_query_len, .n_slots = n_seqs + 1};
  b.query_start.push_back(0);
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t len = s == 0 ? max_query_len : 1 + static_cast<int64_t>(hash_bits(seed, 50, s) % max_query_len);
    b.query_start.push_back(static_cast<int32_t>(b.query_start.back() + len));
    b.state_slot.push_back(static_cast<int32_t>(n_seqs - s));
    const bool continues = verify || s % 2 == 1;
    b.seq_past.push_back(continues ? static_cast<int32_t>(3 + hash_bits(seed, 51, s) % 1000) : 0);
  }
  b.tokens = b.query_start.back();
  if (verify) {
    // The even sequences verify; their row slots follow the sequences' slots, max_rows of them each.
    b.max_rows = max_query_len;
    b.row_slots.assign(static_cast<size_t>(n_seqs * max_query_len), -1);
    for (int64_t s = 0; s < n_seqs; s += 2) {
      for (int64_t t = 0; t < max_query_len; ++t) {
        b.row_slots[s * max_query_len + t] = static_cast<int32_t>(b.n_slots++);
      }
    }
  }
  return b;
}

std::vector<float> gdn_conv_cpu(const GdnConvInputs& in) {
  const int64_t hist = in.kernel - 1, ch = in.channels, y_size = in.batch.tokens * ch;
  std::vector<float> out(static_cast<size_t>(y_size + in.conv_state.size()));
  for (size_t i = 0; i < in.conv_state.size(); ++i) out[y_size + i] = bf16_to_float(in.conv_state[i]);
  for (int64_t s = 0; s < in.batch.n_seqs; ++s) {
    const SeqRows r = seq_rows(in.batch, s);
    float* state = &out[y_size + r.slot * ch * hist];
    if (r.fresh) std::fill_n(state, ch * hist, 0.0f);
    std::vector<float> x(static_cast<size_t>(r.len * in.x_stride));
    for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_to_float(in.x[r.begin * in.x_stride + int64_t(i)]);
    // A verification runs row by row, the state after each copied to the row's slot.
    const int64_t step = in.batch.row_slot(s, 0) < 0 ? r.len : 1;
    for (int64_t t = 0; t < r.len; t += step) {
      cpu_causal_conv1d_silu(&x[t * in.x_stride], in.x_stride, step, ch, in.weight.data(), in.kernel, state,
                             &out[(r.begin + t) * ch]);
      if (const int32_t rs = in.batch.row_slot(s, t); step == 1 && rs >= 0) {
        std::copy_n(state, ch * hist, &out[y_size + rs * ch * hist]);
      }
    }
  }
  return out;
}

std::vector<float> gdn_delta_rule_cpu(const GdnDeltaRuleInputs& in) {
  const int64_t hk = in.n_key_heads, hv = in.n_value_heads, dk = in.key_dim, dv = in.value_dim, w = in.width();
  const int64_t out_size = in.batch.tokens * hv * dv, slot_state = hv * dk * dv;
  std::vector<float> out(static_cast<size_t>(out_size) + in.state.size());
  std::copy(in.state.begin(), in.state.end(), out.begin() + out_size);
  std::vector<float> qkv, g, beta;
  for (int64_t s = 0; s < in.batch.n_seqs; ++s) {
    const SeqRows r = seq_rows(in.batch, s);
    float* state = &out[out_size + r.slot * slot_state];
    if (r.fresh) std::fill_n(state, slot_state, 0.0f);
    delta_rule_prepare_f32(in, r, qkv, g, beta);
    // A verification runs row by row, the state after each copied to the row's slot.
    const int64_t step = in.batch.row_slot(s, 0) < 0 ? r.len : 1;
    for (int64_t t = 0; t < r.len; t += step) {
      const CpuGatedDeltaShape shape{.n_tokens = step, .n_key_heads = hk, .n_value_heads = hv, .key_dim = dk,
                                     .value_dim = dv};
      const float* q = &qkv[t * w];
      cpu_gated_delta_rule(shape, q, q + hk * dk, w, q + 2 * hk * dk, w, &g[t * hv], &beta[t * hv], state,
                           &out[(r.begin + t) * hv * dv]);
      if (const int32_t rs = in.batch.row_slot(s, t); step == 1 && rs >= 0) {
        std::copy_n(state, slot_state, &out[out_size + rs * slot_state]);
      }
    }
  }
  return out;
}

Expected<void> gdn_register_cpu(Registry& r) {
  // fp32 against fp64: the conv is a few products per output (1e-6 relative); the recurrence's fp32 state
  // carries rounding from token to token, but each step contracts S (decay <= 1, I - beta k k^T has norm <= 1),
  // so errors do not grow: ~1e-6 of the state's scale per token at most, far below 2^-16.
  constexpr Tolerance kConvFp32{.rel = 1e-5, .abs = 0.0};
  constexpr Tolerance kDeltaFp32{.rel = 1.0 / 65536, .abs = 0.0};
  TERN_TRY(add_op(r, "gdn_conv", conv_make, conv_reference, kConvFp32, [](const OpInputs& b) {
    return gdn_conv_cpu(static_cast<const GdnConvInputs&>(b));
  }));
  TERN_TRY(add_op(r, "gdn_delta_rule_norm", delta_rule_norm_make, delta_rule_norm_reference, kDeltaFp32,
                  delta_rule_norm_cpu));
  TERN_TRY(add_op(r, "gdn_delta_rule", delta_rule_make, delta_rule_reference, kDeltaFp32, [](const OpInputs& b) {
    return gdn_delta_rule_cpu(static_cast<const GdnDeltaRuleInputs&>(b));
  }));
  return {};
}

SelfTestCase gdn_conv_case(int64_t n_seqs, int64_t max_query_len, int64_t channels, int64_t kernel, bool verify) {
  SelfTestCase c{fmt::format("seqs={} T<={} C={} K={}{}", n_seqs, max_query_len, channels, kernel,
                             verify ? " verify" : ""),
                 {n_seqs, max_query_len, channels, kernel}};
  if (verify) c.dims.push_back(1);
  c.in_fast = verify;  // the kernels' verification instances: no other case reaches them
  return c;
}

SelfTestCase gdn_delta_rule_case(int64_t n_seqs, int64_t max_query_len, int64_t n_key_heads, int64_t n_value_heads,
                                 int64_t key_dim, int64_t value_dim, bool verify) {
  SelfTestCase c{fmt::format("seqs={} T<={} Hk={} Hv={} dk={} dv={}{}", n_seqs, max_query_len, n_key_heads,
                             n_value_heads, key_dim, value_dim, verify ? " verify" : ""),
                 {n_seqs, max_query_len, n_key_heads, n_value_heads, key_dim, value_dim}};
  if (verify) c.dims.push_back(1);
  c.in_fast = verify;
  return c;
}

}  // namespace tern
