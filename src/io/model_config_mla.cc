// deepseek_v3 and glm_moe_dsa configs: MLA attention, sigmoid-scored grouped routing, and (GLM) the DSA indexer.
// Defaults are transformers v5 DeepseekV3Config and GlmMoeDsaConfig. Published checkpoints also carry keys the HF
// classes lack but vLLM's DeepseekV2 family reads (scoring_func, topk_method, moe_layer_freq,
// num_nextn_predict_layers, rope_interleave, indexer_rope_interleave); those are read with vLLM's meaning.
#include "io/model_config_internal.h"

namespace tern::config_detail {

namespace {

struct MlaDefaults {
  int64_t n_routed_experts = 256;
  int64_t n_shared_experts = 1;
  double routed_scaling_factor = 2.5;
  int64_t kv_lora_rank = 512;
  int64_t q_lora_rank = 0;
  int64_t qk_rope_head_dim = 64;
  int64_t qk_nope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  int64_t num_experts_per_tok = 8;
  int64_t first_k_dense_replace = 3;
  int64_t moe_intermediate_size = 2048;
  int64_t num_mtp_layers = 0;
};

// Keys present in DeepSeek-V3 / GLM-5 config.json files that only matter for training or expert parallelism.
void accept_mla_extras(JsonFields& fields) {
  accept_generic_keys(fields);
  fields.accept({"attention_dropout", "pretraining_tp", "aux_loss_alpha", "seq_aux", "ep_size"});
}

// One value under several names (HF attribute_map aliases); different values are contradictory.
Expected<int64_t> read_aliased_int(JsonFields& fields, std::initializer_list<std::string_view> keys, int64_t fallback) {
  std::optional<int64_t> value;
  std::string_view first_key;
  for (std::string_view key : keys) {
    TERN_ASSIGN_OR_RETURN(const std::optional<int64_t> v, fields.get_optional_int(key));
    if (!v) continue;
    if (value && *value != *v)
      return make_error("{} is {} but {} is {}", fields.where(first_key), *value, fields.where(key), *v);
    if (!value) first_key = key;
    value = v;
  }
  return value.value_or(fallback);
}

Expected<void> read_mla_attention(JsonFields& fields, const MlaDefaults& d, ModelConfig& config) {
  TERN_ASSIGN_OR_RETURN(config.kv_lora_rank, read_positive(fields, "kv_lora_rank", d.kv_lora_rank));
  // q_lora_rank: null means no query LoRA (q_proj instead of q_a_proj / q_b_proj).
  TERN_ASSIGN_OR_RETURN(const std::optional<int64_t> q_lora, fields.get_optional_int("q_lora_rank"));
  config.q_lora_rank = fields.has("q_lora_rank") ? q_lora.value_or(0) : d.q_lora_rank;
  TERN_TRY(require_non_negative(fields, "q_lora_rank", config.q_lora_rank));
  TERN_ASSIGN_OR_RETURN(config.qk_rope_head_dim, read_positive(fields, "qk_rope_head_dim", d.qk_rope_head_dim));
  TERN_ASSIGN_OR_RETURN(config.qk_nope_head_dim, read_positive(fields, "qk_nope_head_dim", d.qk_nope_head_dim));
  TERN_ASSIGN_OR_RETURN(config.v_head_dim, read_positive(fields, "v_head_dim", d.v_head_dim));
  config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim;
  // transformers v5 writes its derived qk_head_dim into config.json; it must agree with its parts.
  TERN_ASSIGN_OR_RETURN(const std::optional<int64_t> written_qk, fields.get_optional_int("qk_head_dim"));
  if (written_qk && *written_qk != config.qk_head_dim) {
    return make_error("{} is {}, but qk_nope_head_dim + qk_rope_head_dim is {}", fields.where("qk_head_dim"),
                      *written_qk, config.qk_head_dim);
  }
  // HF sets head_dim = qk_rope_head_dim whatever the file says; a written head_dim must be one of the two widths
  // the exporters use for it.
  TERN_ASSIGN_OR_RETURN(const std::optional<int64_t> written, fields.get_optional_int("head_dim"));
  if (written && *written != config.qk_rope_head_dim && *written != config.qk_head_dim) {
    return make_error("{} is {}, neither qk_rope_head_dim ({}) nor qk_nope_head_dim + qk_rope_head_dim ({})",
                      fields.where("head_dim"), *written, config.qk_rope_head_dim, config.qk_head_dim);
  }
  config.head_dim = config.qk_rope_head_dim;
  config.attention = AttentionKind::kMla;
  TERN_ASSIGN_OR_RETURN(const bool interleave, fields.get_bool("rope_interleave", true));
  RopeInputs inputs;
  inputs.head_dim = config.qk_rope_head_dim;
  inputs.max_position_embeddings = config.max_position_embeddings;
  inputs.interleaved = interleave;
  TERN_ASSIGN_OR_RETURN(config.rope, read_rope(fields, inputs));
  return {};
}

Expected<void> read_router(JsonFields& fields, ModelConfig& config) {
  TERN_ASSIGN_OR_RETURN(const std::string scoring, fields.get_string("scoring_func", "sigmoid"));
  if (scoring != "sigmoid" && scoring != "softmax") {
    return make_error("{} is '{}' (supported: sigmoid, softmax)", fields.where("scoring_func"), scoring);
  }
  config.router_scoring = scoring == "sigmoid" ? RouterScoring::kSigmoid : RouterScoring::kSoftmax;
  TERN_ASSIGN_OR_RETURN(config.topk_method, fields.get_string("topk_method", "noaux_tc"));
  if (config.topk_method != "noaux_tc" && config.topk_method != "greedy" &&
      config.topk_method != "group_limited_greedy") {
    return make_error("{} is '{}' (supported: noaux_tc, greedy, group_limited_greedy)", fields.where("topk_method"),
                      config.topk_method);
  }
  TERN_ASSIGN_OR_RETURN(config.routed_scaling_factor, fields.get_double("routed_scaling_factor", 2.5));
  if (!(config.routed_scaling_factor > 0.0)) {
    return make_error("{} must be positive, got {}", fields.where("routed_scaling_factor"),
                      config.routed_scaling_factor);
  }
  return {};
}

// Grouped top-k: E experts in n_group groups, topk_group groups kept, k experts chosen among the kept groups.
Expected<void> check_expert_groups(const JsonFields& fields, const ModelConfig& c) {
  if (c.num_experts_per_tok > c.num_experts) {
    return make_error("{} is {} but there are only {} experts", fields.where("num_experts_per_tok"),
                      c.num_experts_per_tok, c.num_experts);
  }
  if (c.num_experts % c.n_group != 0) {
    return make_error("{}: {} experts do not split into {} groups", fields.where("n_group"), c.num_experts, c.n_group);
  }
  if (c.topk_group > c.n_group) {
    return make_error("{} is {} but there are only {} groups", fields.where("topk_group"), c.topk_group, c.n_group);
  }
  if (c.num_experts_per_tok > c.topk_group * (c.num_experts / c.n_group)) {
    return make_error("{}: {} experts per token cannot come from {} groups of {}", fields.where("num_experts_per_tok"),
                      c.num_experts_per_tok, c.topk_group, c.num_experts / c.n_group);
  }
  return {};
}

Expected<void> read_mla_experts(JsonFields& fields, const MlaDefaults& d, ModelConfig& config) {
  // attribute_map num_local_experts -> n_routed_experts; GLM also accepts num_experts for backward compatibility.
  TERN_ASSIGN_OR_RETURN(
      config.num_experts,
      read_aliased_int(fields, {"n_routed_experts", "num_local_experts", "num_experts"}, d.n_routed_experts));
  TERN_TRY(require_positive(fields, "n_routed_experts", config.num_experts));
  TERN_ASSIGN_OR_RETURN(config.n_shared_experts, fields.get_int("n_shared_experts", d.n_shared_experts));
  TERN_TRY(require_non_negative(fields, "n_shared_experts", config.n_shared_experts));
  TERN_ASSIGN_OR_RETURN(config.num_experts_per_tok,
                        read_positive(fields, "num_experts_per_tok", d.num_experts_per_tok));
  TERN_ASSIGN_OR_RETURN(config.n_group, read_positive(fields, "n_group", d.n_group));
  TERN_ASSIGN_OR_RETURN(config.topk_group, read_positive(fields, "topk_group", d.topk_group));
  TERN_TRY(check_expert_groups(fields, config));
  TERN_ASSIGN_OR_RETURN(config.moe_intermediate_size,
                        read_positive(fields, "moe_intermediate_size", d.moe_intermediate_size));
  TERN_ASSIGN_OR_RETURN(config.norm_topk_prob, fields.get_bool("norm_topk_prob", true));
  TERN_ASSIGN_OR_RETURN(config.first_k_dense_replace, fields.get_int("first_k_dense_replace", d.first_k_dense_replace));
  TERN_TRY(require_non_negative(fields, "first_k_dense_replace", config.first_k_dense_replace));
  TERN_ASSIGN_OR_RETURN(const int64_t freq, read_positive(fields, "moe_layer_freq", 1));
  // vLLM DeepseekV2DecoderLayer: MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0 (HF's rule when the
  // frequency is 1).
  config.moe_layers.clear();
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    config.moe_layers.push_back(i >= config.first_k_dense_replace && i % freq == 0);
  }
  TERN_ASSIGN_OR_RETURN(config.num_mtp_layers,
                        read_aliased_int(fields, {"num_nextn_predict_layers", "num_mtp_layers"}, d.num_mtp_layers));
  TERN_TRY(require_non_negative(fields, "num_nextn_predict_layers", config.num_mtp_layers));
  return read_router(fields, config);
}

Expected<ModelConfig> parse_mla_common(JsonFields& fields, Architecture architecture, const TextDefaults& text,
                                       const MlaDefaults& mla) {
  ModelConfig config;
  config.architecture = architecture;
  config.model_type = std::string(architecture_name(architecture));
  TERN_TRY(read_text_basics(fields, text, config));
  TERN_TRY(read_mla_attention(fields, mla, config));
  TERN_TRY(read_mla_experts(fields, mla, config));
  return config;
}

// GLM's mlp_layer_types ("dense"/"sparse"), when written, must agree with first_k_dense_replace / moe_layer_freq,
// which vLLM uses instead.
Expected<void> check_mlp_layer_types(JsonFields& fields, const ModelConfig& config) {
  std::vector<std::string> types;
  TERN_ASSIGN_OR_RETURN(const bool present, fields.get_string_list("mlp_layer_types", types));
  if (!present) return {};
  if (static_cast<int64_t>(types.size()) != config.num_hidden_layers) {
    return make_error("{} has {} entries but num_hidden_layers is {}", fields.where("mlp_layer_types"), types.size(),
                      config.num_hidden_layers);
  }
  for (size_t i = 0; i < types.size(); ++i) {
    const std::string& type = types[i];
    if (type != "dense" && type != "sparse") {
      return make_error("{} is '{}' (expected dense or sparse)", fields.where("mlp_layer_types", i), type);
    }
    if ((type == "sparse") != config.moe_layers[i]) {
      return make_error("{} is '{}', which contradicts first_k_dense_replace = {}", fields.where("mlp_layer_types", i),
                        type, config.first_k_dense_replace);
    }
  }
  return {};
}

// Per-layer indexer mode (GlmMoeDsaConfig.__post_init__): indexer_types as written, else index_topk_pattern
// ("F"/"S" per layer), else layer i is full iff max(i - index_skip_topk_offset + 1, 0) % max(index_topk_freq, 1) == 0.
Expected<std::vector<std::string>> indexer_type_names(JsonFields& fields, int64_t n_layers) {
  std::vector<std::string> names;
  TERN_ASSIGN_OR_RETURN(const bool written, fields.get_string_list("indexer_types", names));
  const nlohmann::json* pattern = fields.get_raw("index_topk_pattern");
  TERN_ASSIGN_OR_RETURN(const int64_t freq_raw, fields.get_int("index_topk_freq", 1));
  TERN_ASSIGN_OR_RETURN(const int64_t offset, fields.get_int("index_skip_topk_offset", 2));
  if (written) return names;
  if (pattern != nullptr && pattern->is_string()) {
    for (const char c : pattern->get<std::string>()) {
      if (c != 'F' && c != 'S') return make_error("{} may hold only 'F' and 'S'", fields.where("index_topk_pattern"));
      names.emplace_back(c == 'F' ? "full" : "shared");
    }
    return names;
  }
  if (pattern != nullptr && !pattern->is_null()) {
    TERN_TRY(fields.get_string_list("index_topk_pattern", names));
    return names;
  }
  const int64_t freq = std::max<int64_t>(freq_raw, 1);
  for (int64_t i = 0; i < n_layers; ++i) {
    names.emplace_back(std::max<int64_t>(i - offset + 1, 0) % freq == 0 ? "full" : "shared");
  }
  return names;
}

Expected<void> read_indexer(JsonFields& fields, ModelConfig& config) {
  TERN_ASSIGN_OR_RETURN(config.index_topk, read_positive(fields, "index_topk", 2048));
  TERN_ASSIGN_OR_RETURN(config.index_head_dim, read_positive(fields, "index_head_dim", 128));
  TERN_ASSIGN_OR_RETURN(config.index_n_heads, read_positive(fields, "index_n_heads", 32));
  if (config.index_head_dim < config.qk_rope_head_dim) {
    return make_error("{} ({}) is smaller than qk_rope_head_dim ({}), the part of it RoPE rotates",
                      fields.where("index_head_dim"), config.index_head_dim, config.qk_rope_head_dim);
  }
  // vLLM: is_neox_style = not indexer_rope_interleave (GLM-5's config.json: true). transformers (5.17) always
  // rotates GLM's indexer interleaved and reads no such key, so a config without it is interleaved too.
  TERN_ASSIGN_OR_RETURN(config.indexer_rope_interleave, fields.get_bool("indexer_rope_interleave", true));
  TERN_ASSIGN_OR_RETURN(const auto names, indexer_type_names(fields, config.num_hidden_layers));
  if (static_cast<int64_t>(names.size()) != config.num_hidden_layers) {
    return make_error("{}: {} indexer types for {} layers", fields.where("indexer_types"), names.size(),
                      config.num_hidden_layers);
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] != "full" && names[i] != "shared") {
      return make_error("{} is '{}' (expected full or shared)", fields.where("indexer_types", i), names[i]);
    }
    if (i == 0 && names[i] == "shared") {
      return make_error("{} is 'shared' but no earlier layer computes a top-k to share",
                        fields.where("indexer_types", 0));
    }
    config.indexer_types.push_back(names[i] == "full" ? IndexerType::kFull : IndexerType::kShared);
  }
  return {};
}

}  // namespace

Expected<ModelConfig> parse_deepseek_v3(const nlohmann::json& json, std::string_view source) {
  JsonFields fields(json, source);
  accept_mla_extras(fields);
  const TextDefaults text{129280, 7168, 18432, 61, 128, 128, 4096, 1e-6, 0, 1};
  MlaDefaults mla;
  mla.q_lora_rank = 1536;
  mla.qk_nope_head_dim = 128;
  mla.v_head_dim = 128;
  mla.n_group = 8;
  mla.topk_group = 4;
  mla.num_mtp_layers = 1;
  TERN_ASSIGN_OR_RETURN(ModelConfig config, parse_mla_common(fields, Architecture::kDeepseekV3, text, mla));
  fill_full_attention_layers(config);
  TERN_TRY(fields.reject_unknown("DeepseekV3Config"));
  return config;
}

Expected<ModelConfig> parse_glm_moe_dsa(const nlohmann::json& json, std::string_view source) {
  JsonFields fields(json, source);
  accept_mla_extras(fields);
  const TextDefaults text{154880, 6144, 12288, 78, 64, 64, 202752, 1e-5, 0, 1};
  MlaDefaults mla;
  mla.q_lora_rank = 2048;
  mla.qk_nope_head_dim = 192;
  mla.v_head_dim = 256;
  TERN_ASSIGN_OR_RETURN(ModelConfig config, parse_mla_common(fields, Architecture::kGlmMoeDsa, text, mla));
  TERN_ASSIGN_OR_RETURN(const bool mlp_bias, fields.get_bool("mlp_bias", false));
  if (mlp_bias) return make_error("{} is true; MLP biases are not supported", fields.where("mlp_bias"));
  TERN_TRY(check_mlp_layer_types(fields, config));
  TERN_TRY(read_layer_types(fields, /*allow_linear=*/false, {"deepseek_sparse_attention"}, config));
  fill_full_attention_layers(config);
  TERN_TRY(read_indexer(fields, config));
  TERN_TRY(fields.reject_unknown("GlmMoeDsaConfig"));
  return config;
}

}  // namespace tern::config_detail
