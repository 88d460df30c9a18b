#include "runtime/perplexity.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>

namespace tern {
namespace {

tl::unexpected<PerplexityError> failure(PerplexityFailure kind, std::string message) {
  return tl::unexpected<PerplexityError>(PerplexityError{kind, std::move(message)});
}

// The first non-finite value of a window's rows, as an error naming the window and the token whose row it is.
std::optional<PerplexityError> find_non_finite(std::span<const float> logits, int64_t vocab, size_t window,
                                               const PerplexityWindow& w, const char* which) {
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isfinite(logits[i])) continue;
    const int64_t row = static_cast<int64_t>(i) / vocab;
    return PerplexityError{
        PerplexityFailure::kNonFinite,
        fmt::format("{}: non-finite logit ({}) at token position {} (the row after that token; vocabulary id {}) in "
                    "window {} (tokens [{}, {}))",
                    which, logits[i], w.begin + row, static_cast<int64_t>(i) % vocab, window, w.begin, w.end)};
  }
  return std::nullopt;
}

tl::expected<std::vector<float>, PerplexityError> window_logits(const WindowLogits& logits_of, int64_t vocab,
                                                                size_t index, const PerplexityWindow& w,
                                                                const char* which) {
  auto logits = logits_of(w.begin, w.end);
  if (!logits) {
    return failure(PerplexityFailure::kModel, fmt::format("{}: window {} (tokens [{}, {})): {}", which, index, w.begin,
                                                          w.end, logits.error().message));
  }
  const size_t want = static_cast<size_t>((w.end - w.begin) * vocab);
  if (logits->size() != want) {
    return failure(PerplexityFailure::kModel,
                   fmt::format("{}: window {} (tokens [{}, {})) returned {} logits, expected {} rows of {}", which,
                               index, w.begin, w.end, logits->size(), w.end - w.begin, vocab));
  }
  if (auto bad = find_non_finite(*logits, vocab, index, w, which)) return tl::unexpected<PerplexityError>(*bad);
  return std::move(*logits);
}

}  // namespace

Expected<std::vector<PerplexityWindow>> perplexity_windows(int64_t tokens, int64_t context, int64_t stride) {
  if (context < 2) return make_error("the context must be at least 2 tokens, got {}", context);
  if (stride < 1 || stride > context) {
    return make_error("the stride must be between 1 and the context ({}), got {}", context, stride);
  }
  if (tokens < 2) return make_error("perplexity needs at least 2 tokens, got {}", tokens);
  std::vector<PerplexityWindow> windows;
  int64_t prev_end = 0;
  for (int64_t w = 0;; ++w) {
    const int64_t begin = w * stride;
    const int64_t end = std::min(begin + context, tokens);
    windows.push_back({.begin = begin, .end = end, .first_target = std::max(prev_end, begin + 1)});
    prev_end = end;
    if (end == tokens) break;
  }
  return windows;
}

double log_sum_exp(std::span<const float> row) {
  const float max = *std::max_element(row.begin(), row.end());
  double sum = 0;
  for (const float x : row) sum += std::exp(static_cast<double>(x) - static_cast<double>(max));
  return static_cast<double>(max) + std::log(sum);
}

double token_nll(std::span<const float> row, int32_t target) {
  return log_sum_exp(row) - static_cast<double>(row[static_cast<size_t>(target)]);
}

double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  const double p_lse = log_sum_exp(p_logits), q_lse = log_sum_exp(q_logits);
  double kl = 0;
  for (size_t i = 0; i < p_logits.size(); ++i) {
    const double log_p = static_cast<double>(p_logits[i]) - p_lse;
    const double log_q = static_cast<double>(q_logits[i]) - q_lse;
    kl += std::exp(log_p) * (log_p - log_q);
  }
  return kl;
}

int64_t argmax(std::span<const float> row) {
  return std::max_element(row.begin(), row.end()) - row.begin();  // the first of equal maxima
}

double quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double position = q * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(position));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  const double fraction = position - static_cast<double>(lo);
  return values[lo] + (values[hi] - values[lo]) * fraction;
}

tl::expected<PerplexityResult, PerplexityError> perplexity_run(std::span<const int32_t> tokens,
                                                               const PerplexityOptions& o, const WindowLogits& model,
                                                               const WindowLogits* reference) {
  if (o.vocab < 1) return failure(PerplexityFailure::kBadInput, fmt::format("vocabulary size {}", o.vocab));
  auto plan = perplexity_windows(static_cast<int64_t>(tokens.size()), o.context, o.stride);
  if (!plan) return failure(PerplexityFailure::kBadInput, plan.error().message);
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= o.vocab) {
      return failure(
          PerplexityFailure::kBadInput,
          fmt::format("token {} at position {} is outside the model's vocabulary of {}", tokens[i], i, o.vocab));
    }
  }
  const size_t vocab = static_cast<size_t>(o.vocab);
  PerplexityResult r;
  r.tokens = static_cast<int64_t>(tokens.size());
  r.windows = static_cast<int64_t>(plan->size());
  r.has_reference = reference != nullptr;
  std::vector<double> kls;
  for (size_t index = 0; index < plan->size(); ++index) {
    const PerplexityWindow& w = (*plan)[index];
    auto logits = window_logits(model, o.vocab, index, w, "model");
    if (!logits) return tl::unexpected<PerplexityError>(logits.error());
    std::vector<float> ref_logits;
    if (reference) {
      auto got = window_logits(*reference, o.vocab, index, w, "reference");
      if (!got) return tl::unexpected<PerplexityError>(got.error());
      ref_logits = std::move(*got);
    }
    for (int64_t j = w.first_target; j < w.end; ++j) {
      const size_t row = static_cast<size_t>(j - 1 - w.begin);
      const std::span<const float> q(logits->data() + row * vocab, vocab);
      r.nll_sum += token_nll(q, tokens[static_cast<size_t>(j)]);
      ++r.scored;
      if (reference) {
        const std::span<const float> p(ref_logits.data() + row * vocab, vocab);
        r.reference_nll_sum += token_nll(p, tokens[static_cast<size_t>(j)]);
        kls.push_back(kl_divergence(p, q));
        r.top1_matches += argmax(p) == argmax(q);
      }
    }
    if (o.progress) o.progress(index, plan->size());
  }
  const double scored = static_cast<double>(r.scored);
  r.mean_nll = r.nll_sum / scored;
  r.perplexity = std::exp(r.mean_nll);
  if (reference) {
    r.reference_mean_nll = r.reference_nll_sum / scored;
    r.reference_perplexity = std::exp(r.reference_mean_nll);
    double sum = 0;
    for (const double kl : kls) sum += kl;
    r.kl.mean = sum / scored;
    r.kl.max = *std::max_element(kls.begin(), kls.end());
    r.kl.p99 = quantile(std::move(kls), 0.99);
    r.top1_agreement = static_cast<double>(r.top1_matches) / scored;
  }
  return r;
}

}  // namespace tern
