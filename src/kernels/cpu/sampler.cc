#include "kernels/cpu/sampler.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

namespace tern {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Written as "inside the range" so that NaN, which fails every comparison, is rejected too.
bool is_within(float x, float lo, float hi) {
  return x >= lo && x <= hi;
}

uint64_t splitmix64_next(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t rotate_left(uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}

uint64_t random_seed() {
  std::random_device device;
  return (uint64_t{device()} << 32) ^ uint64_t { device() };
}

const char* non_finite_name(float x) {
  if (std::isnan(x)) return "NaN";
  return x > 0 ? "+inf" : "-inf";
}

// The row's maximum, or an error naming the first non-finite value.
Expected<float> logits_check_finite(std::span<const float> logits) {
  float max = -kInf;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!std::isfinite(logits[i])) return make_error("logits contain {} at id {}", non_finite_name(logits[i]), i);
    max = std::max(max, logits[i]);
  }
  return max;
}

Expected<void> token_ids_check(std::span<const int32_t> ids, size_t vocab, const char* what) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || static_cast<size_t>(ids[i]) >= vocab) {
      return make_error("{}[{}] = {} is outside the vocabulary [0, {})", what, i, ids[i], vocab);
    }
  }
  return {};
}

Expected<void> penalized_check_finite(float x, int32_t id, const char* penalty) {
  if (std::isfinite(x)) return {};
  return make_error("logits at id {} became {} after the {}", id, non_finite_name(x), penalty);
}

// First maximum, so ties go to the lowest id (torch.argmax, which vLLM's greedy path uses, does the same).
int32_t logits_argmax(std::span<const float> logits) {
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

// The k-th largest value (counting repeats), 0 < k < size. For small k (top_k 20 to 50 is the common setting) a
// min-heap of the k best so far rejects most of the row with one comparison; otherwise nth_element on a copy.
float logits_kth_largest(std::span<const float> logits, size_t k, std::vector<float>& scratch) {
  constexpr size_t kMaxHeap = 1024;
  const auto greater = std::greater<float>();
  if (k > kMaxHeap) {
    scratch.assign(logits.begin(), logits.end());
    const auto kth = scratch.begin() + static_cast<ptrdiff_t>(k - 1);
    std::nth_element(scratch.begin(), kth, scratch.end(), greater);
    return *kth;
  }
  scratch.assign(logits.begin(), logits.begin() + static_cast<ptrdiff_t>(k));
  std::make_heap(scratch.begin(), scratch.end(), greater);  // front() is the smallest of the k kept
  for (size_t i = k; i < logits.size(); ++i) {
    if (logits[i] <= scratch.front()) continue;
    std::pop_heap(scratch.begin(), scratch.end(), greater);
    scratch.back() = logits[i];
    std::push_heap(scratch.begin(), scratch.end(), greater);
  }
  return scratch.front();
}

// log(sum(exp(x - max))) with a double accumulator: the log-normaliser of the raw log_softmax.
double logits_log_sum_exp(std::span<const float> logits, float max) {
  double sum = 0.0;
  for (float x : logits) sum += std::exp(x - max);
  return std::log(sum);
}

float raw_logprob(float logit, float max, double log_sum) {
  return static_cast<float>(static_cast<double>(logit) - static_cast<double>(max) - log_sum);
}

// The n highest logits, highest first, ties to the lower id; one pass with a small sorted list, since n <= 20.
std::vector<std::pair<int32_t, float>> logits_top_logprobs(std::span<const float> logits, int32_t n, float max,
                                                           double log_sum) {
  std::vector<int32_t> best;
  best.reserve(static_cast<size_t>(n) + 1);
  const auto higher = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  for (size_t i = 0; i < logits.size(); ++i) {
    const auto id = static_cast<int32_t>(i);
    if (best.size() == static_cast<size_t>(n) && !higher(id, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), id, higher), id);
    if (best.size() > static_cast<size_t>(n)) best.pop_back();
  }
  std::vector<std::pair<int32_t, float>> top;
  top.reserve(best.size());
  for (int32_t id : best) top.emplace_back(id, raw_logprob(logits[id], max, log_sum));
  return top;
}

}  // namespace

Expected<SampledToken> logits_token_logprob(std::span<const float> logits, int32_t id, int32_t top) {
  if (id < 0 || static_cast<size_t>(id) >= logits.size()) {
    return make_error("token id {} is outside the vocabulary (size {})", id, logits.size());
  }
  TERN_ASSIGN_OR_RETURN(const float max, logits_check_finite(logits));
  const double log_sum = logits_log_sum_exp(logits, max);
  SampledToken t{.id = id, .logprob = raw_logprob(logits[static_cast<size_t>(id)], max, log_sum)};
  if (top > 0) t.top_logprobs = logits_top_logprobs(logits, top, max, log_sum);
  return t;
}

bool sampling_penalties_active(const SamplingParams& p) {
  return p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
}

Expected<void> sampling_params_validate(const SamplingParams& p) {
  if (!is_within(p.temperature, 0.0f, std::numeric_limits<float>::max())) {
    return make_error("temperature must be a finite number >= 0, got {}", p.temperature);
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return make_error("top_p must be in (0, 1], got {}", p.top_p);
  if (p.top_k < -1) return make_error("top_k must be -1 or 0 (disabled) or at least 1, got {}", p.top_k);
  if (!is_within(p.min_p, 0.0f, 1.0f)) return make_error("min_p must be in [0, 1], got {}", p.min_p);
  if (!(p.repetition_penalty > 0.0f && std::isfinite(p.repetition_penalty))) {
    return make_error("repetition_penalty must be a finite number > 0, got {}", p.repetition_penalty);
  }
  if (!is_within(p.presence_penalty, -2.0f, 2.0f)) {
    return make_error("presence_penalty must be in [-2, 2], got {}", p.presence_penalty);
  }
  if (!is_within(p.frequency_penalty, -2.0f, 2.0f)) {
    return make_error("frequency_penalty must be in [-2, 2], got {}", p.frequency_penalty);
  }
  if (p.logprobs < 0 || p.logprobs > kSamplingMaxLogprobs) {
    return make_error("logprobs must be in [0, {}], got {}", kSamplingMaxLogprobs, p.logprobs);
  }
  if (p.logit_bias.size() > kSamplingMaxLogitBias) {
    return make_error("logit_bias must have at most {} entries, got {}", kSamplingMaxLogitBias, p.logit_bias.size());
  }
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0) return make_error("logit_bias must have token ids >= 0, got {}", id);
    if (!is_within(bias, -100.0f, 100.0f)) return make_error("logit_bias must be in [-100, 100], got {}", bias);
  }
  if (p.banned_ids.size() > kSamplingMaxLogitBias) {
    return make_error("at most {} banned token ids, got {}", kSamplingMaxLogitBias, p.banned_ids.size());
  }
  for (int32_t id : p.banned_ids) {
    if (id < 0) return make_error("banned token ids must be >= 0, got {}", id);
  }
  if (p.banned_until < 0) return make_error("banned_until must be >= 0, got {}", p.banned_until);
  return {};
}

// vLLM's apply_penalties: the repetition penalty (divide positive logits, multiply the others) on every token of
// the prompt or the output, then, over output tokens only, OpenAI's `logit -= frequency * count` and
// `logit -= presence * (count > 0)`. Sorting the ids costs O(n log n) in the sequence length but never a
// vocabulary-sized mask per sequence.
Expected<void> sampling_apply_penalties(const SamplingParams& params, std::span<float> logits,
                                        std::span<const int32_t> prompt_ids, std::span<const int32_t> output_ids) {
  const bool repetition = params.repetition_penalty != 1.0f;
  if (!sampling_penalties_active(params)) return {};
  if (repetition) TERN_TRY(token_ids_check(prompt_ids, logits.size(), "prompt_ids"));
  TERN_TRY(token_ids_check(output_ids, logits.size(), "output_ids"));

  std::vector<int32_t> ids(output_ids.begin(), output_ids.end());
  std::sort(ids.begin(), ids.end());
  if (repetition) {
    std::vector<int32_t> seen(prompt_ids.begin(), prompt_ids.end());
    seen.insert(seen.end(), ids.begin(), ids.end());
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (int32_t id : seen) {
      float& x = logits[id];
      x = x > 0.0f ? x / params.repetition_penalty : x * params.repetition_penalty;
      TERN_TRY(penalized_check_finite(x, id, "repetition_penalty"));
    }
  }
  for (size_t run = 0; run < ids.size();) {
    const int32_t id = ids[run];
    size_t end = run;
    while (end < ids.size() && ids[end] == id) ++end;
    float& x = logits[id];
    x -= params.frequency_penalty * static_cast<float>(end - run);
    x -= params.presence_penalty;
    TERN_TRY(penalized_check_finite(x, id, "frequency_penalty/presence_penalty"));
    run = end;
  }
  return {};
}

SamplerRng::SamplerRng(uint64_t seed) {
  for (uint64_t& word : state_) word = splitmix64_next(seed);
}

uint64_t SamplerRng::next_u64() {
  const uint64_t result = rotate_left(state_[1] * 5, 7) * 9;
  const uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotate_left(state_[3], 45);
  return result;
}

double SamplerRng::next_unit() {
  return static_cast<double>(next_u64() >> 11) * 0x1.0p-53;
}

Sampler::Sampler(const SamplingParams& params)
    : params_(params), rng_(params.seed.has_value() ? *params.seed : random_seed()) {
  if (auto valid = sampling_params_validate(params_); !valid) invalid_ = valid.error();
}

void Sampler::set_banned_ids(std::vector<int32_t> ids, int64_t until) {
  params_.banned_ids = std::move(ids);
  params_.banned_until = until;
  if (auto valid = sampling_params_validate(params_); !valid) invalid_ = valid.error();
}

double Sampler::next_draw() {
  return params_.temperature < kSamplingGreedyTemperature ? 0.0 : take_draw();
}

double Sampler::take_draw() {
  if (!given_draw_) return rng_.next_unit();
  const double u = *given_draw_;
  given_draw_.reset();
  return u;
}

Expected<std::span<const float>> Sampler::prepare(std::span<const float> logits, std::span<const int32_t> prompt_ids,
                                                  std::span<const int32_t> output_ids, float& raw_max) {
  if (invalid_) return tl::unexpected<Error>(*invalid_);
  if (logits.empty()) return make_error("logits row is empty");
  if (logits.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return make_error("logits row has {} entries, more than int32 token ids can address", logits.size());
  }
  TERN_ASSIGN_OR_RETURN(raw_max, logits_check_finite(logits));
  return apply_bias_and_penalties(logits, prompt_ids, output_ids);
}

void Sampler::describe(std::span<const float> logits, float raw_max, SampledToken& token) const {
  // Logprobs describe the model, not the sampling: log_softmax of the raw row, before penalties and temperature,
  // as vLLM's default logprobs_mode "raw_logprobs" returns them.
  const double log_sum = logits_log_sum_exp(logits, raw_max);
  token.logprob = raw_logprob(logits[token.id], raw_max, log_sum);
  if (params_.logprobs > 0) token.top_logprobs = logits_top_logprobs(logits, params_.logprobs, raw_max, log_sum);
}

Expected<SampledToken> Sampler::sample(std::span<const float> logits, std::span<const int32_t> prompt_ids,
                                       std::span<const int32_t> output_ids) {
  float raw_max = 0.0f;
  TERN_ASSIGN_OR_RETURN(const std::span<const float> processed, prepare(logits, prompt_ids, output_ids, raw_max));
  SampledToken token;
  token.id = params_.temperature < kSamplingGreedyTemperature ? logits_argmax(processed) : sample_random(processed);
  describe(logits, raw_max, token);
  return token;
}

Expected<std::span<const float>> Sampler::apply_bias_and_penalties(std::span<const float> logits,
                                                                   std::span<const int32_t> prompt_ids,
                                                                   std::span<const int32_t> output_ids) {
  const bool ban = sampling_ban_active(params_, output_ids.size());
  if (params_.logit_bias.empty() && !ban && !sampling_penalties_active(params_)) return logits;
  penalized_.assign(logits.begin(), logits.end());
  for (const auto& [id, bias] : params_.logit_bias) {
    if (static_cast<size_t>(id) >= logits.size()) {
      return make_error("logit_bias names token id {}, outside the vocabulary (size {})", id, logits.size());
    }
    penalized_[static_cast<size_t>(id)] += bias;
  }
  TERN_TRY(sampling_apply_penalties(params_, penalized_, prompt_ids, output_ids));
  // After the penalties, which refuse a logit they would push past the float range.
  for (int32_t id : ban ? std::span<const int32_t>(params_.banned_ids) : std::span<const int32_t>()) {
    if (static_cast<size_t>(id) >= logits.size()) {
      return make_error("banned token id {} is outside the vocabulary (size {})", id, logits.size());
    }
    penalized_[static_cast<size_t>(id)] = -std::numeric_limits<float>::infinity();
  }
  if (ban && std::ranges::all_of(penalized_, [](float v) { return std::isinf(v) && v < 0; })) {
    return make_error("every token id of the vocabulary is banned (min_tokens bans the stop ids)");
  }
  return std::span<const float>(penalized_);
}

int32_t Sampler::sample_random(std::span<const float> logits) {
  mass_scale_ = std::ldexp(1.0f, 62 - static_cast<int>(std::bit_width(logits.size())));
  select_candidates(logits);
  if (params_.top_p < 1.0f) apply_top_p();
  uint64_t total = 0;
  for (const Candidate& c : candidates_) total += mass(c);
  // Inverse CDF over the kept tokens in id order with one uniform draw per token, so a seed replays exactly.
  const auto target = std::min(total - 1, static_cast<uint64_t>(take_draw() * static_cast<double>(total)));
  uint64_t cumulative = 0;
  for (const Candidate& c : candidates_) {
    cumulative += mass(c);
    if (target < cumulative) return c.id;
  }
  return candidates_.back().id;  // not reached: target < total
}

// Temperature, min_p and top_k in one pass. vLLM applies min_p before top_k; both keep every token whose logit
// reaches a threshold, so their intersection does not depend on the order. top_k keeps ties with the k-th
// largest logit (vLLM and transformers mask only `logit < kth`). Temperature preserves the order of logits, so
// the k-th largest is found on the unscaled row.
void Sampler::select_candidates(std::span<const float> logits) {
  const size_t vocab = logits.size();
  const float max = *std::max_element(logits.begin(), logits.end());
  float threshold = -kInf;
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < vocab) {
    threshold = logits_kth_largest(logits, static_cast<size_t>(params_.top_k), value_scratch_);
  }
  // Weights are probabilities relative to the best token, so min_p's `prob < min_p * max_prob` is
  // `weight < min_p`. Subtracting the max before dividing keeps a small temperature from overflowing. Tokens
  // whose mass rounds to zero (weight < 2^-44 for a 248k vocabulary) could never be drawn and are dropped.
  candidates_.clear();
  for (size_t i = 0; i < vocab; ++i) {
    if (logits[i] < threshold) continue;
    const Candidate c{static_cast<int32_t>(i), std::exp((logits[i] - max) / params_.temperature)};
    if (c.weight >= params_.min_p && mass(c) > 0) candidates_.push_back(c);
  }
}

// Keeps the smallest set of most probable tokens whose probability (renormalised over the tokens min_p and top_k
// kept) reaches top_p; the best token always stays. vLLM drops the ascending tail whose cumulative mass is
// <= 1 - top_p, which is the same set. Nothing is fully sorted: one pass sums the mass per weight bucket (the
// float's exponent and top mantissa bits, which order positive floats), the walk down the buckets finds the one
// holding the boundary, and a weighted quickselect runs on that bucket's tokens only. Kept tokens stay in id order.
void Sampler::apply_top_p() {
  constexpr int kBucketShift = 20;  // 8 buckets per power of two
  constexpr size_t kBuckets = (std::bit_cast<uint32_t>(1.0f) >> kBucketShift) + 1;
  const auto bucket = [](const Candidate& c) { return std::bit_cast<uint32_t>(c.weight) >> kBucketShift; };
  std::array<uint64_t, kBuckets> bucket_mass{};
  uint64_t total = 0;
  for (const Candidate& c : candidates_) {
    bucket_mass[bucket(c)] += mass(c);
    total += mass(c);
  }
  const double wanted = std::ceil(static_cast<double>(params_.top_p) * static_cast<double>(total));
  uint64_t need = std::clamp<uint64_t>(static_cast<uint64_t>(wanted), 1, total);
  size_t boundary_bucket = kBuckets - 1;
  while (bucket_mass[boundary_bucket] < need) need -= bucket_mass[boundary_bucket--];  // ends: the sum is total

  select_scratch_.clear();
  for (const Candidate& c : candidates_) {
    if (bucket(c) == boundary_bucket) select_scratch_.push_back(c);
  }
  const Candidate boundary = top_p_boundary(select_scratch_, need);
  std::erase_if(candidates_, [&](const Candidate& c) { return more_probable(boundary, c); });
}

// A strict total order, so the kept set is the same whatever order the candidates arrive in.
bool Sampler::more_probable(const Candidate& a, const Candidate& b) {
  return a.weight > b.weight || (a.weight == b.weight && a.id < b.id);
}

// The token at which the cumulative mass of `tokens`, taken from the most probable, first reaches `need` (which
// is at most their total). Weighted quickselect: nth_element splits the range holding the boundary in two.
Sampler::Candidate Sampler::top_p_boundary(std::vector<Candidate>& tokens, uint64_t need) const {
  auto lo = tokens.begin(), hi = tokens.end();
  while (hi - lo > 32) {  // invariant: the boundary is in [lo, hi), and `need` is what [lo, ...] must still cover
    const auto mid = lo + (hi - lo) / 2;
    std::nth_element(lo, mid, hi, more_probable);
    uint64_t upper = 0;
    for (auto it = lo; it != mid; ++it) upper += mass(*it);
    if (upper >= need) {
      hi = mid;
    } else {
      need -= upper;
      lo = mid;
    }
  }
  std::sort(lo, hi, more_probable);
  uint64_t cumulative = 0;
  for (auto it = lo; it != hi; ++it) {
    cumulative += mass(*it);
    if (cumulative >= need) return *it;
  }
  return *(hi - 1);  // not reached while need <= the range's mass
}

}  // namespace tern
