// The CPU model path against transformers: every fixture's reference.json (tests/fixtures/README.md) holds, per
// prompt, the top-16 teacher-forced logits at every position and a 24-token greedy continuation, computed by
// transformers in fp32. Also: cached decode equals recomputation, and batching does not change a sequence's result.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <map>
#include <numeric>

#include "runtime/model_runner.h"

namespace tern {
namespace {

struct Case {
  std::string fixture;
  std::string reference;
  bool w4a4;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.fixture << "/" << c.reference << (c.w4a4 ? " (W4A4)" : ""); }

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return info.param.fixture + (info.param.w4a4 ? "_w4a4" : info.param.reference == "reference.json" ? "" : "_w4a16");
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return nlohmann::json::parse(in);
}

std::unique_ptr<ModelRunner> load(const Case& c) {
  ModelLoadOptions options;
  options.nvfp4_activations = c.w4a4 ? Nvfp4Activations::kQuantize : Nvfp4Activations::kDequantize;
  auto model = runner_load(std::string(TERN_FIXTURES_DIR) + "/" + c.fixture, options);
  EXPECT_TRUE(model.has_value()) << (model ? "" : model.error().message);
  return model ? std::move(*model) : nullptr;
}

int32_t argmax(const float* row, int64_t n) { return static_cast<int32_t>(std::max_element(row, row + n) - row); }

std::vector<int32_t> top_k_ids(const float* row, int64_t n, int64_t k) {
  std::vector<int32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
  ids.resize(k);
  return ids;
}

class ModelReference : public testing::TestWithParam<Case> {};

// At each position: every reference top-K logit is matched within 1e-3 * max |reference logit|, and the top-K sets
// agree except for ids whose reference logit is within that tolerance of the K-th.
TEST_P(ModelReference, TeacherForcedLogitsMatchTransformers) {
  const Case& c = GetParam();
  auto model = load(c);
  ASSERT_TRUE(model);
  const auto ref = read_json(std::string(TERN_FIXTURES_DIR) + "/" + c.fixture + "/" + c.reference);
  const int64_t vocab = model->config().vocab_size;
  double worst = 0.0;  // max |ours - reference| / max |reference| over all positions, for the log
  for (size_t p = 0; p < ref["prompts"].size(); ++p) {
    const auto prompt = ref["prompts"][p].get<std::vector<int32_t>>();
    SequenceCache seq = model->new_sequence();
    const std::vector<SequenceInput> batch{{&seq, prompt}};
    auto logits = model->forward(batch, LogitsFor::kAllTokens);
    ASSERT_TRUE(logits.has_value()) << logits.error().message;
    const auto& positions = ref["teacher_forced"][p]["positions"];
    ASSERT_EQ(positions.size(), prompt.size());
    for (size_t t = 0; t < prompt.size(); ++t) {
      const auto ids = positions[t]["ids"].get<std::vector<int32_t>>();
      const auto want = positions[t]["logits"].get<std::vector<double>>();
      const float* row = &(*logits)[t * vocab];
      double max_ref = 0.0;
      for (double v : want) max_ref = std::max(max_ref, std::abs(v));
      const double tol = 1e-3 * max_ref;
      for (size_t j = 0; j < ids.size(); ++j) {
        ASSERT_TRUE(std::isfinite(row[ids[j]]));
        worst = std::max(worst, std::abs(row[ids[j]] - want[j]) / max_ref);
        ASSERT_LE(std::abs(row[ids[j]] - want[j]), tol)
            << "prompt " << p << " position " << t << " id " << ids[j] << " ours " << row[ids[j]] << " ref " << want[j];
      }
      const auto ours = top_k_ids(row, vocab, static_cast<int64_t>(ids.size()));
      for (size_t j = 0; j < ids.size(); ++j) {
        const bool clearly_in = want[j] - want.back() > tol;
        if (clearly_in) {
          ASSERT_NE(std::find(ours.begin(), ours.end(), ids[j]), ours.end())
              << "prompt " << p << " position " << t << ": reference top id " << ids[j] << " missing from ours";
        }
        if (std::find(ids.begin(), ids.end(), ours[j]) == ids.end()) {
          ASSERT_LE(row[ours[j]] - want.back(), tol) << "prompt " << p << " position " << t << ": id " << ours[j]
                                                     << " is in our top-K only";
        }
      }
    }
  }
  std::cout << "max |logit - reference| / max |reference logit| = " << worst << "\n";
}

// Prefill, then decode one token at a time from the cache, argmax each step: the 24 tokens transformers generated.
TEST_P(ModelReference, GreedyContinuationMatchesTransformers) {
  const Case& c = GetParam();
  auto model = load(c);
  ASSERT_TRUE(model);
  const auto ref = read_json(std::string(TERN_FIXTURES_DIR) + "/" + c.fixture + "/" + c.reference);
  const int64_t vocab = model->config().vocab_size;
  for (size_t p = 0; p < ref["prompts"].size(); ++p) {
    const auto prompt = ref["prompts"][p].get<std::vector<int32_t>>();
    const auto want = ref["greedy"][p]["continuation"].get<std::vector<int32_t>>();
    SequenceCache seq = model->new_sequence();
    std::vector<int32_t> next = prompt, got;
    while (got.size() < want.size()) {
      const std::vector<SequenceInput> batch{{&seq, next}};
      auto logits = model->forward(batch, LogitsFor::kLastToken);
      ASSERT_TRUE(logits.has_value()) << logits.error().message;
      got.push_back(argmax(logits->data(), vocab));
      next = {got.back()};
    }
    EXPECT_EQ(got, want) << "prompt " << p;
  }
}

// Logits of decode steps from the cache equal those of one forward pass over the whole sequence.
TEST_P(ModelReference, CachedDecodeEqualsRecomputation) {
  auto model = load(GetParam());
  ASSERT_TRUE(model);
  const int64_t vocab = model->config().vocab_size;
  const std::vector<int32_t> tokens{17, 300, 42, 99, 5, 250, 123, 7, 411, 64, 8, 199};
  SequenceCache cached = model->new_sequence();
  std::vector<float> stepwise;
  const std::vector<SequenceInput> prefill{{&cached, std::span(tokens).first(5)}};
  auto first = model->forward(prefill, LogitsFor::kAllTokens);
  ASSERT_TRUE(first.has_value());
  stepwise = *first;
  for (size_t t = 5; t < tokens.size(); ++t) {
    const std::vector<SequenceInput> step{{&cached, std::span(tokens).subspan(t, 1)}};
    auto logits = model->forward(step, LogitsFor::kLastToken);
    ASSERT_TRUE(logits.has_value());
    stepwise.insert(stepwise.end(), logits->begin(), logits->end());
  }
  SequenceCache fresh = model->new_sequence();
  const std::vector<SequenceInput> whole{{&fresh, tokens}};
  auto all = model->forward(whole, LogitsFor::kAllTokens);
  ASSERT_TRUE(all.has_value());
  ASSERT_EQ(all->size(), stepwise.size());
  float max_abs = 0.0f;
  for (float v : *all) max_abs = std::max(max_abs, std::abs(v));
  for (size_t i = 0; i < stepwise.size(); ++i) {
    ASSERT_TRUE(std::isfinite(stepwise[i]));
    ASSERT_NEAR(stepwise[i], (*all)[i], 1e-5f * max_abs) << "token " << i / vocab << " id " << i % vocab;
  }
}

// Three sequences of different lengths prefilled and decoded together give each exactly its solo result.
TEST_P(ModelReference, BatchEqualsSequencesAlone) {
  auto model = load(GetParam());
  ASSERT_TRUE(model);
  const std::vector<std::vector<int32_t>> prompts{{11, 22, 33}, {400, 5, 60, 7, 80, 9, 100}, {250}};
  const std::vector<int32_t> decode_tokens{13, 14, 15};
  auto run = [&](std::vector<size_t> which) {
    std::vector<SequenceCache> caches;
    for (size_t i = 0; i < which.size(); ++i) caches.push_back(model->new_sequence());
    std::vector<std::vector<float>> per_seq(which.size());
    for (int step = -1; step < static_cast<int>(decode_tokens.size()); ++step) {
      std::vector<SequenceInput> batch;
      for (size_t i = 0; i < which.size(); ++i) {
        batch.push_back({&caches[i], step < 0 ? std::span<const int32_t>(prompts[which[i]])
                                              : std::span<const int32_t>(&decode_tokens[step], 1)});
      }
      auto logits = model->forward(batch, LogitsFor::kLastToken);
      EXPECT_TRUE(logits.has_value());
      const size_t v = logits->size() / which.size();
      for (size_t i = 0; i < which.size(); ++i) {
        per_seq[i].insert(per_seq[i].end(), logits->begin() + i * v, logits->begin() + (i + 1) * v);
      }
    }
    return per_seq;
  };
  const auto together = run({0, 1, 2});
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto alone = run({i});
    ASSERT_EQ(alone[0].size(), together[i].size());
    for (size_t j = 0; j < alone[0].size(); ++j) ASSERT_EQ(alone[0][j], together[i][j]) << "sequence " << i << " " << j;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ModelReference,
                         testing::Values(Case{"qwen3", "reference.json", false},
                                         Case{"qwen3_moe", "reference.json", false},
                                         Case{"qwen3_5_moe", "reference.json", false},
                                         Case{"qwen3_5_moe_fused", "reference.json", false},
                                         Case{"qwen3_5_moe_nvfp4", "reference_w4a16.json", false},
                                         Case{"qwen3_5_moe_nvfp4", "reference_w4a4.json", true},
                                         Case{"glm_moe_dsa", "reference.json", false}),
                         case_name);

}  // namespace
}  // namespace tern

namespace tern {
namespace {

// Intermediates reach a tracer under stable names, one row per batch row, all finite.
TEST(ModelTrace, NamedIntermediatesOfEveryBlock) {
  auto model = runner_load(std::string(TERN_FIXTURES_DIR) + "/qwen3_5_moe", {});
  ASSERT_TRUE(model.has_value()) << model.error().message;
  std::map<std::string, std::pair<int64_t, int64_t>> seen;
  bool all_finite = true;
  const Tracer tracer = [&](std::string_view name, const float* data, int64_t rows, int64_t cols) {
    seen[std::string(name)] = {rows, cols};
    for (int64_t i = 0; i < rows * cols; ++i) all_finite = all_finite && std::isfinite(data[i]);
  };
  SequenceCache seq = (*model)->new_sequence();
  const std::vector<int32_t> tokens{5, 6, 7};
  const std::vector<SequenceInput> batch{{&seq, tokens}};
  ASSERT_TRUE((*model)->forward(batch, LogitsFor::kLastToken, &tracer).has_value());
  EXPECT_TRUE(all_finite);
  for (const char* name : {"layers.0.gdn_core", "layers.1.attn", "layers.0.router_logits", "layers.0.mixer_out",
                           "layers.3.ffn_out", "layers.3.out", "final_norm"}) {
    ASSERT_TRUE(seen.contains(name)) << name;
  }
  EXPECT_EQ(seen["layers.0.gdn_core"], (std::pair<int64_t, int64_t>{3, 128}));  // 4 value heads x 32
  EXPECT_EQ(seen["layers.1.attn"], (std::pair<int64_t, int64_t>{3, 256}));      // 4 heads x 64
  EXPECT_EQ(seen["layers.0.router_logits"], (std::pair<int64_t, int64_t>{3, 8}));
  EXPECT_EQ(seen["final_norm"], (std::pair<int64_t, int64_t>{1, 64}));
}

}  // namespace
}  // namespace tern

namespace tern {
namespace {

// forward_sample on the CPU: each row's token is what its own Sampler picks from forward's logits of the same step
// (greedy, and a seeded random row whose stream must advance exactly as the Sampler's); a row without a sampler
// gets an entry and consumes nothing; a row count that does not match the batch is an error.
TEST(ModelForwardSample, CpuRowsAreTheirSamplersTokens) {
  auto model = runner_load(std::string(TERN_FIXTURES_DIR) + "/qwen3", {});
  ASSERT_TRUE(model.has_value()) << model.error().message;
  ModelRunner& m = **model;
  const int64_t vocab = m.config().vocab_size;
  const std::vector<SamplingParams> params{{.temperature = 0.0f, .logprobs = 3},
                                           {.temperature = 0.8f, .top_p = 0.9f, .seed = 5}};
  std::vector<Sampler> sampled_by_step{Sampler(params[0]), Sampler(params[1])};
  std::vector<Sampler> reference{Sampler(params[0]), Sampler(params[1])};
  const std::vector<int32_t> prompt{7, 300, 42};
  std::vector<SequenceCache> a{m.new_sequence(), m.new_sequence(), m.new_sequence()};
  std::vector<SequenceCache> b{m.new_sequence(), m.new_sequence(), m.new_sequence()};
  std::vector<std::vector<int32_t>> next(3, prompt), outputs(2);
  for (int step = 0; step < 6; ++step) {
    const std::vector<SequenceInput> batch_a{{&a[0], next[0]}, {&a[1], next[1]}, {&a[2], next[2]}};
    const std::vector<SequenceInput> batch_b{{&b[0], next[0]}, {&b[1], next[1]}, {&b[2], next[2]}};
    const std::vector<SampleRow> rows{{&sampled_by_step[0], prompt, outputs[0]},
                                      {&sampled_by_step[1], prompt, outputs[1]},
                                      {}};
    auto got = m.forward_sample(batch_a, rows);
    ASSERT_TRUE(got.has_value()) << got.error().message;
    ASSERT_EQ(got->size(), 3u);
    auto logits = m.forward(batch_b, LogitsFor::kLastToken);
    ASSERT_TRUE(logits.has_value()) << logits.error().message;
    for (size_t i = 0; i < 2; ++i) {
      auto want = reference[i].sample(std::span<const float>(*logits).subspan(i * vocab, vocab), prompt, outputs[i]);
      ASSERT_TRUE((*got)[i].has_value() && want.has_value()) << "step " << step << " row " << i;
      EXPECT_EQ((*got)[i]->id, want->id) << "step " << step << " row " << i;
      EXPECT_FLOAT_EQ((*got)[i]->logprob, want->logprob);
      EXPECT_EQ((*got)[i]->top_logprobs, want->top_logprobs);
      outputs[i].push_back(want->id);
      next[i] = {want->id};
    }
    EXPECT_TRUE((*got)[2].has_value());
    next[2] = {static_cast<int32_t>(step + 1)};
  }
  const std::vector<SequenceInput> one{{&a[0], next[0]}};
  const auto mismatch = m.forward_sample(one, std::vector<SampleRow>(2));
  ASSERT_FALSE(mismatch.has_value());
  EXPECT_NE(mismatch.error().message.find("2 sampling rows for 1 sequences"), std::string::npos)
      << mismatch.error().message;
}

}  // namespace
}  // namespace tern
