// Speculative decoding with the MTP layer on the CPU, on the trained demo model (demo/: its MTP layer was trained
// with it, so drafts are accepted often, and rejected often too):
// - the draft module itself against the training script's PyTorch implementation: its mean NLL and top-1 on the
//   held-out text (demo/eval.json "mtp", computed by tools/train_demo.py in fp32);
// - greedy output with speculation identical to plain greedy decoding, for 1..4 draft steps, batched, with chunked
//   prompts, and with drafts forced to be all right or all wrong;
// - the caches after rejections equal to a recompute of the kept tokens;
// - sampling with speculation distributed as the model's own distribution (a chi-square test);
// - refusals: a model without MTP layers, a checkpoint whose MTP weights are incomplete;
// - GLM-5's MTP layer (the GLM fixture with one written at test time): greedy output kept, one device and two
//   ranks, and the draft reading the normed hidden states (the model's, and chained its own).
#include "runtime/speculative.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>

#include "runtime/free_port_test_util.h"
#include "runtime/model_runner.h"
#include "runtime/speculative_test_util.h"
#include "runtime/tp_runner.h"
#include "tokenizer/tokenizer.h"

namespace tern {
namespace {

using namespace spec_test;

std::unique_ptr<ModelRunner> load_demo(bool draft = true, int world = 1) {
  ModelLoadOptions options;
  options.load_draft = draft;
  options.tensor_parallel_size = world;
  auto runner = runner_load(kDemo, options);
  EXPECT_TRUE(runner.has_value()) << (runner ? "" : runner.error().message);
  return runner ? std::move(*runner) : nullptr;
}

TEST(Speculative, TheDraftModuleMatchesTheTrainingScriptOnHeldOutText) {
  auto runner = load_demo();
  ASSERT_TRUE(runner);
  const auto eval = nlohmann::json::parse(read_file(std::string(TERN_DEMO_DIR) + "/eval.json"));
  ASSERT_EQ(static_cast<int64_t>(heldout_tokens().size()), eval["tokens"].get<int64_t>());
  const DraftHeldout got = draft_module_on_heldout_text(*runner);
  ASSERT_EQ(got.scored, eval["mtp"]["scored"].get<int64_t>());
  const double want = eval["mtp"]["mean_nll"].get<double>();
  EXPECT_NEAR(got.nll / static_cast<double>(got.scored), want, 1e-5 * want);
  // Top-1 of 21,310 predictions: a near-tie may fall either way between fp32 implementations.
  EXPECT_NEAR(static_cast<double>(got.hits),
              eval["mtp"]["top1_accuracy"].get<double>() * static_cast<double>(got.scored), 3.0);
}

class GreedySteps : public testing::TestWithParam<int> {};

TEST_P(GreedySteps, MatchPlainGreedyDecoding) {
  const int steps = GetParam();
  auto runner = load_demo();
  ASSERT_TRUE(runner);
  const SamplingParams greedy{.temperature = 0.0f};
  // Prompts of different lengths decoded together, prompts in chunks of 7 (so draft extends run over prompt
  // chunks that sample nothing, and decode steps share the batch with prompt chunks).
  // The last prompt has steps + 1 tokens: a prefill of a verification's size, which must still run as a prefill.
  std::vector<SpecRun> runs;
  for (auto [offset, length] : {std::pair<size_t, size_t>{0, 12}, {700, 31}, {3000, 5},
                                {5000, static_cast<size_t>(steps) + 1}}) {
    runs.emplace_back(*runner, prompt(offset, length), greedy);
  }
  const int n = 48;
  run_speculative(*runner, runs, n, steps, 7);
  int64_t drafted = 0, accepted = 0;
  for (SpecRun& r : runs) {
    const std::vector<int32_t> want = plain_greedy(*runner, r.prompt, n);
    r.output.resize(n);  // the last step may go past n
    EXPECT_EQ(r.output, want);
    drafted += r.drafted;
    accepted += r.accepted;
  }
  // Both outcomes occur on real text: drafts accepted and drafts rejected.
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, drafted);
  std::cout << steps << " steps: " << accepted << " of " << drafted << " drafts accepted\n";
}

INSTANTIATE_TEST_SUITE_P(Speculative, GreedySteps, testing::Values(1, 2, 3, 4));

TEST(Speculative, TensorParallelRanksDraftAndVerifyAsOneDevice) {
  // The demo splits at 2 ranks (4 attention heads, 2 KV heads, 4 GDN key heads, experts 64 wide): the ranks' draft
  // module and verification give the one device's greedy tokens, with drafts accepted and rejected.
  auto one = load_demo(true, 1), two = load_demo(true, 2);
  ASSERT_TRUE(one && two);
  const SamplingParams greedy{.temperature = 0.0f};
  std::vector<SpecRun> a, b;
  for (auto [offset, length] : {std::pair<size_t, size_t>{100, 14}, {2500, 6}}) {
    a.emplace_back(*one, prompt(offset, length), greedy);
    b.emplace_back(*two, prompt(offset, length), greedy);
  }
  run_speculative(*one, a, 32, 3, 8);
  run_speculative(*two, b, 32, 3, 8);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i].output.resize(32);
    b[i].output.resize(32);
    EXPECT_EQ(b[i].output, a[i].output);
    EXPECT_EQ(b[i].output, plain_greedy(*one, a[i].prompt, 32));
    EXPECT_GT(b[i].accepted, 0);
    EXPECT_LT(b[i].accepted, b[i].drafted);
  }
}

TEST(Speculative, TwoNodesDraftAndVerifyAsOneDevice) {
  // Node 1 (tp_worker_run on a thread, over Gloo and a TCP store) runs node 0's verification, keep and draft plans.
  auto one = load_demo(true, 1);
  ASSERT_TRUE(one);
  ModelLoadOptions options = two_loopback_nodes();
  options.load_draft = true;
  Expected<void> worker_result = make_error("not run");
  std::thread worker([&] {
    ModelLoadOptions node1 = options;
    node1.node_rank = 1;
    worker_result = tp_worker_run(kDemo, node1);
  });
  {
    auto split = runner_load(kDemo, options);
    ASSERT_TRUE(split.has_value()) << split.error().message;
    std::vector<SpecRun> runs;
    runs.emplace_back(**split, prompt(300, 10), SamplingParams{.temperature = 0.0f});
    run_speculative(**split, runs, 24, 2, 8);
    runs[0].output.resize(24);
    EXPECT_EQ(runs[0].output, plain_greedy(*one, runs[0].prompt, 24));
    EXPECT_GT(runs[0].accepted, 0);
    EXPECT_LT(runs[0].accepted, runs[0].drafted);
  }  // node 0's runner goes: node 1 is told to stop
  worker.join();
  EXPECT_TRUE(worker_result.has_value()) << worker_result.error().message;
}

TEST(Speculative, DraftsForcedRightOrWrongKeepGreedyOutput) {
  auto runner = load_demo();
  ASSERT_TRUE(runner);
  expect_forced_drafts_keep_greedy_output(*runner);
}

TEST(Speculative, CachesAfterRejectionsEqualARecompute) {
  auto runner = load_demo();
  ASSERT_TRUE(runner);
  std::vector<SpecRun> runs;
  runs.emplace_back(*runner, prompt(4200, 20), SamplingParams{.temperature = 0.0f});
  run_speculative(*runner, runs, 30, 3, 64);
  SpecRun& r = runs[0];
  ASSERT_GT(r.drafted, r.accepted);  // some rejections happened
  // The cache holds every token but the last output; recompute those in one prefill.
  const std::vector<int32_t> all = r.all();
  ASSERT_EQ(r.cache.length, static_cast<int64_t>(all.size()) - 1);
  SequenceCache fresh = runner->new_sequence();
  const std::vector<SequenceInput> batch{{&fresh, std::span<const int32_t>(all).first(all.size() - 1)}};
  ASSERT_TRUE(runner->forward(batch, LogitsFor::kLastToken).has_value());
  const int64_t layers = runner->config().num_hidden_layers;
  auto expect_close = [](const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double scale = 0.0, worst = 0.0;
    for (float v : want) scale = std::max(scale, std::abs(double{v}));
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << what;
      worst = std::max(worst, std::abs(double{got[i]} - double{want[i]}));
    }
    EXPECT_LE(worst, 1e-5 * scale) << what;
  };
  for (int64_t l = 0; l < layers; ++l) {
    const LayerCache& a = r.cache.layers[static_cast<size_t>(l)];
    const LayerCache& b = fresh.layers[static_cast<size_t>(l)];
    const std::string name = "layer " + std::to_string(l);
    expect_close(a.recurrent_state, b.recurrent_state, name + " recurrent state");
    expect_close(a.conv_state, b.conv_state, name + " conv state");
    if (!b.k.empty()) {
      // Entries past the length are rejected rows, overwritten later.
      expect_close(std::vector<float>(a.k.begin(), a.k.begin() + static_cast<ptrdiff_t>(b.k.size())), b.k,
                   name + " keys");
      expect_close(std::vector<float>(a.v.begin(), a.v.begin() + static_cast<ptrdiff_t>(b.v.size())), b.v,
                   name + " values");
    }
  }
}

TEST(Speculative, SamplingKeepsTheModelsDistribution) {
  auto runner = load_demo();
  ASSERT_TRUE(runner);
  expect_sampling_keeps_the_models_distribution(*runner);
}

TEST(Speculative, ModelsWithoutAWholeDraftModuleAreRefused) {
  ModelLoadOptions options;
  options.load_draft = true;
  auto dense = runner_load(std::string(TERN_FIXTURES_DIR) + "/qwen3", options);
  ASSERT_FALSE(dense.has_value());
  EXPECT_NE(dense.error().message.find("no multi-token-prediction layers"), std::string::npos)
      << dense.error().message;
  // A config without MTP layers, of an architecture that has them.
  auto none = runner_load(std::string(TERN_FIXTURES_DIR) + "/qwen3_5_moe", options);
  ASSERT_FALSE(none.has_value());
  EXPECT_NE(none.error().message.find("mtp_num_hidden_layers"), std::string::npos) << none.error().message;
  // The same fixture saying it has one: its checkpoint carries only mtp.fc and the two pre-fc norms.
  const std::filesystem::path dir = std::filesystem::path(testing::TempDir()) / "qwen3_5_moe_partial_mtp";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::filesystem::path source = std::filesystem::path(TERN_FIXTURES_DIR) / "qwen3_5_moe";
  std::filesystem::copy_file(source / "model.safetensors", dir / "model.safetensors");
  auto config = nlohmann::json::parse(read_file(source / "config.json"));
  config["text_config"]["mtp_num_hidden_layers"] = 1;
  std::ofstream(dir / "config.json") << config.dump();
  auto partial = runner_load(dir, options);
  ASSERT_FALSE(partial.has_value());
  EXPECT_NE(partial.error().message.find("mtp."), std::string::npos) << partial.error().message;
  // Without load_draft the draft calls are refused, not run.
  auto plain = load_demo(false);
  ASSERT_TRUE(plain);
  SequenceCache cache = plain->new_sequence();
  const std::vector<int32_t> t = {1, 2, 3};
  const std::vector<DraftInput> rows{{{&cache, t}, 0, DraftHidden::kModel, 0}};
  EXPECT_FALSE(plain->draft(rows, LogitsFor::kLastToken).has_value());
  std::vector<int32_t> drafts;
  Sampler sampler(SamplingParams{.temperature = 0.0f});
  SpecSequence s{.input = {&cache, t}, .following = {}, .sample = {&sampler, t, {}}, .drafts = &drafts};
  EXPECT_FALSE(speculative_step(*plain, {&s, 1}, 2).has_value());
}

// The governor of --speculative-adaptive on simulated steps: a plain step takes t_plain and gives a token, a steady
// speculative one takes t_spec and gives n_spec (the step after a switch is not steady and is not recorded, as in
// the engine). Returns the share of steps that verified, from step `from` on.
double verify_share(SpeculationGovernor& g, int steps, int from, const std::function<int(int)>& batch_at,
                    const std::function<std::tuple<double, double, double>(int, int)>& costs) {
  bool last = false;
  int verified = 0;
  for (int i = 0; i < steps; ++i) {
    const int batch = batch_at(i);
    const bool v = g.verify(batch);
    const auto [t_plain, t_spec, n_spec] = costs(i, batch);
    if (v == last) g.record(batch, v, v ? t_spec : t_plain, v ? n_spec : 1.0);
    last = v;
    if (i >= from && v) ++verified;
  }
  return static_cast<double>(verified) / (steps - from);
}

TEST(SpeculationGovernor, VerifiesWhereItPaysAndNotWhereItLoses) {
  const auto one = [](int) { return 1; };
  SpeculationGovernor pays, loses;
  // 3 tokens in 20 ms (150 per second) against 1 in 10 ms: verify, but for the probes of plain steps.
  const double share_pays = verify_share(pays, 1000, 100, one, [](int, int) { return std::tuple{0.010, 0.020, 3.0}; });
  EXPECT_GT(share_pays, 0.85);
  EXPECT_LT(share_pays, 1.0) << "plain steps are probed now and then";
  // 1.5 tokens in 20 ms (75 per second): plain, but for the probes.
  const double share_loses =
      verify_share(loses, 1000, 100, one, [](int, int) { return std::tuple{0.010, 0.020, 1.5}; });
  EXPECT_LT(share_loses, 0.15);
  EXPECT_GT(share_loses, 0.0) << "speculative steps are probed now and then";
}

TEST(SpeculationGovernor, EachBatchSizeDecidesForItself) {
  SpeculationGovernor g;
  // Batches 1 and 64 alternate: speculation pays at 1 (3 tokens in 20 ms against 10 ms), not at 64 (1.5 tokens in
  // 60 ms against 30 ms).
  int verified[2] = {0, 0}, seen[2] = {0, 0};
  bool last[2] = {false, false};
  for (int i = 0; i < 2000; ++i) {
    const int k = i % 2, batch = k == 0 ? 1 : 64;
    const bool v = g.verify(batch);
    const double t = k == 0 ? (v ? 0.020 : 0.010) : (v ? 0.060 : 0.030);
    if (v == last[k]) g.record(batch, v, t, v ? (k == 0 ? 3.0 : 1.5) : 1.0);
    last[k] = v;
    if (i >= 200) {
      ++seen[k];
      verified[k] += v ? 1 : 0;
    }
  }
  EXPECT_GT(static_cast<double>(verified[0]) / seen[0], 0.85);
  EXPECT_LT(static_cast<double>(verified[1]) / seen[1], 0.15);
}

TEST(SpeculationGovernor, FollowsAChangeInAcceptance) {
  const auto one = [](int) { return 1; };
  // Acceptance drops after step 1000 (3 tokens a step, then 1.2): the governor stops verifying.
  SpeculationGovernor falls;
  const double after_fall = verify_share(falls, 2000, 1300, one, [](int i, int) {
    return std::tuple{0.010, 0.020, i < 1000 ? 3.0 : 1.2};
  });
  EXPECT_LT(after_fall, 0.15);
  // And rises: the probes of speculative steps find it paying again.
  SpeculationGovernor rises;
  const double after_rise = verify_share(rises, 2000, 1500, one, [](int i, int) {
    return std::tuple{0.010, 0.020, i < 1000 ? 1.2 : 3.0};
  });
  EXPECT_GT(after_rise, 0.85);
  // A step without a usable time teaches nothing.
  SpeculationGovernor g;
  for (int i = 0; i < 10; ++i) g.record(1, true, std::nan(""), 3.0);
  for (int i = 0; i < 10; ++i) g.record(1, true, 0.0, 3.0);
  EXPECT_TRUE(g.verify(1)) << "still exploring speculation";
}

std::unique_ptr<ModelRunner> load_glm(const std::filesystem::path& dir, bool draft = true) {
  ModelLoadOptions options;
  options.load_draft = draft;
  auto runner = runner_load(dir, options);
  EXPECT_TRUE(runner.has_value()) << (runner ? "" : runner.error().message);
  return runner ? std::move(*runner) : nullptr;
}

// GLM-5's MTP layer as the draft: greedy output with speculation is plain greedy output for 1..4 draft steps, with
// prompts longer than the fixture's index_topk of 16 (so both the model's and the draft layer's indexers select),
// in chunks; and with drafts forced right (all accepted) or wrong (none).
TEST(Speculative, GlmMtpLayerKeepsGreedyOutput) {
  auto runner = load_glm(glm_with_mtp("glm_mtp"));
  ASSERT_TRUE(runner);
  ASSERT_NE(runner->model().draft, nullptr);
  const int32_t vocab = static_cast<int32_t>(runner->config().vocab_size);
  for (int steps : {1, 2, 3, 4}) {
    std::vector<SpecRun> runs;
    for (auto [length, seed] : {std::pair<size_t, uint32_t>{30, 1}, {9, 2}, {static_cast<size_t>(steps) + 1, 3}}) {
      runs.emplace_back(*runner, random_prompt(length, seed, vocab), SamplingParams{.temperature = 0.0f});
    }
    run_speculative(*runner, runs, 24, steps, 7);
    for (SpecRun& r : runs) {
      r.output.resize(24);
      EXPECT_EQ(r.output, plain_greedy(*runner, r.prompt, 24)) << steps << " steps";
      EXPECT_GT(r.drafted, 0);
    }
  }
  const std::vector<int32_t> p = random_prompt(20, 4, vocab);
  const int n = 20, steps = 3;
  const std::vector<int32_t> want = plain_greedy(*runner, p, n + steps + 1);
  for (const bool right : {true, false}) {
    std::vector<SpecRun> runs;
    runs.emplace_back(*runner, p, SamplingParams{.temperature = 0.0f});
    run_speculative(*runner, runs, n, steps, 64, [&](size_t, SpecRun& r) {
      if (right) {
        r.drafts.assign(want.begin() + static_cast<ptrdiff_t>(r.output.size()),
                        want.begin() + static_cast<ptrdiff_t>(r.output.size() + steps));
      } else {
        r.drafts.assign(steps, (want[r.output.size()] + 17) % vocab);
      }
    });
    EXPECT_GT(runs[0].drafted, 0);
    EXPECT_EQ(runs[0].accepted, right ? runs[0].drafted : 0);
    runs[0].output.resize(n);
    EXPECT_EQ(runs[0].output, std::vector<int32_t>(want.begin(), want.begin() + n)) << (right ? "right" : "wrong");
  }
}

// The DeepSeek / GLM draft layer reads the model's hidden state after its final norm, and chained its own after
// shared_head.norm, as the checkpoints' training code hands it over (docs/speculative.md). An RMSNorm whose weight's
// signs are flipped negates its output exactly, so:
//   - model.norm and the layer's hnorm both flipped: the model's logits are negated, and hnorm(-h) with -w is
//     hnorm(h) with w, so the draft logits over a prompt are the same bits (a layer reading the stream before the
//     final norm would see h unchanged and its hnorm output negated);
//   - shared_head.norm flipped: a draft step's logits are negated; the chained step then reads a negated hidden
//     state, so its logits are not the negated ones (a layer chaining its stream before shared_head.norm would read
//     the same state and give exactly those).
TEST(Speculative, GlmMtpLayerReadsTheNormedHiddenStates) {
  struct Run {
    std::vector<float> model, draft, chained;
  };
  auto run = [](const std::filesystem::path& dir) -> Run {
    auto r = load_glm(dir);
    EXPECT_TRUE(r);
    if (!r) return {};
    const std::vector<int32_t> t = random_prompt(25, 5, static_cast<int32_t>(r->config().vocab_size));
    SequenceCache cache = r->new_sequence();
    Run out;
    auto logits = r->forward(std::vector<SequenceInput>{{&cache, t}}, LogitsFor::kAllTokens);
    EXPECT_TRUE(logits.has_value()) << logits.error().message;
    if (logits) out.model = *logits;
    const std::vector<int32_t> next(t.begin() + 1, t.end());
    auto drafted = r->draft(std::vector<DraftInput>{{{&cache, next}, 0, DraftHidden::kModel, 0}}, LogitsFor::kAllTokens);
    EXPECT_TRUE(drafted.has_value()) << drafted.error().message;
    if (drafted) out.draft = *drafted;
    const std::vector<int32_t> one{t.back()};
    auto again = r->draft(std::vector<DraftInput>{{{&cache, one}, static_cast<int64_t>(t.size()) - 1,
                                                   DraftHidden::kDraft, 0}},
                          LogitsFor::kLastToken);
    EXPECT_TRUE(again.has_value()) << again.error().message;
    if (again) out.chained = *again;
    return out;
  };
  auto negated = [](std::vector<float> v) {
    for (float& x : v) x = -x;
    return v;
  };
  const Run a = run(glm_with_mtp("glm_mtp_a"));
  const Run b = run(glm_with_mtp("glm_mtp_b", {"model.norm.weight", "model.layers.3.hnorm.weight"}));
  const Run c = run(glm_with_mtp("glm_mtp_c", {"model.layers.3.shared_head.norm.weight"}));
  ASSERT_FALSE(a.draft.empty() || a.chained.empty() || b.draft.empty() || c.chained.empty());
  for (float v : a.draft) ASSERT_TRUE(std::isfinite(v));
  EXPECT_EQ(b.model, negated(a.model));
  EXPECT_EQ(b.draft, a.draft);
  EXPECT_EQ(c.model, a.model);
  EXPECT_EQ(c.draft, negated(a.draft));
  ASSERT_EQ(c.chained.size(), a.chained.size());
  double spread = 0.0, off = 0.0;
  for (size_t v = 0; v < a.chained.size(); ++v) {
    spread = std::max(spread, std::abs(double{a.chained[v]}));
    off = std::max(off, std::abs(double{c.chained[v]} + double{a.chained[v]}));
  }
  EXPECT_GT(off, 0.1 * spread) << "the chained step read the draft's stream before shared_head.norm";
}

// Two tensor-parallel ranks (eh_proj and the norms whole on each, the MLA and MoE layer split as the model's):
// the one device's greedy tokens with speculation.
TEST(Speculative, GlmMtpLayerAtTwoRanks) {
  const std::filesystem::path dir = glm_with_mtp("glm_mtp_tp");
  auto one = load_glm(dir);
  ModelLoadOptions options;
  options.load_draft = true;
  options.tensor_parallel_size = 2;
  auto two = runner_load(dir, options);
  ASSERT_TRUE(one && two.has_value()) << (two ? "" : two.error().message);
  const std::vector<int32_t> p = random_prompt(22, 8, static_cast<int32_t>(one->config().vocab_size));
  std::vector<SpecRun> a, b;
  a.emplace_back(*one, p, SamplingParams{.temperature = 0.0f});
  b.emplace_back(**two, p, SamplingParams{.temperature = 0.0f});
  run_speculative(*one, a, 16, 3, 8);
  run_speculative(**two, b, 16, 3, 8);
  a[0].output.resize(16);
  b[0].output.resize(16);
  EXPECT_EQ(b[0].output, a[0].output);
  EXPECT_EQ(b[0].output, plain_greedy(*one, p, 16));
  EXPECT_GT(b[0].drafted, 0);
}

// Without load_draft the checkpoint's MTP layer is skipped, not read: the model loads and decodes as the fixture.
TEST(Speculative, GlmMtpLayerIsReadOnlyWhenAskedFor) {
  auto plain = load_glm(glm_with_mtp("glm_mtp_plain"), false);
  auto fixture = load_glm(std::filesystem::path(TERN_FIXTURES_DIR) / "glm_moe_dsa", false);
  ASSERT_TRUE(plain && fixture);
  EXPECT_EQ(plain->model().draft, nullptr);
  const std::vector<int32_t> p = random_prompt(20, 6, static_cast<int32_t>(plain->config().vocab_size));
  EXPECT_EQ(plain_greedy(*plain, p, 8), plain_greedy(*fixture, p, 8));
}

TEST(Speculative, DraftRowsMustFollowTheModelsRows) {
  auto runner = load_demo();
  ASSERT_TRUE(runner);
  SequenceCache cache = runner->new_sequence();
  const std::vector<int32_t> t = prompt(50, 6);
  const std::vector<SequenceInput> batch{{&cache, t}};
  ASSERT_TRUE(runner->forward(batch, LogitsFor::kLastToken).has_value());
  const std::vector<int32_t> next(t.begin() + 1, t.end());
  // A position the model's rows do not start at, more rows than it ran, a chain with nothing before it.
  const std::vector<std::vector<DraftInput>> bad = {
      {{{&cache, next}, 1, DraftHidden::kModel, 0}},
      {{{&cache, t}, 0, DraftHidden::kModel, 0}, {{&cache, t}, 0, DraftHidden::kModel, 1}},
      {{{&cache, std::span<const int32_t>(t).first(1)}, 6, DraftHidden::kDraft, 0}},
  };
  for (const auto& rows : bad) EXPECT_FALSE(runner->draft(rows, LogitsFor::kLastToken).has_value());
  // keep_rows without a verification.
  EXPECT_FALSE(runner->keep_rows(cache, 1).has_value());
  const std::vector<DraftInput> good{{{&cache, next}, 0, DraftHidden::kModel, 0}};
  EXPECT_TRUE(runner->draft(good, LogitsFor::kLastToken).has_value());
}

}  // namespace
}  // namespace tern
