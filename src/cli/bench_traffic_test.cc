// The traffic model of `tern bench` against numbers worked out by hand from the fixtures' config.json (read here as
// plain JSON, not through the model loader) and against a simulation of top-k routing.
#include "cli/bench_traffic.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <random>
#include <set>

namespace tern {
namespace {

nlohmann::json fixture_config(const std::string& name) {
  std::ifstream in(std::string(TERN_FIXTURES_DIR) + "/" + name + "/config.json");
  return nlohmann::json::parse(in);
}

std::unique_ptr<CausalLm> load(const std::string& name, int world = 1, LoadFormat format = LoadFormat::kAuto) {
  auto model = model_build_host(std::string(TERN_FIXTURES_DIR) + "/" + name,
                                {.load_format = format, .shard = {0, world}});
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

// The busiest expert-parallel rank's experts: by hand where the answer is exact (one token's 2 of 4 experts over 2
// ranks: both on one rank for 2 of the 6 pairs, so 2 * 2/6 + 1 * 4/6 = 4/3; one expert a rank: always 1), and against
// drawing here (a shuffle per token, another generator) at the 397B's 512 experts top-10 over 8 ranks and the 35B's
// 256 top-8 over 4. At one rank it is every distinct expert.
TEST(BenchTraffic, BusiestExpertParallelRankMatchesSimulatedRouting) {
  EXPECT_NEAR(expected_busiest_rank_experts(4, 2, 2, 1), 4.0 / 3.0, 0.03);
  EXPECT_DOUBLE_EQ(expected_busiest_rank_experts(8, 8, 2, 1), 1.0);
  EXPECT_NEAR(expected_busiest_rank_experts(64, 1, 4, 16), expected_distinct_experts(64, 4, 16), 0.1);
  std::mt19937 rng(11);
  struct Shape {
    int experts, ranks, top_k, tokens;
  };
  for (const Shape s : {Shape{512, 8, 10, 1}, Shape{512, 8, 10, 16}, Shape{256, 4, 8, 64}}) {
    std::vector<int> experts(static_cast<size_t>(s.experts));
    for (int e = 0; e < s.experts; ++e) experts[e] = e;
    constexpr int kTrials = 4000;
    double total = 0;
    for (int trial = 0; trial < kTrials; ++trial) {
      std::set<int> hit;
      for (int t = 0; t < s.tokens; ++t) {
        std::shuffle(experts.begin(), experts.end(), rng);
        hit.insert(experts.begin(), experts.begin() + s.top_k);
      }
      std::vector<int> per_rank(static_cast<size_t>(s.ranks), 0);
      for (int e : hit) ++per_rank[e / (s.experts / s.ranks)];
      total += *std::max_element(per_rank.begin(), per_rank.end());
    }
    const double busiest = expected_busiest_rank_experts(s.experts, s.ranks, s.top_k, s.tokens);
    EXPECT_NEAR(busiest, total / kTrials, 0.03 * busiest) << s.experts << " experts over " << s.ranks << " ranks";
    // More than the mean share (the step waits for the busiest rank), by less as the batch grows.
    EXPECT_GT(busiest, expected_distinct_experts(s.experts, s.top_k, s.tokens) / s.ranks * 1.01);
  }
}

// Tensor parallelism, worked out here from the configs: rank 0's share of every linear as docs/architecture.md's
// sharding table says (heads, KV heads replicated when fewer than the ranks, expert columns, vocabulary rows padded
// to 64 x world), and the collectives a step adds.
double ceil_div(double a, double b) { return std::ceil(a / b); }

// Rank 0's vocabulary rows: the vocabulary padded to a multiple of 64 x world, split evenly, clipped.
double rank0_vocab_rows(double vocab, double world) { return std::min(vocab, ceil_div(vocab, 64 * world) * 64); }

struct RankBytes {
  double dense = 0, experts = 0, embedding = 0, kv_per_token = 0, state_per_sequence = 0;
  double total() const { return dense + experts + embedding; }
};

// Qwen3 (dense, tied): q, o by heads; k, v by KV heads; gate, up, down by the intermediate; BF16.
RankBytes qwen3_per_rank(const nlohmann::json& c, double w) {
  const double h = c["hidden_size"], nq = c["num_attention_heads"], nkv = c["num_key_value_heads"], hd = c["head_dim"],
               inter = c["intermediate_size"], layers = c["num_hidden_layers"], vocab = c["vocab_size"];
  const double kv_rank = std::max(1.0, nkv / w);
  const double per_layer = 2 * (nq / w * hd * h * 2 + kv_rank * hd * h * 2 + 3 * h * inter / w);
  RankBytes e;
  e.dense = layers * per_layer + rank0_vocab_rows(vocab, w) * h * 2;  // lm_head is the embedding table
  e.kv_per_token = layers * 2 * kv_rank * hd * 2;
  return e;
}

// Qwen3.5-MoE (untied), `expert_byte` bytes per routed-expert element (BF16 2, NVFP4 0.5 + 1/16), the rest BF16.
RankBytes qwen3_5_per_rank(const nlohmann::json& c, double w, double expert_byte) {
  const double h = c["hidden_size"], nq = c["num_attention_heads"], nkv = c["num_key_value_heads"], hd = c["head_dim"],
               nk = c["linear_num_key_heads"], nv = c["linear_num_value_heads"], dk = c["linear_key_head_dim"],
               dv = c["linear_value_head_dim"], kernel = c["linear_conv_kernel_dim"], experts = c["num_experts"],
               inter = c["moe_intermediate_size"], shared = c["shared_expert_intermediate_size"],
               layers = c["num_hidden_layers"], vocab = c["vocab_size"];
  double attention_layers = 0;
  if (c.contains("layer_types")) {
    for (const auto& t : c["layer_types"]) attention_layers += t == "full_attention";
  } else {
    const int64_t interval = c["full_attention_interval"];
    for (int64_t i = 0; i < static_cast<int64_t>(layers); ++i) attention_layers += (i + 1) % interval == 0;
  }
  const double gdn_layers = layers - attention_layers, kv_rank = std::max(1.0, nkv / w);
  const double gdn = 2 * h * ((2 * nk * dk + nv * dv) / w + nv * dv / w + 2 * nv / w + nv * dv / w);
  const double attention = 2 * h * (2 * nq * hd / w + 2 * kv_rank * hd + nq * hd / w);  // q with its gate
  const double moe_dense = 2 * h * (experts + 3 * shared / w + 1);  // router, shared expert, its gate
  RankBytes e;
  e.dense = gdn_layers * gdn + attention_layers * attention + layers * moe_dense + rank0_vocab_rows(vocab, w) * h * 2;
  e.experts = layers * experts * 3 * h * inter / w * expert_byte;
  e.embedding = rank0_vocab_rows(vocab, w) * h * 2;
  e.kv_per_token = attention_layers * 2 * kv_rank * hd * 2;
  e.state_per_sequence = gdn_layers * (nv / w * dk * dv * 4 + (2 * nk / w * dk + nv / w * dv) * (kernel - 1) * 2);
  return e;
}

void expect_traffic(const StepTraffic& t, const RankBytes& e, const std::string& what) {
  EXPECT_DOUBLE_EQ(t.dense_weight_bytes, e.dense) << what;
  EXPECT_DOUBLE_EQ(static_cast<double>(t.moe_layers * t.n_experts) * t.expert_bytes, e.experts) << what;
  EXPECT_DOUBLE_EQ(t.embedding_bytes, e.embedding) << what;
  EXPECT_DOUBLE_EQ(weight_bytes(t), e.total()) << what;
  EXPECT_DOUBLE_EQ(t.kv_bytes_per_token, e.kv_per_token) << what;
  EXPECT_DOUBLE_EQ(t.state_bytes_per_sequence, e.state_per_sequence) << what;
}

TEST(BenchTrafficTp, DenseRankHoldsItsShareOfTheCheckpoint) {
  const auto c = fixture_config("qwen3");
  for (int w : {1, 2, 4}) {
    auto model = load("qwen3", w);
    ASSERT_TRUE(model);
    expect_traffic(step_traffic_of(*model), qwen3_per_rank(c, w), "qwen3 at TP " + std::to_string(w));
  }
  // At TP 2 every linear of Qwen3 splits (norms are not counted); at TP 4 the 2 KV heads are replicated, so a rank
  // holds more than a quarter.
  const double one = weight_bytes(step_traffic_of(*load("qwen3", 1)));
  EXPECT_DOUBLE_EQ(weight_bytes(step_traffic_of(*load("qwen3", 2))), one / 2);
  EXPECT_GT(weight_bytes(step_traffic_of(*load("qwen3", 4))), one / 4);
}

TEST(BenchTrafficTp, MoeRankHoldsItsShareOfTheCheckpoint) {
  const auto c = fixture_config("qwen3_5_moe")["text_config"];
  for (int w : {1, 2}) {
    auto model = load("qwen3_5_moe", w);
    ASSERT_TRUE(model);
    const StepTraffic t = step_traffic_of(*model);
    expect_traffic(t, qwen3_5_per_rank(c, w, 2), "qwen3_5_moe at TP " + std::to_string(w));
    EXPECT_EQ(t.n_experts, c["num_experts"].get<int64_t>());  // every expert on every rank, a slice of each
    // The same counts from the config alone (shapes-only weights, nothing read from the checkpoint).
    auto shapes = load("qwen3_5_moe", w, LoadFormat::kShapes);
    ASSERT_TRUE(shapes);
    expect_traffic(step_traffic_of(*shapes), qwen3_5_per_rank(c, w, 2), "shapes only at TP " + std::to_string(w));
  }
}

// The full Qwen3.5-397B-A17B NVFP4 bench config at TP 8 and 4, planned as `tern bench --plan-only` does it.
TEST(BenchTrafficTp, Qwen35_397bSplitsOverFourAndEight) {
  const std::string dir = std::string(TERN_SOURCE_DIR) + "/bench/configs/qwen3.5-397b-a17b-nvfp4";
  std::ifstream in(dir + "/config.json");
  const auto config = nlohmann::json::parse(in);
  // Only the routed experts are NVFP4: the ignore list names everything else.
  const auto ignore = config["quantization_config"]["ignore"].get<std::set<std::string>>();
  for (const char* p : {"lm_head", "*linear_attn*", "*self_attn*", "*mlp.gate", "*shared_expert*"}) {
    ASSERT_TRUE(ignore.contains(p)) << p;
  }
  const auto& c = config["text_config"];
  for (int w : {8, 4}) {
    auto model = model_build_host(dir, {.load_format = LoadFormat::kShapes, .shard = {0, w}});
    ASSERT_TRUE(model) << model.error().message;
    const StepTraffic t = step_traffic_of(**model);
    expect_traffic(t, qwen3_5_per_rank(c, w, 0.5 + 1.0 / 16), "397B at TP " + std::to_string(w));
    const StepCollectives s = step_collectives(t, w, 4, 4);
    EXPECT_EQ(s.all_reduces, 2 * c["num_hidden_layers"].get<int64_t>() + 1);
    EXPECT_DOUBLE_EQ(s.all_reduce_bytes, 4.0 * 4096 * 2);
    EXPECT_DOUBLE_EQ(s.all_gather_bytes, 4.0 * (248320.0 / w) * w * 2);  // 248320 = 64 x 3880: no padding
  }
  // 3 does not divide the 16 GDN key heads: the error names the tensor.
  auto three = model_build_host(dir, {.load_format = LoadFormat::kShapes, .shard = {0, 3}});
  ASSERT_FALSE(three);
  EXPECT_NE(three.error().message.find("linear_attn.in_proj_qkv.weight"), std::string::npos) << three.error().message;
}

TEST(BenchTrafficTp, CollectivesFromTheConfig) {
  const auto c = fixture_config("qwen3_5_moe")["text_config"];
  const int64_t layers = c["num_hidden_layers"], h = c["hidden_size"], vocab = c["vocab_size"];
  auto model = load("qwen3_5_moe", 2);
  ASSERT_TRUE(model);
  const StepTraffic t = step_traffic_of(*model);
  for (int64_t batch : {1, 5}) {
    const StepCollectives s = step_collectives(t, 2, batch, batch);
    EXPECT_EQ(s.all_reduces, 2 * layers + 1);  // after every mixer and feed-forward block, and the embedding
    EXPECT_DOUBLE_EQ(s.all_reduce_bytes, static_cast<double>(batch * h * 2));
    EXPECT_DOUBLE_EQ(s.all_gather_bytes, static_cast<double>(batch) * rank0_vocab_rows(vocab, 2) * 2 * 2);
    EXPECT_DOUBLE_EQ(s.bytes_per_step(), static_cast<double>(2 * layers + 1) * s.all_reduce_bytes + s.all_gather_bytes);
  }
  // Prefill: every token is summed, only the last one's logits gathered.
  EXPECT_DOUBLE_EQ(step_collectives(t, 2, 24, 1).all_reduce_bytes, 24.0 * static_cast<double>(h) * 2);
  // One rank: none.
  EXPECT_EQ(step_collectives(step_traffic_of(*load("qwen3_5_moe")), 1, 4, 4).all_reduces, 0);
  // A vocabulary that does not split evenly gathers padded ranges: 1000 rows over 3 ranks is 3 x 384.
  StepTraffic padded;
  padded.vocab = 1000;
  padded.hidden = 8;
  EXPECT_DOUBLE_EQ(step_collectives(padded, 3, 2, 2).all_gather_bytes, 2.0 * 384 * 3 * 2);
}

// The weight schema's declarations count the same bytes per rank as the blocks built from them.
TEST(BenchTrafficTp, SchemaAgreesWithTheBlocks) {
  for (const char* name : {"qwen3", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_nvfp4"}) {
    const std::string dir = std::string(TERN_FIXTURES_DIR) + "/" + name;
    auto config = model_config_load(dir);
    auto quant = quant_config_load(dir);
    ASSERT_TRUE(config && quant);
    const WeightSchema schema = weight_schema_build(*config, weight_schema_default_text_prefix(*config));
    for (int w : {1, 2}) {
      const StepTraffic t = step_traffic_of(*load(name, w, LoadFormat::kShapes));
      auto b = schema_rank_bytes(schema, *quant, {0, w});
      ASSERT_TRUE(b) << b.error().message;
      EXPECT_DOUBLE_EQ(b->weight_bytes(), weight_bytes(t)) << name << " at TP " << w;
      EXPECT_DOUBLE_EQ(b->cache_bytes_per_token, t.kv_bytes_per_token) << name << " at TP " << w;
      EXPECT_DOUBLE_EQ(b->state_bytes_per_sequence, t.state_bytes_per_sequence) << name << " at TP " << w;
    }
  }
}

}  // namespace
}  // namespace tern
