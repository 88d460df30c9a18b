// The traffic model of `tern bench` against numbers worked out by hand from the fixtures' config.json (read here as
// plain JSON, not through the model loader) and against a simulation of top-k routing.
#include "cli/bench_traffic.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <random>
#include <set>

namespace tern {
namespace {

nlohmann::json fixture_config(const std::string& name) {
  std::ifstream in(std::string(TERN_FIXTURES_DIR) + "/" + name + "/config.json");
  return nlohmann::json::parse(in);
}

std::unique_ptr<CausalLm> load(const std::string& name) {
  auto model = model_build_host(std::string(TERN_FIXTURES_DIR) + "/" + name, {});
  EXPECT_TRUE(model.has_value()) << (model ? "" : model.error().message);
  return model ? std::move(*model) : nullptr;
}

TEST(BenchTraffic, DenseModelFromItsConfig) {
  const auto c = fixture_config("qwen3");
  auto model = load("qwen3");
  ASSERT_TRUE(model);
  const double h = c["hidden_size"], heads = c["num_attention_heads"], kv = c["num_key_value_heads"],
               hd = c["head_dim"], inter = c["intermediate_size"], layers = c["num_hidden_layers"],
               vocab = c["vocab_size"];
  const double per_layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter;  // q, o; k, v; gate, up, down
  const StepTraffic t = step_traffic_of(*model);
  EXPECT_DOUBLE_EQ(t.dense_weight_bytes, 2 * (layers * per_layer + vocab * h));
  EXPECT_DOUBLE_EQ(t.kv_bytes_per_token, layers * 2 * kv * hd * 2);
  EXPECT_DOUBLE_EQ(t.linear_flops_per_token, 2 * (layers * per_layer + vocab * h));
  EXPECT_DOUBLE_EQ(t.attention_flops_per_token2, layers * 2 * heads * hd);
  EXPECT_EQ(t.moe_layers, 0);
  // One step of 4 sequences at 100 cached tokens: the weights once, each sequence's KV.
  EXPECT_DOUBLE_EQ(decode_step_bytes(t, 4, 100), t.dense_weight_bytes + 4 * 100 * t.kv_bytes_per_token);
  EXPECT_DOUBLE_EQ(prefill_flops(t, 10), 10 * t.linear_flops_per_token + 100 * t.attention_flops_per_token2);
}

TEST(BenchTraffic, MoeModelCountsRoutedExperts) {
  const auto c = fixture_config("qwen3_moe");
  auto model = load("qwen3_moe");
  ASSERT_TRUE(model);
  const StepTraffic t = step_traffic_of(*model);
  const double h = c["hidden_size"], moe_inter = c["moe_intermediate_size"];
  EXPECT_DOUBLE_EQ(t.expert_bytes, 2 * 3 * h * moe_inter);
  EXPECT_EQ(t.n_experts, c["num_local_experts"].get<int64_t>());
  EXPECT_EQ(t.top_k, c["num_experts_per_tok"].get<int64_t>());
  // HF Qwen3-MoE: layer i is sparse when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
  const int64_t layers = c["num_hidden_layers"], step = c["decoder_sparse_step"];
  const auto dense_only = c["mlp_only_layers"].get<std::set<int64_t>>();
  int64_t sparse = 0;
  for (int64_t i = 0; i < layers; ++i) sparse += !dense_only.contains(i) && (i + 1) % step == 0;
  EXPECT_EQ(t.moe_layers, sparse);
  const double one = decode_step_bytes(t, 1, 0), two = decode_step_bytes(t, 2, 0);
  EXPECT_DOUBLE_EQ(one - t.dense_weight_bytes, static_cast<double>(sparse * t.top_k) * t.expert_bytes);
  EXPECT_GT(two, one);
}

// The closed form against drawing top-k sets: E=64 experts, k=4, 1..64 tokens, 20000 trials each.
TEST(BenchTraffic, DistinctExpertsMatchSimulatedRouting) {
  std::mt19937 rng(5);
  std::vector<int> experts(64);
  for (int e = 0; e < 64; ++e) experts[e] = e;
  for (int tokens : {1, 3, 16, 64}) {
    double total = 0;
    constexpr int kTrials = 20000;
    for (int trial = 0; trial < kTrials; ++trial) {
      std::set<int> hit;
      for (int t = 0; t < tokens; ++t) {
        std::shuffle(experts.begin(), experts.end(), rng);
        hit.insert(experts.begin(), experts.begin() + 4);
      }
      total += static_cast<double>(hit.size());
    }
    EXPECT_NEAR(expected_distinct_experts(64, 4, tokens), total / kTrials, 0.05) << tokens << " tokens";
  }
  EXPECT_DOUBLE_EQ(expected_distinct_experts(64, 4, 1), 4.0);
}

}  // namespace
}  // namespace tern
