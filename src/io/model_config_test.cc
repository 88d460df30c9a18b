// config.json parsing tests. Expected values come from the published configs in tests/data/configs (each file says
// where its values come from), the transformers v5 configuration classes' defaults and __post_init__ rules, and
// docs/model-specs.md §2.1 and §3.1 -- never from this parser's output.
#include "io/model_config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace tern {
namespace {

using nlohmann::json;

// Test data files carry a leading // comment naming their source, so they are read with comments allowed.
json load_data(const std::string& name) {
  const std::string path = std::string(TERN_SOURCE_DIR) + "/tests/data/configs/" + name;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream buffer;
  buffer << in.rdbuf();
  return json::parse(buffer.str(), nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
}

ModelConfig parse_ok(const json& config) {
  Expected<ModelConfig> parsed = model_config_parse(config, "test/config.json");
  EXPECT_TRUE(parsed.has_value()) << (parsed ? "" : parsed.error().message);
  return parsed ? *parsed : ModelConfig{};
}

std::string parse_error(const json& config) {
  Expected<ModelConfig> parsed = model_config_parse(config, "test/config.json");
  EXPECT_FALSE(parsed.has_value()) << "parsed although it should not";
  return parsed ? std::string() : parsed.error().message;
}

// The error names the file and the field.
#define EXPECT_ERROR_NAMES(config, field)                                      \
  do {                                                                         \
    const std::string message = parse_error(config);                           \
    EXPECT_NE(message.find("test/config.json"), std::string::npos) << message; \
    EXPECT_NE(message.find(field), std::string::npos) << message;              \
  } while (0)

// Qwen3-Next / Qwen3.5 hybrid pattern from HF __post_init__: layer i is full attention iff (i+1) % interval == 0.
std::vector<LayerType> hybrid_pattern(int n_layers, int interval) {
  std::vector<LayerType> out;
  for (int i = 0; i < n_layers; ++i) {
    out.push_back((i + 1) % interval == 0 ? LayerType::kFullAttention : LayerType::kLinearAttention);
  }
  return out;
}

std::vector<bool> dense_then_moe(int n_layers, int n_dense) {
  std::vector<bool> out(static_cast<size_t>(n_layers), true);
  for (int i = 0; i < n_dense; ++i) out[static_cast<size_t>(i)] = false;
  return out;
}

std::vector<bool> moe_flags(const ModelConfig& c) {
  std::vector<bool> out;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) out.push_back(c.is_moe_layer(i));
  return out;
}

TEST(ModelConfig, Qwen3_8B) {
  const ModelConfig c = parse_ok(load_data("qwen3_8b.json"));
  EXPECT_EQ(c.architecture, Architecture::kQwen3);
  EXPECT_EQ(architecture_name(c.architecture), "qwen3");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_hidden_layers, 36);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.intermediate_size, 12288);
  EXPECT_EQ(c.max_position_embeddings, 40960);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.attention, AttentionKind::kGqa);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_EQ(c.rope.rotary_dim, 128);  // full rotary: partial_rotary_factor defaults to 1
  EXPECT_FALSE(c.rope.interleaved);
  EXPECT_EQ(c.layer_types, std::vector<LayerType>(36, LayerType::kFullAttention));
  EXPECT_EQ(c.num_experts, 0);
  EXPECT_EQ(moe_flags(c), std::vector<bool>(36, false));
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151645});
  EXPECT_EQ(c.bos_token_id, 151643);
  EXPECT_FALSE(c.pad_token_id.has_value());
  EXPECT_FALSE(c.has_vision);
}

TEST(ModelConfig, Qwen3_30B_A3B) {
  const ModelConfig c = parse_ok(load_data("qwen3_30b_a3b.json"));
  EXPECT_EQ(c.architecture, Architecture::kQwen3Moe);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 48);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 128);  // written; hidden/heads would be 64
  EXPECT_EQ(c.rope.rotary_dim, 128);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_EQ(c.intermediate_size, 6144);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.router_scoring, RouterScoring::kSoftmax);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  EXPECT_EQ(moe_flags(c), std::vector<bool>(48, true));  // (i+1) % 1 == 0 for every layer
  EXPECT_EQ(c.attention, AttentionKind::kGqa);
}

TEST(ModelConfig, Qwen3NextInstruct) {
  const ModelConfig c = parse_ok(load_data("qwen3_next_80b_a3b_instruct.json"));
  EXPECT_EQ(c.architecture, Architecture::kQwen3Next);
  EXPECT_EQ(c.attention, AttentionKind::kGatedGqa);
  EXPECT_EQ(c.layer_types, hybrid_pattern(48, 4));
  EXPECT_EQ(c.layer_types[3], LayerType::kFullAttention);
  EXPECT_EQ(c.layer_types[4], LayerType::kLinearAttention);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_DOUBLE_EQ(c.rope.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.rope.rotary_dim, 64);  // 256 * 0.25
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e7);
  EXPECT_TRUE(c.rope.mrope_section.empty());
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.num_experts, 512);
  EXPECT_EQ(c.num_experts_per_tok, 10);
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_EQ(c.intermediate_size, 5120);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(moe_flags(c), std::vector<bool>(48, true));
  EXPECT_EQ(c.max_position_embeddings, 262144);
}

TEST(ModelConfig, Qwen35_35B_A3B) {
  const ModelConfig c = parse_ok(load_data("qwen3_5_35b_a3b.json"));
  EXPECT_EQ(c.architecture, Architecture::kQwen35Moe);
  EXPECT_EQ(c.model_type, "qwen3_5_moe");
  EXPECT_EQ(architecture_name(c.architecture), "qwen3_5_moe");
  EXPECT_TRUE(c.has_vision);
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 40);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.intermediate_size, 0);
  EXPECT_EQ(c.attention, AttentionKind::kGatedGqa);
  EXPECT_EQ(c.layer_types, hybrid_pattern(40, 4));
  EXPECT_EQ(c.rope.rotary_dim, 64);
  EXPECT_EQ(c.rope.mrope_section, (std::vector<int64_t>{11, 11, 10}));
  EXPECT_TRUE(c.rope.mrope_interleaved);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e7);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_TRUE(c.norm_topk_prob);  // Qwen3.5 always renormalises
  EXPECT_EQ(moe_flags(c), std::vector<bool>(40, true));
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.num_mtp_layers, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{248044});
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 262144);
}

TEST(ModelConfig, Qwen35_397B_A17B) {
  const ModelConfig c = parse_ok(load_data("qwen3_5_397b_a17b.json"));
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_hidden_layers, 60);
  EXPECT_EQ(c.layer_types, hybrid_pattern(60, 4));  // full attention at 3, 7, ..., 59
  int n_full = 0;
  for (LayerType t : c.layer_types) n_full += t == LayerType::kFullAttention;
  EXPECT_EQ(n_full, 15);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 64);  // 4 value heads per key head
  EXPECT_EQ(c.num_experts, 512);
  EXPECT_EQ(c.num_experts_per_tok, 10);
  EXPECT_EQ(c.moe_intermediate_size, 1024);
  EXPECT_EQ(c.shared_expert_intermediate_size, 1024);
  EXPECT_EQ(c.rope.rotary_dim, 64);
  // Text defaults not written in this file come from Qwen3_5MoeTextConfig.
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_FALSE(c.attention_bias);
}

TEST(ModelConfig, Glm5) {
  const ModelConfig c = parse_ok(load_data("glm_5.json"));
  EXPECT_EQ(c.architecture, Architecture::kGlmMoeDsa);
  EXPECT_EQ(architecture_name(c.architecture), "glm_moe_dsa");
  EXPECT_EQ(c.attention, AttentionKind::kMla);
  EXPECT_EQ(c.vocab_size, 154880);
  EXPECT_EQ(c.hidden_size, 6144);
  EXPECT_EQ(c.intermediate_size, 12288);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 78);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.num_key_value_heads, 64);
  EXPECT_EQ(c.q_lora_rank, 2048);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 192);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.qk_head_dim, 256);
  EXPECT_EQ(c.v_head_dim, 256);
  EXPECT_EQ(c.head_dim, 64);  // HF points head_dim at the rope slice
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.router_scoring, RouterScoring::kSigmoid);
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_EQ(moe_flags(c), dense_then_moe(78, 3));  // layers 0-2 dense, 3-77 MoE
  EXPECT_EQ(c.max_position_embeddings, 202752);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.index_topk, 2048);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_n_heads, 32);
  EXPECT_TRUE(c.indexer_rope_interleave);
  EXPECT_EQ(c.indexer_types, std::vector<IndexerType>(78, IndexerType::kFull));  // freq 1, offset 2
  EXPECT_TRUE(c.rope.interleaved);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.rope.rotary_dim, 64);
  EXPECT_EQ(c.layer_types, std::vector<LayerType>(78, LayerType::kFullAttention));
  EXPECT_EQ(c.num_mtp_layers, 1);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{154820, 154827, 154829}));
  EXPECT_EQ(c.pad_token_id, 154820);
  EXPECT_EQ(c.bos_token_id, 0);  // not in the file: GlmMoeDsaConfig default
}

TEST(ModelConfig, DeepseekV3) {
  const ModelConfig c = parse_ok(load_data("deepseek_v3.json"));
  EXPECT_EQ(c.architecture, Architecture::kDeepseekV3);
  EXPECT_EQ(c.attention, AttentionKind::kMla);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.qk_head_dim, 192);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(moe_flags(c), dense_then_moe(61, 3));
  EXPECT_EQ(c.router_scoring, RouterScoring::kSigmoid);
  EXPECT_EQ(c.rope.type, "yarn");  // legacy "type" key in rope_scaling
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 40.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.beta_slow, 1.0);
  EXPECT_EQ(c.rope.mscale, 1.0);
  EXPECT_EQ(c.rope.mscale_all_dim, 1.0);
  EXPECT_FALSE(c.rope.attention_factor.has_value());
  EXPECT_EQ(c.rope.rotary_dim, 64);
  EXPECT_TRUE(c.rope.interleaved);  // rope_interleave defaults to true
  EXPECT_EQ(c.num_mtp_layers, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{1});
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_TRUE(c.indexer_types.empty());
  EXPECT_EQ(c.index_topk, 0);
}

// ---- Defaults for missing fields (transformers v5 class defaults) ----

TEST(ModelConfigDefaults, Qwen3EmptyConfig) {
  const ModelConfig c = parse_ok(json{{"model_type", "qwen3"}, {"hidden_size", 2048}});
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.intermediate_size, 22016);
  EXPECT_EQ(c.num_hidden_layers, 32);
  EXPECT_EQ(c.num_key_value_heads, 32);
  EXPECT_EQ(c.head_dim, 128);  // a Qwen3Config field: not hidden/heads (= 64 here)
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);  // RotaryEmbeddingConfigMixin.default_theta
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_FALSE(c.bos_token_id.has_value());
}

TEST(ModelConfigDefaults, Qwen3MoeHeadDimFromHiddenSize) {
  // Qwen3MoeConfig has no head_dim field; the attention uses hidden_size // num_attention_heads.
  const ModelConfig c = parse_ok(json{{"model_type", "qwen3_moe"}});
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.num_hidden_layers, 24);
}

TEST(ModelConfigDefaults, Qwen3MoeSparseStepAndMlpOnlyLayers) {
  const ModelConfig c = parse_ok(json{
      {"model_type", "qwen3_moe"}, {"num_hidden_layers", 6}, {"decoder_sparse_step", 2}, {"mlp_only_layers", {3}}});
  // MoE iff i not in [3] and (i+1) % 2 == 0: layers 1 and 5.
  EXPECT_EQ(moe_flags(c), (std::vector<bool>{false, true, false, false, false, true}));
  EXPECT_EQ(c.mlp_only_layers, std::vector<int64_t>{3});
}

TEST(ModelConfigDefaults, Qwen3MoeNumLocalExpertsAlias) {
  const ModelConfig c = parse_ok(json{{"model_type", "qwen3_moe"}, {"num_local_experts", 64}});
  EXPECT_EQ(c.num_experts, 64);
}

TEST(ModelConfigDefaults, Qwen3NextIntervalAndPartialRotary) {
  const ModelConfig c =
      parse_ok(json{{"model_type", "qwen3_next"}, {"num_hidden_layers", 6}, {"full_attention_interval", 2}});
  EXPECT_EQ(c.layer_types, hybrid_pattern(6, 2));
  EXPECT_DOUBLE_EQ(c.rope.partial_rotary_factor, 0.25);  // kwargs.setdefault("partial_rotary_factor", 0.25)
  EXPECT_EQ(c.rope.rotary_dim, 64);
  EXPECT_EQ(c.intermediate_size, 5632);
  EXPECT_EQ(c.num_experts, 512);
  EXPECT_EQ(c.num_experts_per_tok, 10);
  EXPECT_TRUE(c.norm_topk_prob);
}

TEST(ModelConfigDefaults, Qwen3NextExplicitLayerTypesWinOverInterval) {
  json config{{"model_type", "qwen3_next"},
              {"num_hidden_layers", 3},
              {"full_attention_interval", 4},
              {"layer_types", {"full_attention", "linear_attention", "mamba"}}};
  const ModelConfig c = parse_ok(config);
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{LayerType::kFullAttention, LayerType::kLinearAttention,
                                                   LayerType::kLinearAttention}));  // "mamba" is the legacy name
}

TEST(ModelConfigDefaults, Qwen35WithoutTextConfigIs35BA3B) {
  const ModelConfig c = parse_ok(json{{"model_type", "qwen3_5_moe"}});
  EXPECT_TRUE(c.has_vision);
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 40);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.layer_types, hybrid_pattern(40, 4));
  EXPECT_EQ(c.rope.rotary_dim, 64);
  EXPECT_EQ(c.max_position_embeddings, 32768);
}

TEST(ModelConfigDefaults, BareQwen35TextConfig) {
  const ModelConfig c = parse_ok(json{{"model_type", "qwen3_5_moe_text"}, {"num_hidden_layers", 8}});
  EXPECT_EQ(c.architecture, Architecture::kQwen35Moe);
  EXPECT_EQ(c.model_type, "qwen3_5_moe_text");
  EXPECT_FALSE(c.has_vision);
  EXPECT_EQ(c.layer_types, hybrid_pattern(8, 4));
}

TEST(ModelConfigDefaults, Qwen35TopLevelTokenIdsFillTheTextConfig) {
  const ModelConfig c =
      parse_ok(json{{"model_type", "qwen3_5_moe"}, {"eos_token_id", {1, 2}}, {"text_config", {{"bos_token_id", 7}}}});
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(c.bos_token_id, 7);
}

TEST(ModelConfigDefaults, DeepseekV3EmptyConfig) {
  const ModelConfig c = parse_ok(json{{"model_type", "deepseek_v3"}});
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.num_mtp_layers, 1);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_EQ(c.rope.rotary_dim, 64);
  EXPECT_EQ(moe_flags(c), dense_then_moe(61, 3));
}

TEST(ModelConfigDefaults, DeepseekNullQLoraRankMeansNone) {
  const ModelConfig c = parse_ok(json{{"model_type", "deepseek_v3"}, {"q_lora_rank", nullptr}});
  EXPECT_EQ(c.q_lora_rank, 0);
}

TEST(ModelConfigDefaults, MoeLayerFreq) {
  // vLLM DeepseekV2DecoderLayer: MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0.
  const ModelConfig c = parse_ok(json{
      {"model_type", "deepseek_v3"}, {"num_hidden_layers", 6}, {"first_k_dense_replace", 1}, {"moe_layer_freq", 2}});
  EXPECT_EQ(moe_flags(c), (std::vector<bool>{false, false, true, false, true, false}));
}

TEST(ModelConfigDefaults, GlmEmptyConfig) {
  const ModelConfig c = parse_ok(json{{"model_type", "glm_moe_dsa"}});
  EXPECT_EQ(c.num_hidden_layers, 78);
  EXPECT_EQ(c.q_lora_rank, 2048);
  EXPECT_EQ(c.v_head_dim, 256);
  EXPECT_EQ(c.qk_nope_head_dim, 192);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_TRUE(c.indexer_rope_interleave);  // transformers rotates GLM's indexer interleaved whatever the config says
  EXPECT_EQ(c.num_mtp_layers, 0);
  EXPECT_EQ(moe_flags(c), dense_then_moe(78, 3));
  EXPECT_EQ(c.indexer_types, std::vector<IndexerType>(78, IndexerType::kFull));
}

TEST(ModelConfigDefaults, GlmIndexerFrequencyAndOffset) {
  // full iff max(i - 3 + 1, 0) % 4 == 0: layers 0, 1, 2, then 6, 10, ...
  const ModelConfig c = parse_ok(json{
      {"model_type", "glm_moe_dsa"}, {"num_hidden_layers", 11}, {"index_topk_freq", 4}, {"index_skip_topk_offset", 3}});
  const IndexerType F = IndexerType::kFull;
  const IndexerType S = IndexerType::kShared;
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{F, F, F, S, S, S, F, S, S, S, F}));
}

TEST(ModelConfigDefaults, GlmIndexerPattern) {
  const ModelConfig c =
      parse_ok(json{{"model_type", "glm_moe_dsa"}, {"num_hidden_layers", 4}, {"index_topk_pattern", "FSSF"}});
  const IndexerType F = IndexerType::kFull;
  const IndexerType S = IndexerType::kShared;
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{F, S, S, F}));
}

TEST(ModelConfigDefaults, GlmMatchingMlpLayerTypesAccepted) {
  json config{{"model_type", "glm_moe_dsa"},
              {"num_hidden_layers", 4},
              {"first_k_dense_replace", 1},
              {"mlp_layer_types", {"dense", "sparse", "sparse", "sparse"}},
              {"layer_types", json::array({"deepseek_sparse_attention", "deepseek_sparse_attention",
                                           "deepseek_sparse_attention", "deepseek_sparse_attention"})}};
  const ModelConfig c = parse_ok(config);
  EXPECT_EQ(moe_flags(c), (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ(c.layer_types, std::vector<LayerType>(4, LayerType::kFullAttention));
}

// ---- RoPE forms ----

TEST(ModelConfigRope, LegacyYarnRopeScaling) {
  // The Qwen3 model card's long-context recipe, in the legacy top-level form.
  const ModelConfig c = parse_ok(
      json{{"model_type", "qwen3"},
           {"rope_theta", 1000000},
           {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}}}});
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope.factor, 4.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_DOUBLE_EQ(c.rope.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.beta_slow, 1.0);
}

TEST(ModelConfigRope, YarnOriginalLengthDefaultsToMaxPosition) {
  const ModelConfig c = parse_ok(json{{"model_type", "qwen3"},
                                      {"max_position_embeddings", 40960},
                                      {"rope_parameters", {{"rope_type", "yarn"}, {"factor", 2}}}});
  EXPECT_EQ(c.rope.original_max_position_embeddings, 40960);
}

TEST(ModelConfigRope, V5RopeParameters) {
  const ModelConfig c = parse_ok(
      json{{"model_type", "qwen3_next"},
           {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 5000000}, {"partial_rotary_factor", 0.5}}}});
  EXPECT_DOUBLE_EQ(c.rope.theta, 5e6);
  EXPECT_EQ(c.rope.rotary_dim, 128);  // 256 * 0.5
}

TEST(ModelConfigRope, SameValueInBothPlacesIsFine) {
  const ModelConfig c =
      parse_ok(json{{"model_type", "qwen3"}, {"rope_theta", 500000}, {"rope_parameters", {{"rope_theta", 500000}}}});
  EXPECT_DOUBLE_EQ(c.rope.theta, 5e5);
}

// ---- Errors: each names the file and the field ----

TEST(ModelConfigErrors, UnknownField) {
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"hiden_size", 4096}}), "hiden_size");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_5_moe"}, {"text_config", {{"num_layers", 4}}}}),
                     "text_config.num_layers");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"rope_parameters", {{"rope_theta", 1e6}, {"fctor", 2}}}}),
                     "rope_parameters.fctor");
  // Fields of other architectures are unknown here.
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"num_experts", 8}}), "num_experts");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_5_moe_text"}, {"decoder_sparse_step", 1}}), "decoder_sparse_step");
}

TEST(ModelConfigErrors, UnknownModelTypeListsSupported) {
  const std::string message = parse_error(json{{"model_type", "llama"}});
  EXPECT_NE(message.find("llama"), std::string::npos) << message;
  for (const char* name : {"qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "glm_moe_dsa", "deepseek_v3"}) {
    EXPECT_NE(message.find(name), std::string::npos) << message;
  }
  EXPECT_NE(parse_error(json{{"hidden_size", 1}}).find("model_type"), std::string::npos);
  EXPECT_ERROR_NAMES((json{{"model_type", 3}}), "model_type");
}

TEST(ModelConfigErrors, HeadsNotMultipleOfKvHeads) {
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"num_attention_heads", 32}, {"num_key_value_heads", 5}}),
                     "num_key_value_heads");
}

TEST(ModelConfigErrors, LayerTypes) {
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_next"},
                           {"num_hidden_layers", 3},
                           {"layer_types", {"full_attention", "linear_attention"}}}),
                     "layer_types");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_next"},
                           {"num_hidden_layers", 2},
                           {"layer_types", {"full_attention", "sliding_attention"}}}),
                     "layer_types[1]");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"num_hidden_layers", 1}, {"layer_types", {"linear_attention"}}}),
                     "layer_types[0]");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_next"}, {"layer_types", "full_attention"}}), "layer_types");
}

TEST(ModelConfigErrors, ExpertCounts) {
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_moe"}, {"num_experts", 4}, {"num_experts_per_tok", 8}}),
                     "num_experts_per_tok");
  EXPECT_ERROR_NAMES((json{{"model_type", "deepseek_v3"}, {"n_routed_experts", 4}, {"num_experts_per_tok", 8}}),
                     "num_experts_per_tok");
  EXPECT_ERROR_NAMES((json{{"model_type", "deepseek_v3"}, {"n_routed_experts", 100}}), "n_group");
  EXPECT_ERROR_NAMES((json{{"model_type", "deepseek_v3"}, {"topk_group", 9}}), "topk_group");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_5_moe_text"}, {"num_experts", 0}}), "num_experts");
  EXPECT_ERROR_NAMES((json{{"model_type", "deepseek_v3"}, {"n_routed_experts", 64}, {"num_local_experts", 32}}),
                     "num_local_experts");
}

TEST(ModelConfigErrors, HeadDimInconsistent) {
  // Qwen3-MoE derives head_dim from hidden_size / heads when absent, so they must divide.
  EXPECT_ERROR_NAMES(
      (json{
          {"model_type", "qwen3_moe"}, {"hidden_size", 1000}, {"num_attention_heads", 32}, {"num_key_value_heads", 4}}),
      "hidden_size");
  // MLA: a written head_dim must be the rope width or the full q/k width.
  EXPECT_ERROR_NAMES((json{{"model_type", "glm_moe_dsa"}, {"head_dim", 128}}), "head_dim");
  EXPECT_ERROR_NAMES((json{{"model_type", "glm_moe_dsa"}, {"index_head_dim", 32}}), "index_head_dim");
  EXPECT_ERROR_NAMES((json{{"model_type", "glm_moe_dsa"}, {"qk_head_dim", 100}}), "qk_head_dim");
}

TEST(ModelConfigErrors, LinearHeads) {
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_next"}, {"linear_num_key_heads", 16}, {"linear_num_value_heads", 24}}),
                     "linear_num_value_heads");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_next"}, {"linear_key_head_dim", 0}}), "linear_key_head_dim");
}

TEST(ModelConfigErrors, NonPositiveSizes) {
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"hidden_size", 0}}), "hidden_size");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"vocab_size", -5}}), "vocab_size");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"num_hidden_layers", 0}}), "num_hidden_layers");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"rms_norm_eps", 0.0}}), "rms_norm_eps");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_moe"}, {"decoder_sparse_step", 0}}), "decoder_sparse_step");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_next"}, {"full_attention_interval", 0}}), "full_attention_interval");
  EXPECT_ERROR_NAMES((json{{"model_type", "deepseek_v3"}, {"moe_layer_freq", 0}}), "moe_layer_freq");
  EXPECT_ERROR_NAMES((json{{"model_type", "deepseek_v3"}, {"kv_lora_rank", -1}}), "kv_lora_rank");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"num_hidden_layers", 1LL << 40}}), "num_hidden_layers");
}

// Sizes beyond what any model has (2^62 vocabulary, 2^31 hidden size): an error naming the field and the limit,
// before anything computes bytes from them.
TEST(ModelConfigErrors, AbsurdSizesAreBounded) {
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"vocab_size", 1LL << 62}}), "vocab_size");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"hidden_size", 1LL << 31}}), "hidden_size");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"intermediate_size", (1LL << 24) + 1}}), "intermediate_size");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_moe"}, {"num_experts", 1LL << 40}}), "num_experts");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"max_position_embeddings", (1LL << 30) + 1}}),
                     "max_position_embeddings");
  // The largest allowed values still parse.
  json ok{{"model_type", "qwen3"}, {"vocab_size", 1LL << 24}, {"max_position_embeddings", 1LL << 30}};
  auto c = model_config_parse(ok, "config.json");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->vocab_size, 1LL << 24);
}

TEST(ModelConfigErrors, WrongJsonTypes) {
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"hidden_size", "4096"}}), "hidden_size");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"hidden_size", 4096.5}}), "hidden_size");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"hidden_size", nullptr}}), "hidden_size");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"tie_word_embeddings", 1}}), "tie_word_embeddings");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"rope_theta", "1e6"}}), "rope_theta");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"eos_token_id", {1, "2"}}}), "eos_token_id[1]");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_moe"}, {"mlp_only_layers", 3}}), "mlp_only_layers");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"rope_parameters", {1, 2}}}), "rope_parameters");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_5_moe"}, {"text_config", 5}}), "text_config");
  const std::string message = parse_error(json::array());
  EXPECT_NE(message.find("object"), std::string::npos) << message;
}

TEST(ModelConfigErrors, ContradictoryRope) {
  EXPECT_ERROR_NAMES(
      (json{{"model_type", "qwen3"}, {"rope_theta", 10000}, {"rope_parameters", {{"rope_theta", 1000000}}}}),
      "rope_theta");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"},
                           {"rope_parameters", {{"rope_type", "default"}}},
                           {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 2}}}}),
                     "rope_scaling");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"rope_parameters", {{"rope_type", "longrope"}}}}),
                     "rope_parameters.rope_type");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"rope_parameters", {{"rope_type", "yarn"}}}}),
                     "rope_parameters.factor");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_next"}, {"rope_parameters", {{"mrope_section", {11, 11, 11}}}}}),
                     "mrope_section");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_next"}, {"partial_rotary_factor", 1.5}}), "partial_rotary_factor");
}

TEST(ModelConfigErrors, Qwen35TopLevel) {
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_5_moe"}, {"text_config", {{"model_type", "qwen3_next"}}}}),
                     "text_config.model_type");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_5_moe"},
                           {"tie_word_embeddings", true},
                           {"text_config", {{"tie_word_embeddings", false}}}}),
                     "tie_word_embeddings");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_5_moe"}, {"text_config", {{"hidden_size", -1}}}}),
                     "text_config.hidden_size");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_5_moe"}, {"vision_config", "none"}}), "vision_config");
}

TEST(ModelConfigErrors, DenseAndIndexerLayouts) {
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_moe"}, {"num_hidden_layers", 4}, {"mlp_only_layers", {4}}}),
                     "mlp_only_layers");
  EXPECT_ERROR_NAMES((json{{"model_type", "glm_moe_dsa"},
                           {"num_hidden_layers", 3},
                           {"first_k_dense_replace", 1},
                           {"mlp_layer_types", {"dense", "dense", "sparse"}}}),
                     "mlp_layer_types[1]");
  EXPECT_ERROR_NAMES(
      (json{{"model_type", "glm_moe_dsa"}, {"num_hidden_layers", 2}, {"indexer_types", {"shared", "full"}}}),
      "indexer_types");
  EXPECT_ERROR_NAMES((json{{"model_type", "glm_moe_dsa"}, {"num_hidden_layers", 2}, {"index_topk_pattern", "FX"}}),
                     "index_topk_pattern");
  EXPECT_ERROR_NAMES((json{{"model_type", "glm_moe_dsa"}, {"scoring_func", "relu"}}), "scoring_func");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3"}, {"use_sliding_window", true}}), "use_sliding_window");
  EXPECT_ERROR_NAMES((json{{"model_type", "qwen3_moe"}, {"num_experts", 0}, {"intermediate_size", 0}}),
                     "intermediate_size");
}

// ---- Loading from disk ----

class ModelConfigLoad : public ::testing::Test {
 protected:
  void SetUp() override {
    // One directory per test: ctest runs the tests of this fixture in parallel processes.
    dir_ = std::filesystem::path(TERN_BINARY_DIR) /
           ("model_config_load_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void write(const std::string& text) { std::ofstream(dir_ / "config.json") << text; }
  std::filesystem::path dir_;
};

TEST_F(ModelConfigLoad, DirectoryAndFile) {
  write(load_data("qwen3_8b.json").dump());
  Expected<ModelConfig> from_dir = model_config_load(dir_);
  ASSERT_TRUE(from_dir.has_value()) << from_dir.error().message;
  EXPECT_EQ(from_dir->hidden_size, 4096);
  Expected<ModelConfig> from_file = model_config_load(dir_ / "config.json");
  ASSERT_TRUE(from_file.has_value()) << from_file.error().message;
  EXPECT_EQ(from_file->num_hidden_layers, 36);
}

TEST_F(ModelConfigLoad, ErrorsNameThePath) {
  write("{\"model_type\": \"qwen3\", \"hidden_size\": }");
  Expected<ModelConfig> bad = model_config_load(dir_);
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find((dir_ / "config.json").string()), std::string::npos) << bad.error().message;
  write("{\"model_type\": \"qwen3\", \"hidden_size\": \"big\"}");
  bad = model_config_load(dir_);
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("config.json: field 'hidden_size'"), std::string::npos) << bad.error().message;
  Expected<ModelConfig> missing = model_config_load(dir_ / "absent");
  ASSERT_FALSE(missing.has_value());
  EXPECT_NE(missing.error().message.find("absent"), std::string::npos) << missing.error().message;
}


// generation_config.json's eos_token_id (an id or a list) joins config.json's, as vLLM and SGLang stop on both: a
// GLM-5 checkpoint lists <|endoftext|>, <|user|> and <|observation|> there. A bad file is an error naming it.
TEST_F(ModelConfigLoad, GenerationConfigEosIdsJoinTheConfigs) {
  write(R"({"model_type": "qwen3", "vocab_size": 1000, "eos_token_id": 7})");
  const auto generation = [&](const std::string& text) { std::ofstream(dir_ / "generation_config.json") << text; };
  const auto eos = [&] {
    Expected<ModelConfig> c = model_config_load(dir_);
    EXPECT_TRUE(c.has_value()) << c.error().message;
    return c ? c->eos_token_ids : std::vector<int64_t>{-1};
  };
  EXPECT_EQ(eos(), std::vector<int64_t>{7});  // no generation_config.json
  generation(R"({"eos_token_id": [7, 12, 9], "pad_token_id": 7, "do_sample": true})");
  EXPECT_EQ(eos(), (std::vector<int64_t>{7, 12, 9}));
  EXPECT_EQ(model_config_load(dir_ / "config.json")->eos_token_ids, (std::vector<int64_t>{7, 12, 9}));
  generation(R"({"eos_token_id": 12})");
  EXPECT_EQ(eos(), (std::vector<int64_t>{7, 12}));
  generation(R"({"eos_token_id": null})");
  EXPECT_EQ(eos(), std::vector<int64_t>{7});
  generation(R"({"temperature": 0.6})");
  EXPECT_EQ(eos(), std::vector<int64_t>{7});
  write(R"({"model_type": "qwen3", "vocab_size": 1000})");
  generation(R"({"eos_token_id": [3, 3]})");
  EXPECT_EQ(eos(), std::vector<int64_t>{3});

  for (const char* bad : {R"({"eos_token_id": "3"})", R"({"eos_token_id": [3, 2.5]})", R"({"eos_token_id": [1000]})",
                          R"({"eos_token_id": -1})", R"([1, 2])", R"({"eos_token_id": [3,)"}) {
    generation(bad);
    Expected<ModelConfig> c = model_config_load(dir_);
    ASSERT_FALSE(c.has_value()) << bad;
    EXPECT_NE(c.error().message.find((dir_ / "generation_config.json").string()), std::string::npos)
        << c.error().message;
  }
  generation(R"({"eos_token_id": [3, "4"]})");
  EXPECT_NE(model_config_load(dir_).error().message.find("'eos_token_id' must be a token id or a list of token ids"),
            std::string::npos);
}


// config.json nested 30,000 deep: an error naming the file and the limit, not a crash.
TEST(ModelConfig, DeepNestingIsAnErrorNotACrash) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "tern_deep_config";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "qwen3", "extra": )" << std::string(30000, '[')
                                      << std::string(30000, ']') << "}";
  auto config = model_config_load(dir);
  std::filesystem::remove_all(dir);
  ASSERT_FALSE(config);
  EXPECT_NE(config.error().message.find("config.json"), std::string::npos) << config.error().message;
  EXPECT_NE(config.error().message.find("nested deeper than 128"), std::string::npos) << config.error().message;
}

}  // namespace
}  // namespace tern
