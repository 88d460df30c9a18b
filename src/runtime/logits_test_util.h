// The logits a model gives a prompt, for tests that compare models or devices on them (fp8_checkpoint_test.cc,
// rope_scaling_test.cc, cuda_runner_test.cc).
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <vector>

#include "runtime/model_runner.h"

namespace tern {

// Every token's logits of `tokens` run as one new sequence of the model in `dir` loaded with `options`; empty after
// a failure, which the calling test records.
inline std::vector<float> all_token_logits(const std::filesystem::path& dir, const ModelLoadOptions& options,
                                           const std::vector<int32_t>& tokens) {
  auto model = runner_load(dir, options);
  EXPECT_TRUE(model.has_value()) << (model ? "" : model.error().message);
  if (!model) return {};
  SequenceCache cache = (*model)->new_sequence();
  const std::vector<SequenceInput> batch{{&cache, tokens}};
  auto logits = (*model)->forward(batch, LogitsFor::kAllTokens);
  EXPECT_TRUE(logits.has_value()) << (logits ? "" : logits.error().message);
  return logits ? *logits : std::vector<float>{};
}

}  // namespace tern
