// Perplexity of a token sequence under a causal language model, with strided sliding windows, and the KL
// divergence of the model's next-token distributions from a reference model's (`tern perplexity`, tern's counterpart
// of llama.cpp's `llama-perplexity`, with the strided windows of transformers' perplexity guide).
//
// The protocol, for T tokens, context N and stride S:
//   windows w = 0, 1, ...: b = w*S, e = min(b + N, T), each run from a fresh sequence over tokens[b, e) with the
//   logits of every position; window w scores the targets j in [max(prev_e, b + 1), e) with the logits row at
//   window position j - 1 - b; prev_e = e; the window whose e == T is the last.
// With S < N every target 1..T-1 is scored exactly once. With S == N the first token of each window after the
// first has no row before it in its window and is not scored (T - W targets in all), as in transformers' guide.
//   NLL of a target = -log_softmax(row)[target] (max-subtracted log-sum-exp, the exponentials summed in double);
//   mean NLL = sum over the scored targets / their number; perplexity = exp(mean NLL).
//
// The model is reached through a callback that returns a window's logits, so the scoring is independent of where
// the model runs (the CLI hands it a ModelRunner's; the tests hand it rows they made):
//
//   auto result = perplexity_run(tokens, {.context = 512, .stride = 256, .vocab = V},
//                                [&](int64_t b, int64_t e) { return logits_of(tokens, b, e); }, nullptr);
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <tl/expected.hpp>
#include <vector>

#include "core/error.h"

namespace tern {

struct PerplexityWindow {
  int64_t begin = 0, end = 0;  // the window runs tokens [begin, end) from a fresh sequence
  int64_t first_target = 0;    // it scores targets [first_target, end), target j with row j - 1 - begin
};

// The windows of the protocol above. Errors: context < 2, stride outside [1, context], tokens < 2.
Expected<std::vector<PerplexityWindow>> perplexity_windows(int64_t tokens, int64_t context, int64_t stride);

// log(sum_i exp(row[i])), as max + log(sum_i exp(row[i] - max)) with the sum in double. The row must be finite.
double log_sum_exp(std::span<const float> row);
// -log_softmax(row)[target]. The row must be finite and target inside it.
double token_nll(std::span<const float> row, int32_t target);
// KL(P || Q) = sum_i P_i (log P_i - log Q_i) of P = softmax(p_logits), Q = softmax(q_logits), in double.
double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits);
// The index of the largest value (the lowest such index on ties).
int64_t argmax(std::span<const float> row);
// The q-quantile (0 <= q <= 1) of `values` by linear interpolation between the closest ranks: sorted v, position
// q * (n - 1), as numpy.percentile / numpy.quantile do by default. 0 for no values.
double quantile(std::vector<double> values, double q);

// A window's logits: (end - begin) rows of `vocab` floats, row r after token begin + r, from a fresh sequence.
using WindowLogits = std::function<Expected<std::vector<float>>(int64_t begin, int64_t end)>;

struct PerplexityOptions {
  int64_t context = 512;
  int64_t stride = 256;
  int64_t vocab = 0;  // the width of a logits row (the model's vocab_size)
  // Called after each window (index from 0, total); may be empty.
  std::function<void(size_t window, size_t windows)> progress;
};

struct KlStats {
  double mean = 0, max = 0, p99 = 0;
};

struct PerplexityResult {
  int64_t tokens = 0, scored = 0, windows = 0;
  double nll_sum = 0, mean_nll = 0, perplexity = 0;
  // With a reference model:
  bool has_reference = false;
  double reference_nll_sum = 0, reference_mean_nll = 0, reference_perplexity = 0;
  KlStats kl;                 // of KL(P_reference || Q_model) over the scored positions
  int64_t top1_matches = 0;   // scored positions where both argmaxes agree
  double top1_agreement = 0;  // top1_matches / scored
};

enum class PerplexityFailure {
  kBadInput,   // context, stride, token ids or vocab the protocol cannot run with
  kNonFinite,  // a window's logits hold NaN or an infinity
  kModel,      // the callback failed, or returned the wrong number of logits
};
struct PerplexityError {
  PerplexityFailure kind = PerplexityFailure::kBadInput;
  std::string message;
};

// Runs the windows over `model` (and `reference`, when not null, on the same windows) and scores them. Every
// token must be in [0, vocab). A non-finite logit anywhere in a window's rows stops the run with an error naming
// the window and the absolute token position whose row it is.
tl::expected<PerplexityResult, PerplexityError> perplexity_run(std::span<const int32_t> tokens,
                                                               const PerplexityOptions& options,
                                                               const WindowLogits& model,
                                                               const WindowLogits* reference);

}  // namespace tern
