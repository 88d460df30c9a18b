// Tensor parallelism on the CPU against one device: every fixture that splits at 2 and 4 ranks gives the
// teacher-forced logits of the whole model within 1e-5 (relative to the largest logit) and the same 24 greedy
// tokens, batched sequences included, with the routed experts sliced or (expert parallelism) whole on each rank; the ranks hold the same bits of every replicated result; a model that cannot
// split is refused naming the tensor; a failing rank fails the step and every later one without hanging.
// (The whole model is checked against transformers in model_reference_test.cc.)
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>


#include "dist/loopback.h"
#include "runtime/cpu_runner.h"
#include "runtime/free_port_test_util.h"
#include "runtime/model_runner.h"
#include "runtime/tp_runner.h"

namespace tern {
namespace {

struct Case {
  std::string fixture;
  int world;
  bool expert_parallel = false;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.fixture << " at " << c.world << " ranks" << (c.expert_parallel ? ", experts whole" : "");
}
std::string case_name(const testing::TestParamInfo<Case>& info) {
  return info.param.fixture + "_tp" + std::to_string(info.param.world) + (info.param.expert_parallel ? "_ep" : "");
}

std::string fixture(const std::string& name) { return std::string(TERN_FIXTURES_DIR) + "/" + name; }

std::unique_ptr<ModelRunner> load(const std::string& name, int world, bool expert_parallel = false) {
  ModelLoadOptions options;
  options.tensor_parallel_size = world;
  options.expert_parallel = expert_parallel;
  auto runner = runner_load(fixture(name), options);
  EXPECT_TRUE(runner.has_value()) << (runner ? "" : runner.error().message);
  return runner ? std::move(*runner) : nullptr;
}

std::vector<std::vector<int32_t>> prompts(const std::string& name) {
  const bool nvfp4 = name.find("nvfp4") != std::string::npos;
  std::ifstream in(fixture(name) + (nvfp4 ? "/reference_w4a16.json" : "/reference.json"));
  EXPECT_TRUE(in.good());
  return nlohmann::json::parse(in)["prompts"].get<std::vector<std::vector<int32_t>>>();
}

int32_t argmax(std::span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

class TensorParallel : public testing::TestWithParam<Case> {};

TEST_P(TensorParallel, TeacherForcedLogitsMatchOneDevice) {
  const Case& c = GetParam();
  auto one = load(c.fixture, 1), split = load(c.fixture, c.world, c.expert_parallel);
  ASSERT_TRUE(one && split);
  EXPECT_NE(split->describe().find(std::to_string(c.world) + " tensor-parallel ranks"), std::string::npos)
      << split->describe();
  for (const auto& prompt : prompts(c.fixture)) {
    SequenceCache a = one->new_sequence(), b = split->new_sequence();
    const std::vector<SequenceInput> in_a{{&a, prompt}}, in_b{{&b, prompt}};
    auto want = one->forward(in_a, LogitsFor::kAllTokens);
    auto got = split->forward(in_b, LogitsFor::kAllTokens);
    ASSERT_TRUE(want && got) << (want ? got.error().message : want.error().message);
    ASSERT_EQ(got->size(), want->size());
    double max_ref = 0.0, worst = 0.0;
    for (float v : *want) max_ref = std::max(max_ref, std::abs(double{v}));
    for (size_t i = 0; i < want->size(); ++i) {
      ASSERT_TRUE(std::isfinite((*got)[i])) << "logit " << i;
      worst = std::max(worst, std::abs(double{(*got)[i]} - double{(*want)[i]}));
    }
    EXPECT_GT(max_ref, 0.1);
    EXPECT_LE(worst, 1e-5 * max_ref) << "prompt of " << prompt.size() << " tokens";
  }
}

// The prompts decoded side by side, each extending its own caches, prefill and decode rows in one step once the
// first sequence is decoding.
TEST_P(TensorParallel, BatchedGreedyDecodeMatchesOneDevice) {
  const Case& c = GetParam();
  auto one = load(c.fixture, 1), split = load(c.fixture, c.world, c.expert_parallel);
  ASSERT_TRUE(one && split);
  const auto all = prompts(c.fixture);
  const int64_t vocab = one->config().vocab_size;
  auto decode = [&](ModelRunner& m) {
    std::vector<SequenceCache> seqs;
    for (size_t i = 0; i < all.size(); ++i) seqs.push_back(m.new_sequence());
    std::vector<std::vector<int32_t>> next = all, out(all.size());
    for (int step = 0; step < 24; ++step) {
      std::vector<SequenceInput> batch;
      for (size_t i = 0; i < all.size(); ++i) batch.push_back({&seqs[i], next[i]});
      auto logits = m.forward(batch, LogitsFor::kLastToken);
      EXPECT_TRUE(logits.has_value()) << (logits ? "" : logits.error().message);
      if (!logits) return out;
      for (size_t i = 0; i < all.size(); ++i) {
        const int32_t id = argmax(std::span<const float>(*logits).subspan(i * vocab, vocab));
        out[i].push_back(id);
        next[i] = {id};
      }
    }
    return out;
  };
  const auto want = decode(*one);
  const auto got = decode(*split);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i], want[i]) << "prompt " << i;
    EXPECT_EQ(want[i].size(), 24u);
  }
}

// Sampling at several ranks: rank 0 samples once per row with the row's own random stream, so the tokens are the
// ones one device samples from the same logits.
TEST_P(TensorParallel, SampledTokensMatchOneDevice) {
  const Case& c = GetParam();
  auto one = load(c.fixture, 1), split = load(c.fixture, c.world, c.expert_parallel);
  ASSERT_TRUE(one && split);
  SamplingParams params;
  params.temperature = 0.8f;
  params.top_k = 20;
  params.seed = 1234;
  Sampler sa(params), sb(params);
  const std::vector<int32_t> prompt = prompts(c.fixture).front();
  SequenceCache a = one->new_sequence(), b = split->new_sequence();
  std::vector<int32_t> next = prompt, out_a, out_b;
  for (int step = 0; step < 12; ++step) {
    const std::vector<SequenceInput> in_a{{&a, next}}, in_b{{&b, next}};
    const std::vector<SampleRow> rows_a{{&sa, prompt, out_a}}, rows_b{{&sb, prompt, out_b}};
    auto ga = one->forward_sample(in_a, rows_a);
    auto gb = split->forward_sample(in_b, rows_b);
    ASSERT_TRUE(ga && gb) << (ga ? gb.error().message : ga.error().message);
    ASSERT_TRUE((*ga)[0] && (*gb)[0]);
    EXPECT_EQ((*gb)[0]->id, (*ga)[0]->id) << "step " << step;
    out_a.push_back((*ga)[0]->id);
    out_b.push_back((*gb)[0]->id);
    next = {(*ga)[0]->id};
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TensorParallel,
                         testing::Values(Case{"qwen3", 2}, Case{"qwen3", 4}, Case{"qwen3_moe", 2},
                                         Case{"qwen3_moe", 4}, Case{"qwen3_5_moe", 2}, Case{"qwen3_5_moe_fused", 2},
                                         Case{"qwen3_5_moe_nvfp4", 2}, Case{"glm_moe_dsa", 2}, Case{"glm_moe_dsa", 4},
                                         // 8 experts: 4 or 2 whole ones on each rank
                                         Case{"qwen3_moe", 2, true}, Case{"qwen3_moe", 4, true},
                                         Case{"qwen3_5_moe", 2, true}, Case{"qwen3_5_moe_fused", 2, true},
                                         Case{"qwen3_5_moe_nvfp4", 2, true}, Case{"glm_moe_dsa", 4, true}),
                         case_name);

// GLM's fixture config with GLM-5's latent width (kv_lora_rank 512) and dummy weights, its latent cache in FP8 entries
// (--kv-cache-dtype fp8_e4m3; the latent replicated on each rank): the model split over 2 ranks gives the whole
// model's teacher-forced logits, as the plain cache does, while FP8 moves them from the plain cache's.
TEST(TensorParallelFp8Latent, TheSplitModelReadsTheSameEntries) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "tern_tp_glm_latent512";
  std::filesystem::create_directories(dir);
  {
    std::ifstream in(fixture("glm_moe_dsa") + "/config.json");
    nlohmann::json config = nlohmann::json::parse(in);
    config["kv_lora_rank"] = 512;
    std::ofstream(dir / "config.json") << config.dump(1);
  }
  auto make = [&](int world, bool fp8) {
    ModelLoadOptions o{.load_format = LoadFormat::kDummy,
                       .kv_cache_dtype = fp8 ? KvCacheDtype::kFp8E4m3 : KvCacheDtype::kAuto,
                       .tensor_parallel_size = world,
                       .dummy_seed = 3};
    auto r = runner_load(dir, o);
    EXPECT_TRUE(r.has_value()) << (r ? "" : r.error().message);
    return r ? std::move(*r) : nullptr;
  };
  auto one = make(1, true), split = make(2, true), plain = make(1, false);
  ASSERT_TRUE(one && split && plain);
  double worst = 0.0, fp8_effect = 0.0, max_ref = 0.0;
  for (const auto& prompt : prompts("glm_moe_dsa")) {
    SequenceCache a = one->new_sequence(), b = split->new_sequence(), c = plain->new_sequence();
    auto want = one->forward(std::vector<SequenceInput>{{&a, prompt}}, LogitsFor::kAllTokens);
    auto got = split->forward(std::vector<SequenceInput>{{&b, prompt}}, LogitsFor::kAllTokens);
    auto bf = plain->forward(std::vector<SequenceInput>{{&c, prompt}}, LogitsFor::kAllTokens);
    ASSERT_TRUE(want && got && bf);
    ASSERT_EQ(got->size(), want->size());
    for (size_t i = 0; i < want->size(); ++i) {
      ASSERT_TRUE(std::isfinite((*got)[i])) << "logit " << i;
      max_ref = std::max(max_ref, std::abs(double{(*want)[i]}));
      worst = std::max(worst, std::abs(double{(*got)[i]} - double{(*want)[i]}));
      fp8_effect = std::max(fp8_effect, std::abs(double{(*bf)[i]} - double{(*want)[i]}));
    }
  }
  std::printf("FP8 latent at 2 ranks: max |split - whole| / max |logit| = %.3g; the FP8 cache's effect %.3g\n",
              worst / max_ref, fp8_effect / max_ref);
  EXPECT_LE(worst, 1e-5 * max_ref);
  EXPECT_GT(fp8_effect, 100 * worst) << "the FP8 cache must change the logits, or the check shows nothing";
  std::filesystem::remove_all(dir);
}

// The ranks' own runners, driven by hand: after each step every rank holds the same bits of the logits (gathered)
// as rank 0, and so of the residual stream they came from.
TEST(TensorParallelRanks, EveryRankHoldsTheSameBits) {
  for (const auto& [name, expert_parallel] : {std::pair{"qwen3_moe", false}, std::pair{"qwen3_5_moe", false},
                                              std::pair{"qwen3_moe", true}, std::pair{"qwen3_5_moe", true}}) {
    SCOPED_TRACE(expert_parallel ? "experts whole on each rank" : "experts sliced");
    const int world = 2;
    LoopbackGroup group(world);
    std::vector<std::unique_ptr<ModelRunner>> ranks(world);
    for (int r = 0; r < world; ++r) {
      ModelLoadOptions options;
      options.communicator = &group.rank(r);
      options.shard = {r, world, expert_parallel};
      auto model = model_build_host(fixture(name), options);
      ASSERT_TRUE(model.has_value()) << model.error().message;
      auto runner = cpu_runner_create(std::move(*model), &group.rank(r));
      ASSERT_TRUE(runner.has_value()) << runner.error().message;
      ranks[r] = std::move(*runner);
    }
    const auto prompt = prompts(name).front();
    std::vector<SequenceCache> seqs{ranks[0]->new_sequence(), ranks[1]->new_sequence()};
    std::vector<std::vector<float>> logits(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        const std::vector<SequenceInput> in{{&seqs[r], prompt}};
        auto l = ranks[r]->forward(in, LogitsFor::kAllTokens);
        if (l) logits[r] = std::move(*l);
      });
    }
    for (std::thread& t : threads) t.join();
    ASSERT_EQ(logits[0].size(), prompt.size() * 512u) << name;
    ASSERT_EQ(logits[1].size(), logits[0].size()) << name;
    for (size_t i = 0; i < logits[0].size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(logits[1][i]), std::bit_cast<uint32_t>(logits[0][i])) << name << " " << i;
    }
  }
}

TEST(TensorParallelRefusals, AModelThatCannotSplitIsRefusedNamingTheTensor) {
  struct Refusal {
    std::string fixture;
    int world;
    std::string needle;
  };
  for (const Refusal& r : {Refusal{"qwen3_5_moe", 4, "linear_attn.in_proj_qkv"},  // 2 GDN key heads
                           Refusal{"qwen3", 3, "self_attn.q_proj"},               // 4 heads
                           Refusal{"qwen3_5_moe_nvfp4", 4, "linear_attn"}}) {
    ModelLoadOptions options;
    options.tensor_parallel_size = r.world;
    auto runner = runner_load(fixture(r.fixture), options);
    ASSERT_FALSE(runner.has_value()) << r.fixture;
    const std::string& m = runner.error().message;
    EXPECT_NE(m.find(r.needle), std::string::npos) << r.fixture << ": " << m;
    EXPECT_NE(m.find("world size " + std::to_string(r.world)), std::string::npos) << m;
  }
  ModelLoadOptions zero;
  zero.tensor_parallel_size = 0;
  auto runner = runner_load(fixture("qwen3"), zero);
  ASSERT_FALSE(runner.has_value());
  EXPECT_NE(runner.error().message.find("at least 1"), std::string::npos) << runner.error().message;
}

TEST(TensorParallelFailures, ABadTokenFailsTheStepAndLeavesTheGroupWorking) {
  auto split = load("qwen3", 2);
  ASSERT_TRUE(split);
  SequenceCache seq = split->new_sequence();
  const std::vector<int32_t> bad{3, 512};
  const std::vector<SequenceInput> in{{&seq, bad}};
  auto failed = split->forward(in, LogitsFor::kLastToken);
  ASSERT_FALSE(failed.has_value());
  EXPECT_NE(failed.error().message.find("token id 512"), std::string::npos) << failed.error().message;
  const std::vector<int32_t> good{3, 511};
  const std::vector<SequenceInput> in_good{{&seq, good}};
  auto ok = split->forward(in_good, LogitsFor::kLastToken);
  EXPECT_TRUE(ok.has_value()) << ok.error().message;
}

TEST(TensorParallelFailures, ASequenceOfAnotherRunnerIsRefused) {
  auto one = load("qwen3", 1), split = load("qwen3", 2);
  ASSERT_TRUE(one && split);
  SequenceCache seq = one->new_sequence();
  const std::vector<int32_t> tokens{3, 4};
  const std::vector<SequenceInput> in{{&seq, tokens}};
  auto failed = split->forward(in, LogitsFor::kLastToken);
  ASSERT_FALSE(failed.has_value());
  EXPECT_NE(failed.error().message.find("not made by this tensor-parallel runner"), std::string::npos)
      << failed.error().message;
}

TEST(TensorParallelCheck, TheCpuGroupAllReducesTheExactSum) {
  for (const int world : {2, 3}) {
    ModelLoadOptions options;
    options.tensor_parallel_size = world;
    auto check = tp_group_check(options, std::chrono::seconds(30));
    ASSERT_TRUE(check.has_value()) << check.error().message;
    EXPECT_EQ(check->world, world);
    EXPECT_TRUE(check->devices.empty());
    EXPECT_NE(check->transport.find("loopback"), std::string::npos) << check->transport;
    EXPECT_EQ(check->probe_bytes, int64_t{4} << 20);
    EXPECT_GT(check->all_reduce_ms, 0.0);
  }
}

TEST(TensorParallelCheck, MoreRanksThanGpusIsRefusedSayingWhatToDo) {
  ModelLoadOptions options;
  options.device = ModelDevice::kCuda;
  options.tensor_parallel_size = 64;
  auto check = tp_group_check(options, std::chrono::seconds(30));
  ASSERT_FALSE(check.has_value());
  EXPECT_NE(check.error().message.find("--tensor-parallel-size 64 needs 64 GPUs"), std::string::npos)
      << check.error().message;
  EXPECT_NE(check.error().message.find("--cuda-devices"), std::string::npos) << check.error().message;
  options.cuda_devices = {0, 1};
  auto listed = runner_load(fixture("qwen3"), options);
  ASSERT_FALSE(listed.has_value());
  EXPECT_NE(listed.error().message.find("--cuda-devices lists 2 GPUs for --tensor-parallel-size 64"),
            std::string::npos) << listed.error().message;
}

// Two "nodes" in one process: node 1's ranks (tp_worker_run on a thread, over Gloo and a real TCP store) run the
// steps node 0's runner sends; the logits are one device's, greedy decode included, and node 1 ends when node 0's
// runner goes away.
TEST(TensorParallelNodes, TwoNodesOverLoopbackMatchOneDevice) {
  const std::string name = "qwen3_5_moe";
  auto one = load(name, 1);
  ASSERT_TRUE(one);
  ModelLoadOptions options = two_loopback_nodes();
  Expected<void> worker_result = make_error("not run");
  std::thread worker([&] {
    ModelLoadOptions node1 = options;
    node1.node_rank = 1;
    worker_result = tp_worker_run(fixture(name), node1);
  });
  {
    auto split = runner_load(fixture(name), options);
    ASSERT_TRUE(split.has_value()) << split.error().message;
    EXPECT_NE((*split)->describe().find("2 tensor-parallel ranks on 2 nodes"), std::string::npos)
        << (*split)->describe();
    const int64_t vocab = one->config().vocab_size;
    for (const auto& prompt : prompts(name)) {
      SequenceCache a = one->new_sequence(), b = (*split)->new_sequence();
      std::vector<int32_t> next = prompt;
      for (int step = 0; step < 8; ++step) {
        const std::vector<SequenceInput> in_a{{&a, next}}, in_b{{&b, next}};
        auto want = one->forward(in_a, LogitsFor::kLastToken);
        auto got = (*split)->forward(in_b, LogitsFor::kLastToken);
        ASSERT_TRUE(want && got) << (want ? got.error().message : want.error().message);
        double max_ref = 0.0, worst = 0.0;
        for (int64_t v = 0; v < vocab; ++v) {
          max_ref = std::max(max_ref, std::abs(double{(*want)[v]}));
          worst = std::max(worst, std::abs(double{(*got)[v]} - double{(*want)[v]}));
        }
        EXPECT_LE(worst, 1e-5 * max_ref) << "step " << step;
        const int32_t id = argmax(*want);
        EXPECT_EQ(argmax(*got), id) << "step " << step;
        next = {id};
      }
    }
  }  // node 0's runner goes: node 1 is told to stop
  worker.join();
  EXPECT_TRUE(worker_result.has_value()) << worker_result.error().message;
}

// Nodes started differently would run other slices than node 0 plans for without anything failing: a node with
// expert parallelism beside one without, or with another checkpoint's config.json (the NVFP4 copy's), fails start-up
// on both nodes, naming the option, before any weight loads.
TEST(TensorParallelNodes, NodesStartedWithOtherFlagsAreRefused) {
  struct Case {
    std::string node1_model;
    bool node1_expert_parallel;
    std::string needle;
  };
  for (const Case& c : {Case{"qwen3_5_moe", true, "--enable-expert-parallel"},
                        Case{"qwen3_5_moe_nvfp4", false, "config.json"}}) {
    ModelLoadOptions options = two_loopback_nodes();
    Expected<void> worker_result = make_error("not run");
    std::thread worker([&] {
      ModelLoadOptions node1 = options;
      node1.node_rank = 1;
      node1.expert_parallel = c.node1_expert_parallel;
      worker_result = tp_worker_run(fixture(c.node1_model), node1);
    });
    {
      auto split = runner_load(fixture("qwen3_5_moe"), options);
      EXPECT_FALSE(split.has_value()) << c.needle;
      if (!split) {
        EXPECT_NE(split.error().message.find(c.needle), std::string::npos) << split.error().message;
      }
    }  // a runner made in error goes before the join, so node 1 is told to stop
    worker.join();
    ASSERT_FALSE(worker_result.has_value()) << c.needle;
    EXPECT_NE(worker_result.error().message.find(c.needle), std::string::npos) << worker_result.error().message;
  }
}

// A front end without ranks (ModelLoadOptions::front_end) and the two nodes holding a rank each of a group of two,
// the nodes running as threads of this test until the front end's runner goes (or a step fails there).
struct FrontEndNodes {
  ModelLoadOptions options;
  Expected<void> results[2] = {make_error("not run"), make_error("not run")};
  std::vector<std::thread> workers;

  explicit FrontEndNodes(const std::string& name) {
    options.tensor_parallel_size = 2;
    options.nnodes = 3;
    options.front_end = true;
    options.dist_init_addr = "127.0.0.1:" + std::to_string(free_port());
    options.tp_join_timeout = std::chrono::seconds(30);
    for (int node = 1; node <= 2; ++node) {
      workers.emplace_back([this, name, node] {
        ModelLoadOptions mine = options;
        mine.node_rank = node;
        results[node - 1] = tp_worker_run(fixture(name), mine);
      });
    }
  }
  // Also on a failed assertion's return, after the front end's runner (declared later) has gone.
  ~FrontEndNodes() { join(); }
  void join() {
    for (std::thread& t : workers) {
      if (t.joinable()) t.join();
    }
  }
};

// A front end without ranks (ModelLoadOptions::front_end): node 0 holds the scheduler's model shapes only, two
// other nodes hold a rank each (the one with rank 0 sends each step's logits back; the other takes part), and the
// front end's logits, batched over two sequences, and its sampled tokens (drawn on the host from those logits) are
// those of one device.
TEST(TensorParallelNodes, AFrontEndWithoutRanksMatchesOneDevice) {
  const std::string name = "qwen3_5_moe";
  auto one = load(name, 1);
  ASSERT_TRUE(one);
  FrontEndNodes nodes(name);
  {
    auto front = runner_load(fixture(name), nodes.options);
    ASSERT_TRUE(front.has_value()) << front.error().message;
    EXPECT_NE((*front)->describe().find("2 tensor-parallel ranks on 2 other nodes, this process their front end"),
              std::string::npos) << (*front)->describe();
    EXPECT_EQ((*front)->config().vocab_size, one->config().vocab_size);
    const int64_t vocab = one->config().vocab_size;
    const auto all = prompts(name);
    ASSERT_GE(all.size(), 2u);
    SequenceCache a[2] = {one->new_sequence(), one->new_sequence()};
    SequenceCache b[2] = {(*front)->new_sequence(), (*front)->new_sequence()};
    std::vector<int32_t> next[2] = {all[0], all[1]};
    for (int step = 0; step < 6; ++step) {
      const std::vector<SequenceInput> in_a{{&a[0], next[0]}, {&a[1], next[1]}};
      const std::vector<SequenceInput> in_b{{&b[0], next[0]}, {&b[1], next[1]}};
      auto want = one->forward(in_a, LogitsFor::kLastToken);
      auto got = (*front)->forward(in_b, LogitsFor::kLastToken);
      ASSERT_TRUE(want && got) << (want ? got.error().message : want.error().message);
      ASSERT_EQ(got->size(), want->size());
      for (int s = 0; s < 2; ++s) {
        const std::span<const float> w(want->data() + s * vocab, static_cast<size_t>(vocab));
        const std::span<const float> g(got->data() + s * vocab, static_cast<size_t>(vocab));
        double max_ref = 0.0, worst = 0.0;
        for (int64_t v = 0; v < vocab; ++v) {
          max_ref = std::max(max_ref, std::abs(double{w[v]}));
          worst = std::max(worst, std::abs(double{g[v]} - double{w[v]}));
        }
        EXPECT_LE(worst, 1e-5 * max_ref) << "step " << step << " sequence " << s;
        EXPECT_EQ(argmax(g), argmax(w)) << "step " << step << " sequence " << s;
        next[s] = {argmax(w)};
      }
    }
    // Sampling: rank 0 draws with the front end's draws (and the ids its penalties read), the tokens and their
    // logprobs come back; two sequences, one random with penalties and top logprobs, one greedy with every even id
    // banned for its first 4 tokens (min_tokens' ban travels in the plan, resolved for each row's output: without
    // it about half the greedy tokens would differ, before the 4th and after it).
    SamplingParams random{.temperature = 0.8f, .top_k = 20, .repetition_penalty = 1.2f, .presence_penalty = 0.3f,
                          .seed = 99, .logprobs = 3};
    SamplingParams greedy{.temperature = 0.0f, .banned_until = 4};
    for (int32_t id = 0; id < std::min<int64_t>(vocab, 2 * kSamplingMaxLogitBias); id += 2) {
      greedy.banned_ids.push_back(id);
    }
    Sampler sa[2] = {Sampler(random), Sampler(greedy)}, sb[2] = {Sampler(random), Sampler(greedy)};
    SequenceCache c[2] = {one->new_sequence(), one->new_sequence()};
    SequenceCache d[2] = {(*front)->new_sequence(), (*front)->new_sequence()};
    std::vector<int32_t> tokens[2] = {all[0], all[1]}, out_a[2], out_b[2];
    for (int step = 0; step < 8; ++step) {
      std::vector<SequenceInput> in_a, in_b;
      std::vector<SampleRow> rows_a, rows_b;
      for (int s = 0; s < 2; ++s) {
        in_a.push_back({&c[s], tokens[s]});
        in_b.push_back({&d[s], tokens[s]});
        rows_a.push_back({&sa[s], all[s], out_a[s]});
        rows_b.push_back({&sb[s], all[s], out_b[s]});
      }
      auto ga = one->forward_sample(in_a, rows_a);
      auto gb = (*front)->forward_sample(in_b, rows_b);
      ASSERT_TRUE(ga && gb) << (ga ? gb.error().message : ga.error().message);
      ASSERT_EQ(gb->size(), 2u);
      for (int s = 0; s < 2; ++s) {
        const auto& want = (*ga)[static_cast<size_t>(s)];
        const auto& got = (*gb)[static_cast<size_t>(s)];
        ASSERT_TRUE(want && got) << (got ? "" : got.error().message);
        EXPECT_EQ(got->id, want->id) << "step " << step << " sequence " << s;
        if (s == 1 && step < 4) {
          EXPECT_EQ(got->id % 2, 1) << "step " << step << ": a banned id";
        }
        EXPECT_NEAR(got->logprob, want->logprob, 1e-4) << "step " << step << " sequence " << s;
        ASSERT_EQ(got->top_logprobs.size(), want->top_logprobs.size());
        for (size_t k = 0; k < want->top_logprobs.size(); ++k) {
          EXPECT_EQ(got->top_logprobs[k].first, want->top_logprobs[k].first) << "step " << step << " rank " << k;
        }
        out_a[s].push_back(want->id);
        out_b[s].push_back(got->id);
        tokens[s] = {want->id};
      }
    }
    EXPECT_EQ(sa[0].next_draw(), sb[0].next_draw()) << "the front end's stream advanced as the host sampler's did";
  }  // the front end goes: the nodes are told to stop
  nodes.join();
  for (const auto& r : nodes.results) EXPECT_TRUE(r.has_value()) << r.error().message;
}

// The lists that grow with a sequence go to the other nodes as changes: with a penalty on, a decode step's plan is
// a few dozen words however long the prompt (the ids the penalties read, and the KV block ids, are held there),
// and the tokens rank 0 samples from the held ids are one device's. The sequence released, its successor starts
// from nothing.
TEST(TensorParallelNodes, ThePlansSendTheGrowingListsAsChanges) {
  const std::string name = "qwen3";
  auto one = load(name, 1);
  ASSERT_TRUE(one);
  std::vector<int32_t> prompt;
  while (prompt.size() < 300) {
    for (const auto& p : prompts(name)) prompt.insert(prompt.end(), p.begin(), p.end());
  }
  FrontEndNodes nodes(name);
  {
    auto front = runner_load(fixture(name), nodes.options);
    ASSERT_TRUE(front.has_value()) << front.error().message;
    const SamplingParams params{.temperature = 0.9f, .top_k = 30, .repetition_penalty = 1.5f,
                                .presence_penalty = 0.5f, .frequency_penalty = 0.4f, .seed = 7};
    for (int round = 0; round < 2; ++round) {  // the second a new sequence after the first's release
      Sampler sa(params), sb(params);
      SequenceCache a = one->new_sequence(), b = (*front)->new_sequence();
      std::vector<int32_t> tokens = prompt, out_a, out_b;
      for (int step = 0; step < 8; ++step) {
        const int64_t before = (*front)->plan_bytes_sent();
        const std::vector<SampleRow> rows_a{{&sa, prompt, out_a}}, rows_b{{&sb, prompt, out_b}};
        auto ga = one->forward_sample(std::vector<SequenceInput>{{&a, tokens}}, rows_a);
        auto gb = (*front)->forward_sample(std::vector<SequenceInput>{{&b, tokens}}, rows_b);
        ASSERT_TRUE(ga && gb) << (ga ? gb.error().message : ga.error().message);
        const auto& want = ga->at(0);
        const auto& got = gb->at(0);
        ASSERT_TRUE(want && got) << (got ? "" : got.error().message);
        EXPECT_EQ(got->id, want->id) << "round " << round << " step " << step;
        EXPECT_NEAR(got->logprob, want->logprob, 1e-4) << "round " << round << " step " << step;
        const int64_t sent = (*front)->plan_bytes_sent() - before;
        if (step == 0) {
          EXPECT_GE(sent, static_cast<int64_t>(2 * prompt.size() * sizeof(int64_t)));  // the tokens, the ids
        } else {
          EXPECT_LE(sent, 64 * static_cast<int64_t>(sizeof(int64_t))) << "round " << round << " step " << step;
        }
        out_a.push_back(want->id);
        out_b.push_back(got->id);
        tokens = {want->id};
      }
    }
  }
  nodes.join();
  for (const auto& r : nodes.results) EXPECT_TRUE(r.has_value()) << r.error().message;
}

// A step that fails on the ranks (here node 0's plan disagrees with the ranks on a sequence's length) fails on the
// front end with the ranks' reason at once, not at the control group's deadline; every later step fails too, and
// the nodes end with the error.
TEST(TensorParallelNodes, AStepThatFailsOnTheRanksFailsOnTheFrontEnd) {
  const std::string name = "qwen3";
  FrontEndNodes nodes(name);
  {
    auto front = runner_load(fixture(name), nodes.options);
    ASSERT_TRUE(front.has_value()) << front.error().message;
    SequenceCache seq = (*front)->new_sequence();
    const std::vector<int32_t> prompt = prompts(name).front();
    ASSERT_TRUE((*front)->forward(std::vector<SequenceInput>{{&seq, prompt}}, LogitsFor::kLastToken).has_value());
    seq.length += 1;  // the ranks hold one token less
    const std::vector<int32_t> token{1};
    const auto start = std::chrono::steady_clock::now();
    auto r = (*front)->forward(std::vector<SequenceInput>{{&seq, token}}, LogitsFor::kLastToken);
    ASSERT_FALSE(r.has_value());
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
    EXPECT_NE(r.error().message.find("this node's rank holds"), std::string::npos) << r.error().message;
    auto later = (*front)->forward(std::vector<SequenceInput>{{&seq, token}}, LogitsFor::kLastToken);
    ASSERT_FALSE(later.has_value());
    EXPECT_NE(later.error().message.find("failed earlier"), std::string::npos) << later.error().message;
    EXPECT_TRUE((*front)->failure().has_value());
  }
  nodes.join();
  for (const auto& w : nodes.results) {
    ASSERT_FALSE(w.has_value());
    EXPECT_NE(w.error().message.find("this node's rank holds"), std::string::npos) << w.error().message;
  }
}

// Each node's GPUs (machines of 8 here): by default rank r of the node on GPU r; --cuda-devices listing the node's
// ranks' GPUs, or every rank's when the nodes share a machine (--distributed-executor-backend mp), of which each node
// takes its own; a front end none; a list of any other length, or a GPU not present, refused.
TEST(TensorParallelNodes, EachNodeTakesItsRanksGpus) {
  auto devices = [](const std::vector<int>& listed, int world, NodeLayout layout) {
    return tp_rank_devices(listed, world, layout, 8);
  };
  const NodeLayout one{}, node1_of4{.nnodes = 4, .node_rank = 1}, node3_of4{.nnodes = 4, .node_rank = 3};
  const NodeLayout front{.nnodes = 3, .node_rank = 0, .front_end = true},
                   front_node2{.nnodes = 3, .node_rank = 2, .front_end = true};
  EXPECT_EQ(devices({}, 4, one).value(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(devices({5, 6}, 2, one).value(), (std::vector<int>{5, 6}));
  EXPECT_EQ(devices({}, 4, node1_of4).value(), (std::vector<int>{0}));
  EXPECT_EQ(devices({4, 5, 6, 7}, 4, node1_of4).value(), (std::vector<int>{5}));  // every rank's: its own
  EXPECT_EQ(devices({4, 5, 6, 7}, 4, node3_of4).value(), (std::vector<int>{7}));
  EXPECT_EQ(devices({2}, 4, node3_of4).value(), (std::vector<int>{2}));            // the node's own
  EXPECT_TRUE(devices({0, 1}, 2, front).value().empty());
  EXPECT_EQ(devices({0, 1}, 2, front_node2).value(), (std::vector<int>{1}));        // node 2 holds rank 1
  EXPECT_EQ(devices({0, 1, 2, 3}, 4, front_node2).value(), (std::vector<int>{2, 3}));
  const auto three = devices({0, 1, 2}, 4, node1_of4);
  ASSERT_FALSE(three.has_value());
  EXPECT_NE(three.error().message.find("--cuda-devices lists 3 GPUs for --tensor-parallel-size 4 (1 per node, or 4"),
            std::string::npos) << three.error().message;
  const auto absent = devices({0, 9}, 2, one);
  ASSERT_FALSE(absent.has_value());
  EXPECT_NE(absent.error().message.find("GPU 9 does not exist (8 present)"), std::string::npos);
  const auto too_few = tp_rank_devices({}, 16, one, 8);
  ASSERT_FALSE(too_few.has_value());
  EXPECT_NE(too_few.error().message.find("--tensor-parallel-size 16 needs 16 GPUs, 8 present"), std::string::npos);
}

TEST(TensorParallelNodes, ImpossibleLayoutsAreRefused) {
  struct Bad {
    int tp, nnodes, node_rank;
    std::string addr, needle;
    bool front_end = false;
  };
  for (const Bad& b : {Bad{2, 2, 0, "", "needs --dist-init-addr HOST:PORT"},
                       Bad{2, 2, 0, "127.0.0.1:99999", "needs --dist-init-addr HOST:PORT"},
                       Bad{3, 2, 0, "127.0.0.1:29500",
                           "--tensor-parallel-size 3 does not divide over 2 nodes (--nnodes 2)"},
                       Bad{2, 2, 2, "127.0.0.1:29500", "--node-rank 2 is outside [0, 2)"},
                       Bad{2, 1, 0, "", "a front end without ranks needs the ranks on at least one other node", true},
                       Bad{3, 3, 0, "127.0.0.1:29500", "does not divide over 2 nodes besides the front end", true}}) {
    ModelLoadOptions options;
    options.tensor_parallel_size = b.tp;
    options.nnodes = b.nnodes;
    options.node_rank = b.node_rank;
    options.dist_init_addr = b.addr;
    options.front_end = b.front_end;
    auto r = b.node_rank == 0 ? runner_load(fixture("qwen3"), options).map([](auto&&) {})
                              : tp_worker_run(fixture("qwen3"), options);
    ASSERT_FALSE(r.has_value()) << b.needle;
    EXPECT_NE(r.error().message.find(b.needle), std::string::npos) << r.error().message;
  }
}

TEST(TensorParallelNodes, ANodeThatNeverComesIsADeadlineNotAHang) {
  ModelLoadOptions options = two_loopback_nodes(std::chrono::seconds(2));
  const auto start = std::chrono::steady_clock::now();
  auto r = runner_load(fixture("qwen3"), options);
  ASSERT_FALSE(r.has_value());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_NE(r.error().message.find("joining the other nodes at 127.0.0.1"), std::string::npos) << r.error().message;
}

}  // namespace
}  // namespace tern
