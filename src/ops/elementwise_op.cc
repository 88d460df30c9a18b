#include "ops/elementwise_op.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>

#include "core/formats.h"
#include "layers/norms.h"
#include "layers/rope.h"
#include "ops/harness_util.h"

namespace tern {
namespace {

std::vector<float> widen(const std::vector<uint16_t>& bf16) {
  std::vector<float> out(bf16.size());
  for (size_t i = 0; i < bf16.size(); ++i) out[i] = bf16_to_float(bf16[i]);
  return out;
}

double silu_f64(double x) { return x / (1.0 + std::exp(-x)); }

Expected<void> check_dims(const SelfTestCase& c, size_t count, const char* layout) {
  if (c.dims.size() != count) return make_error("case '{}' needs dims {}", c.label, layout);
  for (size_t i = 0; i < count; ++i) {
    if (c.dims[i] < 0) return make_error("case '{}': negative dim in {}", c.label, layout);
  }
  return {};
}

// Runs a CPU implementation into a poisoned output and times it.
template <class F>
RunOutput cpu_run_timed(size_t count, F&& body) {
  RunOutput out{.values = std::vector<float>(count)};
  poison_f32(out.values);
  const auto start = std::chrono::steady_clock::now();
  body(out.values.data());
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// rms_norm

Expected<std::unique_ptr<OpInputs>> rms_norm_make(const SelfTestCase& c, uint64_t seed) {
  TERN_TRY(check_dims(c, 5, "{tokens, heads, dim, form, residual}"));
  if (c.dims[2] == 0 || c.dims[3] > 2 || c.dims[4] > 1) return make_error("rms_norm case '{}': bad dims", c.label);
  auto in = std::make_unique<RmsNormInputs>();
  in->rows = c.dims[0] * c.dims[1];
  in->dim = c.dims[2];
  in->form = static_cast<RmsNormForm>(c.dims[3]);
  in->residual = c.dims[4] == 1;
  const int64_t n = in->rows * in->dim;
  in->x = hashed_bf16_vector(seed, 1, n, 2.0f);
  if (in->residual) in->residual_in = hashed_bf16_vector(seed, 2, n, 2.0f);
  if (in->form == RmsNormForm::kGated) in->gate = hashed_bf16_vector(seed, 3, n, 4.0f);
  // Zero-centred checkpoints store small offsets from 1; plain weights sit around 1.
  const bool centred = in->form == RmsNormForm::kZeroCentred;
  in->weight = hashed_bf16_vector(seed, 4, in->dim, 0.5f, centred ? 0.0f : 1.0f);
  return in;
}

std::vector<float> rms_norm_reference(const OpInputs& base) {
  const auto& in = static_cast<const RmsNormInputs&>(base);
  const int64_t n = in.rows * in.dim;
  std::vector<float> out(static_cast<size_t>(in.residual ? 2 * n : n));
  float* y = out.data() + (in.residual ? n : 0);
  const double offset = in.form == RmsNormForm::kZeroCentred ? 1.0 : 0.0;
  std::vector<double> h(static_cast<size_t>(in.dim));
  for (int64_t r = 0; r < in.rows; ++r) {
    double sum = 0.0;
    for (int64_t i = 0; i < in.dim; ++i) {
      const int64_t e = r * in.dim + i;
      h[i] = double(bf16_to_float(in.x[e])) + (in.residual ? double(bf16_to_float(in.residual_in[e])) : 0.0);
      if (in.residual) out[e] = static_cast<float>(h[i]);
      sum += h[i] * h[i];
    }
    const double inv = 1.0 / std::sqrt(sum / double(in.dim) + double(in.eps));
    for (int64_t i = 0; i < in.dim; ++i) {
      const int64_t e = r * in.dim + i;
      double v = (offset + bf16_to_float(in.weight[i])) * h[i] * inv;
      if (in.form == RmsNormForm::kGated) v *= silu_f64(bf16_to_float(in.gate[e]));
      y[e] = static_cast<float>(v);
    }
  }
  return out;
}

Expected<RunOutput> rms_norm_cpu(const OpInputs& base) {
  const auto& in = static_cast<const RmsNormInputs&>(base);
  const int64_t n = in.rows * in.dim;
  std::vector<float> h = widen(in.x);
  if (in.residual) {
    const std::vector<float> r = widen(in.residual_in);
    for (int64_t i = 0; i < n; ++i) h[i] += r[i];
  }
  const std::vector<float> z = widen(in.gate), w = widen(in.weight);
  return cpu_run_timed(static_cast<size_t>(in.residual ? 2 * n : n), [&](float* out) {
    float* y = out;
    if (in.residual) {
      std::copy(h.begin(), h.end(), out);
      y = out + n;
    }
    if (in.form == RmsNormForm::kGated) {
      gated_rms_norm(h.data(), z.data(), in.rows, w, in.eps, y);
    } else {
      const RmsNorm norm{.weight = w, .eps = in.eps, .zero_centred = in.form == RmsNormForm::kZeroCentred};
      norm.forward(h.data(), in.rows, y);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// rope

Expected<std::unique_ptr<OpInputs>> rope_make(const SelfTestCase& c, uint64_t seed) {
  TERN_TRY(check_dims(c, 6, "{tokens, heads, head_dim, rotary_dim, interleaved, theta}"));
  const auto& d = c.dims;
  if (d[1] == 0 || d[2] == 0 || d[2] % 2 || d[3] == 0 || d[3] % 2 || d[3] > d[2] || d[4] > 1 || d[5] < 2) {
    return make_error("rope case '{}': bad dims", c.label);
  }
  auto in = std::make_unique<RopeInputs>();
  in->tokens = d[0];
  in->n_heads = d[1];
  in->head_dim = d[2];
  in->rotary_dim = d[3];
  in->interleaved = d[4] == 1;
  in->theta = static_cast<double>(d[5]);
  in->x = hashed_bf16_vector(seed, 1, in->tokens * in->n_heads * in->head_dim, 2.0f);
  // Positions up to 2^17 so the angles reach the large-argument range of sin/cos.
  for (int64_t t = 0; t < in->tokens; ++t) in->positions.push_back(static_cast<int32_t>(hash_bits(seed, 2, t) >> 47));
  return in;
}

// The two dims of rotation pair i.
std::pair<int64_t, int64_t> rope_pair(const RopeInputs& in, int64_t i) {
  return in.interleaved ? std::pair{2 * i, 2 * i + 1} : std::pair{i, i + in.rotary_dim / 2};
}

std::vector<float> rope_reference(const OpInputs& base) {
  const auto& in = static_cast<const RopeInputs&>(base);
  std::vector<float> out = widen(in.x);  // pass-through dims stay as they are
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int64_t i = 0; i < in.rotary_dim / 2; ++i) {
      const double angle = rope_reference_angle(in.positions[t], i, in.rotary_dim, in.theta);
      const double c = std::cos(angle), s = std::sin(angle);
      const auto [lo, hi] = rope_pair(in, i);
      for (int64_t h = 0; h < in.n_heads; ++h) {
        const int64_t base_index = (t * in.n_heads + h) * in.head_dim;
        const double u = bf16_to_float(in.x[base_index + lo]), v = bf16_to_float(in.x[base_index + hi]);
        out[base_index + lo] = static_cast<float>(u * c - v * s);
        out[base_index + hi] = static_cast<float>(v * c + u * s);
      }
    }
  }
  return out;
}

Expected<RunOutput> rope_cpu(const OpInputs& base) {
  const auto& in = static_cast<const RopeInputs&>(base);
  const std::vector<float> x = widen(in.x);
  const Rope neox(in.rotary_dim, in.theta);
  const int64_t token_size = in.n_heads * in.head_dim;
  return cpu_run_timed(x.size(), [&](float* y) {
    std::copy(x.begin(), x.end(), y);
    for (int64_t t = 0; t < in.tokens; ++t) {
      float* v = y + t * token_size;
      if (!in.interleaved) {
        neox.apply(v, in.n_heads, in.head_dim, in.positions[t]);
        continue;
      }
      // layers/rope has only the NeoX layout; the interleaved one rotates (2i, 2i + 1) with the same fp32 math.
      for (int64_t i = 0; i < in.rotary_dim / 2; ++i) {
        const double angle = rope_reference_angle(in.positions[t], i, in.rotary_dim, in.theta);
        const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
        for (int64_t h = 0; h < in.n_heads; ++h) {
          float* p = v + h * in.head_dim + 2 * i;
          const float a = p[0], b = p[1];
          p[0] = a * c - b * s;
          p[1] = b * c + a * s;
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// silu_mul, embedding, residual_add

Expected<std::unique_ptr<OpInputs>> silu_mul_make(const SelfTestCase& c, uint64_t seed) {
  TERN_TRY(check_dims(c, 2, "{tokens, inter}"));
  auto in = std::make_unique<SiluMulInputs>();
  in->rows = c.dims[0];
  in->inter = c.dims[1];
  // Gates over +-6 cover silu's linear, curved and vanishing regions.
  const std::vector<uint16_t> gate = hashed_bf16_vector(seed, 1, in->rows * in->inter, 6.0f);
  const std::vector<uint16_t> up = hashed_bf16_vector(seed, 2, in->rows * in->inter, 2.0f);
  for (int64_t r = 0; r < in->rows; ++r) {
    in->gate_up.insert(in->gate_up.end(), gate.begin() + r * in->inter, gate.begin() + (r + 1) * in->inter);
    in->gate_up.insert(in->gate_up.end(), up.begin() + r * in->inter, up.begin() + (r + 1) * in->inter);
  }
  return in;
}

template <class F>
void silu_mul_apply(const SiluMulInputs& in, float* out, F&& silu_times) {
  for (int64_t r = 0; r < in.rows; ++r) {
    for (int64_t i = 0; i < in.inter; ++i) {
      const float g = bf16_to_float(in.gate_up[r * 2 * in.inter + i]);
      const float u = bf16_to_float(in.gate_up[r * 2 * in.inter + in.inter + i]);
      out[r * in.inter + i] = silu_times(g, u);
    }
  }
}

constexpr uint16_t kBf16QuietNan = 0x7FC0;

Expected<std::unique_ptr<OpInputs>> embedding_make(const SelfTestCase& c, uint64_t seed) {
  TERN_TRY(check_dims(c, 3, "{tokens, vocab, hidden}"));
  if (c.dims[1] == 0 || c.dims[1] > INT32_MAX) return make_error("embedding case '{}': bad vocab", c.label);
  auto in = std::make_unique<EmbeddingInputs>();
  in->tokens = c.dims[0];
  in->vocab = c.dims[1];
  in->hidden = c.dims[2];
  for (int64_t t = 0; t < in->tokens; ++t) {
    in->ids.push_back(static_cast<int32_t>(hash_bits(seed, 2, t) % static_cast<uint64_t>(in->vocab)));
  }
  // The first and last rows of the table are the edges a range check gets wrong.
  if (in->tokens >= 2) {
    in->ids.front() = static_cast<int32_t>(in->vocab - 1);
    in->ids.back() = 0;
  }
  // Only the rows looked up get random values; every other row is NaN, so reading a wrong row cannot pass (and a
  // real vocabulary of 250k rows costs no more than the rows a case reads).
  in->table.assign(static_cast<size_t>(in->vocab * in->hidden), kBf16QuietNan);
  for (int64_t t = 0; t < in->tokens; ++t) {
    const std::vector<uint16_t> row = hashed_bf16_vector(seed ^ static_cast<uint64_t>(in->ids[t]), 1, in->hidden, 0.1f);
    std::copy(row.begin(), row.end(), in->table.begin() + in->ids[t] * in->hidden);
  }
  return in;
}

std::vector<float> embedding_reference(const OpInputs& base) {
  const auto& in = static_cast<const EmbeddingInputs&>(base);
  std::vector<float> out(static_cast<size_t>(in.tokens * in.hidden));
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int64_t i = 0; i < in.hidden; ++i) out[t * in.hidden + i] = bf16_to_float(in.table[in.ids[t] * in.hidden + i]);
  }
  return out;
}

Expected<RunOutput> embedding_cpu(const OpInputs& base) {
  const auto& in = static_cast<const EmbeddingInputs&>(base);
  for (int64_t t = 0; t < in.tokens; ++t) {
    if (in.ids[t] < 0 || in.ids[t] >= in.vocab) {
      return make_error("embedding: token {} has id {} outside the vocabulary [0, {})", t, in.ids[t], in.vocab);
    }
  }
  return cpu_run_timed(static_cast<size_t>(in.tokens * in.hidden), [&](float* y) {
    for (int64_t t = 0; t < in.tokens; ++t) {
      for (int64_t i = 0; i < in.hidden; ++i) y[t * in.hidden + i] = bf16_to_float(in.table[in.ids[t] * in.hidden + i]);
    }
  });
}

Expected<std::unique_ptr<OpInputs>> residual_add_make(const SelfTestCase& c, uint64_t seed) {
  TERN_TRY(check_dims(c, 2, "{tokens, hidden}"));
  auto in = std::make_unique<ResidualAddInputs>();
  in->n = c.dims[0] * c.dims[1];
  in->a = hashed_bf16_vector(seed, 1, in->n, 2.0f);
  in->b = hashed_bf16_vector(seed, 2, in->n, 2.0f);
  return in;
}

std::string cpu_only(const DeviceDescription& d, const SelfTestCase&) {
  return d.backend == Backend::kCpu ? "" : "runs on the CPU backend only";
}

Expected<void> add_op(Registry& r, std::string op, decltype(OpHarness::make_inputs) make,
                      decltype(OpHarness::reference) reference, Tolerance tolerance,
                      std::function<Expected<RunOutput>(const OpInputs&)> run) {
  TERN_TRY(r.add_harness(OpHarness{.op = op, .make_inputs = std::move(make), .reference = std::move(reference)}));
  return r.add(Implementation{.op = op, .name = "cpu", .backend = Backend::kCpu, .tolerance = tolerance,
                              .unsupported_reason = cpu_only, .run = std::move(run)});
}

}  // namespace

float rope_reference_angle(int64_t position, int64_t i, int64_t rotary_dim, double theta) {
  const float exponent = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
  const float inv_freq = 1.0f / std::pow(static_cast<float>(theta), exponent);
  return static_cast<float>(position) * inv_freq;
}

Expected<void> elementwise_register_cpu(Registry& r) {
  // fp32 math against fp64: a row's sum of squares (up to 16k terms) and a few products stay within ~1e-6 of the
  // output's scale; 1e-5 leaves margin and still rejects any wrong formula by orders of magnitude.
  constexpr Tolerance kFp32{.rel = 1e-5, .abs = 0.0};
  TERN_TRY(add_op(r, "rms_norm", rms_norm_make, rms_norm_reference, kFp32, rms_norm_cpu));
  TERN_TRY(add_op(r, "rope", rope_make, rope_reference, kFp32, rope_cpu));
  TERN_TRY(add_op(
      r, "silu_mul", silu_mul_make,
      [](const OpInputs& b) {
        const auto& in = static_cast<const SiluMulInputs&>(b);
        std::vector<float> out(static_cast<size_t>(in.rows * in.inter));
        silu_mul_apply(in, out.data(), [](float g, float u) { return static_cast<float>(silu_f64(g) * double(u)); });
        return out;
      },
      kFp32,
      [](const OpInputs& b) -> Expected<RunOutput> {
        const auto& in = static_cast<const SiluMulInputs&>(b);
        return cpu_run_timed(static_cast<size_t>(in.rows * in.inter), [&](float* y) {
          silu_mul_apply(in, y, [](float g, float u) { return silu(g) * u; });  // layers/moe.cc's form
        });
      }));
  // A copy: exact in any format.
  TERN_TRY(add_op(r, "embedding", embedding_make, embedding_reference, Tolerance{}, embedding_cpu));
  TERN_TRY(add_op(
      r, "residual_add", residual_add_make,
      [](const OpInputs& b) {
        const auto& in = static_cast<const ResidualAddInputs&>(b);
        std::vector<float> out(static_cast<size_t>(in.n));
        for (int64_t i = 0; i < in.n; ++i) out[i] = float(double(bf16_to_float(in.a[i])) + bf16_to_float(in.b[i]));
        return out;
      },
      kFp32,
      [](const OpInputs& b) -> Expected<RunOutput> {
        const auto& in = static_cast<const ResidualAddInputs&>(b);
        const std::vector<float> a = widen(in.a), c = widen(in.b);
        return cpu_run_timed(a.size(), [&](float* y) {
          for (size_t i = 0; i < a.size(); ++i) y[i] = a[i] + c[i];
        });
      }));
  return {};
}

SelfTestCase rms_norm_case(int64_t tokens, int64_t heads, int64_t dim, RmsNormForm form, bool residual) {
  static constexpr const char* kForms[] = {"plain", "zero-centred", "gated"};
  return {fmt::format("T={} heads={} dim={} {}{}", tokens, heads, dim, kForms[static_cast<int>(form)],
                      residual ? " +residual" : ""),
          {tokens, heads, dim, static_cast<int64_t>(form), residual ? 1 : 0}};
}

SelfTestCase rope_case(int64_t tokens, int64_t heads, int64_t head_dim, int64_t rotary_dim, bool interleaved,
                       int64_t theta) {
  return {fmt::format("T={} heads={} head_dim={} rotary={} {} theta={}", tokens, heads, head_dim, rotary_dim,
                      interleaved ? "interleaved" : "neox", theta),
          {tokens, heads, head_dim, rotary_dim, interleaved ? 1 : 0, theta}};
}

SelfTestCase silu_mul_case(int64_t tokens, int64_t inter) {
  return {fmt::format("T={} inter={}", tokens, inter), {tokens, inter}};
}

SelfTestCase embedding_case(int64_t tokens, int64_t vocab, int64_t hidden) {
  return {fmt::format("T={} vocab={} hidden={}", tokens, vocab, hidden), {tokens, vocab, hidden}};
}

SelfTestCase residual_add_case(int64_t tokens, int64_t hidden) {
  return {fmt::format("T={} hidden={}", tokens, hidden), {tokens, hidden}};
}

}  // namespace tern
