// Speculative decoding with the model's own multi-token-prediction layer as the draft model (docs/speculative.md).
//
// One step over a batch: every sequence that samples and holds drafts from the step before runs its last token and
// those drafts [x, d1 .. dk] as one verification (SequenceInput::verify); every row samples a token where its
// logits are (ModelRunner::forward_sample_rows), and draft d is accepted when the row before it sampled d (exact for
// greedy and for sampling: speculative.cc) up to the first row that sampled another token — or, when all k are
// accepted, the last row's token — which ends the step's 1 .. k + 1 tokens; the cache keeps the
// rows up to it (ModelRunner::keep_rows). Then the draft module runs over every row the model kept ("draft
// extend": its KV cache follows the model's, and the last row proposes the next token) and chains num_steps - 1 more
// single rows on its own output, one proposal each. Prompt chunks run plainly, with the draft extend over their rows.
//
//   std::vector<int32_t> drafts;                                       // per sequence, kept between steps
//   SpecSequence s{.input = {&cache, last_token}, .following = {}, .sample = {&sampler, prompt, output},
//                  .drafts = &drafts};
//   TERN_ASSIGN_OR_RETURN(auto outcomes, speculative_step(runner, {&s, 1}, 3));
//   for (const SampledToken& t : outcomes[0].tokens) ...                 // 1 .. 4 tokens
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "core/error.h"
#include "runtime/model_runner.h"

namespace tern {

// The most draft tokens one step verifies (--speculative-num-steps).
constexpr int kMaxSpeculativeSteps = 4;

struct SpecSequence {
  // The tokens the scheduler planned (a prompt chunk, or the last token of a decoding sequence), the cache and its
  // ids; the step appends the drafts to verify. The KV ids must hold input.tokens.size() + drafts->size() more.
  SequenceInput input;
  // The known tokens after input.tokens.front() (the rest of the prompt and any output), which the draft module
  // runs on: at least input.tokens.size() of them for a chunk that samples nothing, size() - 1 for one that samples.
  std::span<const int32_t> following;
  SampleRow sample;  // a null sampler: a prompt chunk that samples nothing
  // In: the drafts to verify after the last token (only read when the chunk samples). Out: the next step's.
  std::vector<int32_t>* drafts = nullptr;
};

struct SpecOutcome {
  // The accepted drafts, then the token that replaced the first rejected one or followed the last accepted one.
  std::vector<SampledToken> tokens;
  std::optional<Error> error;  // this sequence could not sample (a non-finite logit); its tokens are empty
  int64_t drafted = 0;         // drafts it verified this step
  int64_t accepted = 0;        // of which accepted
};

// One step, as above: `num_steps` drafts proposed for each sampling sequence's next step (0: none; the draft
// module still follows the model). An error fails the whole step (a runner's), a row's own failure is in its
// outcome.
Expected<std::vector<SpecOutcome>> speculative_step(ModelRunner& runner, std::span<SpecSequence> seqs,
                                                    int num_steps);

// Whether verifying drafts pays at a batch size, decided from what the steps measured (--speculative-adaptive): per
// power-of-two bucket of sampling sequences, the seconds of steady plain steps and of steady speculative steps and
// the tokens each sequence got from a speculative step (exponentially weighted). A bucket verifies while n_spec /
// t_spec, tokens per second per sequence, is at least 1 / t_plain; until both modes have kMinSamples steady steps it
// tries the one short of them (speculation first), and each `probe_every` steps it runs the other mode for
// kProbeSteps steps so that both stay current. A step is steady when it runs the mode of the step before it (a
// speculative step after a plain one has no drafts to verify) and holds no prompt chunk; only those are recorded.
class SpeculationGovernor {
 public:
  static constexpr int kMinSamples = 3;
  static constexpr int kProbeSteps = 4;
  static constexpr double kWeight = 0.25;  // of the newest sample

  explicit SpeculationGovernor(int probe_every = 64) : probe_every_(probe_every) {}
  // Whether a step of `batch` sampling sequences verifies drafts.
  bool verify(int batch);
  // The step just run: its mode, its seconds and the tokens each sampling sequence got.
  void record(int batch, bool verified, double seconds, double tokens_per_sequence);

 private:
  struct Bucket {
    double t_plain = 0.0, t_spec = 0.0, n_spec = 0.0;
    int plain_samples = 0, spec_samples = 0;
    int64_t decisions = 0;
  };
  static int bucket_of(int batch);
  const int probe_every_;
  Bucket buckets_[32];
};

}  // namespace tern
