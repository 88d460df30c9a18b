#include "models/model_runner.h"

namespace tern {

Expected<SampleResults> ModelRunner::forward_sample(std::span<const SequenceInput> batch,
                                                    std::span<const SampleRow> rows, const StepBody& body) {
  TERN_ASSIGN_OR_RETURN(const std::vector<float> logits, forward(batch, LogitsFor::kLastToken, nullptr, body));
  const size_t vocab = batch.empty() ? 0 : logits.size() / batch.size();
  SampleResults results;
  results.reserve(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].sampler == nullptr) {
      results.emplace_back(SampledToken{});
      continue;
    }
    results.push_back(rows[i].sampler->sample(std::span<const float>(logits).subspan(i * vocab, vocab),
                                              rows[i].prompt_ids, rows[i].output_ids));
  }
  return results;
}

}  // namespace tern
