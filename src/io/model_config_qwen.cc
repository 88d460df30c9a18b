// qwen3, qwen3_moe, qwen3_next and qwen3_5_moe configs. Defaults are those of transformers v5 Qwen3Config,
// Qwen3MoeConfig, Qwen3NextConfig and Qwen3_5MoeTextConfig / Qwen3_5MoeConfig (whose text defaults are the
// Qwen3.5-35B-A3B values).
#include <algorithm>

#include "io/model_config_internal.h"

namespace tern::config_detail {

namespace {

// Sliding-window attention is a Qwen3 training option that no released Qwen3 checkpoint enables.
Expected<void> reject_sliding_window(JsonFields& fields) {
  TERN_ASSIGN_OR_RETURN(const bool sliding, fields.get_bool("use_sliding_window", false));
  if (sliding)
    return make_error("{} is true; sliding-window attention is not supported", fields.where("use_sliding_window"));
  fields.accept({"sliding_window", "max_window_layers"});
  return {};
}

// Qwen3MoeDecoderLayer / Qwen3NextDecoderLayer: layer i is MoE iff it is not in mlp_only_layers, there are experts,
// and (i + 1) is a multiple of decoder_sparse_step.
Expected<void> derive_qwen_moe_layers(JsonFields& fields, ModelConfig& config) {
  TERN_ASSIGN_OR_RETURN(config.decoder_sparse_step, read_positive(fields, "decoder_sparse_step", 1));
  config.mlp_only_layers.clear();
  TERN_TRY(fields.get_int_list("mlp_only_layers", config.mlp_only_layers));
  for (const int64_t layer : config.mlp_only_layers) {
    if (layer < 0 || layer >= config.num_hidden_layers) {
      return make_error("{} names layer {}, but the model has {} layers", fields.where("mlp_only_layers"), layer,
                        config.num_hidden_layers);
    }
  }
  config.moe_layers.clear();
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const bool dense_only =
        std::find(config.mlp_only_layers.begin(), config.mlp_only_layers.end(), i) != config.mlp_only_layers.end();
    config.moe_layers.push_back(!dense_only && config.num_experts > 0 && (i + 1) % config.decoder_sparse_step == 0);
  }
  return {};
}

// Expert counts shared by the Qwen MoE families. num_experts == 0 (qwen3_moe/qwen3_next only) means a dense model.
Expected<void> read_qwen_experts(JsonFields& fields, const ModelConfig& defaults, ModelConfig& config) {
  TERN_ASSIGN_OR_RETURN(config.num_experts, fields.get_int("num_experts", defaults.num_experts));
  TERN_TRY(require_non_negative(fields, "num_experts", config.num_experts));
  TERN_ASSIGN_OR_RETURN(config.num_experts_per_tok,
                        fields.get_int("num_experts_per_tok", defaults.num_experts_per_tok));
  TERN_ASSIGN_OR_RETURN(config.moe_intermediate_size,
                        fields.get_int("moe_intermediate_size", defaults.moe_intermediate_size));
  config.router_scoring = RouterScoring::kSoftmax;
  config.topk_method = "greedy";
  if (config.num_experts == 0) return {};
  TERN_TRY(require_positive(fields, "num_experts_per_tok", config.num_experts_per_tok));
  if (config.num_experts_per_tok > config.num_experts) {
    return make_error("{} is {} but there are only {} experts", fields.where("num_experts_per_tok"),
                      config.num_experts_per_tok, config.num_experts);
  }
  TERN_TRY(require_positive(fields, "moe_intermediate_size", config.moe_intermediate_size));
  return {};
}

Expected<void> read_shared_expert(JsonFields& fields, int64_t fallback, ModelConfig& config) {
  TERN_ASSIGN_OR_RETURN(config.shared_expert_intermediate_size,
                        fields.get_int("shared_expert_intermediate_size", fallback));
  return require_non_negative(fields, "shared_expert_intermediate_size", config.shared_expert_intermediate_size);
}

// Gated DeltaNet sizes (Qwen3Next / Qwen3_5MoeText, same defaults).
Expected<void> read_gated_delta_net(JsonFields& fields, ModelConfig& config) {
  TERN_ASSIGN_OR_RETURN(config.linear_conv_kernel_dim, read_positive(fields, "linear_conv_kernel_dim", 4));
  TERN_ASSIGN_OR_RETURN(config.linear_key_head_dim, read_positive(fields, "linear_key_head_dim", 128));
  TERN_ASSIGN_OR_RETURN(config.linear_value_head_dim, read_positive(fields, "linear_value_head_dim", 128));
  TERN_ASSIGN_OR_RETURN(config.linear_num_key_heads, read_positive(fields, "linear_num_key_heads", 16));
  TERN_ASSIGN_OR_RETURN(config.linear_num_value_heads, read_positive(fields, "linear_num_value_heads", 32));
  if (config.linear_num_value_heads % config.linear_num_key_heads != 0) {
    return make_error("{}: linear_num_value_heads ({}) is not a multiple of linear_num_key_heads ({})",
                      fields.where("linear_num_value_heads"), config.linear_num_value_heads,
                      config.linear_num_key_heads);
  }
  return {};
}

Expected<void> read_qwen_rope(JsonFields& fields, double default_partial, ModelConfig& config) {
  RopeInputs inputs;
  inputs.default_partial_rotary_factor = default_partial;
  inputs.head_dim = config.head_dim;
  inputs.max_position_embeddings = config.max_position_embeddings;
  TERN_ASSIGN_OR_RETURN(config.rope, read_rope(fields, inputs));
  return {};
}

// A dense MLP is built wherever a layer is not MoE; it needs a width.
Expected<void> require_dense_width(const JsonFields& fields, const ModelConfig& config) {
  const bool has_dense =
      std::find(config.moe_layers.begin(), config.moe_layers.end(), false) != config.moe_layers.end();
  if (has_dense && config.intermediate_size <= 0) {
    return make_error("{} must be positive: some layers use the dense MLP", fields.where("intermediate_size"));
  }
  return {};
}

ModelConfig start_config(Architecture architecture, std::string_view model_type) {
  ModelConfig config;
  config.architecture = architecture;
  config.model_type = std::string(model_type);
  return config;
}

}  // namespace

Expected<ModelConfig> parse_qwen3(const nlohmann::json& json, std::string_view source) {
  JsonFields fields(json, source);
  accept_generic_keys(fields);
  fields.accept({"attention_dropout"});
  ModelConfig config = start_config(Architecture::kQwen3, "qwen3");
  const TextDefaults defaults{151936, 4096, 22016, 32, 32, 32, 32768, 1e-6, std::nullopt, std::nullopt};
  TERN_TRY(read_text_basics(fields, defaults, config));
  TERN_TRY(read_head_dim(fields, 128, config));
  TERN_TRY(reject_sliding_window(fields));
  TERN_TRY(read_layer_types(fields, /*allow_linear=*/false, {}, config));
  fill_full_attention_layers(config);
  TERN_TRY(read_qwen_rope(fields, 1.0, config));
  config.attention = AttentionKind::kGqa;
  config.moe_layers.assign(static_cast<size_t>(config.num_hidden_layers), false);
  TERN_TRY(fields.reject_unknown("Qwen3Config"));
  return config;
}

Expected<ModelConfig> parse_qwen3_moe(const nlohmann::json& json, std::string_view source) {
  JsonFields fields(json, source);
  accept_generic_keys(fields);
  fields.accept({"attention_dropout", "router_aux_loss_coef", "output_router_logits"});
  ModelConfig config = start_config(Architecture::kQwen3Moe, "qwen3_moe");
  const TextDefaults defaults{151936, 2048, 6144, 24, 32, 4, 32768, 1e-6, std::nullopt, std::nullopt};
  TERN_TRY(read_text_basics(fields, defaults, config));
  TERN_TRY(read_head_dim(fields, 0, config));
  TERN_TRY(reject_sliding_window(fields));
  TERN_TRY(read_layer_types(fields, /*allow_linear=*/false, {}, config));
  fill_full_attention_layers(config);
  TERN_TRY(read_qwen_rope(fields, 1.0, config));
  ModelConfig moe_defaults;
  moe_defaults.num_experts = 128;
  moe_defaults.num_experts_per_tok = 8;
  moe_defaults.moe_intermediate_size = 768;
  // attribute_map: num_experts <-> num_local_experts.
  if (fields.has("num_local_experts") && !fields.has("num_experts")) {
    TERN_ASSIGN_OR_RETURN(moe_defaults.num_experts, fields.get_int("num_local_experts", 128));
  }
  fields.accept({"num_local_experts"});
  TERN_TRY(read_qwen_experts(fields, moe_defaults, config));
  TERN_ASSIGN_OR_RETURN(config.norm_topk_prob, fields.get_bool("norm_topk_prob", false));
  TERN_TRY(derive_qwen_moe_layers(fields, config));
  TERN_TRY(require_dense_width(fields, config));
  TERN_TRY(fields.reject_unknown("Qwen3MoeConfig"));
  return config;
}

Expected<ModelConfig> parse_qwen3_next(const nlohmann::json& json, std::string_view source) {
  JsonFields fields(json, source);
  accept_generic_keys(fields);
  fields.accept({"attention_dropout", "router_aux_loss_coef", "output_router_logits"});
  ModelConfig config = start_config(Architecture::kQwen3Next, "qwen3_next");
  const TextDefaults defaults{151936, 2048, 5632, 48, 16, 2, 32768, 1e-6, std::nullopt, std::nullopt};
  TERN_TRY(read_text_basics(fields, defaults, config));
  TERN_TRY(read_head_dim(fields, 256, config));
  TERN_TRY(reject_sliding_window(fields));
  TERN_TRY(derive_hybrid_layer_types(fields, config));
  TERN_TRY(read_qwen_rope(fields, 0.25, config));
  TERN_TRY(read_gated_delta_net(fields, config));
  ModelConfig moe_defaults;
  moe_defaults.num_experts = 512;
  moe_defaults.num_experts_per_tok = 10;
  moe_defaults.moe_intermediate_size = 512;
  TERN_TRY(read_qwen_experts(fields, moe_defaults, config));
  TERN_TRY(read_shared_expert(fields, 512, config));
  TERN_ASSIGN_OR_RETURN(config.norm_topk_prob, fields.get_bool("norm_topk_prob", true));
  TERN_TRY(derive_qwen_moe_layers(fields, config));
  TERN_TRY(require_dense_width(fields, config));
  // Not a transformers field; vLLM's Qwen3-Next MTP reads it.
  TERN_ASSIGN_OR_RETURN(config.num_mtp_layers, fields.get_int("num_nextn_predict_layers", 0));
  TERN_TRY(require_non_negative(fields, "num_nextn_predict_layers", config.num_mtp_layers));
  config.attention = AttentionKind::kGatedGqa;
  TERN_TRY(fields.reject_unknown("Qwen3NextConfig"));
  return config;
}

namespace {

// Qwen3_5MoeTextConfig. Every layer is MoE and the top-k is always renormalised (the class drops
// intermediate_size, decoder_sparse_step, mlp_only_layers and norm_topk_prob).
Expected<void> parse_qwen35_text(JsonFields& fields, ModelConfig& config) {
  accept_generic_keys(fields);
  fields.accept({"attention_dropout", "router_aux_loss_coef", "output_router_logits", "mamba_ssm_dtype",
                 "mtp_use_dedicated_embeddings"});
  const TextDefaults defaults{248320, 2048, 0, 40, 16, 2, 32768, 1e-6, std::nullopt, std::nullopt};
  TERN_TRY(read_text_basics(fields, defaults, config));
  TERN_TRY(read_head_dim(fields, 256, config));
  TERN_TRY(derive_hybrid_layer_types(fields, config));
  TERN_TRY(read_qwen_rope(fields, 0.25, config));
  TERN_TRY(read_gated_delta_net(fields, config));
  ModelConfig moe_defaults;
  moe_defaults.num_experts = 256;
  moe_defaults.num_experts_per_tok = 8;
  moe_defaults.moe_intermediate_size = 512;
  TERN_TRY(read_qwen_experts(fields, moe_defaults, config));
  TERN_TRY(require_positive(fields, "num_experts", config.num_experts));
  TERN_TRY(read_shared_expert(fields, 512, config));
  config.norm_topk_prob = true;
  config.moe_layers.assign(static_cast<size_t>(config.num_hidden_layers), true);
  // Checkpoint keys read by vLLM's Qwen3.5: the output gate (default on) and the MTP depth.
  TERN_ASSIGN_OR_RETURN(const bool gated, fields.get_bool("attn_output_gate", true));
  config.attention = gated ? AttentionKind::kGatedGqa : AttentionKind::kGqa;
  TERN_ASSIGN_OR_RETURN(config.num_mtp_layers, fields.get_int("mtp_num_hidden_layers", 0));
  TERN_TRY(require_non_negative(fields, "mtp_num_hidden_layers", config.num_mtp_layers));
  return fields.reject_unknown("Qwen3_5MoeTextConfig");
}

Expected<void> check_text_model_type(JsonFields& text) {
  TERN_ASSIGN_OR_RETURN(const std::optional<std::string> type, text.get_optional_string("model_type"));
  if (type && *type != "qwen3_5_moe_text") {
    return make_error("{} is '{}', expected 'qwen3_5_moe_text'", text.where("model_type"), *type);
  }
  return {};
}

// Top-level token ids and tie_word_embeddings may repeat the text config's; different values are contradictory.
Expected<void> merge_top_level(JsonFields& top, const JsonFields& text, ModelConfig& config) {
  for (const char* key : {"tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id"}) {
    const nlohmann::json* outer = top.peek(key);
    const nlohmann::json* inner = text.peek(key);
    if (outer != nullptr && inner != nullptr && !outer->is_null() && !inner->is_null() && *outer != *inner) {
      return make_error("{} contradicts {}", top.where(key), text.where(key));
    }
  }
  TERN_ASSIGN_OR_RETURN(const std::optional<bool> tie, top.get_optional_bool("tie_word_embeddings"));
  if (tie) config.tie_word_embeddings = *tie;
  ModelConfig outer;
  TERN_TRY(read_token_ids(top, TextDefaults{}, outer));
  if (!text.has_value("eos_token_id") && !outer.eos_token_ids.empty()) config.eos_token_ids = outer.eos_token_ids;
  if (!text.has_value("bos_token_id") && outer.bos_token_id) config.bos_token_id = outer.bos_token_id;
  if (!text.has_value("pad_token_id") && outer.pad_token_id) config.pad_token_id = outer.pad_token_id;
  return {};
}

}  // namespace

// Qwen3_5MoeConfig: text_config (served) + vision_config (present even when absent from the file, as HF builds a
// default one) + the multimodal token ids.
Expected<ModelConfig> parse_qwen35_moe(const nlohmann::json& json, std::string_view source) {
  JsonFields top(json, source);
  accept_generic_keys(top);
  top.accept({"image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"});
  const nlohmann::json* vision = top.get_raw("vision_config");
  if (vision != nullptr && !vision->is_null() && !vision->is_object()) {
    return make_error("{} must be an object, got {}", top.where("vision_config"), json_type_name(*vision));
  }
  const nlohmann::json* text_json = top.get_raw("text_config");
  if (text_json != nullptr && !text_json->is_null() && !text_json->is_object()) {
    return make_error("{} must be an object, got {}", top.where("text_config"), json_type_name(*text_json));
  }
  static const nlohmann::json kEmpty = nlohmann::json::object();
  JsonFields text(text_json != nullptr && text_json->is_object() ? *text_json : kEmpty, source, "text_config.");
  TERN_TRY(check_text_model_type(text));
  ModelConfig config = start_config(Architecture::kQwen35Moe, "qwen3_5_moe");
  config.has_vision = true;
  TERN_TRY(parse_qwen35_text(text, config));
  TERN_TRY(merge_top_level(top, text, config));
  TERN_TRY(top.reject_unknown("Qwen3_5MoeConfig"));
  return config;
}

// A bare Qwen3_5MoeTextConfig (a text-only export).
Expected<ModelConfig> parse_qwen35_moe_text_only(const nlohmann::json& json, std::string_view source) {
  JsonFields fields(json, source);
  ModelConfig config = start_config(Architecture::kQwen35Moe, "qwen3_5_moe_text");
  TERN_TRY(parse_qwen35_text(fields, config));
  return config;
}

}  // namespace tern::config_detail
