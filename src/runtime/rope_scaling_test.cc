// Scaled RoPE in the models: a fixture's config with rope_scaling set builds with the variant's table and
// attention factor in every attention block (the tables themselves: layers/rope_test.cc against an independent
// transcription of transformers), MLA's softmax scale takes DeepSeek-V3's mscale^2, and the model's logits move
// (finite, and not the unscaled model's). The whole-model check against transformers is a fixture's job
// (tests/fixtures/README.md); none has a scaled RoPE yet.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>

#include "layers/attention.h"
#include "layers/mla.h"
#include "models/model_info.h"
#include "runtime/logits_test_util.h"
#include "runtime/model_runner.h"
#include "runtime/rope_scaling_test_util.h"

namespace tern {
namespace {

std::vector<float> logits_of(const std::filesystem::path& dir) {
  return all_token_logits(dir, {}, {5, 17, 300, 42, 99, 7, 250, 123, 11, 64});
}

TEST(RopeScaling, QwenYarnReachesEveryAttentionBlock) {
  const nlohmann::json yarn = {{"rope_type", "yarn"}, {"rope_theta", 1000000.0}, {"factor", 4.0},
                               {"original_max_position_embeddings", 8}};
  const auto dir = with_rope("qwen3", yarn, "qwen3_yarn");
  auto model = model_build_host(dir, {});
  ASSERT_TRUE(model.has_value()) << model.error().message;
  const RopeConfig& r = (*model)->config().rope;
  ASSERT_EQ(r.type, "yarn");
  const auto want = rope_frequencies(r, r.rotary_dim);
  ASSERT_TRUE(want.has_value());
  EXPECT_NEAR(want->attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-6);
  int attention = 0;
  for (const DecoderLayer& layer : (*model)->layers) {
    const auto* a = dynamic_cast<const Attention*>(layer.mixer.get());
    ASSERT_NE(a, nullptr);
    EXPECT_EQ(a->rope().inv_freq(), want->inv_freq);
    EXPECT_EQ(a->rope().attention_factor(), want->attention_factor);
    ++attention;
  }
  EXPECT_GT(attention, 0);
  // A prompt longer than the 8 original positions: the logits move from the unscaled model's, and stay finite.
  const std::vector<float> scaled = logits_of(dir);
  const std::vector<float> plain = logits_of(std::filesystem::path(TERN_FIXTURES_DIR) / "qwen3");
  ASSERT_EQ(scaled.size(), plain.size());
  ASSERT_FALSE(scaled.empty());
  double moved = 0;
  for (size_t i = 0; i < scaled.size(); ++i) {
    ASSERT_TRUE(std::isfinite(scaled[i])) << i;
    moved = std::max(moved, static_cast<double>(std::fabs(scaled[i] - plain[i])));
  }
  EXPECT_GT(moved, 1e-3);
  // tern info names the scaling.
  const auto info = model_info_inspect(dir);
  ASSERT_TRUE(info.has_value()) << info.error().message;
  const std::string text = model_info_to_text(*info);
  EXPECT_NE(text.find("yarn RoPE x4 over 8 positions"), std::string::npos) << text;
  std::filesystem::remove_all(dir);
}

// DeepSeek-V3's form on the MLA fixture: factor 40, mscale = mscale_all_dim = 1, so cos and sin are unscaled and the
// softmax scale is multiplied by (0.1 ln 40 + 1)^2.
TEST(RopeScaling, MlaTakesDeepSeekV3sSoftmaxMscale) {
  const nlohmann::json yarn = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 40.0},
                               {"original_max_position_embeddings", 4}, {"beta_fast", 32}, {"beta_slow", 1},
                               {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
  const auto dir = with_rope("glm_moe_dsa", yarn, "glm_deepseek_yarn");
  auto model = model_build_host(dir, {});
  ASSERT_TRUE(model.has_value()) << model.error().message;
  const ModelConfig& c = (*model)->config();
  const double mscale = std::pow(0.1 * std::log(40.0) + 1.0, 2.0);
  int mla = 0;
  for (const DecoderLayer& layer : (*model)->layers) {
    const auto* a = dynamic_cast<const MlaAttention*>(layer.mixer.get());
    ASSERT_NE(a, nullptr);
    EXPECT_NEAR(a->shape().scale, mscale / std::sqrt(static_cast<double>(c.qk_head_dim)), 1e-6);
    EXPECT_EQ(a->rope().attention_factor(), 1.0f);
    ++mla;
  }
  EXPECT_GT(mla, 0);
  for (float v : logits_of(dir)) ASSERT_TRUE(std::isfinite(v));
  std::filesystem::remove_all(dir);
}

// YaRN's attention factor (cos and sin times it) moves the logits by more than twice the GPU test's bound (1/16 of
// the largest logit, GpuModel.ScaledRopeMatchesTheCpuPath), so that test fails a kernel that leaves the factor out:
// Qwen's yarn (factor 0.1 ln 4 + 1 on gated attention) and DeepSeek's with mscale != mscale_all_dim (their ratio, on
// MLA and the DSA indexer), each against the same config with attention_factor 1.
TEST(RopeScaling, AnAttentionFactorMovesTheLogits) {
  const nlohmann::json qwen = {{"rope_type", "yarn"}, {"rope_theta", 1000000.0}, {"factor", 4.0},
                               {"original_max_position_embeddings", 8}};
  nlohmann::json deepseek = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 40.0},
                             {"original_max_position_embeddings", 4}, {"mscale", 1.0}, {"mscale_all_dim", 0.25}};
  for (const auto& [fixture, rope] : {std::pair{"qwen3", qwen}, std::pair{"glm_moe_dsa", deepseek}}) {
    SCOPED_TRACE(fixture);
    nlohmann::json unit = rope;
    unit["attention_factor"] = 1.0;
    const auto dir = with_rope(fixture, rope, std::string(fixture) + "_factor");
    const auto unit_dir = with_rope(fixture, unit, std::string(fixture) + "_unit_factor");
    auto model = model_build_host(dir, {});
    ASSERT_TRUE(model.has_value()) << model.error().message;
    const RopeConfig& r = (*model)->config().rope;
    const auto want = rope_frequencies(r, r.rotary_dim);
    ASSERT_TRUE(want.has_value());
    EXPECT_GT(want->attention_factor, 1.1f);
    const std::vector<float> scaled = logits_of(dir), plain = logits_of(unit_dir);
    ASSERT_FALSE(scaled.empty());
    ASSERT_EQ(scaled.size(), plain.size());
    double max_ref = 0, moved = 0;
    for (size_t i = 0; i < scaled.size(); ++i) {
      ASSERT_TRUE(std::isfinite(scaled[i])) << i;
      max_ref = std::max(max_ref, std::fabs(double{scaled[i]}));
      moved = std::max(moved, std::fabs(double{scaled[i]} - plain[i]));
    }
    EXPECT_GT(moved, 2 * max_ref / 16) << "moved " << moved << ", largest logit " << max_ref;
    std::filesystem::remove_all(dir);
    std::filesystem::remove_all(unit_dir);
  }
}

TEST(RopeScaling, DynamicRopeIsRefusedNamingIt) {
  const nlohmann::json dynamic = {{"rope_type", "dynamic"}, {"rope_theta", 1000000.0}, {"factor", 2.0}};
  const auto dir = with_rope("qwen3", dynamic, "qwen3_dynamic");
  auto model = model_build_host(dir, {});
  ASSERT_FALSE(model.has_value());
  EXPECT_NE(model.error().message.find("rope_type 'dynamic'"), std::string::npos) << model.error().message;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tern
