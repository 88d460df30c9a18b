// Speculative decoding with the MTP layer on a CUDA GPU (label gpu), on the trained demo model (demo/), whose drafts
// are accepted often and rejected often:
// - the draft module's mean NLL on the held-out text against the training script's fp32 figure (demo/eval.json
//   "mtp"), within the 1% that bf16 activations are allowed on the main model (src/cli/demo_model_test.py);
// - greedy output with speculation identical to the GPU's own plain greedy decoding, batched, prompts in chunks
//   (up to a near-tie of the fp32 reference, which bf16 may break either way: expect_same_greedy), and with drafts
//   forced all right or all wrong (every step then keeps one row: the Gated DeltaNet state of row 0);
// - after rejections, the next logits equal those of a fresh prefill of the kept tokens as closely as the GPU's
//   plain decoding of the same tokens does (a state left after a rejected row is off by O(1));
// - sampling: the output's distribution over many seeds is the model's (a chi-square test);
// - refusals: a verification longer than the runner was sized for;
// - GLM-5's MTP layer (the GLM fixture with one written at test time) against the CPU path and greedy decoding, also
//   with every sequence the runner holds verifying at its longest graphed context.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <iostream>

#include "runtime/model_runner.h"
#include "runtime/speculative.h"
#include "runtime/speculative_test_util.h"

namespace tern {
namespace {

using namespace spec_test;

// A CUDA runner of the model and its draft module, sized for the tests' few sequences.
ModelLoadOptions gpu_draft_options(int64_t max_sequences, int64_t max_batch_tokens, int64_t kv_cache_tokens,
                                   int64_t verify_rows, bool graphs = true) {
  ModelLoadOptions options;
  options.load_draft = true;
  options.device = ModelDevice::kCuda;
  options.device_options.max_sequences = max_sequences;
  options.device_options.max_batch_tokens = max_batch_tokens;
  options.device_options.kv_cache_tokens = kv_cache_tokens;
  options.device_options.verify_rows = verify_rows;
  options.device_options.cuda_graphs = graphs;
  return options;
}

std::unique_ptr<ModelRunner> load_gpu_demo(int64_t verify_rows = 5, bool graphs = true) {
  if (runner_cuda_device_count() == 0) return nullptr;
  auto runner = runner_load(kDemo, gpu_draft_options(8, 2048, 16384, verify_rows, graphs));
  EXPECT_TRUE(runner.has_value()) << (runner ? "" : runner.error().message);
  return runner ? std::move(*runner) : nullptr;
}

#define REQUIRE_GPU(runner)                                   \
  if (runner_cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  ASSERT_TRUE(runner)

TEST(CudaSpeculative, TheDraftModuleMatchesTheTrainingScriptOnHeldOutText) {
  auto runner = load_gpu_demo();
  REQUIRE_GPU(runner);
  const auto eval = nlohmann::json::parse(read_file(std::string(TERN_DEMO_DIR) + "/eval.json"));
  ASSERT_EQ(static_cast<int64_t>(heldout_tokens().size()), eval["tokens"].get<int64_t>());
  const DraftHeldout r = draft_module_on_heldout_text(*runner);
  ASSERT_EQ(r.scored, eval["mtp"]["scored"].get<int64_t>());
  const double want = eval["mtp"]["mean_nll"].get<double>(), got = r.nll / static_cast<double>(r.scored);
  std::cout << "draft module mean NLL on the GPU " << got << ", fp32 reference " << want << "\n";
  EXPECT_NEAR(got, want, 1e-2 * want);
}

double max_abs_diff(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    EXPECT_TRUE(std::isfinite(a[i]) && std::isfinite(b[i]));
    worst = std::max(worst, std::abs(double{a[i]} - double{b[i]}));
  }
  return worst;
}

// Greedy speculative output against the GPU's plain greedy output: identical, except that from a position where the
// fp32 CPU path's logits of the two tokens chosen differ by less than the GPU's own deviation from those logits
// there (a near-tie, which bf16 arithmetic in two kernel arrangements may break either way), the rest may differ.
void expect_same_greedy(ModelRunner& gpu, ModelRunner& cpu, const std::vector<int32_t>& prompt_ids,
                        const std::vector<int32_t>& got, const std::vector<int32_t>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  const auto diverge = std::mismatch(got.begin(), got.end(), want.begin());
  if (diverge.first == got.end()) return;
  const size_t i = static_cast<size_t>(diverge.first - got.begin());
  std::vector<int32_t> context = prompt_ids;
  context.insert(context.end(), want.begin(), want.begin() + static_cast<ptrdiff_t>(i));
  SequenceCache gc = gpu.new_sequence(), cc = cpu.new_sequence();
  auto g = gpu.forward(std::vector<SequenceInput>{{&gc, context}}, LogitsFor::kLastToken);
  auto c = cpu.forward(std::vector<SequenceInput>{{&cc, context}}, LogitsFor::kLastToken);
  ASSERT_TRUE(g && c);
  const double margin =
      std::abs(double{(*c)[static_cast<size_t>(got[i])]} - double{(*c)[static_cast<size_t>(want[i])]});
  const double noise = max_abs_diff(*g, *c);
  std::cout << what << ": tokens " << got[i] << " and " << want[i] << " at output " << i << ", "
            << margin << " apart in fp32; the GPU's logits there are off by up to " << noise << "\n";
  EXPECT_LT(margin, noise) << what << ": speculative and plain greedy output differ at output " << i
                           << " where the reference does not have them near-tied";
}

class CudaGreedySteps : public testing::TestWithParam<int> {};

TEST_P(CudaGreedySteps, MatchPlainGreedyDecoding) {
  const int steps = GetParam();
  auto runner = load_gpu_demo(steps + 1);
  REQUIRE_GPU(runner);
  ModelLoadOptions cpu_options;
  cpu_options.load_draft = true;
  auto cpu = runner_load(kDemo, cpu_options);
  ASSERT_TRUE(cpu.has_value());
  const SamplingParams greedy{.temperature = 0.0f};
  // Prompts of different lengths decoded together, prompts in chunks of 7 (draft extends over chunks that sample
  // nothing; verifications sharing a step with prompt chunks, which are long enough for the chunked delta rule
  // at chunk 40). The last prompt has steps + 1 tokens: a prefill of a verification's size.
  for (const int64_t chunk : {int64_t{7}, int64_t{40}}) {
    std::vector<SpecRun> runs;
    for (auto [offset, length] : {std::pair<size_t, size_t>{0, 12}, {700, 90}, {3000, 5},
                                  {5000, static_cast<size_t>(steps) + 1}}) {
      runs.emplace_back(*runner, prompt(offset, length), greedy);
    }
    const int n = 48;
    run_speculative(*runner, runs, n, steps, chunk);
    int64_t drafted = 0, accepted = 0;
    for (SpecRun& r : runs) {
      const std::vector<int32_t> want = plain_greedy(*runner, r.prompt, n);
      r.output.resize(n);  // the last step may go past n
      expect_same_greedy(*runner, **cpu, r.prompt, r.output, want,
                         "prompt of " + std::to_string(r.prompt.size()) + ", chunk " + std::to_string(chunk));
      drafted += r.drafted;
      accepted += r.accepted;
    }
    EXPECT_GT(accepted, 0);
    EXPECT_LT(accepted, drafted);
    std::cout << steps << " steps, chunk " << chunk << ": " << accepted << " of " << drafted
              << " drafts accepted\n";
  }
}

INSTANTIATE_TEST_SUITE_P(CudaSpeculative, CudaGreedySteps, testing::Values(1, 3, 4));

// GLM-5's MTP layer (the GLM fixture with one written at test time, speculative_test_util.h) on the GPU: its draft
// logits over a prompt and a chained step track the CPU path's (which reads the normed hidden states; a GPU keeping
// another state instead is off by the logits' whole spread) on a prompt shorter than index_topk, so
// no DSA selection (whose near-ties bf16 may break either way) is involved; greedy output with speculation is the
// GPU's plain greedy output up to near-ties, and forced-right drafts are all accepted.
TEST(CudaSpeculative, GlmMtpLayerTracksTheCpuPath) {
  if (runner_cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::filesystem::path dir = glm_with_mtp("glm_mtp_gpu");
  ModelLoadOptions gpu_options = gpu_draft_options(4, 256, 4096, 4);
  gpu_options.device_options.max_context_tokens = 256;  // the fixture's max_position_embeddings, as serve sets it
  auto gpu = runner_load(dir, gpu_options);
  ASSERT_TRUE(gpu.has_value()) << gpu.error().message;
  ModelLoadOptions cpu_options;
  cpu_options.load_draft = true;
  auto cpu = runner_load(dir, cpu_options);
  ASSERT_TRUE(cpu.has_value()) << cpu.error().message;
  const int32_t vocab = static_cast<int32_t>((*gpu)->config().vocab_size);
  const std::vector<int32_t> t = random_prompt(12, 11, vocab);
  ASSERT_LT(static_cast<int64_t>(t.size()), (*gpu)->config().index_topk);
  std::vector<std::vector<float>> drafted, chained;
  for (ModelRunner* r : {gpu->get(), cpu->get()}) {
    SequenceCache cache = r->new_sequence();
    ASSERT_TRUE(r->forward(std::vector<SequenceInput>{{&cache, t}}, LogitsFor::kLastToken).has_value());
    const std::vector<int32_t> next(t.begin() + 1, t.end());
    auto d = r->draft(std::vector<DraftInput>{{{&cache, next}, 0, DraftHidden::kModel, 0}}, LogitsFor::kAllTokens);
    ASSERT_TRUE(d.has_value()) << d.error().message;
    drafted.push_back(*d);
    const std::vector<int32_t> one{t.back()};
    auto c = r->draft(std::vector<DraftInput>{{{&cache, one}, static_cast<int64_t>(t.size()) - 1,
                                                DraftHidden::kDraft, 0}},
                      LogitsFor::kLastToken);
    ASSERT_TRUE(c.has_value()) << c.error().message;
    chained.push_back(*c);
  }
  const auto [lo, hi] = std::minmax_element(drafted[1].begin(), drafted[1].end());
  const double spread = double{*hi} - double{*lo};
  const double off = max_abs_diff(drafted[0], drafted[1]), off_chained = max_abs_diff(chained[0], chained[1]);
  std::cout << "GLM draft logits: GPU off the CPU by " << off << " (chained " << off_chained << ") of a spread of "
            << spread << "\n";
  EXPECT_LT(off, 0.1 * spread);
  EXPECT_LT(off_chained, 0.1 * spread);
  for (int steps : {1, 3}) {
    std::vector<SpecRun> runs;
    for (auto [length, seed] : {std::pair<size_t, uint32_t>{30, 12}, {9, 13}}) {
      runs.emplace_back(**gpu, random_prompt(length, seed, vocab), SamplingParams{.temperature = 0.0f});
    }
    run_speculative(**gpu, runs, 24, steps, 7);
    for (SpecRun& r : runs) {
      r.output.resize(24);
      expect_same_greedy(**gpu, **cpu, r.prompt, r.output, plain_greedy(**gpu, r.prompt, 24),
                         "GLM, " + std::to_string(steps) + " steps");
      EXPECT_GT(r.drafted, 0);
    }
  }
  // Every sequence the runner holds verifying at once in the widest decode graph (contexts past 128 of the 256): the
  // DSA indexer's graph workspace must hold max_sequences x verify_rows score rows (it held max_sequences once).
  std::vector<SpecRun> full;
  for (uint32_t seed = 20; seed < 24; ++seed) {
    full.emplace_back(**gpu, random_prompt(200, seed, vocab), SamplingParams{.temperature = 0.0f});
  }
  run_speculative(**gpu, full, 8, 3, 64);
  for (SpecRun& r : full) {
    r.output.resize(8);
    expect_same_greedy(**gpu, **cpu, r.prompt, r.output, plain_greedy(**gpu, r.prompt, 8), "GLM, a full batch");
  }
  const std::vector<int32_t> p = random_prompt(20, 14, vocab);
  const std::vector<int32_t> want = plain_greedy(**gpu, p, 24);
  std::vector<SpecRun> right;
  right.emplace_back(**gpu, p, SamplingParams{.temperature = 0.0f});
  run_speculative(**gpu, right, 20, 3, 64, [&](size_t, SpecRun& r) {
    r.drafts.assign(want.begin() + static_cast<ptrdiff_t>(r.output.size()),
                    want.begin() + static_cast<ptrdiff_t>(r.output.size() + 3));
  });
  EXPECT_EQ(right[0].accepted, right[0].drafted);
  right[0].output.resize(20);
  expect_same_greedy(**gpu, **cpu, p, right[0].output, std::vector<int32_t>(want.begin(), want.begin() + 20),
                     "GLM, forced-right drafts");
}

TEST(CudaSpeculative, DraftsForcedRightOrWrongKeepGreedyOutput) {
  auto runner = load_gpu_demo(4);
  REQUIRE_GPU(runner);
  expect_forced_drafts_keep_greedy_output(*runner);
}

TEST(CudaSpeculative, StatesAfterRejectionsEqualARecompute) {
  auto runner = load_gpu_demo();
  REQUIRE_GPU(runner);
  std::vector<SpecRun> runs;
  runs.emplace_back(*runner, prompt(4200, 20), SamplingParams{.temperature = 0.0f});
  run_speculative(*runner, runs, 30, 3, 64);
  SpecRun& r = runs[0];
  ASSERT_GT(r.drafted, r.accepted);  // some rejections happened
  const std::vector<int32_t> all = r.all();
  ASSERT_EQ(r.cache.length, static_cast<int64_t>(all.size()) - 1);
  // The next token's logits from the speculative cache, from a fresh prefill of every token, and from plain
  // one-token decoding of the same tokens after the prompt (the GPU's own spread between two exact paths).
  const std::vector<int32_t> last{all.back()};
  auto spec = runner->forward(std::vector<SequenceInput>{{&r.cache, last}}, LogitsFor::kLastToken);
  ASSERT_TRUE(spec.has_value()) << spec.error().message;
  SequenceCache fresh = runner->new_sequence();
  auto recompute = runner->forward(std::vector<SequenceInput>{{&fresh, all}}, LogitsFor::kLastToken);
  ASSERT_TRUE(recompute.has_value());
  SequenceCache plain = runner->new_sequence();
  auto step = runner->forward(std::vector<SequenceInput>{{&plain, r.prompt}}, LogitsFor::kLastToken);
  ASSERT_TRUE(step.has_value());
  for (size_t i = r.prompt.size(); i < all.size(); ++i) {
    step = runner->forward(std::vector<SequenceInput>{{&plain, std::span<const int32_t>(&all[i], 1)}},
                           LogitsFor::kLastToken);
    ASSERT_TRUE(step.has_value());
  }
  double scale = 0.0;
  for (float v : *recompute) scale = std::max(scale, std::abs(double{v}));
  const double spec_error = max_abs_diff(*spec, *recompute), plain_error = max_abs_diff(*step, *recompute);
  std::cout << "next logits vs a recompute: speculative " << spec_error << ", plain decoding " << plain_error
            << " (largest logit " << scale << ")\n";
  EXPECT_LE(spec_error, std::max(2.0 * plain_error, 1e-2 * scale));
}

// Sampling (T > 0) verification: every row samples on the device with its own draw; the output keeps the model's
// distribution.
TEST(CudaSpeculative, SamplingKeepsTheModelsDistribution) {
  auto runner = load_gpu_demo();
  ASSERT_TRUE(runner);
  expect_sampling_keeps_the_models_distribution(*runner);
}

TEST(CudaSpeculative, VerificationsLongerThanTheRunnerHoldsAreRefused) {
  auto runner = load_gpu_demo(3);
  REQUIRE_GPU(runner);
  SequenceCache cache = runner->new_sequence();
  const std::vector<int32_t> p = prompt(50, 6);
  ASSERT_TRUE(runner->forward(std::vector<SequenceInput>{{&cache, p}}, LogitsFor::kLastToken).has_value());
  const std::vector<int32_t> four = prompt(56, 4);
  SequenceInput v{&cache, four};
  v.verify = true;
  auto refused = runner->forward(std::vector<SequenceInput>{v}, LogitsFor::kLastToken);
  ASSERT_FALSE(refused.has_value());
  EXPECT_NE(refused.error().message.find("verification of 4 rows"), std::string::npos) << refused.error().message;
  EXPECT_EQ(cache.length, 6);
  v.tokens = std::span<const int32_t>(four).first(3);
  auto ok = runner->forward(std::vector<SequenceInput>{v}, LogitsFor::kLastToken);
  ASSERT_TRUE(ok.has_value()) << ok.error().message;
  EXPECT_EQ(ok->size(), 3 * static_cast<size_t>(runner->config().vocab_size));  // every verified row's logits
  EXPECT_TRUE(runner->keep_rows(cache, 2).has_value());
  EXPECT_EQ(cache.length, 8);
}

}  // namespace
}  // namespace tern
