// Defaults, derived values and accepted keys follow the transformers v5 configuration classes
// (models/<name>/configuration_<name>.py, PreTrainedConfig in configuration_utils.py and the RoPE standardisation in
// modeling_rope_utils.py), plus the checkpoint keys vLLM reads for the same architectures (scoring_func,
// topk_method, moe_layer_freq, num_nextn_predict_layers, ...), because published config.json files carry them.
#include "io/model_config.h"

#include <algorithm>
#include <cmath>

#include "core/json_parse.h"
#include "io/json_fields.h"
#include "io/model_config_internal.h"

namespace tern {

std::string_view architecture_name(Architecture architecture) {
  switch (architecture) {
    case Architecture::kQwen3:
      return "qwen3";
    case Architecture::kQwen3Moe:
      return "qwen3_moe";
    case Architecture::kQwen3Next:
      return "qwen3_next";
    case Architecture::kQwen35Moe:
      return "qwen3_5_moe";
    case Architecture::kGlmMoeDsa:
      return "glm_moe_dsa";
    case Architecture::kDeepseekV3:
      return "deepseek_v3";
  }
  return "unknown";
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  TERN_CHECK(layer >= 0 && layer < static_cast<int64_t>(moe_layers.size()), "layer {} of {}", layer, moe_layers.size());
  return moe_layers[static_cast<size_t>(layer)];
}

namespace config_detail {

namespace {

// PreTrainedConfig attributes (current and v4), generation parameters that transformers pops from config.json,
// and bookkeeping keys the Hub tooling writes. None of them changes the served model.
const std::vector<std::string_view>& generic_config_keys() {
  // clang-format off
  static const std::vector<std::string_view> keys = {
      "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
      "quantization_config", "_name_or_path", "name_or_path", "_commit_hash", "auto_map", "initializer_range",
      "output_hidden_states", "output_attentions", "return_dict", "use_return_dict", "chunk_size_feed_forward",
      "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
      "tie_encoder_decoder", "id2label", "label2id", "num_labels", "problem_type", "pruned_heads", "tokenizer_class",
      "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params", "finetuning_task", "torchscript",
      "use_bfloat16", "tf_legacy_loss",
      "attn_implementation", "_attn_implementation", "_attn_implementation_autoset", "_attn_implementation_internal",
      "experts_implementation", "_experts_implementation", "per_layer_config",
      "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
      "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
      "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
      "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
      "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens"
  };
  // clang-format on
  return keys;
}

}  // namespace

void accept_generic_keys(JsonFields& fields) {
  fields.accept(generic_config_keys());
}

// Every size and count in config.json has an upper bound, so that the byte sizes computed from them (a vocabulary
// times a hidden size, ...) stay far inside int64 and an absurd value is an error naming its field rather than an
// overflow or an allocation that aborts. Context lengths may be larger than other sizes.
int64_t size_limit(std::string_view key) {
  return key.find("max_position_embeddings") != std::string_view::npos ? kConfigMaxContext : kConfigMaxSize;
}

Expected<void> require_positive(const JsonFields& fields, std::string_view key, int64_t value) {
  if (value <= 0) return make_error("{} must be positive, got {}", fields.where(key), value);
  if (value > size_limit(key)) {
    return make_error("{} is {}, more than tern's limit of {}", fields.where(key), value, size_limit(key));
  }
  return {};
}

Expected<void> require_non_negative(const JsonFields& fields, std::string_view key, int64_t value) {
  if (value < 0) return make_error("{} must not be negative, got {}", fields.where(key), value);
  if (value > size_limit(key)) {
    return make_error("{} is {}, more than tern's limit of {}", fields.where(key), value, size_limit(key));
  }
  return {};
}

Expected<int64_t> read_positive(JsonFields& fields, std::string_view key, int64_t fallback) {
  TERN_ASSIGN_OR_RETURN(const int64_t value, fields.get_int(key, fallback));
  TERN_TRY(require_positive(fields, key, value));
  return value;
}

Expected<void> read_token_ids(JsonFields& fields, const TextDefaults& defaults, ModelConfig& config) {
  const nlohmann::json* eos = fields.get_raw("eos_token_id");
  if (eos == nullptr) {
    if (defaults.eos_token_id) config.eos_token_ids = {*defaults.eos_token_id};
  } else if (eos->is_array()) {
    TERN_TRY(fields.get_int_list("eos_token_id", config.eos_token_ids));
  } else if (!eos->is_null()) {
    TERN_ASSIGN_OR_RETURN(auto single, fields.get_optional_int("eos_token_id"));
    config.eos_token_ids = {*single};
  }
  if (fields.has("bos_token_id")) {
    TERN_ASSIGN_OR_RETURN(config.bos_token_id, fields.get_optional_int("bos_token_id"));
  } else {
    config.bos_token_id = defaults.bos_token_id;
  }
  TERN_ASSIGN_OR_RETURN(config.pad_token_id, fields.get_optional_int("pad_token_id"));
  return {};
}

// Fields every text architecture here shares, with the class defaults in `defaults`.
Expected<void> read_text_basics(JsonFields& fields, const TextDefaults& defaults, ModelConfig& config) {
  TERN_ASSIGN_OR_RETURN(config.vocab_size, read_positive(fields, "vocab_size", defaults.vocab_size));
  TERN_ASSIGN_OR_RETURN(config.hidden_size, read_positive(fields, "hidden_size", defaults.hidden_size));
  TERN_ASSIGN_OR_RETURN(config.num_hidden_layers, read_positive(fields, "num_hidden_layers", defaults.num_layers));
  if (config.num_hidden_layers > kMaxLayers) {
    return make_error("{} is {}, more than the {} layers tern supports", fields.where("num_hidden_layers"),
                      config.num_hidden_layers, kMaxLayers);
  }
  TERN_ASSIGN_OR_RETURN(config.num_attention_heads, read_positive(fields, "num_attention_heads", defaults.num_heads));
  // `num_key_value_heads: null` means "as many as the query heads" (HF __post_init__).
  TERN_ASSIGN_OR_RETURN(const std::optional<int64_t> kv_heads, fields.get_optional_int("num_key_value_heads"));
  config.num_key_value_heads =
      fields.has("num_key_value_heads") ? kv_heads.value_or(config.num_attention_heads) : defaults.num_kv_heads;
  TERN_TRY(require_positive(fields, "num_key_value_heads", config.num_key_value_heads));
  if (config.num_attention_heads % config.num_key_value_heads != 0) {
    return make_error("{}: num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                      fields.where("num_key_value_heads"), config.num_attention_heads, config.num_key_value_heads);
  }
  TERN_ASSIGN_OR_RETURN(config.hidden_act, fields.get_string("hidden_act", "silu"));
  TERN_ASSIGN_OR_RETURN(config.max_position_embeddings,
                        read_positive(fields, "max_position_embeddings", defaults.max_position_embeddings));
  TERN_ASSIGN_OR_RETURN(config.rms_norm_eps, fields.get_double("rms_norm_eps", defaults.rms_norm_eps));
  if (!(config.rms_norm_eps > 0.0)) {
    return make_error("{} must be positive, got {}", fields.where("rms_norm_eps"), config.rms_norm_eps);
  }
  TERN_ASSIGN_OR_RETURN(config.tie_word_embeddings, fields.get_bool("tie_word_embeddings", false));
  TERN_ASSIGN_OR_RETURN(config.attention_bias, fields.get_bool("attention_bias", false));
  if (defaults.intermediate_size > 0) {
    TERN_ASSIGN_OR_RETURN(config.intermediate_size,
                          read_positive(fields, "intermediate_size", defaults.intermediate_size));
  }
  return read_token_ids(fields, defaults, config);
}

// head_dim: the class default when the class has the field, else hidden_size / num_attention_heads as the modeling
// code's getattr fallback computes it (then hidden_size must divide evenly).
Expected<void> read_head_dim(JsonFields& fields, int64_t class_default, ModelConfig& config) {
  if (class_default > 0 || fields.has("head_dim")) {
    TERN_ASSIGN_OR_RETURN(config.head_dim, read_positive(fields, "head_dim", class_default));
    return {};
  }
  if (config.hidden_size % config.num_attention_heads != 0) {
    return make_error("{}: head_dim is absent and hidden_size ({}) is not a multiple of num_attention_heads ({})",
                      fields.where("hidden_size"), config.hidden_size, config.num_attention_heads);
  }
  config.head_dim = config.hidden_size / config.num_attention_heads;
  return {};
}

// layer_types as written: HF's legacy names are remapped ("attention" -> full, "mamba" -> linear, as
// remap_legacy_layer_types does); `full_aliases` lists other names that mean full attention for this architecture.
Expected<void> read_layer_types(JsonFields& fields, bool allow_linear,
                                const std::vector<std::string_view>& full_aliases, ModelConfig& config) {
  std::vector<std::string> names;
  TERN_ASSIGN_OR_RETURN(const bool present, fields.get_string_list("layer_types", names));
  if (!present) return {};
  if (static_cast<int64_t>(names.size()) != config.num_hidden_layers) {
    return make_error("{} has {} entries but num_hidden_layers is {}", fields.where("layer_types"), names.size(),
                      config.num_hidden_layers);
  }
  config.layer_types.clear();
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    const bool is_full = name == "full_attention" || name == "attention" ||
                         std::find(full_aliases.begin(), full_aliases.end(), name) != full_aliases.end();
    const bool is_linear = allow_linear && (name == "linear_attention" || name == "mamba");
    if (!is_full && !is_linear) {
      return make_error("{} is '{}', which {} does not support (expected {})", fields.where("layer_types", i), name,
                        config.model_type, allow_linear ? "full_attention or linear_attention" : "full_attention");
    }
    config.layer_types.push_back(is_full ? LayerType::kFullAttention : LayerType::kLinearAttention);
  }
  return {};
}

// Layer i is linear unless (i+1) is a multiple of full_attention_interval (HF Qwen3Next/Qwen3_5MoeText __post_init__).
Expected<void> derive_hybrid_layer_types(JsonFields& fields, ModelConfig& config) {
  TERN_ASSIGN_OR_RETURN(const int64_t interval, read_positive(fields, "full_attention_interval", 4));
  TERN_TRY(read_layer_types(fields, /*allow_linear=*/true, {}, config));
  if (fields.has_value("layer_types")) return {};
  config.layer_types.clear();
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    config.layer_types.push_back((i + 1) % interval == 0 ? LayerType::kFullAttention : LayerType::kLinearAttention);
  }
  return {};
}

void fill_full_attention_layers(ModelConfig& config) {
  if (config.layer_types.empty()) {
    config.layer_types.assign(static_cast<size_t>(config.num_hidden_layers), LayerType::kFullAttention);
  }
}

}  // namespace config_detail

namespace {

using namespace config_detail;

Expected<ModelConfig> parse_by_model_type(const nlohmann::json& config, std::string_view source,
                                          const std::string& model_type) {
  if (model_type == "qwen3") return parse_qwen3(config, source);
  if (model_type == "qwen3_moe") return parse_qwen3_moe(config, source);
  if (model_type == "qwen3_next") return parse_qwen3_next(config, source);
  if (model_type == "qwen3_5_moe") return parse_qwen35_moe(config, source);
  if (model_type == "qwen3_5_moe_text") return parse_qwen35_moe_text_only(config, source);
  if (model_type == "glm_moe_dsa") return parse_glm_moe_dsa(config, source);
  if (model_type == "deepseek_v3") return parse_deepseek_v3(config, source);
  return make_error(
      "{}: unsupported model_type '{}' (supported: qwen3, qwen3_moe, qwen3_next, qwen3_5_moe, qwen3_5_moe_text, "
      "glm_moe_dsa, deepseek_v3)",
      source, model_type);
}

}  // namespace

Expected<ModelConfig> model_config_parse(const nlohmann::json& config, std::string_view source) {
  if (!config.is_object()) {
    return make_error("{}: a config must be a JSON object, got {}", source, json_type_name(config));
  }
  JsonFields fields(config, source);
  TERN_ASSIGN_OR_RETURN(const std::optional<std::string> model_type, fields.get_optional_string("model_type"));
  if (!model_type) return make_error("{}: missing field 'model_type'", source);
  return parse_by_model_type(config, source, *model_type);
}

namespace {

// generation_config.json's eos_token_id (an id or a list) joins config.json's: generation stops at either, as in
// vLLM and SGLang (GLM-5 lists <|endoftext|>, <|user|> and <|observation|> there).
Expected<void> add_generation_config_eos(const std::filesystem::path& path, ModelConfig& config) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return {};
  TERN_ASSIGN_OR_RETURN(const nlohmann::json document, json_read_file(path));
  if (!document.is_object()) {
    return make_error("{}: a generation config must be a JSON object, got {}", path.string(),
                      json_type_name(document));
  }
  const auto eos = document.find("eos_token_id");
  if (eos == document.end() || eos->is_null()) return {};
  const auto bad = [&] {
    return make_error("{}: field 'eos_token_id' must be a token id or a list of token ids (integers in [0, {})), "
                      "got {}", path.string(), config.vocab_size, eos->dump());
  };
  std::vector<int64_t> ids;
  for (const nlohmann::json& id : eos->is_array() ? *eos : nlohmann::json::array({*eos})) {
    if (!id.is_number_integer()) return bad();
    const int64_t value = id.get<int64_t>();
    if (value < 0 || value >= config.vocab_size) return bad();
    ids.push_back(value);
  }
  for (int64_t id : ids) {
    if (std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(), id) == config.eos_token_ids.end()) {
      config.eos_token_ids.push_back(id);
    }
  }
  return {};
}

}  // namespace

Expected<ModelConfig> model_config_load(const std::filesystem::path& dir_or_config_json) {
  std::error_code ec;
  const bool is_dir = std::filesystem::is_directory(dir_or_config_json, ec);
  const std::filesystem::path path = is_dir ? dir_or_config_json / "config.json" : dir_or_config_json;
  // Strict JSON, like Python's json module: no comments, and NaN/Infinity are not JSON.
  TERN_ASSIGN_OR_RETURN(const nlohmann::json document, json_read_file(path, "the model config"));
  TERN_ASSIGN_OR_RETURN(ModelConfig config, model_config_parse(document, path.string()));
  TERN_TRY(add_generation_config_eos(path.parent_path() / "generation_config.json", config));
  return config;
}

}  // namespace tern
