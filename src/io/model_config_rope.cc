// RoPE settings as transformers v5 standardises them (modeling_rope_utils.py, RotaryEmbeddingConfigMixin):
// the dict is `rope_scaling or rope_parameters`; a top-level rope_theta / partial_rotary_factor fills in what the
// dict lacks; rope_type falls back to the legacy "type" key, then "default"; yarn/llama3 take
// original_max_position_embeddings from max_position_embeddings when absent. The rotary width is
// int(head_dim * partial_rotary_factor) as in _compute_default_rope_parameters.
#include <cmath>

#include "io/model_config_internal.h"

namespace tern::config_detail {

namespace {

// Picks the RoPE dict. HF silently prefers rope_scaling; two different non-empty dicts are contradictory here.
Expected<const nlohmann::json*> pick_rope_dict(JsonFields& fields, std::string& key) {
  const nlohmann::json* parameters = fields.get_raw("rope_parameters");
  const nlohmann::json* scaling = fields.get_raw("rope_scaling");
  for (const auto& [name, value] : {std::pair{"rope_parameters", parameters}, std::pair{"rope_scaling", scaling}}) {
    if (value != nullptr && !value->is_null() && !value->is_object()) {
      return make_error("{} must be an object, got {}", fields.where(name), json_type_name(*value));
    }
  }
  const bool has_parameters = parameters != nullptr && parameters->is_object() && !parameters->empty();
  const bool has_scaling = scaling != nullptr && scaling->is_object() && !scaling->empty();
  if (has_parameters && has_scaling && *parameters != *scaling) {
    return make_error("{}: rope_parameters and rope_scaling are both set and disagree", fields.where("rope_scaling"));
  }
  key = has_scaling ? "rope_scaling" : "rope_parameters";
  if (has_scaling) return scaling;
  return has_parameters ? parameters : nullptr;
}

// A value that may sit in the RoPE dict or (legacy) at the top level; both present and different is an error.
Expected<double> read_dict_or_top(JsonFields& rope, JsonFields& top, std::string_view key, double fallback) {
  TERN_ASSIGN_OR_RETURN(const std::optional<double> in_dict, rope.get_optional_double(key));
  TERN_ASSIGN_OR_RETURN(const std::optional<double> at_top, top.get_optional_double(key));
  if (in_dict && at_top && *in_dict != *at_top) {
    return make_error("{} is {} but {} is {}", rope.where(key), *in_dict, top.where(key), *at_top);
  }
  if (in_dict) return *in_dict;
  return at_top.value_or(fallback);
}

Expected<std::string> read_rope_type(JsonFields& rope) {
  TERN_ASSIGN_OR_RETURN(const std::optional<std::string> rope_type, rope.get_optional_string("rope_type"));
  TERN_ASSIGN_OR_RETURN(const std::optional<std::string> legacy_type, rope.get_optional_string("type"));
  if (rope_type && legacy_type && *rope_type != *legacy_type) {
    return make_error("{} is '{}' but {} is '{}'", rope.where("rope_type"), *rope_type, rope.where("type"),
                      *legacy_type);
  }
  std::string type = rope_type ? *rope_type : legacy_type.value_or("default");
  if (type != "default" && type != "linear" && type != "dynamic" && type != "yarn" && type != "llama3") {
    return make_error("{} is '{}', which tern does not support (supported: default, linear, dynamic, yarn, llama3)",
                      rope.where(rope_type ? "rope_type" : "type"), type);
  }
  return type;
}

// The scaling fields of linear / dynamic / yarn / llama3 RoPE.
Expected<void> read_rope_scaling(JsonFields& rope, const RopeInputs& inputs, RopeConfig& out) {
  if (out.type == "default") return {};
  TERN_ASSIGN_OR_RETURN(const std::optional<double> factor, rope.get_optional_double("factor"));
  if (!factor) return make_error("{}: rope_type '{}' requires it", rope.where("factor"), out.type);
  if (!(*factor >= 1.0)) return make_error("{} must be >= 1, got {}", rope.where("factor"), *factor);
  out.factor = *factor;
  if (out.type != "yarn" && out.type != "llama3") return {};
  TERN_ASSIGN_OR_RETURN(out.original_max_position_embeddings,
                        rope.get_int("original_max_position_embeddings", inputs.max_position_embeddings));
  TERN_TRY(require_positive(rope, "original_max_position_embeddings", out.original_max_position_embeddings));
  if (out.type == "llama3") {
    TERN_ASSIGN_OR_RETURN(out.low_freq_factor, rope.get_double("low_freq_factor", 1.0));
    TERN_ASSIGN_OR_RETURN(out.high_freq_factor, rope.get_double("high_freq_factor", 4.0));
    return {};
  }
  TERN_ASSIGN_OR_RETURN(out.attention_factor, rope.get_optional_double("attention_factor"));
  // HF reads these with `or`, so null and 0 also mean the defaults 32 / 1.
  TERN_ASSIGN_OR_RETURN(const std::optional<double> beta_fast, rope.get_optional_double("beta_fast"));
  TERN_ASSIGN_OR_RETURN(const std::optional<double> beta_slow, rope.get_optional_double("beta_slow"));
  out.beta_fast = beta_fast && *beta_fast != 0.0 ? *beta_fast : 32.0;
  out.beta_slow = beta_slow && *beta_slow != 0.0 ? *beta_slow : 1.0;
  TERN_ASSIGN_OR_RETURN(out.mscale, rope.get_optional_double("mscale"));
  TERN_ASSIGN_OR_RETURN(out.mscale_all_dim, rope.get_optional_double("mscale_all_dim"));
  TERN_ASSIGN_OR_RETURN(out.truncate, rope.get_bool("truncate", true));
  return {};
}

Expected<void> read_mrope(JsonFields& rope, RopeConfig& out) {
  std::vector<int64_t> section;
  TERN_ASSIGN_OR_RETURN(const bool present, rope.get_int_list("mrope_section", section));
  TERN_ASSIGN_OR_RETURN(out.mrope_interleaved, rope.get_bool("mrope_interleaved", false));
  if (!present) return {};
  int64_t total = 0;
  for (const int64_t s : section) {
    if (s < 0 || s > out.rotary_dim) return make_error("{} has an invalid entry {}", rope.where("mrope_section"), s);
    total += s;
  }
  if (total * 2 != out.rotary_dim) {
    return make_error("{} sums to {} but the rotary dimension {} needs {} frequencies", rope.where("mrope_section"),
                      total, out.rotary_dim, out.rotary_dim / 2);
  }
  out.mrope_section = std::move(section);
  return {};
}

}  // namespace

Expected<RopeConfig> read_rope(JsonFields& fields, const RopeInputs& inputs) {
  std::string dict_key;
  TERN_ASSIGN_OR_RETURN(const nlohmann::json* dict, pick_rope_dict(fields, dict_key));
  static const nlohmann::json kEmpty = nlohmann::json::object();
  JsonFields rope(dict != nullptr ? *dict : kEmpty, fields.source(), fields.path(dict_key) + ".");
  RopeConfig out;
  out.interleaved = inputs.interleaved;
  TERN_ASSIGN_OR_RETURN(out.theta, read_dict_or_top(rope, fields, "rope_theta", inputs.default_theta));
  if (!(out.theta > 0.0)) return make_error("{} must be positive, got {}", rope.where("rope_theta"), out.theta);
  TERN_ASSIGN_OR_RETURN(out.partial_rotary_factor,
                        read_dict_or_top(rope, fields, "partial_rotary_factor", inputs.default_partial_rotary_factor));
  if (!(out.partial_rotary_factor > 0.0 && out.partial_rotary_factor <= 1.0)) {
    return make_error("{} must be in (0, 1], got {}", rope.where("partial_rotary_factor"), out.partial_rotary_factor);
  }
  out.rotary_dim = static_cast<int64_t>(std::trunc(static_cast<double>(inputs.head_dim) * out.partial_rotary_factor));
  if (out.rotary_dim <= 0 || out.rotary_dim % 2 != 0) {
    return make_error(
        "{}: head_dim {} x partial_rotary_factor {} gives a rotary dimension of {}, which is not a "
        "positive even number",
        rope.where("partial_rotary_factor"), inputs.head_dim, out.partial_rotary_factor, out.rotary_dim);
  }
  TERN_ASSIGN_OR_RETURN(out.type, read_rope_type(rope));
  TERN_TRY(read_rope_scaling(rope, inputs, out));
  TERN_TRY(read_mrope(rope, out));
  TERN_TRY(rope.reject_unknown(fmt::format("the '{}' RoPE parameters", out.type)));
  return out;
}

}  // namespace tern::config_detail
