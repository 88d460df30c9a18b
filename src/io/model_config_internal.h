// Shared pieces of the config.json parsers (model_config*.cc); not part of the public io/ API.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "io/json_fields.h"
#include "io/model_config.h"

namespace tern::config_detail {

// A bound on num_hidden_layers so that a corrupt file cannot make per-layer tables exhaust memory.
inline constexpr int64_t kMaxLayers = 1 << 16;

// The defaults of one transformers configuration class (0 where the class has no such field).
struct TextDefaults {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> eos_token_id;
};

// What the RoPE reader needs from the architecture.
struct RopeInputs {
  double default_theta = 10000.0;  // RotaryEmbeddingConfigMixin.default_theta
  double default_partial_rotary_factor = 1.0;
  int64_t head_dim = 0;  // the width RoPE is computed over
  int64_t max_position_embeddings = 0;
  bool interleaved = false;
};

void accept_generic_keys(JsonFields& fields);
Expected<void> require_positive(const JsonFields& fields, std::string_view key, int64_t value);
Expected<void> require_non_negative(const JsonFields& fields, std::string_view key, int64_t value);
// The largest size or count a config.json field may give (2^24: vocabularies, hidden and intermediate sizes, head
// and expert counts), and the largest context (2^30).
constexpr int64_t kConfigMaxSize = int64_t{1} << 24;
constexpr int64_t kConfigMaxContext = int64_t{1} << 30;
Expected<int64_t> read_positive(JsonFields& fields, std::string_view key, int64_t fallback);
Expected<void> read_token_ids(JsonFields& fields, const TextDefaults& defaults, ModelConfig& config);
Expected<void> read_text_basics(JsonFields& fields, const TextDefaults& defaults, ModelConfig& config);
Expected<void> read_head_dim(JsonFields& fields, int64_t class_default, ModelConfig& config);
Expected<void> read_layer_types(JsonFields& fields, bool allow_linear,
                                const std::vector<std::string_view>& full_aliases, ModelConfig& config);
Expected<void> derive_hybrid_layer_types(JsonFields& fields, ModelConfig& config);
void fill_full_attention_layers(ModelConfig& config);

// rope_parameters / legacy rope_scaling + rope_theta + partial_rotary_factor -> RopeConfig (model_config_rope.cc).
Expected<RopeConfig> read_rope(JsonFields& fields, const RopeInputs& inputs);

// One parser per model_type (model_config_qwen.cc, model_config_mla.cc).
Expected<ModelConfig> parse_qwen3(const nlohmann::json& config, std::string_view source);
Expected<ModelConfig> parse_qwen3_moe(const nlohmann::json& config, std::string_view source);
Expected<ModelConfig> parse_qwen3_next(const nlohmann::json& config, std::string_view source);
Expected<ModelConfig> parse_qwen35_moe(const nlohmann::json& config, std::string_view source);
Expected<ModelConfig> parse_qwen35_moe_text_only(const nlohmann::json& config, std::string_view source);
Expected<ModelConfig> parse_glm_moe_dsa(const nlohmann::json& config, std::string_view source);
Expected<ModelConfig> parse_deepseek_v3(const nlohmann::json& config, std::string_view source);

}  // namespace tern::config_detail
