#include "runtime/engine.h"

#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <random>

namespace tern {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<ModelRunner> load_fixture() {
  auto model = runner_load(std::string(TERN_FIXTURES_DIR) + "/qwen3", {});
  EXPECT_TRUE(model) << (model ? "" : model.error().message);
  return model ? std::move(*model) : nullptr;
}

struct Result {
  std::vector<int32_t> ids;
  std::string finish_reason;
};

Result drain(RequestStream& stream) {
  Result r;
  for (int spins = 0; spins < 600; ++spins) {
    for (TokenEvent& e : stream.wait(100ms)) {
      if (e.token_id >= 0) r.ids.push_back(e.token_id);
      if (e.finished) {
        r.finish_reason = e.finish_reason;
        return r;
      }
    }
  }
  ADD_FAILURE() << "no final event";
  return r;
}

GenerationRequest greedy(std::vector<int32_t> prompt, int32_t max_tokens) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0.0f;
  r.stop.max_tokens = max_tokens;
  return r;
}

// The reference is the plain one-sequence loop of `tern generate` (one forward per token, no scheduler).
std::vector<int32_t> generate_alone(ModelRunner& model, std::vector<int32_t> prompt, int32_t max_tokens) {
  SequenceCache seq = model.new_sequence();
  Sampler sampler(greedy({}, 1).sampling);
  std::vector<int32_t> out, next = prompt;
  while (static_cast<int32_t>(out.size()) < max_tokens) {
    const std::vector<SequenceInput> batch{{&seq, next}};
    auto logits = model.forward(batch, LogitsFor::kLastToken);
    EXPECT_TRUE(logits);
    auto t = sampler.sample(*logits, prompt, out);
    EXPECT_TRUE(t);
    out.push_back(t->id);
    next = {t->id};
    const std::vector<int64_t>& eos = model.config().eos_token_ids;
    if (std::find(eos.begin(), eos.end(), t->id) != eos.end()) break;
  }
  return out;
}

TEST(Engine, ConcurrentGreedyRequestsMatchTheSingleSequenceLoop) {
  auto reference_model = load_fixture();
  ASSERT_TRUE(reference_model);
  EngineMetrics metrics;
  // Small budget and KV capacity: prefills are chunked, mixed with decodes, and some sequences get preempted.
  EngineConfig config{.scheduler = {.max_running = 6, .max_waiting = 64, .token_budget = 24, .block_size = 4,
                                    .num_blocks = 40},
                      .context_length = 256};
  Engine engine(load_fixture(), std::nullopt, config, metrics);
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 12; ++i) {
    std::vector<int32_t> p(5 + rng() % 40);
    for (int32_t& t : p) t = static_cast<int32_t>(rng() % 500);
    prompts.push_back(p);
    auto s = engine.submit(greedy(p, 12));
    ASSERT_TRUE(s);
    streams.push_back(*s);
  }
  for (size_t i = 0; i < streams.size(); ++i) {
    Result r = drain(*streams[i]);
    EXPECT_EQ(r.ids, generate_alone(*reference_model, prompts[i], 12)) << "request " << i;
    EXPECT_TRUE(r.finish_reason == "length" || r.finish_reason == "stop");
  }
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(metrics.kv_blocks_used.load(), 0);
  EXPECT_EQ(metrics.num_running.load(), 0);
  EXPECT_GT(metrics.generation_tokens.load(), 12u);
}

// Speculation in the engine on the trained demo model (its MTP layer drafts): the same greedy tokens as the plain
// loop for concurrent requests with chunked prompts and preemptions, drafts verified and accepted, and the metrics
// counting them; a batch at --speculative-disable-batch-size verifies nothing and still gives the same tokens.
std::unique_ptr<ModelRunner> load_demo_with_draft() {
  ModelLoadOptions options;
  options.load_draft = true;
  auto model = runner_load(std::string(TERN_SOURCE_DIR) + "/demo/tern-demo-bf16", options);
  EXPECT_TRUE(model) << (model ? "" : model.error().message);
  return model ? std::move(*model) : nullptr;
}

void expect_speculative_engine_matches(int disable_batch_size, bool adaptive = false) {
  auto reference = load_demo_with_draft();
  ASSERT_TRUE(reference);
  EngineMetrics metrics;
  // Few KV blocks: some sequences are preempted and recomputed (their drafts dropped with their cache).
  EngineConfig config{.scheduler = {.max_running = 4, .max_waiting = 64, .token_budget = 40, .block_size = 4,
                                    .num_blocks = 36},
                      .context_length = 256, .speculative_steps = 3,
                      .speculative_disable_batch_size = disable_batch_size,
                      .speculative_adaptive = adaptive};
  Engine engine(load_demo_with_draft(), std::nullopt, config, metrics);
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 8; ++i) {
    // Token ids of common words cut from ordinary ids: the demo's vocabulary is byte-level BPE over 4,096 ids.
    std::vector<int32_t> p(3 + rng() % 30);
    for (int32_t& t : p) t = static_cast<int32_t>(200 + rng() % 800);
    prompts.push_back(p);
    auto s = engine.submit(greedy(p, 20));
    ASSERT_TRUE(s);
    streams.push_back(*s);
  }
  for (size_t i = 0; i < streams.size(); ++i) {
    Result r = drain(*streams[i]);
    EXPECT_EQ(r.ids, generate_alone(*reference, prompts[i], 20)) << "request " << i;
  }
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(metrics.kv_blocks_used.load(), 0);
  if (disable_batch_size == 1) {
    EXPECT_EQ(metrics.spec_draft_tokens.load(), 0u);
  } else {
    EXPECT_GT(metrics.spec_verify_steps.load(), 0u);
    EXPECT_GT(metrics.spec_accepted_tokens.load(), 0u);
    EXPECT_LT(metrics.spec_accepted_tokens.load(), metrics.spec_draft_tokens.load());
    EXPECT_LE(metrics.spec_draft_tokens.load(), 3 * metrics.spec_verify_steps.load());
    EXPECT_GT(metrics.preemptions.load(), 0u);
    // By position: each count of the totals once, the first position verified in every verification, a later one
    // accepted only as often as the one before it, none past the 3 steps asked for.
    uint64_t drafted = 0, accepted = 0;
    for (int k = 0; k < EngineMetrics::kSpecPositions; ++k) {
      const uint64_t d = metrics.spec_draft_tokens_at[static_cast<size_t>(k)].load();
      const uint64_t a = metrics.spec_accepted_tokens_at[static_cast<size_t>(k)].load();
      drafted += d;
      accepted += a;
      EXPECT_LE(a, d) << "position " << k;
      if (k == 0) {
        EXPECT_EQ(d, metrics.spec_verify_steps.load());
      } else {
        EXPECT_LE(a, metrics.spec_accepted_tokens_at[static_cast<size_t>(k - 1)].load()) << "position " << k;
      }
      if (k >= 3) {
        EXPECT_EQ(d, 0u) << "position " << k;
      }
    }
    EXPECT_EQ(drafted, metrics.spec_draft_tokens.load());
    EXPECT_EQ(accepted, metrics.spec_accepted_tokens.load());
  }
}

TEST(Engine, SpeculativeGreedyRequestsMatchTheSingleSequenceLoop) { expect_speculative_engine_matches(0); }

TEST(Engine, SpeculationOffPastTheDisableBatchSizeGivesTheSameTokens) { expect_speculative_engine_matches(1); }

// --speculative-adaptive: the engine switches between verifying and plain steps as the governor decides (first
// verifying, then plain to measure it), and the tokens stay those of the plain loop.
TEST(Engine, AdaptiveSpeculationGivesTheSameTokens) { expect_speculative_engine_matches(0, true); }

// A request's prompt logprobs (GenerationRequest::prompt_logprobs) and its generated ids.
struct Scored {
  std::vector<SampledToken> prompt;
  Result result;
};

Scored drain_scored(RequestStream& stream) {
  Scored s;
  for (int spins = 0; spins < 600; ++spins) {
    for (TokenEvent& e : stream.wait(100ms)) {
      s.prompt.insert(s.prompt.end(), e.prompt_logprobs.begin(), e.prompt_logprobs.end());
      if (e.token_id >= 0) {
        EXPECT_TRUE(e.prompt_logprobs.empty()) << "prompt logprobs come before the first token";
        s.result.ids.push_back(e.token_id);
      }
      if (e.finished) {
        s.result.finish_reason = e.finish_reason;
        return s;
      }
    }
  }
  ADD_FAILURE() << "no final event";
  return s;
}

// Prompt logprobs against transformers (the fixture's teacher-forced top-16 logits, float64): at each position after
// the first, the prompt token's logprob and the top 3 differ from the best one as the reference logits do, the
// top 3 are the reference's best ids, and the first generated token is transformers' greedy one. The requests run
// together with a plain greedy one, which still gets the single-sequence loop's tokens.
TEST(Engine, PromptLogprobsMatchTransformers) {
  std::ifstream in(std::string(TERN_FIXTURES_DIR) + "/qwen3/reference.json");
  const nlohmann::json ref = nlohmann::json::parse(in);
  EngineMetrics metrics;
  EngineConfig config{.scheduler = {.max_running = 8, .token_budget = 64}, .context_length = 256};
  Engine engine(load_fixture(), std::nullopt, config, metrics);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& prompt : ref["prompts"]) {
    GenerationRequest r = greedy(prompt.get<std::vector<int32_t>>(), 1);
    r.prompt_logprobs = 3;
    auto s = engine.submit(std::move(r));
    ASSERT_TRUE(s) << s.error().message;
    streams.push_back(*s);
  }
  const std::vector<int32_t> plain_prompt{7, 100, 3, 250, 9, 41};
  auto plain = engine.submit(greedy(plain_prompt, 12));
  ASSERT_TRUE(plain);
  for (size_t p = 0; p < streams.size(); ++p) {
    SCOPED_TRACE("prompt " + std::to_string(p));
    const auto prompt = ref["prompts"][p].get<std::vector<int32_t>>();
    const Scored got = drain_scored(*streams[p]);
    ASSERT_EQ(got.prompt.size(), prompt.size() - 1);
    for (size_t t = 0; t + 1 < prompt.size(); ++t) {
      const SampledToken& lp = got.prompt[t];
      const auto& pos = ref["teacher_forced"][p]["positions"][t];
      const auto ids = pos["ids"].get<std::vector<int32_t>>();
      const auto logits = pos["logits"].get<std::vector<double>>();
      double max_ref = 0.0;
      for (double v : logits) max_ref = std::max(max_ref, std::abs(v));
      const double tol = 2e-3 * max_ref;
      EXPECT_EQ(lp.id, prompt[t + 1]);
      ASSERT_TRUE(std::isfinite(lp.logprob) && lp.logprob <= 0.0f) << lp.logprob;
      ASSERT_EQ(lp.top_logprobs.size(), 3u);
      for (size_t j = 0; j < 3; ++j) {
        if (logits[j] - logits[j + 1] > tol && (j == 0 || logits[j - 1] - logits[j] > tol)) {
          EXPECT_EQ(lp.top_logprobs[j].first, ids[j]) << "position " << t << " rank " << j;
        }
        EXPECT_NEAR(lp.top_logprobs[0].second - lp.top_logprobs[j].second, logits[0] - logits[j], tol)
            << "position " << t << " rank " << j;
      }
      auto at = std::find(ids.begin(), ids.end(), prompt[t + 1]);
      if (at != ids.end()) {
        EXPECT_NEAR(lp.logprob - lp.top_logprobs[0].second, logits[at - ids.begin()] - logits[0], tol)
            << "position " << t;
      } else {
        EXPECT_LT(lp.logprob - lp.top_logprobs[0].second, logits.back() - logits[0] + tol) << "position " << t;
      }
    }
    ASSERT_EQ(got.result.ids.size(), 1u);
    EXPECT_EQ(got.result.ids[0], ref["greedy"][p]["continuation"][0].get<int32_t>());
  }
  auto alone = load_fixture();
  ASSERT_TRUE(alone);
  EXPECT_EQ(drain(**plain).ids, generate_alone(*alone, plain_prompt, 12));
}

// A prompt longer than a prompt-logprobs step (max_running = 64 tokens here) runs over several steps: every position's
// logprob is sent once, in order, and equals the one of a single forward over the whole prompt; the tokens
// generated after it are the single-sequence loop's.
TEST(Engine, PromptLogprobsOverSeveralStepsEqualOneForward) {
  std::mt19937 rng(17);
  std::vector<int32_t> prompt(2 * kPromptLogprobsChunk + 37);
  for (int32_t& id : prompt) id = static_cast<int32_t>(rng() % 512);
  EngineMetrics metrics;
  EngineConfig config{.scheduler = {.token_budget = 2048}, .context_length = 1024};
  Engine engine(load_fixture(), std::nullopt, config, metrics);
  GenerationRequest r = greedy(prompt, 5);
  r.prompt_logprobs = 1;
  auto s = engine.submit(std::move(r));
  ASSERT_TRUE(s) << s.error().message;
  const Scored got = drain_scored(**s);

  auto alone = load_fixture();
  ASSERT_TRUE(alone);
  SequenceCache seq = alone->new_sequence();
  const std::vector<SequenceInput> batch{{&seq, prompt}};
  auto logits = alone->forward(batch, LogitsFor::kAllTokens);
  ASSERT_TRUE(logits);
  const auto vocab = static_cast<size_t>(alone->config().vocab_size);
  ASSERT_EQ(got.prompt.size(), prompt.size() - 1);
  for (size_t t = 0; t + 1 < prompt.size(); ++t) {
    auto want = logits_token_logprob(std::span<const float>(*logits).subspan(t * vocab, vocab), prompt[t + 1], 1);
    ASSERT_TRUE(want);
    EXPECT_EQ(got.prompt[t].id, prompt[t + 1]) << t;
    EXPECT_NEAR(got.prompt[t].logprob, want->logprob, 1e-4) << "position " << t;
    ASSERT_EQ(got.prompt[t].top_logprobs.size(), 1u);
    EXPECT_NEAR(got.prompt[t].top_logprobs[0].second, want->top_logprobs[0].second, 1e-4) << "position " << t;
  }
  auto fresh = load_fixture();
  ASSERT_TRUE(fresh);
  EXPECT_EQ(got.result.ids, generate_alone(*fresh, prompt, 5));
}

TEST(Engine, CancelFreesTheSequenceAndShutdownAbortsTheRest) {
  EngineMetrics metrics;
  EngineConfig config{.scheduler = {.max_running = 2, .max_waiting = 2, .token_budget = 64, .block_size = 16,
                                    .num_blocks = 64},
                      .context_length = 256};
  Engine engine(load_fixture(), std::nullopt, config, metrics);
  auto a = engine.submit(greedy({1, 2, 3}, 200));
  ASSERT_TRUE(a);
  (*a)->cancel();
  EXPECT_EQ(drain(**a).finish_reason, "abort");
  auto b = engine.submit(greedy({4, 5, 6}, 240));
  ASSERT_TRUE(b);
  engine.shutdown();
  EXPECT_EQ(drain(**b).finish_reason, "abort");
  EXPECT_FALSE(engine.submit(greedy({1}, 1)));
  EXPECT_EQ(metrics.kv_blocks_used.load(), 0);
}

// vLLM's min_tokens: with the EOS pushed to the top by a +100 bias, a request gets the EOS at once, and with
// min_tokens 4 four other tokens first, then the EOS ("stop"), greedy and drawn. Also on a two-rank tensor-parallel
// model, where the ban travels in each step's plan.
TEST(Engine, MinTokensHoldsOffTheEos) {
  for (int tp : {1, 2}) {
    SCOPED_TRACE("tensor-parallel size " + std::to_string(tp));
    EngineMetrics metrics;
    auto model = runner_load(std::string(TERN_FIXTURES_DIR) + "/qwen3", {.tensor_parallel_size = tp});
    ASSERT_TRUE(model) << model.error().message;
    const auto eos = static_cast<int32_t>((*model)->config().eos_token_ids.at(0));
    Engine engine(std::move(*model), std::nullopt, EngineConfig{}, metrics);
    auto request = [&](int32_t min_tokens, float temperature) {
      GenerationRequest r = greedy({1, 2, 3, 4}, 10);
      r.sampling.temperature = temperature;
      r.sampling.seed = 11;
      r.sampling.logit_bias = {{eos, 100.0f}};
      r.stop.min_tokens = min_tokens;
      return r;
    };
    auto at_once = engine.submit(request(0, 0.0f));
    ASSERT_TRUE(at_once);
    const Result first = drain(**at_once);
    EXPECT_EQ(first.ids, std::vector<int32_t>{eos});
    EXPECT_EQ(first.finish_reason, "stop");
    for (float temperature : {0.0f, 1.0f}) {
      auto held = engine.submit(request(4, temperature));
      ASSERT_TRUE(held);
      const Result r = drain(**held);
      ASSERT_EQ(r.ids.size(), 5u) << "temperature " << temperature;
      for (size_t i = 0; i < 4; ++i) EXPECT_NE(r.ids[i], eos) << i;
      EXPECT_EQ(r.ids[4], eos);
      EXPECT_EQ(r.finish_reason, "stop");
    }
  }
}

// min_tokens under speculative decoding (the demo model's MTP layer drafting, 1 and 3 drafts a step, one and two
// tensor-parallel ranks): each row of a verification is banned or not by its own output, drafts before it included,
// so with the EOS pushed to the top by a +100 bias the EOS comes right after min_tokens other tokens, and greedy
// gives the plain engine's tokens. Fails if a verification keeps the ban its step began with on every row (the EOS
// then comes only after the drafts accepted past min_tokens; checked: the second prompt with one draft a step
// already ends 2 tokens late).
TEST(Engine, MinTokensWithSpeculation) {
  EngineMetrics plain_metrics;
  auto plain_model = load_demo_with_draft();
  ASSERT_TRUE(plain_model);
  const auto eos = static_cast<int32_t>(plain_model->config().eos_token_ids.at(0));
  Engine plain(std::move(plain_model), std::nullopt, EngineConfig{}, plain_metrics);
  // Prompts cut from the demo's held-out text, whose drafts are accepted often enough to cross min_tokens.
  auto tokenizer = Tokenizer::load(std::string(TERN_SOURCE_DIR) + "/demo/tern-demo-bf16");
  ASSERT_TRUE(tokenizer) << tokenizer.error().message;
  std::ifstream text_file(std::string(TERN_SOURCE_DIR) + "/demo/heldout.txt");
  const std::string text((std::istreambuf_iterator<char>(text_file)), std::istreambuf_iterator<char>());
  const std::vector<int32_t> text_ids = tokenizer->encode(text);
  ASSERT_GT(text_ids.size(), 2000u);
  // (drafts a step, tensor-parallel ranks): on two ranks the ban travels in each step's plan, resolved per row.
  for (auto [steps, tp] : {std::pair{1, 1}, {3, 1}, {3, 2}}) {
    EngineMetrics spec_metrics;
    ModelLoadOptions options;
    options.load_draft = true;
    options.tensor_parallel_size = tp;
    auto model = runner_load(std::string(TERN_SOURCE_DIR) + "/demo/tern-demo-bf16", options);
    ASSERT_TRUE(model) << model.error().message;
    Engine spec(std::move(*model), std::nullopt, EngineConfig{.speculative_steps = steps}, spec_metrics);
    for (int i = 0; i < (tp == 1 ? 16 : 8); ++i) {
      const auto at = text_ids.begin() + 97 * i;
      const std::vector<int32_t> prompt(at, at + 12 + i);
      const int32_t min_tokens = 4 + i % 8;
      for (float temperature : {0.0f, 1.0f}) {
        SCOPED_TRACE(fmt::format("{} drafts, {} ranks, prompt {}, min_tokens {}, temperature {}", steps, tp, i,
                                 min_tokens, temperature));
        GenerationRequest r = greedy(prompt, 16);
        r.sampling.temperature = temperature;
        r.sampling.seed = 5 + static_cast<uint64_t>(i);
        r.sampling.logit_bias = {{eos, 100.0f}};
        r.stop.min_tokens = min_tokens;
        auto s = spec.submit(r);
        ASSERT_TRUE(s) << s.error().message;
        const Result got = drain(**s);
        ASSERT_EQ(got.ids.size(), static_cast<size_t>(min_tokens) + 1);
        for (int32_t k = 0; k < min_tokens; ++k) EXPECT_NE(got.ids[static_cast<size_t>(k)], eos) << k;
        EXPECT_EQ(got.ids.back(), eos);
        EXPECT_EQ(got.finish_reason, "stop");
        if (temperature == 0.0f) {
          auto p = plain.submit(r);
          ASSERT_TRUE(p) << p.error().message;
          EXPECT_EQ(got.ids, drain(**p).ids);
        }
      }
    }
    EXPECT_GT(spec_metrics.spec_accepted_tokens.load(), 0u);
  }
}

TEST(Engine, ContextLengthEndsGenerationWithLength) {
  EngineMetrics metrics;
  EngineConfig config{.scheduler = {}, .context_length = 10};
  Engine engine(load_fixture(), std::nullopt, config, metrics);
  auto s = engine.submit(greedy({1, 2, 3, 4, 5, 6, 7, 8}, 100));
  ASSERT_TRUE(s);
  Result r = drain(**s);
  EXPECT_LE(r.ids.size(), 2u);
  if (r.ids.size() == 2u) {
    EXPECT_EQ(r.finish_reason, "length");
  }
}

// A runner whose device is lost after `ok_steps` steps (a tensor-parallel rank gone): its steps fail from then on
// and it says why in failure(), as TpRunner does.
class FailingRunner final : public ModelRunner {
 public:
  FailingRunner(std::unique_ptr<ModelRunner> inner, int ok_steps) : inner_(std::move(inner)), ok_steps_(ok_steps) {}
  const CausalLm& model() const override { return inner_->model(); }
  SequenceCache new_sequence() override { return inner_->new_sequence(); }
  ModelDevice device() const override { return inner_->device(); }
  std::string describe() const override { return "a runner that fails"; }
  int64_t kv_cache_tokens() const override { return inner_->kv_cache_tokens(); }
  std::optional<std::string> failure() const override {
    return failed_ ? std::optional<std::string>("rank 1: the GPU fell off the bus") : std::nullopt;
  }

 protected:
  Expected<std::vector<float>> step(std::span<const SequenceInput> batch, LogitsFor which,
                                    const Tracer* tracer) override {
    if (failed_ || steps_++ >= ok_steps_) {
      failed_ = true;
      return make_error("a step failed on 1 of 2 tensor-parallel ranks; rank 1: the GPU fell off the bus");
    }
    auto logits = inner_->forward(batch, which, tracer);
    // forward() advanced the caches; the caller's forward() advances them again.
    for (const SequenceInput& in : batch) in.cache->length -= static_cast<int64_t>(in.tokens.size());
    return logits;
  }

 private:
  std::unique_ptr<ModelRunner> inner_;
  const int ok_steps_;
  int steps_ = 0;
  bool failed_ = false;
};

TEST(Engine, AModelThatFailsForGoodEndsEveryRequestAndRefusesNewOnes) {
  EngineMetrics metrics;
  EngineConfig config{.scheduler = {.max_running = 1, .max_waiting = 8, .token_budget = 64, .block_size = 16,
                                    .num_blocks = 64},
                      .context_length = 256};
  Engine engine(std::make_unique<FailingRunner>(load_fixture(), 3), std::nullopt, config, metrics);
  EXPECT_FALSE(engine.failure().has_value());
  // One runs, the other waits (max_running 1): both end with the error.
  auto a = engine.submit(greedy({1, 2, 3}, 50));
  auto b = engine.submit(greedy({4, 5, 6}, 50));
  ASSERT_TRUE(a && b);
  const Result ra = drain(**a), rb = drain(**b);
  EXPECT_EQ(ra.finish_reason, "error");
  EXPECT_EQ(rb.finish_reason, "error");
  EXPECT_LT(ra.ids.size(), 50u);
  const auto why = engine.failure();
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("the GPU fell off the bus"), std::string::npos) << *why;
  auto c = engine.submit(greedy({7}, 5));
  ASSERT_FALSE(c.has_value());
  EXPECT_NE(c.error().message.find("can run no more steps"), std::string::npos) << c.error().message;
  engine.shutdown();  // the gauges are published after each loop: wait for the last
  EXPECT_EQ(metrics.kv_blocks_used.load(), 0);
}

}  // namespace
}  // namespace tern
