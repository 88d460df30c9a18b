// Token sampling on the CPU with the semantics of vLLM's v1 sampler, one Sampler per sequence:
//
//   raw logits ──► logprobs (log_softmax of the raw row: vLLM's default logprobs_mode "raw_logprobs")
//       │
//       └─► penalties (repetition over prompt+output, presence/frequency over output)
//             ├─► temperature < 1e-5: greedy argmax, ties to the lowest id
//             └─► temperature ─► min_p ─► top_k ─► top_p ─► draw from the renormalised kept set
//
// min_p comes before top_p as in vLLM v1 (transformers and SGLang apply it after top_p; the kept sets differ
// when both are set). top_p is taken over the distribution renormalised after min_p and top_k, as vLLM does
// (SGLang uses the unrenormalised one). A random draw consumes exactly one value of the seeded generator; a
// greedy step none.
//
//   Sampler sampler(params);  // params checked by sampling_params_validate at the API boundary
//   TERN_ASSIGN_OR_RETURN(SampledToken t, sampler.sample(logits_row, prompt_ids, output_ids));
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "core/error.h"

namespace tern {

struct SamplingParams {
  float temperature = 1.0f;         // 0 (or < 1e-5) = greedy
  int32_t top_k = -1;               // -1 or 0 = disabled
  float top_p = 1.0f;               // (0, 1]; 1 = disabled
  float min_p = 0.0f;               // [0, 1]; 0 = disabled
  float repetition_penalty = 1.0f;  // > 0; 1 = disabled
  float presence_penalty = 0.0f;    // [-2, 2]
  float frequency_penalty = 0.0f;   // [-2, 2]
  std::optional<uint64_t> seed;     // none = a fresh random seed per Sampler
  int32_t logprobs = 0;             // number of top logprobs to return, [0, 20]
  // OpenAI's logit_bias: (id, bias in [-100, 100]) added to the logits the token is chosen from, before the
  // penalties; the logprobs stay the raw row's. At most kSamplingMaxLogitBias entries; an id outside the vocabulary
  // is an error of the step that meets it.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // Ids that cannot be sampled (their logits -inf after the bias and the penalties; the logprobs stay raw): the
  // engine's ban of the stop ids until a request's min_tokens are out (vLLM's min_tokens). At most
  // kSamplingMaxLogitBias entries, each >= 0; an id outside the vocabulary is an error of the step that meets it.
  std::vector<int32_t> banned_ids;
  // The ban holds while the row's output (output_ids) has fewer tokens than this; 0: always. So each row of a
  // speculative verification, whose output includes the drafts before it, is banned or not on its own.
  int64_t banned_until = 0;
};

// Whether banned_ids apply to a row whose output has n_output tokens.
inline bool sampling_ban_active(const SamplingParams& p, size_t n_output) {
  return !p.banned_ids.empty() && (p.banned_until <= 0 || static_cast<int64_t>(n_output) < p.banned_until);
}

constexpr int32_t kSamplingMaxLogprobs = 20;
constexpr size_t kSamplingMaxLogitBias = 1024;
// Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
constexpr float kSamplingGreedyTemperature = 1e-5f;

// Checks every field against its allowed range; the error names the parameter, the range and the value.
Expected<void> sampling_params_validate(const SamplingParams& params);
// Whether any penalty is on (repetition != 1, presence or frequency != 0): only then are the prompt and output ids
// read.
bool sampling_penalties_active(const SamplingParams& params);

// The penalty stage alone, in place on one row (also the CPU reference for device implementations). A no-op
// when no penalty is active; otherwise an id outside [0, vocab) or a logit pushed past the float range is an error.
Expected<void> sampling_apply_penalties(const SamplingParams& params, std::span<float> logits,
                                        std::span<const int32_t> prompt_ids, std::span<const int32_t> output_ids);

struct SampledToken {
  int32_t id = -1;
  float logprob = 0.0f;  // log_softmax of the raw logits at `id`
  // The `logprobs` highest raw log-probabilities, highest first, ties to the lower id. The sampled token is in
  // it only if it ranks there (vLLM adds it to the response separately, as `logprob` here).
  std::vector<std::pair<int32_t, float>> top_logprobs;
};

// What a prompt token gets (vLLM's prompt_logprobs, OpenAI's echo with logprobs): the raw log_softmax of `logits` at
// `id` and the `top` highest raw log-probabilities (as SampledToken: highest first, ties to the lower id). A
// non-finite logit or an id outside the row is an error naming it.
Expected<SampledToken> logits_token_logprob(std::span<const float> logits, int32_t id, int32_t top);

// xoshiro256** seeded through splitmix64: fixed integer arithmetic, so one seed gives one stream everywhere.
class SamplerRng {
 public:
  explicit SamplerRng(uint64_t seed);
  uint64_t next_u64();
  double next_unit();  // uniform in [0, 1), 53 random bits

 private:
  std::array<uint64_t, 4> state_;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);

  // `logits`: one row [vocab]. `prompt_ids`/`output_ids` feed the penalties (only read when one is active; ids
  // must then lie in [0, vocab)). A non-finite raw logit is an error naming the first bad id, never a crash.
  // Invalid params (see sampling_params_validate) are reported here too.
  Expected<SampledToken> sample(std::span<const float> logits, std::span<const int32_t> prompt_ids,
                                std::span<const int32_t> output_ids);

  const SamplingParams& params() const { return params_; }
  // Replaces SamplingParams::banned_ids and banned_until from the next step on (checked as the constructor checks its
  // params).
  void set_banned_ids(std::vector<int32_t> ids, int64_t until = 0);
  // For a device sampler that reproduces sample(): the uniform this step's random draw uses, taken from this
  // Sampler's stream exactly as sample() would take it (one value), or 0 for a greedy step (none taken).
  double next_draw();
  // For a process that samples for another process's Sampler (the rank 0 of a tensor-parallel front end): the next
  // random draw, sample()'s or next_draw()'s, is `u` (that Sampler's next_draw()) instead of this stream's next value.
  void give_draw(double u) { given_draw_ = u; }

 private:
  struct Candidate {
    int32_t id;
    float weight;  // exp((logit - max) / temperature): unnormalised probability, 1 for the best token
  };
  // Probability mass as a fixed-point integer (the best token has 2^(62 - bit_width(vocab))): integer sums do
  // not depend on the order of addition, so the kept set and the drawn token do not depend on the order in
  // which a standard library's nth_element leaves the candidates.
  uint64_t mass(const Candidate& c) const { return static_cast<uint64_t>(c.weight * mass_scale_); }

  // The checks, logit bias and penalties sample() begins with: the processed row (and its raw maximum).
  Expected<std::span<const float>> prepare(std::span<const float> logits, std::span<const int32_t> prompt_ids,
                                           std::span<const int32_t> output_ids, float& raw_max);
  // `token`'s logprob and the top logprobs from the raw row.
  void describe(std::span<const float> logits, float raw_max, SampledToken& token) const;
  Expected<std::span<const float>> apply_bias_and_penalties(std::span<const float> logits,
                                                            std::span<const int32_t> prompt_ids,
                                                            std::span<const int32_t> output_ids);
  int32_t sample_random(std::span<const float> logits);
  void select_candidates(std::span<const float> logits);
  void apply_top_p();
  static bool more_probable(const Candidate& a, const Candidate& b);
  Candidate top_p_boundary(std::vector<Candidate>& tokens, uint64_t need) const;

  SamplingParams params_;
  std::optional<Error> invalid_;
  SamplerRng rng_;
  std::optional<double> given_draw_;  // give_draw's, for the next draw only
  double take_draw();
  std::vector<float> penalized_;  // [vocab] logits after the bias and penalties (only when one is active)
  std::vector<float> value_scratch_;       // [top_k] heap or [vocab] copy for the top-k selection
  std::vector<Candidate> candidates_;      // tokens still allowed after min_p / top_k / top_p, in id order
  std::vector<Candidate> select_scratch_;  // reordered copy for the top_p selection
  float mass_scale_ = 1.0f;
};

}  // namespace tern
