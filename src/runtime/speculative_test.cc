// Speculative decoding with the MTP layer on the CPU, on the trained demo model (demo/: its MTP layer was trained
// with it, so drafts are accepted often, and rejected often too):
// - the draft module itself against the training script's PyTorch implementation: its mean NLL and top-1 on the
//   held-out text (demo/eval.json "mtp", computed by tools/train_demo.py in fp32);
// - greedy output with speculation identical to plain greedy decoding, for 1..4 draft steps, batched, with chunked
//   prompts, and with drafts forced to be all right or all wrong;
// - the caches after rejections equal to a recompute of the kept tokens;
// - sampling with speculation distributed as the model's own distribution (a chi-square test);
// - refusals: a model without MTP layers, a checkpoint whose MTP weights are incomplete.
#include "runtime/speculative.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>


#include <thread>

#include "runtime/free_port_test_util.h"
#include "runtime/model_runner.h"
#include "runtime/tp_runner.h"
#include "tokenizer/tokenizer.h"

namespace tern {
namespace {

const std::string kDemo = std::string(TERN_DEMO_DIR) + "/tern-demo-bf16";

std::unique_ptr<ModelRunner> load_demo(bool draft = true, int world = 1) {
  ModelLoadOptions options;
  options.load_draft = draft;
  options.tensor_parallel_size = world;
  auto runner = runner_load(kDemo, options);
  EXPECT_TRUE(runner.has_value()) << (runner ? "" : runner.error().message);
  return runner ? std::move(*runner) : nullptr;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The held-out text's tokens (the demo's tokenizer is byte-identical to the Rust tokenizers library).
const std::vector<int32_t>& heldout_tokens() {
  static const std::vector<int32_t> tokens = [] {
    auto tok = Tokenizer::load(kDemo);
    EXPECT_TRUE(tok.has_value());
    return tok ? tok->encode(read_file(std::string(TERN_DEMO_DIR) + "/heldout.txt")) : std::vector<int32_t>{};
  }();
  return tokens;
}

// Prompts cut from the held-out text: real text, so the drafts are right often enough to test acceptance.
std::vector<int32_t> prompt(size_t offset, size_t length) {
  const auto& t = heldout_tokens();
  return {t.begin() + static_cast<ptrdiff_t>(offset), t.begin() + static_cast<ptrdiff_t>(offset + length)};
}

int32_t argmax(std::span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

std::vector<double> log_softmax(std::span<const float> row) {
  const double max = *std::max_element(row.begin(), row.end());
  double sum = 0.0;
  for (float x : row) sum += std::exp(double{x} - max);
  std::vector<double> out;
  for (float x : row) out.push_back(double{x} - max - std::log(sum));
  return out;
}

// Plain greedy decoding, one token per step.
std::vector<int32_t> plain_greedy(ModelRunner& runner, const std::vector<int32_t>& prompt_ids, int n) {
  SequenceCache cache = runner.new_sequence();
  std::vector<int32_t> out;
  std::vector<int32_t> next = prompt_ids;
  for (int i = 0; i < n; ++i) {
    const std::vector<SequenceInput> batch{{&cache, next}};
    auto logits = runner.forward(batch, LogitsFor::kLastToken);
    EXPECT_TRUE(logits.has_value()) << logits.error().message;
    if (!logits) return out;
    out.push_back(argmax(*logits));
    next = {out.back()};
  }
  return out;
}

// One sequence decoded with speculation: its prompt in chunks of `chunk` tokens, then steps of 1 + drafts.
struct SpecRun {
  std::vector<int32_t> prompt, output;
  SequenceCache cache;
  Sampler sampler;
  std::vector<int32_t> drafts;
  int64_t prompt_done = 0;
  int64_t drafted = 0, accepted = 0;
  SpecRun(ModelRunner& runner, std::vector<int32_t> p, SamplingParams params)
      : prompt(std::move(p)), cache(runner.new_sequence()), sampler(params) {}
  std::vector<int32_t> all() const {
    std::vector<int32_t> t = prompt;
    t.insert(t.end(), output.begin(), output.end());
    return t;
  }
};

// Runs `runs` together until each has `n` output tokens. `override_drafts`, if set, replaces each sequence's drafts
// before every step (the test's forced acceptance or rejection).
void run_speculative(ModelRunner& runner, std::vector<SpecRun>& runs, int n, int steps, int64_t chunk,
                     const std::function<void(size_t, SpecRun&)>& override_drafts = nullptr) {
  for (int guard = 0; guard < 10 * n + 100; ++guard) {
    std::vector<SpecSequence> seqs;
    std::vector<size_t> which;
    std::vector<std::vector<int32_t>> known(runs.size());
    for (size_t i = 0; i < runs.size(); ++i) {
      SpecRun& r = runs[i];
      if (static_cast<int>(r.output.size()) >= n) continue;
      known[i] = r.all();
      const int64_t begin = r.cache.length;
      const int64_t count = std::min<int64_t>(chunk, static_cast<int64_t>(known[i].size()) - begin);
      const bool samples = begin + count == static_cast<int64_t>(known[i].size());
      if (override_drafts && samples && !r.output.empty()) override_drafts(i, r);
      SpecSequence s;
      s.input = {&r.cache, std::span<const int32_t>(known[i]).subspan(static_cast<size_t>(begin),
                                                                         static_cast<size_t>(count))};
      s.following = std::span<const int32_t>(known[i]).subspan(static_cast<size_t>(begin + 1));
      if (samples) s.sample = {&r.sampler, r.prompt, r.output};
      s.drafts = &r.drafts;
      seqs.push_back(s);
      which.push_back(i);
    }
    if (seqs.empty()) return;
    auto outcomes = speculative_step(runner, seqs, steps);
    ASSERT_TRUE(outcomes.has_value()) << outcomes.error().message;
    for (size_t k = 0; k < which.size(); ++k) {
      SpecRun& r = runs[which[k]];
      const SpecOutcome& o = (*outcomes)[k];
      ASSERT_FALSE(o.error) << o.error->message;
      r.drafted += o.drafted;
      r.accepted += o.accepted;
      for (const SampledToken& t : o.tokens) r.output.push_back(t.id);
      if (!o.tokens.empty()) {
        ASSERT_EQ(r.cache.length + 1, static_cast<int64_t>(r.all().size()));
      }
    }
  }
  FAIL() << "the runs did not finish";
}

TEST(Speculative, TheDraftModuleMatchesTheTrainingScriptOnHeldOutText) {
  // demo/eval.json's protocol: windows of 512 tokens every 256; in each, the draft module at row j runs on the
  // model's hidden state at j and the token j + 1, predicting j + 2; targets t in [max(prev_e, b + 2), e).
  auto runner = load_demo();
  ASSERT_TRUE(runner);
  const auto& tokens = heldout_tokens();
  const int64_t T = static_cast<int64_t>(tokens.size()), context = 512, stride = 256;
  const auto eval = nlohmann::json::parse(read_file(std::string(TERN_DEMO_DIR) + "/eval.json"));
  ASSERT_EQ(T, eval["tokens"].get<int64_t>());
  const size_t vocab = static_cast<size_t>(runner->config().vocab_size);
  double nll = 0.0;
  int64_t hits = 0, scored = 0, prev_e = 0;
  for (int64_t b = 0;; b += stride) {
    const int64_t e = std::min(b + context, T);
    const std::span<const int32_t> window(tokens.data() + b, static_cast<size_t>(e - b));
    SequenceCache cache = runner->new_sequence();
    const std::vector<SequenceInput> batch{{&cache, window}};
    ASSERT_TRUE(runner->forward(batch, LogitsFor::kLastToken).has_value());
    SequenceInput next{&cache, window.subspan(1)};
    const std::vector<DraftInput> rows{{next, 0, DraftHidden::kModel, 0}};
    auto logits = runner->draft(rows, LogitsFor::kAllTokens);
    ASSERT_TRUE(logits.has_value()) << logits.error().message;
    ASSERT_EQ(logits->size(), (window.size() - 1) * vocab);
    for (int64_t t = std::max(prev_e, b + 2); t < e; ++t) {
      const std::span<const float> row = std::span<const float>(*logits).subspan((t - 2 - b) * vocab, vocab);
      for (float x : row) ASSERT_TRUE(std::isfinite(x));
      nll -= log_softmax(row)[tokens[t]];
      hits += argmax(row) == tokens[t] ? 1 : 0;
      ++scored;
    }
    prev_e = e;
    if (e == T) break;
  }
  ASSERT_EQ(scored, eval["mtp"]["scored"].get<int64_t>());
  const double want = eval["mtp"]["mean_nll"].get<double>();
  EXPECT_NEAR(nll / static_cast<double>(scored), want, 1e-5 * want);
  // Top-1 of 21,310 predictions: a near-tie may fall either way between fp32 implementations.
  EXPECT_NEAR(static_cast<double>(hits), eval["mtp"]["top1_accuracy"].get<double>() * static_cast<double>(scored), 3.0);
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
  ModelLoadOptions options;
  options.load_draft = true;
  options.tensor_parallel_size = 2;
  options.nnodes = 2;
  options.dist_init_addr = "127.0.0.1:" + std::to_string(free_port());
  options.tp_join_timeout = std::chrono::seconds(30);
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
  const std::vector<int32_t> p = prompt(1500, 9);
  const int n = 40, steps = 3;
  const std::vector<int32_t> want = plain_greedy(*runner, p, n + steps + 1);
  // Right: the drafts are the true continuation, so every one is accepted.
  std::vector<SpecRun> right;
  right.emplace_back(*runner, p, SamplingParams{.temperature = 0.0f});
  run_speculative(*runner, right, n, steps, 64, [&](size_t, SpecRun& r) {
    r.drafts.assign(want.begin() + static_cast<ptrdiff_t>(r.output.size()),
                    want.begin() + static_cast<ptrdiff_t>(r.output.size() + steps));
  });
  EXPECT_EQ(right[0].accepted, right[0].drafted);
  EXPECT_GT(right[0].drafted, 0);
  right[0].output.resize(n);
  EXPECT_EQ(right[0].output, std::vector<int32_t>(want.begin(), want.begin() + n));
  // Wrong: every draft is a token the model does not choose there, so none is.
  std::vector<SpecRun> wrong;
  wrong.emplace_back(*runner, p, SamplingParams{.temperature = 0.0f});
  run_speculative(*runner, wrong, n, steps, 64, [&](size_t, SpecRun& r) {
    const int32_t truth = want[r.output.size()];
    r.drafts.assign(steps, (truth + 17) % static_cast<int32_t>(runner->config().vocab_size));
  });
  EXPECT_EQ(wrong[0].accepted, 0);
  EXPECT_GT(wrong[0].drafted, 0);
  wrong[0].output.resize(n);
  EXPECT_EQ(wrong[0].output, std::vector<int32_t>(want.begin(), want.begin() + n));
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
  // The second output token (the first a draft can propose) over many seeds, with top_k 6 so that the support is
  // small: its distribution given the first token must be the model's own, softmax(logits / T) over the top 6.
  auto runner = load_demo();
  ASSERT_TRUE(runner);
  const std::vector<int32_t> p = prompt(9000, 6);
  const SamplingParams base{.temperature = 0.8f, .top_k = 6};
  const int draws = 2000;
  std::map<int32_t, std::map<int32_t, int>> second;  // first token -> second token -> count
  int64_t accepted = 0;
  for (int seed = 0; seed < draws; ++seed) {
    SamplingParams params = base;
    params.seed = 1000 + seed;
    std::vector<SpecRun> runs;
    runs.emplace_back(*runner, p, params);
    run_speculative(*runner, runs, 2, 1, 64);
    ++second[runs[0].output[0]][runs[0].output[1]];
    accepted += runs[0].accepted;
  }
  // The most frequent first token, and the model's distribution after it.
  int32_t first = -1;
  int most = 0;
  for (const auto& [token, counts] : second) {
    int total = 0;
    for (const auto& [t, c] : counts) total += c;
    if (total > most) most = total, first = token;
  }
  ASSERT_GT(most, 200);
  std::vector<int32_t> context = p;
  context.push_back(first);
  SequenceCache cache = runner->new_sequence();
  const std::vector<SequenceInput> batch{{&cache, context}};
  auto logits = runner->forward(batch, LogitsFor::kLastToken);
  ASSERT_TRUE(logits.has_value());
  std::vector<std::pair<float, int32_t>> ranked;
  for (size_t i = 0; i < logits->size(); ++i) ranked.push_back({(*logits)[i], static_cast<int32_t>(i)});
  std::partial_sort(ranked.begin(), ranked.begin() + 6, ranked.end(), std::greater<>());
  double z = 0.0;
  for (int k = 0; k < 6; ++k) z += std::exp((double{ranked[k].first} - ranked[0].first) / base.temperature);
  double chi2 = 0.0;
  int inside = 0;
  for (int k = 0; k < 6; ++k) {
    const double q = std::exp((double{ranked[k].first} - ranked[0].first) / base.temperature) / z;
    const int seen = second[first].contains(ranked[k].second) ? second[first][ranked[k].second] : 0;
    inside += seen;
    const double expected = q * most;
    chi2 += (seen - expected) * (seen - expected) / expected;
  }
  EXPECT_EQ(inside, most) << "a token outside the top 6 was sampled";
  // 5 degrees of freedom: P(chi2 > 25.7) = 1e-4.
  EXPECT_LT(chi2, 25.7) << "after token " << first << " (" << most << " draws)";
  EXPECT_GT(accepted, 0);
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
