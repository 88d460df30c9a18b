// ModelOpt quantization-config tests. Expected values come from the example files in tests/data/configs/quant
// (modelled on published ModelOpt exports, see each file's comment), vLLM's rules in modelopt.py and
// utils/quant_utils.py (reasoned case by case in the comments below) and CPython's fnmatch.fnmatchcase.
#include "io/quant_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

namespace tern {
namespace {

using nlohmann::json;

json load_quant_data(const std::string& name) {
  const std::string path = std::string(TERN_SOURCE_DIR) + "/tests/data/configs/quant/" + name;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream buffer;
  buffer << in.rdbuf();
  return json::parse(buffer.str(), nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
}

QuantConfig hf_ok(const json& doc) {
  Expected<QuantConfig> parsed = quant_config_parse_hf_quant(doc, "test/hf_quant_config.json");
  EXPECT_TRUE(parsed.has_value()) << (parsed ? "" : parsed.error().message);
  return parsed ? *parsed : QuantConfig{};
}

QuantConfig qc_ok(const json& doc) {
  Expected<QuantConfig> parsed = quant_config_parse_quantization_config(doc, "test/config.json quantization_config");
  EXPECT_TRUE(parsed.has_value()) << (parsed ? "" : parsed.error().message);
  return parsed ? *parsed : QuantConfig{};
}

std::string hf_error(const json& doc) {
  Expected<QuantConfig> parsed = quant_config_parse_hf_quant(doc, "test/hf_quant_config.json");
  EXPECT_FALSE(parsed.has_value());
  return parsed ? std::string() : parsed.error().message;
}

std::string qc_error(const json& doc) {
  Expected<QuantConfig> parsed = quant_config_parse_quantization_config(doc, "test/config.json quantization_config");
  EXPECT_FALSE(parsed.has_value());
  return parsed ? std::string() : parsed.error().message;
}

#define EXPECT_CONTAINS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

TEST(QuantConfig, HfQuantQwen3MoeFp4) {
  const QuantConfig q = hf_ok(load_quant_data("qwen3_30b_a3b_fp4.hf_quant_config.json"));
  EXPECT_EQ(q.quant_algo, "NVFP4");
  EXPECT_EQ(q.group_size, 16);
  EXPECT_EQ(q.kv_cache_quant_algo, "");
  EXPECT_EQ(q.exclude_modules.size(), 5u);
  EXPECT_EQ(q.exclude_modules[0], "lm_head");
  EXPECT_TRUE(q.activations_quantized);
  EXPECT_TRUE(q.quantized_layers.empty());
  EXPECT_EQ(q.source, "hf_quant_config.json");
  EXPECT_TRUE(q.is_excluded("lm_head"));
  EXPECT_TRUE(q.is_excluded("model.layers.47.mlp.gate"));
  EXPECT_FALSE(q.is_excluded("model.layers.47.mlp.experts.3.gate_proj"));
  EXPECT_FALSE(q.is_excluded("model.layers.5.self_attn.q_proj"));
}

TEST(QuantConfig, HfQuantDeepseekR1Fp4) {
  const QuantConfig q = hf_ok(load_quant_data("deepseek_r1_fp4.hf_quant_config.json"));
  EXPECT_EQ(q.quant_algo, "NVFP4");
  EXPECT_EQ(q.kv_cache_quant_algo, "FP8");
  EXPECT_EQ(q.exclude_modules[1], "model.layers.0.self_attn*");  // as written
  EXPECT_TRUE(q.is_excluded("model.layers.0.self_attn.kv_b_proj"));
  EXPECT_TRUE(q.is_excluded("model.layers.60.self_attn.o_proj"));
  EXPECT_FALSE(q.is_excluded("model.layers.6.mlp.experts.0.down_proj"));
}

TEST(QuantConfig, QuantizationConfigGlm5) {
  const QuantConfig q = qc_ok(load_quant_data("glm5_nvfp4_mtp.config.json")["quantization_config"]);
  EXPECT_EQ(q.quant_algo, "NVFP4");
  EXPECT_EQ(q.group_size, 16);  // from config_groups.group_0.weights.group_size
  EXPECT_EQ(q.kv_cache_quant_algo, "");
  EXPECT_TRUE(q.activations_quantized);
  EXPECT_EQ(q.source, "config.json quantization_config");
  EXPECT_EQ(q.exclude_modules.size(), 8u);
  // Only routed experts of layers 3-77 are NVFP4.
  EXPECT_FALSE(q.is_excluded("model.layers.3.mlp.experts.0.gate_proj"));
  EXPECT_FALSE(q.is_excluded("model.layers.77.mlp.experts.255.down_proj"));
  EXPECT_TRUE(q.is_excluded("model.layers.3.mlp.shared_experts.up_proj"));
  EXPECT_TRUE(q.is_excluded("model.layers.3.mlp.gate"));
  EXPECT_TRUE(q.is_excluded("model.layers.40.self_attn.indexer.wq_b"));
  EXPECT_TRUE(q.is_excluded("model.layers.1.mlp.down_proj"));
  EXPECT_TRUE(q.is_excluded("model.layers.78.mlp.experts.0.gate_proj"));
  EXPECT_TRUE(q.is_excluded("lm_head"));
}

// DeepSeek-V3 / GLM-5-FP8's config.json quantization_config.
TEST(QuantConfig, BlockFp8) {
  const QuantConfig c = qc_ok(json{{"quant_method", "fp8"},
                                   {"fmt", "e4m3"},
                                   {"activation_scheme", "dynamic"},
                                   {"weight_block_size", {128, 128}},
                                   {"modules_to_not_convert", {"lm_head"}}});
  EXPECT_EQ(c.quant_algo, "FP8_BLOCK128");
  EXPECT_EQ(c.group_size, 128);
  EXPECT_FALSE(c.activations_quantized);  // run as W8A16
  EXPECT_EQ(c.exclude_modules, std::vector<std::string>{"lm_head"});
}

TEST(QuantConfig, MixedPrecision) {
  const QuantConfig q = qc_ok(load_quant_data("mixed_precision.config.json")["quantization_config"]);
  EXPECT_EQ(q.quant_algo, "MIXED_PRECISION");
  EXPECT_EQ(q.group_size, 16);
  EXPECT_EQ(q.kv_cache_quant_algo, "FP8");  // kv_cache_scheme float / 8 bits
  ASSERT_EQ(q.quantized_layers.size(), 3u);
  EXPECT_EQ(q.quantized_layers.at("model.layers.0.mlp.experts.0.gate_proj"), "NVFP4");  // upper-cased
  EXPECT_EQ(q.quantized_layers.at("model.layers.0.self_attn.q_proj"), "FP8");
  EXPECT_TRUE(q.activations_quantized);
}

TEST(QuantConfig, WeightOnlyNvfp4) {
  const QuantConfig q = qc_ok(load_quant_data("w4a16_nvfp4.config.json")["quantization_config"]);
  EXPECT_EQ(q.quant_algo, "W4A16_NVFP4");
  EXPECT_EQ(q.group_size, 16);
  EXPECT_FALSE(q.activations_quantized);
  const QuantConfig hf = hf_ok(json{{"quantization",
                                     {{"quant_algo", "W4A16_NVFP4"},
                                      {"group_size", 16},
                                      {"kv_cache_quant_algo", nullptr},
                                      {"exclude_modules", json::array()}}}});
  EXPECT_FALSE(hf.activations_quantized);
}

TEST(QuantConfig, NormalisationAndOptionalForms) {
  // vLLM upper-cases quant_algo and kv_cache_quant_algo and int()-converts group_size.
  const QuantConfig q = hf_ok(json{{"quantization",
                                    {{"quant_algo", "nvfp4"},
                                     {"group_size", "16"},
                                     {"kv_cache_quant_algo", "fp8"},
                                     {"exclude_modules", json::array()}}}});
  EXPECT_EQ(q.quant_algo, "NVFP4");
  EXPECT_EQ(q.kv_cache_quant_algo, "FP8");
  EXPECT_EQ(q.group_size, 16);
  // FP8 does not require the NVFP4 fields; exclude_modules defaults to empty.
  const QuantConfig fp8 = hf_ok(json{{"quantization", {{"quant_algo", "FP8"}}}});
  EXPECT_EQ(fp8.group_size, 0);
  EXPECT_TRUE(fp8.exclude_modules.empty());
  EXPECT_FALSE(fp8.is_excluded("model.layers.0.mlp.down_proj"));
  // The hf_quant_config.json layout nested inside quantization_config is accepted, as vLLM does.
  const QuantConfig nested = qc_ok(
      json{{"quant_method", "modelopt"}, {"quantization", {{"quant_algo", "FP8"}, {"kv_cache_quant_algo", "FP8"}}}});
  EXPECT_EQ(nested.kv_cache_quant_algo, "FP8");
  EXPECT_EQ(nested.source, "config.json quantization_config");
}

TEST(QuantConfigErrors, MissingNvfp4Fields) {
  // ModelOptNvFp4Config._from_config requires these three keys in hf_quant_config.json.
  const json complete = {{"quant_algo", "NVFP4"},
                         {"group_size", 16},
                         {"kv_cache_quant_algo", nullptr},
                         {"exclude_modules", json::array()}};
  for (const char* field : {"group_size", "kv_cache_quant_algo", "exclude_modules"}) {
    json block = complete;
    block.erase(field);
    const std::string message = hf_error(json{{"quantization", block}});
    EXPECT_CONTAINS(message, field);
    EXPECT_CONTAINS(message, "test/hf_quant_config.json");
  }
  EXPECT_CONTAINS(hf_error(json{{"quantization", {{"group_size", 16}}}}), "quant_algo");
  EXPECT_CONTAINS(hf_error(json{{"producer", {{"name", "modelopt"}}}}), "quantization");
  EXPECT_CONTAINS(qc_error(json{{"quant_method", "modelopt"}, {"ignore", json::array()}}), "quant_algo");
}

TEST(QuantConfigErrors, UnknownAlgorithms) {
  const std::string message = hf_error(json{{"quantization", {{"quant_algo", "INT4_AWQ"}}}});
  EXPECT_CONTAINS(message, "INT4_AWQ");
  EXPECT_CONTAINS(message, "NVFP4");  // lists the supported ones
  EXPECT_CONTAINS(message, "quant_algo");
  EXPECT_CONTAINS(hf_error(json{{"quantization", {{"quant_algo", "FP8"}, {"kv_cache_quant_algo", "INT8"}}}}),
                  "kv_cache_quant_algo");
  EXPECT_CONTAINS(qc_error(json{{"quant_method", "modelopt"}, {"quant_algo", "NVFP8"}}), "NVFP8");
  EXPECT_CONTAINS(qc_error(json{{"quant_method", "modelopt"},
                                {"quant_algo", "FP8"},
                                {"kv_cache_quant_algo", "NVFP4"},
                                {"kv_cache_scheme", {{"type", "float"}, {"num_bits", 8}}}}),
                  "kv_cache_quant_algo");
  EXPECT_CONTAINS(qc_error(json{{"quant_method", "gptq"}, {"bits", 4}}), "quant_method");
  // Block-wise FP8 only: per-tensor FP8, other blocks or formats are refused by name.
  EXPECT_CONTAINS(qc_error(json{{"quant_method", "fp8"}, {"fmt", "e4m3"}}), "weight_block_size");
  EXPECT_CONTAINS(qc_error(json{{"quant_method", "fp8"}, {"weight_block_size", {64, 64}}}), "[64, 64]");
  EXPECT_CONTAINS(qc_error(json{{"quant_method", "fp8"}, {"fmt", "e5m2"}, {"weight_block_size", {128, 128}}}), "e5m2");
  EXPECT_CONTAINS(qc_error(json{{"quant_method", "modelopt"},
                                {"quant_algo", "FP8"},
                                {"kv_cache_scheme", {{"type", "int"}, {"num_bits", 8}}}}),
                  "kv_cache_scheme");
  EXPECT_CONTAINS(qc_error(json{{"quant_method", "modelopt"},
                                {"quant_algo", "MIXED_PRECISION"},
                                {"quantized_layers", {{"a.b", {{"quant_algo", "INT8"}}}}}}),
                  "quantized_layers.a.b.quant_algo");
}

TEST(QuantConfigErrors, BadValues) {
  EXPECT_CONTAINS(hf_error(json{{"quantization",
                                 {{"quant_algo", "NVFP4"},
                                  {"group_size", 32},
                                  {"kv_cache_quant_algo", nullptr},
                                  {"exclude_modules", json::array()}}}}),
                  "group_size");
  EXPECT_CONTAINS(hf_error(json{{"quantization", {{"quant_algo", "FP8"}, {"group_size", "sixteen"}}}}), "group_size");
  EXPECT_CONTAINS(hf_error(json{{"quantization", {{"quant_algo", "FP8"}, {"group_size", 16.5}}}}), "group_size");
  EXPECT_CONTAINS(hf_error(json{{"quantization", {{"quant_algo", "FP8"}, {"group_size", -16}}}}), "group_size");
  EXPECT_CONTAINS(hf_error(json{{"quantization", {{"quant_algo", "FP8"}, {"exclude_modules", "lm_head"}}}}),
                  "exclude_modules");
  EXPECT_CONTAINS(hf_error(json{{"quantization", {{"quant_algo", "FP8"}, {"exclude_modules", {"lm_head", 3}}}}}),
                  "exclude_modules[1]");
  EXPECT_CONTAINS(qc_error(json{{"quant_method", "modelopt"}, {"quant_algo", "MIXED_PRECISION"}}), "quantized_layers");
  EXPECT_CONTAINS(
      qc_error(json{
          {"quant_method", "modelopt"},
          {"quant_algo", "W4A16_NVFP4"},
          {"config_groups", {{"g", {{"weights", {{"group_size", 16}}}, {"input_activations", {{"num_bits", 4}}}}}}}}),
      "config_groups");
}

// ---- quant_fnmatch: expected values checked against CPython's fnmatch.fnmatchcase ----

struct GlobCase {
  const char* name;
  const char* pattern;
  bool expected;
};

TEST(QuantFnmatch, MatchesPythonFnmatchcase) {
  const GlobCase cases[] = {
      {"abc", "a*c", true},
      {"a.b.c", "a*", true},
      {"abc", "a?c", true},
      {"ac", "a?c", false},
      {"", "*", true},
      {"", "?", false},
      {"AbC", "abc", false},
      {"b", "[]b]", true},
      {"]", "[]b]", true},
      {"c", "[]b]", false},
      {"[", "[", true},
      {"a[b", "a[b", true},
      {"ab", "a[b", false},
      {"^", "[^a]", true},
      {"b", "[^a]", false},
      {"b", "[!a]", true},
      {"a", "[!a]", false},
      {"]", "[!]]", false},
      {"x", "[!]]", true},
      {"-", "[a-]", true},
      {"-", "[-a]", true},
      {"b", "[a-c]", true},
      {"d", "[a-c]", false},
      {"b", "[c-a]", false},
      {"c", "[c-a]", false},
      {"x", "[c-ax]", true},
      {"a", "[c-ax]", false},
      {"c", "[c-ax]", false},
      {"\\", "[\\]", true},
      {"a\\b", "a\\b", true},
      {"-", "[a-c-e]", true},
      {"d", "[a-c-e]", false},
      {"e", "[a-c-e]", true},
      {"b", "[a-c-e]", true},
      {"!", "[!]", false},
      {"[!]", "[!]", true},
      {"a", "[!-a]", false},
      {"-", "[!-a]", false},
      {"b", "[!-a]", true},
      {"aXbXc", "a*b*c", true},
      {"abcbc", "a*bc", true},
      {"aaab", "a*a*b", true},
      {"ab", "a**b", true},
      {"model.layers.3.self_attn.q_proj", "model.layers.*.self_attn*", true},
      {"model.layers.12.mlp.gate", "model.layers.[0-2].mlp.gate", false},
      {"model.layers.1.mlp.gate", "model.layers.[0-2].mlp.gate", true},
  };
  for (const GlobCase& c : cases) {
    EXPECT_EQ(quant_fnmatch(c.name, c.pattern), c.expected) << "name '" << c.name << "' pattern '" << c.pattern << "'";
  }
}

// ---- is_excluded: expected values reasoned from vLLM's is_layer_excluded ----

struct ExcludeCase {
  std::vector<std::string> patterns;
  const char* module;
  bool expected;
  const char* why;
};

TEST(QuantExclude, FollowsVllmRules) {
  const std::vector<std::string> attn = {"model.layers.*.self_attn*"};
  const ExcludeCase cases[] = {
      {{"lm_head"}, "lm_head", true, "exact match (is_layer_skipped)"},
      {{"lm_head"}, "model.layers.0.mlp.down_proj", false, "no rule matches"},
      {{"lm_head"}, "model.lm_head_extra", true, "legacy substring: 'lm_head' in the name"},
      {attn, "model.layers.3.self_attn.q_proj", true,
       "'self_attn*' is rewritten to 'self_attn' and 'self_attn.*'; fnmatch with the second"},
      {attn, "model.layers.3.self_attn", true, "fnmatch with the rewritten 'model.layers.*.self_attn'"},
      {attn, "model.layers.3.self_attention_x.q_proj", false,
       "after the rewrite neither pattern matches, and a pattern holding '*' is never a substring"},
      {attn, "model.layers.3.mlp.gate_proj", false, "no rule matches"},
      {{"model.layers.1"}, "model.layers.10.mlp.gate_proj", true, "legacy substring quirk: '...1' in '...10...'"},
      {{"model.layers.1"}, "model.layers.2.mlp.gate_proj", false, "not a substring, no wildcard"},
      {{"model.layers.78*"},
       "model.layers.78.mlp.experts.3.gate_proj",
       true,
       "rewritten to 'model.layers.78' (a substring) and 'model.layers.78.*'"},
      {{"model.layers.78*"}, "model.layers.7.mlp.down_proj", false, "'model.layers.78' is not a substring"},
      {{"model.layers.1.mlp.experts.0.down_proj"},
       "model.layers.1.mlp.experts",
       true,
       "experts branch: the fused-experts prefix is a substring of an excluded expert entry"},
      {{"model.layers.1.mlp.experts.0.down_proj"},
       "model.layers.1.mlp.experts.0.up_proj",
       false,
       "experts branch finds nothing; not a substring; fnmatch fails"},
      {{"model.layers.3.mlp.experts*"},
       "model.layers.3.mlp.experts.17.down_proj",
       true,
       "experts branch fails (name longer than the entries) but 'model.layers.3.mlp.experts' is a substring"},
      {{"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"},
       "model.layers.0.self_attn.qkv_proj",
       true,
       "fused name: all three parts are excluded"},
      {{"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"},
       "model.layers.0.mlp.gate_up_proj",
       true,
       "fused gate_up_proj: both parts excluded"},
      {{"model.layers.[0-2].mlp.gate"}, "model.layers.2.mlp.gate", true, "fnmatch character range"},
      {{"model.layers.[0-2].mlp.gate"}, "model.layers.12.mlp.gate", false, "the range covers one character"},
      {{"model.layers.?.self_attn.o_proj"}, "model.layers.7.self_attn.o_proj", true, "fnmatch '?'"},
      {{"model.layers.?.self_attn.o_proj"}, "model.layers.17.self_attn.o_proj", false, "'?' is one character"},
      {{"*.mlp.gate"}, "model.layers.5.mlp.gate_proj", false, "fnmatch is anchored at the end"},
      {{"*.mlp.gate"}, "language_model.model.layers.5.mlp.gate", true, "fnmatch '*' spans dots"},
      {{}, "model.visual.blocks.0.attn.qkv", true, "vision modules are always unquantized"},
      {{"lm_head"}, "model.vision_tower.encoder.layers.0.fc1", true, "vision modules are always unquantized"},
      {{}, "model.layers.0.mlp.down_proj", false, "empty exclude list"},
  };
  for (const ExcludeCase& c : cases) {
    QuantConfig q;
    q.quant_algo = "NVFP4";
    q.exclude_modules = c.patterns;
    EXPECT_EQ(q.is_excluded(c.module), c.expected) << c.module << " (" << c.why << ")";
  }
}

// What the exporter leaves unquantized: Python fnmatch.fnmatchcase of each pattern against the whole module name
// (the expected values are fnmatchcase's), and vision modules.
TEST(QuantExclude, ProducerMatchesPatternsAsShellWildcards) {
  const std::vector<std::string> qwen35 = {"lm_head",     "model.visual*", "mtp*",           "*linear_attn*",
                                           "*self_attn*", "*mlp.gate",     "*shared_expert*"};
  const ExcludeCase cases[] = {
      {qwen35, "model.language_model.layers.0.mlp.shared_expert_gate", true,
       "'*shared_expert*' spans '_gate' (vLLM's rewrite to '*shared_expert' and '*shared_expert.*' does not)"},
      {qwen35, "model.language_model.layers.0.mlp.shared_expert.down_proj", true, "'*shared_expert*'"},
      {qwen35, "model.language_model.layers.0.mlp.gate", true, "'*mlp.gate' (the router)"},
      {qwen35, "model.language_model.layers.0.mlp.experts.3.gate_proj", false, "no pattern matches an expert"},
      {qwen35, "model.language_model.layers.3.linear_attn.in_proj_qkv", true, "'*linear_attn*'"},
      {{"lm_head"}, "model.lm_head_extra", false, "no substring rule: 'lm_head' is the whole name"},
      {{"model.layers.1"}, "model.layers.10.mlp.gate_proj", false, "no substring rule"},
      {{}, "model.visual.blocks.0.attn.qkv", true, "vision modules are never quantized"},
  };
  for (const ExcludeCase& c : cases) {
    QuantConfig q;
    q.quant_algo = "NVFP4";
    q.exclude_modules = c.patterns;
    EXPECT_EQ(q.producer_excludes(c.module), c.expected) << c.module << " (" << c.why << ")";
  }
  QuantConfig q;
  q.exclude_modules = qwen35;
  EXPECT_FALSE(q.is_excluded("model.language_model.layers.0.mlp.shared_expert_gate")) << "vLLM's reading differs";
}

TEST(QuantExclude, FusedNameWithMixedPartsIsAnError) {
  QuantConfig q;
  q.exclude_modules = {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"};
  const Expected<bool> checked = q.is_excluded_checked("model.layers.0.self_attn.qkv_proj");
  ASSERT_FALSE(checked.has_value());
  EXPECT_CONTAINS(checked.error().message, "qkv_proj");
  EXPECT_FALSE(q.is_excluded("model.layers.0.self_attn.qkv_proj"));
  EXPECT_TRUE(q.is_excluded("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(q.is_excluded("model.layers.0.self_attn.v_proj"));
}

// ---- quant_config_load ----

class QuantConfigLoad : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(TERN_BINARY_DIR) /
           ("quant_config_load_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void write(const std::string& file, const json& doc) { std::ofstream(dir_ / file) << doc.dump(2); }
  std::filesystem::path dir_;
};

TEST_F(QuantConfigLoad, NeitherFile) {
  Expected<std::optional<QuantConfig>> loaded = quant_config_load(dir_);
  ASSERT_TRUE(loaded.has_value()) << loaded.error().message;
  EXPECT_FALSE(loaded->has_value());
  write("config.json", json{{"model_type", "qwen3"}, {"quantization_config", nullptr}});
  loaded = quant_config_load(dir_);
  ASSERT_TRUE(loaded.has_value()) << loaded.error().message;
  EXPECT_FALSE(loaded->has_value());
}

TEST_F(QuantConfigLoad, HfQuantOnly) {
  write("config.json", json{{"model_type", "qwen3_moe"}});
  write("hf_quant_config.json", load_quant_data("qwen3_30b_a3b_fp4.hf_quant_config.json"));
  Expected<std::optional<QuantConfig>> loaded = quant_config_load(dir_);
  ASSERT_TRUE(loaded.has_value()) << loaded.error().message;
  ASSERT_TRUE(loaded->has_value());
  EXPECT_EQ((*loaded)->source, "hf_quant_config.json");
  EXPECT_EQ((*loaded)->quant_algo, "NVFP4");
}

TEST_F(QuantConfigLoad, BothAgreeing) {
  write("config.json", load_quant_data("glm5_nvfp4_mtp.config.json"));
  write("hf_quant_config.json", load_quant_data("glm5_nvfp4_mtp.hf_quant_config.json"));
  Expected<std::optional<QuantConfig>> loaded = quant_config_load(dir_);
  ASSERT_TRUE(loaded.has_value()) << loaded.error().message;
  ASSERT_TRUE(loaded->has_value());
  EXPECT_EQ((*loaded)->source, "config.json quantization_config");  // vLLM prefers config.json
  EXPECT_EQ((*loaded)->exclude_modules.front(), "lm_head");
}

TEST_F(QuantConfigLoad, BothDisagreeing) {
  json cfg = load_quant_data("glm5_nvfp4_mtp.config.json");
  cfg["quantization_config"]["ignore"].erase(cfg["quantization_config"]["ignore"].size() - 1);  // drop layer 78
  write("config.json", cfg);
  write("hf_quant_config.json", load_quant_data("glm5_nvfp4_mtp.hf_quant_config.json"));
  Expected<std::optional<QuantConfig>> loaded = quant_config_load(dir_);
  ASSERT_FALSE(loaded.has_value());
  EXPECT_CONTAINS(loaded.error().message, "hf_quant_config.json");
  EXPECT_CONTAINS(loaded.error().message, "config.json");
  EXPECT_CONTAINS(loaded.error().message, "model.layers.78*");

  cfg = load_quant_data("glm5_nvfp4_mtp.config.json");
  cfg["quantization_config"]["kv_cache_scheme"] = {{"type", "float"}, {"num_bits", 8}};
  write("config.json", cfg);
  loaded = quant_config_load(dir_);
  ASSERT_FALSE(loaded.has_value());
  EXPECT_CONTAINS(loaded.error().message, "KV-cache");

  json hf = load_quant_data("glm5_nvfp4_mtp.hf_quant_config.json");
  hf["quantization"]["quant_algo"] = "FP8";
  write("config.json", load_quant_data("glm5_nvfp4_mtp.config.json"));
  write("hf_quant_config.json", hf);
  loaded = quant_config_load(dir_);
  ASSERT_FALSE(loaded.has_value());
  EXPECT_CONTAINS(loaded.error().message, "quant_algo");
}

TEST_F(QuantConfigLoad, BrokenFilesNameThePath) {
  std::ofstream(dir_ / "hf_quant_config.json") << "{\"quantization\": ";
  Expected<std::optional<QuantConfig>> loaded = quant_config_load(dir_);
  ASSERT_FALSE(loaded.has_value());
  EXPECT_CONTAINS(loaded.error().message, (dir_ / "hf_quant_config.json").string());
  std::filesystem::remove(dir_ / "hf_quant_config.json");
  write("config.json", json{{"quantization_config", {{"quant_method", "awq"}}}});
  loaded = quant_config_load(dir_);
  ASSERT_FALSE(loaded.has_value());
  EXPECT_CONTAINS(loaded.error().message, "config.json");
  EXPECT_CONTAINS(loaded.error().message, "quant_method");
}

}  // namespace
}  // namespace tern
