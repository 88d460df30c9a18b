// Parsing follows vLLM's ModelOptQuantConfigBase.from_config and ModelOptNvFp4Config._from_config
// (vllm/model_executor/layers/quantization/modelopt.py); exclusion follows ModelOptQuantConfigBase.is_layer_excluded,
// apply_vllm_mapper and utils/quant_utils.py is_layer_skipped. The code is written from their behaviour.
#include "io/quant_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>

#include "core/json_parse.h"
#include "io/json_fields.h"

namespace tern {

namespace {

constexpr std::string_view kHfQuantSource = "hf_quant_config.json";
constexpr std::string_view kConfigJsonSource = "config.json quantization_config";

// vLLM QUANT_ALGOS and KV_CACHE_QUANT_ALGOS.
const std::vector<std::string_view> kQuantAlgos = {
    "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION"};
const std::vector<std::string_view> kKvCacheAlgos = {"FP8", "NVFP4"};

std::string to_upper(std::string text) {
  for (char& c : text) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return text;
}

bool contains(const std::vector<std::string_view>& list, std::string_view value) {
  return std::find(list.begin(), list.end(), value) != list.end();
}

std::string join(const std::vector<std::string_view>& list) {
  std::string out;
  for (std::string_view item : list) out += (out.empty() ? "" : ", ") + std::string(item);
  return out;
}

bool is_nvfp4_algo(std::string_view algo) {
  return algo.find("NVFP4") != std::string_view::npos;
}
bool is_weight_only_algo(std::string_view algo) {
  return algo == "W4A16_NVFP4" || algo == "FP8_PB_WO";
}

Expected<std::string> read_quant_algo(JsonFields& fields, std::string_view key) {
  TERN_ASSIGN_OR_RETURN(const std::optional<std::string> algo, fields.get_optional_string(key));
  if (!algo || algo->empty()) return make_error("{}: missing field '{}'", fields.source(), fields.path(key));
  std::string upper = to_upper(*algo);
  if (!contains(kQuantAlgos, upper)) {
    return make_error("{} is '{}', which is not a supported ModelOpt algorithm (supported: {})", fields.where(key),
                      *algo, join(kQuantAlgos));
  }
  return upper;
}

Expected<std::string> read_kv_cache_algo(JsonFields& fields) {
  TERN_ASSIGN_OR_RETURN(const std::optional<std::string> algo, fields.get_optional_string("kv_cache_quant_algo"));
  if (!algo) return std::string();
  std::string upper = to_upper(*algo);
  if (!contains(kKvCacheAlgos, upper)) {
    return make_error("{} is '{}' (supported: {})", fields.where("kv_cache_quant_algo"), *algo, join(kKvCacheAlgos));
  }
  return upper;
}

// group_size as vLLM reads it: an integer, or what int() turns into one (a decimal string; an integral float).
Expected<std::optional<int64_t>> read_group_size(JsonFields& fields) {
  const nlohmann::json* raw = fields.get_raw("group_size");
  if (raw == nullptr || raw->is_null()) return std::optional<int64_t>();
  std::optional<int64_t> value;
  if (raw->is_string()) {
    const std::string text = raw->get<std::string>();
    const bool digits = !text.empty() && text.size() < 18 &&
                        std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
    if (digits) value = std::stoll(text);
  } else if (raw->is_number_integer()) {
    value = raw->get<int64_t>();
  } else if (raw->is_number_float()) {
    const double number = raw->get<double>();
    if (number == std::floor(number) && std::abs(number) < 1e15) value = static_cast<int64_t>(number);
  }
  if (!value || *value <= 0) {
    return make_error("{} must be a positive integer, got {}", fields.where("group_size"), raw->dump());
  }
  return value;
}

Expected<void> read_exclude_list(JsonFields& fields, std::string_view key, QuantConfig& config) {
  const nlohmann::json* raw = fields.peek(key);
  if (raw != nullptr && !raw->is_null() && !raw->is_array()) {
    return make_error("{} must be a list, got {}", fields.where(key), json_type_name(*raw));
  }
  TERN_TRY(fields.get_string_list(key, config.exclude_modules));
  return {};
}

// MIXED_PRECISION: {"module": {"quant_algo": "NVFP4", "group_size": 16}, ...}.
Expected<void> read_quantized_layers(JsonFields& fields, QuantConfig& config) {
  const nlohmann::json* layers = fields.get_raw("quantized_layers");
  if (layers == nullptr || layers->is_null()) return {};
  if (!layers->is_object()) {
    return make_error("{} must be an object, got {}", fields.where("quantized_layers"), json_type_name(*layers));
  }
  std::set<int64_t> group_sizes;
  for (const auto& [module, entry] : layers->items()) {
    JsonFields layer(entry, fields.source(), fields.path("quantized_layers") + "." + module + ".");
    if (!entry.is_object()) return make_error("{} must be an object", fields.where("quantized_layers." + module));
    TERN_ASSIGN_OR_RETURN(std::string algo, read_quant_algo(layer, "quant_algo"));
    if (algo == "MIXED_PRECISION") return make_error("{} cannot itself be MIXED_PRECISION", layer.where("quant_algo"));
    TERN_ASSIGN_OR_RETURN(const std::optional<int64_t> group, read_group_size(layer));
    if (is_nvfp4_algo(algo)) group_sizes.insert(group.value_or(16));
    config.quantized_layers[module] = std::move(algo);
  }
  if (group_sizes.size() > 1) {
    return make_error("{} mixes NVFP4 group sizes", fields.where("quantized_layers"));
  }
  if (!group_sizes.empty()) config.group_size = *group_sizes.begin();
  return {};
}

// Defaults and consistency shared by both file forms, once algo / group size / layers are known.
Expected<void> finish_config(JsonFields& fields, std::optional<int64_t> group_size, QuantConfig& config) {
  if (config.quant_algo == "MIXED_PRECISION") {
    if (config.quantized_layers.empty()) {
      return make_error("{}: quant_algo is MIXED_PRECISION but quantized_layers is missing or empty",
                        fields.where("quantized_layers"));
    }
    config.activations_quantized = std::any_of(config.quantized_layers.begin(), config.quantized_layers.end(),
                                               [](const auto& layer) { return !is_weight_only_algo(layer.second); });
    if (group_size) config.group_size = *group_size;
    return {};
  }
  if (!config.quantized_layers.empty()) {
    return make_error("{} is only meaningful with quant_algo MIXED_PRECISION, not {}", fields.where("quantized_layers"),
                      config.quant_algo);
  }
  if (is_nvfp4_algo(config.quant_algo)) {
    config.group_size = group_size.value_or(16);
    if (config.group_size != 16) {
      return make_error("{} is {}, but NVFP4 blocks are 16 elements", fields.where("group_size"), config.group_size);
    }
  } else {
    config.group_size = group_size.value_or(config.quant_algo == "MXFP8" ? 32 : 0);
  }
  config.activations_quantized = !is_weight_only_algo(config.quant_algo);
  return {};
}

// kv_cache_scheme {"type": "float", "num_bits": 8 | 4, ...} -> "FP8" / "NVFP4".
Expected<std::string> read_kv_cache_scheme(JsonFields& fields) {
  const nlohmann::json* scheme = fields.get_raw("kv_cache_scheme");
  if (scheme == nullptr || scheme->is_null()) return std::string();
  if (!scheme->is_object()) {
    return make_error("{} must be an object, got {}", fields.where("kv_cache_scheme"), json_type_name(*scheme));
  }
  JsonFields kv(*scheme, fields.source(), "kv_cache_scheme.");
  TERN_ASSIGN_OR_RETURN(const std::string type, kv.get_string("type", ""));
  TERN_ASSIGN_OR_RETURN(const int64_t bits, kv.get_int("num_bits", 0));
  if (type == "float" && bits == 8) return std::string("FP8");
  if (type == "float" && bits == 4) return std::string("NVFP4");
  return make_error("{} describes a {}-bit '{}' cache, which is neither FP8 nor NVFP4", fields.where("kv_cache_scheme"),
                    bits, type);
}

// config_groups: the weights' group sizes and whether any group quantizes input activations.
Expected<void> read_config_groups(JsonFields& fields, std::set<int64_t>& weight_group_sizes, bool& any_activations,
                                  bool& present) {
  const nlohmann::json* groups = fields.get_raw("config_groups");
  present = groups != nullptr && !groups->is_null();
  if (!present) return {};
  if (!groups->is_object()) {
    return make_error("{} must be an object, got {}", fields.where("config_groups"), json_type_name(*groups));
  }
  for (const auto& [name, group] : groups->items()) {
    JsonFields g(group, fields.source(), fields.path("config_groups") + "." + name + ".");
    if (!group.is_object()) return make_error("{} must be an object", fields.where("config_groups." + name));
    const nlohmann::json* weights = g.get_raw("weights");
    if (weights != nullptr && weights->is_object()) {
      JsonFields w(*weights, fields.source(), g.path("weights") + ".");
      TERN_ASSIGN_OR_RETURN(const std::optional<int64_t> size, read_group_size(w));
      if (size) weight_group_sizes.insert(*size);
    }
    const nlohmann::json* activations = g.get_raw("input_activations");
    if (activations != nullptr && !activations->is_null()) any_activations = true;
  }
  return {};
}

// The flat form names the KV-cache format by kv_cache_quant_algo (what vLLM reads) and/or kv_cache_scheme (what
// ModelOpt writes); both present must agree.
Expected<std::string> read_flat_kv_cache(JsonFields& fields) {
  TERN_ASSIGN_OR_RETURN(const std::string from_algo, read_kv_cache_algo(fields));
  TERN_ASSIGN_OR_RETURN(const std::string from_scheme, read_kv_cache_scheme(fields));
  if (!from_algo.empty() && !from_scheme.empty() && from_algo != from_scheme) {
    return make_error("{} ({}) contradicts kv_cache_scheme ({})", fields.where("kv_cache_quant_algo"), from_algo,
                      from_scheme);
  }
  return from_algo.empty() ? from_scheme : from_algo;
}

}  // namespace

Expected<QuantConfig> quant_config_parse_hf_quant(const nlohmann::json& hf_quant_config, std::string_view source) {
  if (!hf_quant_config.is_object()) return make_error("{}: expected a JSON object", source);
  const auto it = hf_quant_config.find("quantization");
  if (it == hf_quant_config.end() || !it->is_object()) {
    return make_error("{}: missing object field 'quantization'", source);
  }
  JsonFields fields(*it, source, "quantization.");
  QuantConfig config;
  config.source = std::string(kHfQuantSource);
  TERN_ASSIGN_OR_RETURN(config.quant_algo, read_quant_algo(fields, "quant_algo"));
  // ModelOptNvFp4Config._from_config: these keys must be present (kv_cache_quant_algo may be null).
  if (is_nvfp4_algo(config.quant_algo)) {
    for (const char* key : {"group_size", "kv_cache_quant_algo", "exclude_modules"}) {
      if (!fields.has(key)) {
        return make_error("{}: NVFP4 requires field '{}' in the quantization block", source, fields.path(key));
      }
    }
  }
  TERN_ASSIGN_OR_RETURN(config.kv_cache_quant_algo, read_kv_cache_algo(fields));
  TERN_ASSIGN_OR_RETURN(const std::optional<int64_t> group_size, read_group_size(fields));
  TERN_TRY(read_exclude_list(fields, "exclude_modules", config));
  TERN_TRY(read_quantized_layers(fields, config));
  TERN_TRY(finish_config(fields, group_size, config));
  return config;
}

namespace {

// DeepSeek-V3 / GLM-5-FP8's {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
// "weight_block_size": [128, 128]}: e4m3 weights with one fp32 `weight_scale_inv` per 128 x 128 block
// (docs/model-specs.md §1.7). tern runs them weight-only (W8A16), so the activation scheme is read but not applied.
Expected<QuantConfig> parse_fp8_block(JsonFields& fields) {
  QuantConfig config;
  config.source = std::string(kConfigJsonSource);
  TERN_ASSIGN_OR_RETURN(const std::string fmt, fields.get_string("fmt", "e4m3"));
  if (to_upper(fmt) != "E4M3") {
    return make_error("{} is '{}'; only e4m3 FP8 weights are supported", fields.where("fmt"), fmt);
  }
  std::vector<int64_t> block;
  TERN_ASSIGN_OR_RETURN(const bool has_block, fields.get_int_list("weight_block_size", block));
  if (!has_block) {
    return make_error("{} is missing; only block-wise FP8 (weight_block_size [128, 128]) is supported, not per-tensor",
                      fields.where("weight_block_size"));
  }
  if (block != std::vector<int64_t>{128, 128}) {
    return make_error("{} is [{}]; only [128, 128] blocks are supported", fields.where("weight_block_size"),
                      fmt::join(block, ", "));
  }
  TERN_ASSIGN_OR_RETURN(const std::string scheme, fields.get_string("activation_scheme", "dynamic"));
  (void)scheme;
  config.quant_algo = "FP8_BLOCK128";
  config.group_size = 128;
  config.activations_quantized = false;
  // The modules left in BF16, as the exporters name them (informational: the tensors decide).
  for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
    std::vector<std::string> names;
    TERN_ASSIGN_OR_RETURN(const bool has, fields.get_string_list(key, names));
    if (has) config.exclude_modules.insert(config.exclude_modules.end(), names.begin(), names.end());
  }
  return config;
}

}  // namespace

Expected<QuantConfig> quant_config_parse_quantization_config(const nlohmann::json& quantization_config,
                                                             std::string_view source) {
  if (!quantization_config.is_object()) return make_error("{}: expected a JSON object", source);
  JsonFields fields(quantization_config, source);
  TERN_ASSIGN_OR_RETURN(const std::string method, fields.get_string("quant_method", ""));
  if (to_upper(method) == "FP8") return parse_fp8_block(fields);
  if (to_upper(method) != "MODELOPT") {
    return make_error("{} is '{}'; only ModelOpt ('modelopt') and block-wise FP8 ('fp8') quantization are supported",
                      fields.where("quant_method"), method);
  }
  // vLLM also accepts the hf_quant_config.json layout nested here.
  if (quantization_config.contains("quantization")) {
    TERN_ASSIGN_OR_RETURN(QuantConfig nested, quant_config_parse_hf_quant(quantization_config, source));
    nested.source = std::string(kConfigJsonSource);
    return nested;
  }
  QuantConfig config;
  config.source = std::string(kConfigJsonSource);
  TERN_ASSIGN_OR_RETURN(config.quant_algo, read_quant_algo(fields, "quant_algo"));
  TERN_ASSIGN_OR_RETURN(config.kv_cache_quant_algo, read_flat_kv_cache(fields));
  TERN_ASSIGN_OR_RETURN(std::optional<int64_t> group_size, read_group_size(fields));
  TERN_TRY(read_exclude_list(fields, "ignore", config));
  TERN_TRY(read_quantized_layers(fields, config));
  std::set<int64_t> weight_groups;
  bool any_activations = false;
  bool has_groups = false;
  TERN_TRY(read_config_groups(fields, weight_groups, any_activations, has_groups));
  if (!group_size && config.quant_algo != "MIXED_PRECISION" && !weight_groups.empty()) {
    if (weight_groups.size() > 1) return make_error("{} disagree on group_size", fields.where("config_groups"));
    group_size = *weight_groups.begin();
  }
  TERN_TRY(finish_config(fields, group_size, config));
  if (has_groups && any_activations && !config.activations_quantized) {
    return make_error("{}: {} is weight-only but a config group quantizes input_activations",
                      fields.where("config_groups"), config.quant_algo);
  }
  if (has_groups) config.activations_quantized = any_activations;
  return config;
}

namespace {

std::set<std::string> pattern_set(const std::vector<std::string>& patterns) {
  return std::set<std::string>(patterns.begin(), patterns.end());
}

Expected<void> check_agreement(const QuantConfig& hf, const QuantConfig& cfg, const std::string& hf_path,
                               const std::string& cfg_path) {
  const auto disagree = [&](std::string_view what, const std::string& a, const std::string& b) {
    return make_error("{} and {} (quantization_config) disagree on {}: {} vs {}", hf_path, cfg_path, what, a, b);
  };
  if (hf.quant_algo != cfg.quant_algo) return disagree("quant_algo", hf.quant_algo, cfg.quant_algo);
  if (hf.group_size != cfg.group_size) {
    return disagree("group_size", std::to_string(hf.group_size), std::to_string(cfg.group_size));
  }
  if (hf.kv_cache_quant_algo != cfg.kv_cache_quant_algo) {
    return disagree("the KV-cache algorithm", "'" + hf.kv_cache_quant_algo + "'", "'" + cfg.kv_cache_quant_algo + "'");
  }
  const std::set<std::string> a = pattern_set(hf.exclude_modules);
  const std::set<std::string> b = pattern_set(cfg.exclude_modules);
  if (a != b) {
    std::string only_one;
    for (const std::string& p : a)
      if (!b.count(p)) only_one += " '" + p + "' (only in hf_quant_config.json)";
    for (const std::string& p : b)
      if (!a.count(p)) only_one += " '" + p + "' (only in config.json)";
    return make_error("{} and {} (quantization_config) disagree on the excluded modules:{}", hf_path, cfg_path,
                      only_one);
  }
  if (!hf.quantized_layers.empty() && !cfg.quantized_layers.empty() && hf.quantized_layers != cfg.quantized_layers) {
    return disagree("quantized_layers", "one list", "another");
  }
  return {};
}

}  // namespace

Expected<std::optional<QuantConfig>> quant_config_load(const std::filesystem::path& dir) {
  const std::filesystem::path hf_path = dir / "hf_quant_config.json";
  const std::filesystem::path cfg_path = dir / "config.json";
  std::error_code ec;
  std::optional<QuantConfig> hf;
  if (std::filesystem::exists(hf_path, ec)) {
    TERN_ASSIGN_OR_RETURN(const nlohmann::json doc, json_read_file(hf_path));
    TERN_ASSIGN_OR_RETURN(hf, quant_config_parse_hf_quant(doc, hf_path.string()));
  }
  std::optional<QuantConfig> cfg;
  if (std::filesystem::exists(cfg_path, ec)) {
    TERN_ASSIGN_OR_RETURN(const nlohmann::json doc, json_read_file(cfg_path));
    const auto it = doc.is_object() ? doc.find("quantization_config") : doc.end();
    if (doc.is_object() && it != doc.end() && !it->is_null()) {
      TERN_ASSIGN_OR_RETURN(cfg,
                            quant_config_parse_quantization_config(*it, cfg_path.string() + " quantization_config"));
    }
  }
  if (hf && cfg) {
    TERN_TRY(check_agreement(*hf, *cfg, hf_path.string(), cfg_path.string()));
    if (cfg->quantized_layers.empty()) cfg->quantized_layers = hf->quantized_layers;
  }
  // vLLM uses config.json's quantization_config when there is one.
  if (cfg) return cfg;
  return hf;
}

// ---------------------------------------------------------------------------------------------------------------
// Exclusion.

namespace {

// vLLM's packed_modules_mapping for the architectures tern serves: a fused module and the checkpoint modules it
// is made of.
const std::vector<std::pair<std::string_view, std::vector<std::string_view>>>& fused_module_parts() {
  static const std::vector<std::pair<std::string_view, std::vector<std::string_view>>> parts = {
      {"qkv_proj", {"q_proj", "k_proj", "v_proj"}},
      {"gate_up_proj", {"gate_proj", "up_proj"}},
      {"fused_qkv_a_proj", {"q_a_proj", "kv_a_proj_with_mqa"}},
      {"in_proj_qkvz", {"in_proj_qkv", "in_proj_z"}},
      {"in_proj_ba", {"in_proj_b", "in_proj_a"}},
  };
  return parts;
}

std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
  std::string out;
  size_t pos = 0;
  while (true) {
    const size_t hit = text.find(from, pos);
    if (hit == std::string_view::npos) break;
    out.append(text.substr(pos, hit - pos)).append(to);
    pos = hit + from.size();
  }
  return out.append(text.substr(pos));
}

bool contains_text(std::string_view text, std::string_view needle) {
  return text.find(needle) != std::string_view::npos;
}

// is_layer_skipped(prefix, ignored, fused_mapping) with skip_with_substr=False.
Expected<bool> layer_skipped(std::string_view prefix, const std::vector<std::string>& ignored) {
  const size_t dot = prefix.rfind('.');
  const std::string_view proj = dot == std::string_view::npos ? prefix : prefix.substr(dot + 1);
  const auto is_listed = [&](std::string_view name) {
    return std::find(ignored.begin(), ignored.end(), name) != ignored.end();
  };
  for (const auto& [fused, shards] : fused_module_parts()) {
    if (proj != fused) continue;
    std::optional<bool> skipped;
    for (std::string_view shard : shards) {
      const bool shard_skipped = is_listed(replace_all(prefix, proj, shard));
      if (skipped && *skipped != shard_skipped) {
        return make_error("'{}': some but not all of its fused parts are excluded from quantization", prefix);
      }
      skipped = shard_skipped;
    }
    return *skipped;
  }
  if (contains_text(prefix, "experts")) {
    // A fused-experts module is skipped when it is a prefix-substring of an excluded expert entry.
    return std::any_of(ignored.begin(), ignored.end(), [&](const std::string& layer) {
      return contains_text(layer, "experts") && contains_text(layer, prefix);
    });
  }
  return is_listed(prefix);
}

// Vision towers stay unquantized whatever the exclude list says (vLLM and the exporter alike).
bool is_vision_module(std::string_view module_name) {
  for (std::string_view vision : {"vision_tower", "vision_model", "visual"}) {
    if (contains_text(module_name, vision)) return true;
  }
  return false;
}

// apply_vllm_mapper: "foo*" (no '.' right before the '*') becomes "foo" and "foo.*".
std::vector<std::string> expand_patterns(const std::vector<std::string>& patterns) {
  std::vector<std::string> out;
  for (const std::string& p : patterns) {
    if (p.size() >= 2 && p.back() == '*' && p[p.size() - 2] != '.') {
      out.push_back(p.substr(0, p.size() - 1));
      out.push_back(p.substr(0, p.size() - 1) + ".*");
    } else {
      out.push_back(p);
    }
  }
  return out;
}

}  // namespace

Expected<bool> QuantConfig::is_excluded_checked(std::string_view module_name) const {
  if (is_vision_module(module_name)) return true;
  const std::vector<std::string> patterns = expand_patterns(exclude_modules);
  if (patterns.empty()) return false;
  TERN_ASSIGN_OR_RETURN(const bool skipped, layer_skipped(module_name, patterns));
  if (skipped) return true;
  // Legacy substring match kept by vLLM for checkpoints from ModelOpt < 0.39.
  constexpr std::string_view kLanguageModel = "language_model.";
  const bool has_lm_prefix = module_name.substr(0, kLanguageModel.size()) == kLanguageModel;
  const std::string_view stripped = has_lm_prefix ? module_name.substr(kLanguageModel.size()) : module_name;
  for (const std::string& p : patterns) {
    if (p != module_name && (contains_text(module_name, p) || (has_lm_prefix && contains_text(stripped, p)))) {
      return true;
    }
  }
  return std::any_of(patterns.begin(), patterns.end(),
                     [&](const std::string& p) { return quant_fnmatch(module_name, p); });
}

bool QuantConfig::producer_excludes(std::string_view module_name) const {
  if (is_vision_module(module_name)) return true;
  return std::any_of(exclude_modules.begin(), exclude_modules.end(),
                     [&](const std::string& p) { return quant_fnmatch(module_name, p); });
}

bool QuantConfig::is_excluded(std::string_view module_name) const {
  const Expected<bool> excluded = is_excluded_checked(module_name);
  return excluded.has_value() && *excluded;
}

}  // namespace tern
