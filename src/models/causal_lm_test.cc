// CausalLm::release_host_weights: what a device runner whose blocks copied every weight frees once it has placed
// the model (runtime/model_runner.cc's DeviceRunner::place).
#include "models/causal_lm.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace tern {
namespace {

namespace fs = std::filesystem;

// This process's resident memory in bytes (Linux), -1 where /proc says nothing.
int64_t resident_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("VmRSS:")) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// The qwen3 fixture's config made large enough (untied, 32k vocabulary) that its dummy weights, ~260 MB of BF16,
// dwarf everything else the process holds.
fs::path large_qwen3_dir() {
  std::ifstream in(fs::path(TERN_FIXTURES_DIR) / "qwen3" / "config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["hidden_size"] = 1024;
  config["intermediate_size"] = 4096;
  config["num_attention_heads"] = 8;
  config["num_key_value_heads"] = 4;
  config["head_dim"] = 128;
  config["vocab_size"] = 32000;
  config["eos_token_id"] = 31999;
  config["pad_token_id"] = 31998;
  config["tie_word_embeddings"] = false;
  config["num_hidden_layers"] = 4;
  config["layer_types"] = nlohmann::json::array({"full_attention", "full_attention", "full_attention",
                                                 "full_attention"});
  const fs::path dir = fs::temp_directory_path() / ("tern_release_" + std::to_string(::testing::UnitTest::GetInstance()
                                                                                          ->random_seed()));
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config.dump(1);
  return dir;
}

// The BF16 parameters of large_qwen3_dir's model: embedding and lm_head, and per layer q, k, v, o and the MLP.
constexpr int64_t kWeightBytes = 2 * (2 * 32000 * 1024 + 4 * (1024 * 1024 * 2 + 2 * 1024 * 512 + 3 * 1024 * 4096));

TEST(CausalLmRelease, FreesTheHostWeightsAndKeepsTheStructure) {
  const fs::path dir = large_qwen3_dir();
  const int64_t before_load = resident_bytes();
  auto model = model_build_host(dir, {.load_format = LoadFormat::kDummy, .dummy_seed = 3});
  ASSERT_TRUE(model) << model.error().message;
  const int64_t loaded = resident_bytes();
  ASSERT_GT(before_load, 0);
  // The dummy weights were made when read: the process holds them now.
  EXPECT_GT(loaded - before_load, kWeightBytes * 9 / 10) << "loaded " << loaded << ", before " << before_load;
  EXPECT_FALSE((*model)->host_weights_released());

  (*model)->release_host_weights();
  const int64_t released = resident_bytes();
  EXPECT_TRUE((*model)->host_weights_released());
  EXPECT_GT(loaded - released, kWeightBytes * 9 / 10) << "loaded " << loaded << ", released " << released;
  // What the engine and the scheduler still read: the config, the vocabulary, the layer count.
  EXPECT_EQ((*model)->config().vocab_size, 32000);
  EXPECT_EQ((*model)->vocab.full, 32000);
  EXPECT_EQ((*model)->layers.size(), 4u);
  EXPECT_EQ((*model)->layers[0].mixer, nullptr);
  // Neither placed nor visited again: the error says why.
  struct NoOps : BlockOps {
    Expected<std::unique_ptr<Block>> embedding(const CpuMatrix&, VocabRange) override { return nullptr; }
    Expected<std::unique_ptr<Block>> attention(const RmsNorm&, const Attention&) override { return nullptr; }
    Expected<std::unique_ptr<Block>> gated_deltanet(const RmsNorm&, const GatedDeltaNet&) override { return nullptr; }
    Expected<std::unique_ptr<Block>> mla(const RmsNorm&, const MlaAttention&) override { return nullptr; }
    Expected<std::unique_ptr<Block>> mlp(const RmsNorm&, const Mlp&) override { return nullptr; }
    Expected<std::unique_ptr<Block>> moe(const RmsNorm&, const Moe&) override { return nullptr; }
    Expected<std::unique_ptr<Block>> lm_head(const RmsNorm&, const Linear&, VocabRange) override { return nullptr; }
    Expected<std::unique_ptr<Block>> draft_input(const RmsNorm&, const RmsNorm&, const Linear&) override {
      return nullptr;
    }
    Expected<void> trace_output(std::string_view) override { return {}; }
  } ops;
  const auto visited = (*model)->visit_blocks(ops);
  ASSERT_FALSE(visited);
  EXPECT_NE(visited.error().message.find("released"), std::string::npos) << visited.error().message;
  EXPECT_FALSE((*model)->place(ops));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tern
