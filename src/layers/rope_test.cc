// RoPE frequency tables and attention factors of the scaled variants against tools/rope_reference.py's independent
// transcription of transformers 5's rope init functions (tests/fixtures/rope_tables.json): every inv_freq within
// 2 ulp (the pow of the two sides may round differently), the attention factor and DeepSeek-V3's softmax multiplier
// to double rounding. Then what the attention factor does to a rotation, by hand, and the refused types.
#include "layers/rope.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <string>

namespace tern {
namespace {

RopeConfig config_of(const nlohmann::json& p, int64_t rotary_dim) {
  RopeConfig c;
  c.type = p.at("rope_type").get<std::string>();
  c.theta = p.at("rope_theta").get<double>();
  c.rotary_dim = rotary_dim;
  c.factor = p.value("factor", 1.0);
  c.original_max_position_embeddings = p.value("original_max_position_embeddings", int64_t{0});
  if (p.contains("attention_factor")) c.attention_factor = p.at("attention_factor").get<double>();
  if (p.contains("beta_fast")) c.beta_fast = p.at("beta_fast").get<double>();
  if (p.contains("beta_slow")) c.beta_slow = p.at("beta_slow").get<double>();
  if (p.contains("mscale")) c.mscale = p.at("mscale").get<double>();
  if (p.contains("mscale_all_dim")) c.mscale_all_dim = p.at("mscale_all_dim").get<double>();
  c.truncate = p.value("truncate", true);
  return c;
}

TEST(RopeFrequencies, MatchTransformersFormulasTranscribedInPython) {
  std::ifstream in(std::string(TERN_FIXTURES_DIR) + "/rope_tables.json");
  ASSERT_TRUE(in.good());
  const auto cases = nlohmann::json::parse(in).at("cases");
  ASSERT_GE(cases.size(), 6u);
  for (const auto& k : cases) {
    const std::string name = k.at("name").get<std::string>();
    const int64_t dim = k.at("rotary_dim").get<int64_t>();
    const RopeConfig c = config_of(k.at("rope_parameters"), dim);
    const auto got = rope_frequencies(c, dim);
    ASSERT_TRUE(got.has_value()) << name << ": " << got.error().message;
    const auto want = k.at("inv_freq").get<std::vector<double>>();
    ASSERT_EQ(got->inv_freq.size(), want.size()) << name;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got->inv_freq[i], want[i], 2 * std::ldexp(std::fabs(want[i]), -23)) << name << " frequency " << i;
    }
    const double att = k.at("attention_factor").get<double>();
    EXPECT_NEAR(got->attention_factor, att, std::ldexp(att, -24)) << name;
    const double mscale = k.at("mla_softmax_mscale").get<double>();
    EXPECT_NEAR(mla_softmax_mscale(c), mscale, 1e-12 * mscale) << name;
  }
}

// The default table through rope_frequencies is the plain constructor's, bit for bit.
TEST(RopeFrequencies, DefaultIsThePlainTable) {
  RopeConfig c;
  c.theta = 1000000.0;
  const auto f = rope_frequencies(c, 128);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->inv_freq, Rope(128, 1000000.0).inv_freq());
  EXPECT_EQ(f->attention_factor, 1.0f);
}

// A unit vector (1, 0) in the first frequency's pair at position p becomes f (cos, sin) of p * inv_freq[0]; the
// pass-through dims past rotary_dim stay.
TEST(Rope, AttentionFactorScalesTheRotation) {
  RopeFrequencies f{{0.5f, 0.25f}, 1.25f};
  const Rope rope(4, 10000.0, f);
  float x[6] = {1.0f, 0.0f, 0.0f, 0.0f, 3.0f, -2.0f};  // head_dim 6: dims 4, 5 pass through
  rope.apply(x, 1, 6, 3);
  const double angle = 3 * 0.5;
  EXPECT_NEAR(x[0], 1.25 * std::cos(angle), 1e-6);
  EXPECT_NEAR(x[2], 1.25 * std::sin(angle), 1e-6);
  EXPECT_FLOAT_EQ(x[1], 0.0f);
  EXPECT_FLOAT_EQ(x[3], 0.0f);
  EXPECT_FLOAT_EQ(x[4], 3.0f);
  EXPECT_FLOAT_EQ(x[5], -2.0f);
}

TEST(RopeFrequencies, UnsupportedTypesAreRefusedByName) {
  for (const char* type : {"dynamic", "llama3"}) {
    RopeConfig c;
    c.type = type;
    c.factor = 2.0;
    const auto f = rope_frequencies(c, 64);
    ASSERT_FALSE(f.has_value()) << type;
    EXPECT_NE(f.error().message.find(std::string("rope_type '") + type + "'"), std::string::npos)
        << f.error().message;
  }
}

}  // namespace
}  // namespace tern
