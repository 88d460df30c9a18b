// `tern info` against the fixtures: numbers must equal what tools/make_fixtures.py computed from the instantiated
// transformers model (expected_info.json), and broken checkpoints must be reported with the tensor's name.
#include "models/model_info.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "io/safetensors.h"

namespace tern {
namespace {

namespace fs = std::filesystem;

const std::vector<std::string> kFixtures = {"qwen3",       "qwen3_moe",         "qwen3_5_moe",
                                            "glm_moe_dsa", "qwen3_5_moe_fused", "qwen3_5_moe_nvfp4"};

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  EXPECT_TRUE(in.good()) << "cannot read " << p;
  return nlohmann::json::parse(in);
}

class FixtureInfo : public ::testing::TestWithParam<std::string> {};

TEST_P(FixtureInfo, MatchesTheNumbersTransformersComputed) {
  const fs::path dir = fs::path(TERN_FIXTURES_DIR) / GetParam();
  ASSERT_TRUE(fs::exists(dir / "config.json")) << dir;
  const nlohmann::json want = read_json(dir / "expected_info.json");
  auto info = model_info_inspect(dir);
  ASSERT_TRUE(info.has_value()) << info.error().message;
  EXPECT_TRUE(info->problems.empty()) << info->problems.front();
  const nlohmann::ordered_json got = model_info_to_json(*info);
  EXPECT_EQ(got["architecture"], want["architecture"]);
  EXPECT_EQ(got["parameters"]["total"], want["parameters"]["total"]);
  EXPECT_EQ(got["parameters"]["active_per_token"], want["parameters"]["active_per_token"]);
  EXPECT_EQ(got["linear_layers"]["nvfp4"], want["linear_layers"]["nvfp4"]);
  EXPECT_EQ(got["linear_layers"]["bf16"], want["linear_layers"]["bf16"]);
  for (const char* key : {"full_attention", "linear_attention", "moe", "dense_mlp"}) {
    EXPECT_EQ(got["layers"][key], want["layers"][key]) << key;
  }
  EXPECT_EQ(got["experts"]["num_experts"], want["experts"]["num_experts"]);
  EXPECT_EQ(got["experts"]["top_k"], want["experts"]["top_k"]);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureInfo, ::testing::ValuesIn(kFixtures));

// The cache figures against the fixtures' config.json numbers, read here: per token, 2 (K and V) x KV heads x head
// dim x 2 bytes per full-attention layer, or MLA's (kv_lora_rank + qk_rope_head_dim) x 2 plus the DSA key's
// index_head_dim x 2; per sequence, Gated DeltaNet's conv state (q, k and v channels x (kernel - 1) x 2) and
// recurrent state (value heads x dk x dv x 4). The FP8 latent (docs/model-specs.md §3.2: kv_lora_rank codes, a 4-byte
// scale per 128, k_pe in bf16) only where kv_lora_rank is whole 128-value tiles: not the tiny GLM's 32, but the same
// config at 128 (its tensors then no longer fit, a problem; the figures come from the config).
TEST(ModelInfo, CacheFiguresFollowTheConfig) {
  auto info_of = [](const fs::path& dir) {
    auto info = model_info_inspect(dir);
    EXPECT_TRUE(info.has_value()) << info.error().message;
    return info ? *info : ModelInfo{};
  };
  const fs::path fixtures = TERN_FIXTURES_DIR;
  {
    const nlohmann::json c = read_json(fixtures / "qwen3" / "config.json");
    const ModelInfo info = info_of(fixtures / "qwen3");
    const int64_t layers = c["num_hidden_layers"], kv_heads = c["num_key_value_heads"], hd = c["head_dim"];
    EXPECT_EQ(info.kv_bytes_per_token, layers * 2 * kv_heads * hd * 2);
    EXPECT_FALSE(info.kv_bytes_per_token_fp8.has_value());
    EXPECT_EQ(info.state_bytes_per_sequence, 0);
  }
  {
    const nlohmann::json c = read_json(fixtures / "qwen3_5_moe" / "config.json");
    const nlohmann::json& t = c.contains("text_config") ? c["text_config"] : c;
    const ModelInfo info = info_of(fixtures / "qwen3_5_moe");
    int64_t full = 0, linear = 0;
    for (const auto& type : t["layer_types"]) (type == "linear_attention" ? linear : full)++;
    ASSERT_GT(full, 0);
    ASSERT_GT(linear, 0);
    const int64_t kv_heads = t["num_key_value_heads"], hd = t["head_dim"], hk = t["linear_num_key_heads"],
                  hv = t["linear_num_value_heads"], dk = t["linear_key_head_dim"], dv = t["linear_value_head_dim"],
                  kernel = t["linear_conv_kernel_dim"];
    EXPECT_EQ(info.kv_bytes_per_token, full * 2 * kv_heads * hd * 2);
    EXPECT_EQ(info.state_bytes_per_sequence, linear * ((2 * hk * dk + hv * dv) * (kernel - 1) * 2 + hv * dk * dv * 4));
  }
  const fs::path glm = fs::temp_directory_path() / "tern_info_cache_glm";
  fs::remove_all(glm);
  fs::copy(fixtures / "glm_moe_dsa", glm, fs::copy_options::recursive);
  for (const int64_t lora : {32, 128}) {
    nlohmann::json c = read_json(glm / "config.json");
    c["kv_lora_rank"] = lora;
    std::ofstream(glm / "config.json") << c.dump(1);
    const ModelInfo info = info_of(glm);
    const int64_t layers = c["num_hidden_layers"], rope = c["qk_rope_head_dim"], key = c["index_head_dim"];
    EXPECT_EQ(info.kv_bytes_per_token, layers * ((lora + rope) * 2 + key * 2)) << lora;
    if (lora == 32) {
      EXPECT_FALSE(info.kv_bytes_per_token_fp8.has_value());
    } else {
      ASSERT_TRUE(info.kv_bytes_per_token_fp8.has_value());
      EXPECT_EQ(*info.kv_bytes_per_token_fp8, layers * (lora + 4 * (lora / 128) + 2 * rope + key * 2));
      EXPECT_NE(model_info_to_text(info).find("with --kv-cache-dtype fp8_e4m3"), std::string::npos);
    }
  }
  fs::remove_all(glm);
}

// Rewrites a fixture into a temporary directory with `edit` applied to its tensor list.
class BrokenCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ = fs::temp_directory_path() / ("tern_info_test_" + std::to_string(rd()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  template <class Edit>
  ModelInfo inspect_edited(const std::string& fixture, Edit edit) {
    const fs::path src = fs::path(TERN_FIXTURES_DIR) / fixture;
    for (const char* f : {"config.json", "hf_quant_config.json"}) {
      if (fs::exists(src / f)) fs::copy_file(src / f, dir_ / f);
    }
    auto set = SafetensorsSet::open_dir(src);
    EXPECT_TRUE(set.has_value());
    std::vector<TensorToWrite> tensors;
    for (const TensorView* t : set->tensors()) tensors.push_back({t->name, t->dtype, t->shape, t->data});
    edit(tensors);
    auto written = safetensors_write(dir_ / "model.safetensors", tensors);
    EXPECT_TRUE(written.has_value()) << written.error().message;
    auto info = model_info_inspect(dir_);
    EXPECT_TRUE(info.has_value()) << info.error().message;
    return *info;
  }

  static bool mentions(const std::vector<std::string>& problems, const std::string& what) {
    for (const auto& p : problems) {
      if (p.find(what) != std::string::npos) return true;
    }
    return false;
  }

  fs::path dir_;
};

TEST_F(BrokenCheckpoint, MissingTensorIsAProblem) {
  std::string removed;
  ModelInfo info = inspect_edited("qwen3_moe", [&](std::vector<TensorToWrite>& t) {
    for (auto it = t.begin(); it != t.end(); ++it) {
      if (it->name.find("post_attention_layernorm") != std::string::npos) {
        removed = it->name;
        t.erase(it);
        break;
      }
    }
  });
  ASSERT_FALSE(removed.empty());
  EXPECT_TRUE(mentions(info.problems, removed)) << "no problem names " << removed;
}

TEST_F(BrokenCheckpoint, UnexpectedTensorIsAProblem) {
  static const std::vector<std::byte> bytes(64 * 2);
  ModelInfo info = inspect_edited("qwen3", [&](std::vector<TensorToWrite>& t) {
    t.push_back({"model.layers.0.self_attn.rotary_emb.extra", DType::kBF16, {64}, bytes});
  });
  EXPECT_TRUE(mentions(info.problems, "model.layers.0.self_attn.rotary_emb.extra"));
}

TEST_F(BrokenCheckpoint, WrongShapeIsAProblem) {
  std::string changed;
  ModelInfo info = inspect_edited("qwen3", [&](std::vector<TensorToWrite>& t) {
    for (auto& x : t) {
      if (x.name.ends_with("mlp.up_proj.weight")) {
        changed = x.name;
        std::swap(x.shape[0], x.shape[1]);
        break;
      }
    }
  });
  ASSERT_FALSE(changed.empty());
  EXPECT_TRUE(mentions(info.problems, changed));
}

TEST_F(BrokenCheckpoint, Nvfp4WithoutItsScaleIsAProblem) {
  std::string removed;
  ModelInfo info = inspect_edited("qwen3_5_moe_nvfp4", [&](std::vector<TensorToWrite>& t) {
    for (auto it = t.begin(); it != t.end(); ++it) {
      if (it->name.ends_with(".weight_scale") && it->name.find("experts") != std::string::npos) {
        removed = it->name;
        t.erase(it);
        break;
      }
    }
  });
  ASSERT_FALSE(removed.empty());
  EXPECT_TRUE(mentions(info.problems, removed));
}

TEST(ModelInfo, UnreadableDirectoryIsAnError) {
  auto info = model_info_inspect("/nonexistent/tern/model");
  ASSERT_FALSE(info.has_value());
  EXPECT_NE(info.error().message.find("/nonexistent/tern/model"), std::string::npos) << info.error().message;
}

}  // namespace
}  // namespace tern
