#include "ops/sampling_op.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>

#include "core/formats.h"

namespace tern {
namespace {

// A draw or cut closer than this (relative to the kept mass) to a boundary makes the harness redraw the row: a
// device's expf moves a token's weight by ~2e-7 of itself, the Sampler's integer masses by ~1e-8 of the total.
constexpr double kCutMargin = 1e-6;
constexpr int kMaxAttempts = 64;
constexpr int64_t kPadding = 8;         // row stride = vocab + kPadding
constexpr int64_t kMaxVocab = 1 << 22;  // ids stay exact as floats; logprobs stay within kSamplingMaxLogprob
constexpr int64_t kPenaltyPool = 64;    // penalty ids come mostly from the row's best tokens

// One combination per row, cycled from a seed-dependent start: greedy (with a tied maximum), each filter alone and
// together, and the penalties in a greedy and a random row.
const SamplingParams kCombos[] = {
    {.temperature = 0.0f, .logprobs = 2},
    {.temperature = 0.8f, .top_k = 50},
    {.temperature = 1.0f, .top_p = 0.9f},
    {.temperature = 0.7f, .min_p = 0.05f},
    {.temperature = 1.2f, .top_k = 200, .top_p = 0.95f, .min_p = 0.02f, .logprobs = 5},
    {.temperature = 0.0f, .repetition_penalty = 1.3f, .presence_penalty = 0.5f, .frequency_penalty = 0.3f},
    {.temperature = 0.9f,
     .top_p = 0.8f,
     .repetition_penalty = 0.8f,
     .presence_penalty = -0.5f,
     .frequency_penalty = 0.5f},
    {.temperature = 1.0f},
};
constexpr int64_t kNumCombos = sizeof(kCombos) / sizeof(kCombos[0]);

bool is_greedy(const SamplingParams& p) {
  return p.temperature < kSamplingGreedyTemperature;
}
bool has_penalty(const SamplingParams& p) {
  return p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
}

uint64_t mix(uint64_t seed, uint64_t a, uint64_t b) {
  uint64_t z = seed ^ (a * 0x9E3779B97F4A7C15ull) ^ (b * 0xD1B54A32D192ED03ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// ---------------------------------------------------------------------------------------------------------------
// The reference of one row, in double.

struct RowResult {
  int32_t id = -1;
  double logprob = 0.0;
  bool near_cut = false;
};

struct Weighted {
  double w;
  int32_t id;
};

// The kept set after top_k, min_p and the zero-mass cut, in id order; flags a weight at the min_p or mass cut.
std::vector<Weighted> kept_tokens(const std::vector<float>& logits, const SamplingParams& p, bool& near_cut) {
  const auto vocab = static_cast<int64_t>(logits.size());
  const float max = *std::max_element(logits.begin(), logits.end());
  float threshold = -INFINITY;
  if (p.top_k > 0 && p.top_k < vocab) {
    std::vector<float> sorted = logits;
    std::nth_element(sorted.begin(), sorted.begin() + (p.top_k - 1), sorted.end(), std::greater<float>());
    threshold = sorted[p.top_k - 1];
  }
  const double scale = std::ldexp(1.0, 62 - static_cast<int>(std::bit_width(static_cast<uint64_t>(vocab))));
  std::vector<Weighted> kept;
  for (int64_t i = 0; i < vocab; ++i) {
    if (logits[i] < threshold) continue;
    const float arg = (logits[i] - max) / p.temperature;  // in float, as the Sampler and the kernel form it
    const double w = std::exp(static_cast<double>(arg));
    if (p.min_p > 0.0f && std::abs(w - p.min_p) <= kCutMargin * p.min_p) near_cut = true;
    if (std::abs(w * scale - 1.0) <= kCutMargin) near_cut = true;
    if (w >= p.min_p && w * scale >= 1.0) kept.push_back({w, static_cast<int32_t>(i)});
  }
  return kept;
}

// The smallest most-probable prefix (weight, then id) whose mass reaches top_p of the total, back in id order.
void apply_top_p(std::vector<Weighted>& kept, double top_p, bool& near_cut) {
  const double total =
      std::accumulate(kept.begin(), kept.end(), 0.0, [](double s, const Weighted& k) { return s + k.w; });
  std::sort(kept.begin(), kept.end(),
            [](const Weighted& a, const Weighted& b) { return a.w > b.w || (a.w == b.w && a.id < b.id); });
  const double need = top_p * total;
  double cumulative = 0.0;
  size_t n = 0;
  while (n < kept.size() && cumulative < need) cumulative += kept[n++].w;
  const double margin = kCutMargin * total;
  if (std::abs(cumulative - need) <= margin || std::abs(cumulative - kept[n - 1].w - need) <= margin) near_cut = true;
  // Unequal weights this close may compare equal in float, where the lower id would come first.
  if (n < kept.size() && kept[n].w != kept[n - 1].w && kept[n].w >= kept[n - 1].w * (1.0 - kCutMargin)) {
    near_cut = true;
  }
  kept.resize(n);
  std::sort(kept.begin(), kept.end(), [](const Weighted& a, const Weighted& b) { return a.id < b.id; });
}

// Inverse CDF over the kept tokens in id order.
int32_t draw(const std::vector<Weighted>& kept, double u, bool& near_cut) {
  const double total =
      std::accumulate(kept.begin(), kept.end(), 0.0, [](double s, const Weighted& k) { return s + k.w; });
  const double target = u * total;
  double cumulative = 0.0;
  int32_t chosen = -1;
  for (const Weighted& k : kept) {
    cumulative += k.w;
    if (std::abs(target - cumulative) <= kCutMargin * total) near_cut = true;
    if (chosen < 0 && target < cumulative) chosen = k.id;
  }
  return chosen >= 0 ? chosen : kept.back().id;
}

Expected<RowResult> reference_row(const std::vector<float>& raw, const SamplingParams& p,
                                  const std::vector<int32_t>& prompt, const std::vector<int32_t>& output, double u) {
  std::vector<float> logits = raw;
  TERN_TRY(sampling_apply_penalties(p, logits, prompt, output));
  RowResult r;
  if (is_greedy(p)) {
    r.id = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());  // first maximum
  } else {
    std::vector<Weighted> kept = kept_tokens(logits, p, r.near_cut);
    if (p.top_p < 1.0f) apply_top_p(kept, p.top_p, r.near_cut);
    r.id = draw(kept, u, r.near_cut);
  }
  const double raw_max = *std::max_element(raw.begin(), raw.end());
  double sum = 0.0;
  for (float x : raw) sum += std::exp(static_cast<double>(x) - raw_max);
  r.logprob = static_cast<double>(raw[r.id]) - raw_max - std::log(sum);
  return r;
}

// ---------------------------------------------------------------------------------------------------------------
// The harness.

struct RowDraft {
  std::vector<uint16_t> logits;  // [stride]
  std::vector<int32_t> prompt, output;
  double uniform = 0.0;
  uint64_t seed = 0;
};

// A row like a language model's: a N(0, sigma) body, a few strong candidates, a tied maximum in greedy rows, and
// penalty ids mostly among the best tokens (where the penalties change the outcome), with repeats.
RowDraft draft_row(int64_t vocab, int64_t stride, const SamplingParams& p, uint64_t seed, int64_t row, int attempt) {
  RowDraft d;
  std::mt19937_64 gen(mix(seed, static_cast<uint64_t>(row), static_cast<uint64_t>(attempt)));
  std::normal_distribution<float> body(0.0f, 1.0f + static_cast<float>((row + attempt) % 3));
  std::uniform_real_distribution<float> peak(6.0f, 14.0f);
  std::uniform_int_distribution<int64_t> any_id(0, vocab - 1);
  d.logits.resize(static_cast<size_t>(stride));
  for (uint16_t& x : d.logits) x = float_to_bf16(body(gen));  // the padding too: finite, never read
  const int n_peaks = static_cast<int>(gen() % 7);
  for (int i = 0; i < n_peaks; ++i) d.logits[any_id(gen)] = float_to_bf16(peak(gen));
  const auto best = std::max_element(d.logits.begin(), d.logits.begin() + vocab,
                                     [](uint16_t a, uint16_t b) { return bf16_to_float(a) < bf16_to_float(b); });
  if (is_greedy(p)) d.logits[any_id(gen)] = *best;  // ties go to the lower id
  if (has_penalty(p)) {
    std::vector<int32_t> order(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    const int64_t pool = std::min(vocab, kPenaltyPool);
    std::partial_sort(order.begin(), order.begin() + pool, order.end(),
                      [&](int32_t a, int32_t b) { return bf16_to_float(d.logits[a]) > bf16_to_float(d.logits[b]); });
    std::uniform_int_distribution<int64_t> pick(0, pool - 1), length(0, 48);
    for (auto* list : {&d.prompt, &d.output}) {
      const int64_t n = length(gen);
      for (int64_t i = 0; i < n; ++i)
        list->push_back(static_cast<int32_t>(i % 3 == 0 ? any_id(gen) : order[pick(gen)]));
    }
  }
  d.seed = gen();
  if (!is_greedy(p)) d.uniform = SamplerRng(d.seed).next_unit();
  return d;
}

std::vector<float> widen_row(const std::vector<uint16_t>& logits, int64_t offset, int64_t vocab) {
  std::vector<float> out(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) out[i] = bf16_to_float(logits[offset + i]);
  return out;
}

Expected<std::unique_ptr<OpInputs>> sampling_make(const SelfTestCase& c, uint64_t seed) {
  if (c.dims.size() != 2 || c.dims[0] <= 0 || c.dims[1] <= 0 || c.dims[1] > kMaxVocab) {
    return make_error("sampling case '{}' needs dims {{rows, vocab}} with rows >= 1 and vocab in [1, {}]", c.label,
                      kMaxVocab);
  }
  auto in = std::make_unique<SamplingInputs>();
  in->rows = c.dims[0];
  in->vocab = c.dims[1];
  in->stride = in->vocab + kPadding;
  in->logits.resize(static_cast<size_t>(in->rows * in->stride));
  for (int64_t r = 0; r < in->rows; ++r) {
    SamplingParams p = kCombos[(r + static_cast<int64_t>(seed % static_cast<uint64_t>(kNumCombos))) % kNumCombos];
    bool accepted = false;
    for (int attempt = 0; attempt < kMaxAttempts && !accepted; ++attempt) {
      RowDraft d = draft_row(in->vocab, in->stride, p, seed, r, attempt);
      TERN_ASSIGN_OR_RETURN(RowResult ref,
                            reference_row(widen_row(d.logits, 0, in->vocab), p, d.prompt, d.output, d.uniform));
      if (ref.near_cut || std::abs(ref.logprob) > kSamplingMaxLogprob) continue;
      accepted = true;
      std::copy(d.logits.begin(), d.logits.end(), in->logits.begin() + r * in->stride);
      p.seed = d.seed;
      in->params.push_back(p);
      in->uniforms.push_back(d.uniform);
      in->prompt_ids.push_back(std::move(d.prompt));
      in->output_ids.push_back(std::move(d.output));
    }
    if (!accepted) return make_error("sampling case '{}': row {} found no draw away from a cut", c.label, r);
  }
  return in;
}

std::vector<float> sampling_reference(const OpInputs& base) {
  const auto& in = static_cast<const SamplingInputs&>(base);
  std::vector<float> out(static_cast<size_t>(2 * in.rows));
  for (int64_t r = 0; r < in.rows; ++r) {
    auto ref = reference_row(in.row(r), in.params[r], in.prompt_ids[r], in.output_ids[r], in.uniforms[r]);
    // The harness only keeps rows the reference accepts; should that ever break, an empty reference fails every
    // implementation on its size (a NaN reference would compare as no error).
    if (!ref) return {};
    out[2 * r] = static_cast<float>(ref->id);
    out[2 * r + 1] = static_cast<float>(ref->logprob);
  }
  return out;
}

std::string cpu_only(const DeviceDescription& d, const SelfTestCase&) {
  return d.backend == Backend::kCpu ? "" : "runs on the CPU backend only";
}

}  // namespace

std::vector<float> SamplingInputs::row(int64_t r) const {
  return widen_row(logits, r * stride, vocab);
}

Expected<std::vector<float>> sampling_cpu(const SamplingInputs& in) {
  std::vector<float> out(static_cast<size_t>(2 * in.rows));
  for (int64_t r = 0; r < in.rows; ++r) {
    Sampler sampler(in.params[r]);
    auto token = sampler.sample(in.row(r), in.prompt_ids[r], in.output_ids[r]);
    if (!token) return make_error("row {}: {}", r, token.error().message);
    out[2 * r] = static_cast<float>(token->id);
    out[2 * r + 1] = token->logprob;
  }
  return out;
}

Expected<void> sampling_register_cpu(Registry& registry) {
  TERN_TRY(
      registry.add_harness(OpHarness{.op = "sampling", .make_inputs = sampling_make, .reference = sampling_reference}));
  return registry.add(Implementation{
      .op = "sampling",
      .name = "cpu",
      .backend = Backend::kCpu,
      .tolerance = kSamplingCpuTolerance,
      .unsupported_reason = cpu_only,
      .run = [](const OpInputs& base) -> Expected<RunOutput> {
        const auto start = std::chrono::steady_clock::now();
        TERN_ASSIGN_OR_RETURN(std::vector<float> values, sampling_cpu(static_cast<const SamplingInputs&>(base)));
        return RunOutput{.values = std::move(values),
                         .seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
      }});
}

SelfTestCase sampling_case(int64_t rows, int64_t vocab) {
  return SelfTestCase{.label = fmt::format("rows={} vocab={}", rows, vocab), .dims = {rows, vocab}};
}

}  // namespace tern
