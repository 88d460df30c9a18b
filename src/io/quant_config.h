// NVIDIA ModelOpt quantization configs (docs/model-specs.md §1.1): the older hf_quant_config.json
// ({"producer", "quantization": {quant_algo, kv_cache_quant_algo, group_size, exclude_modules}}) and the newer
// config.json "quantization_config" ({"quant_method": "modelopt", quant_algo, ignore, kv_cache_scheme,
// config_groups, ...}). Validation follows vLLM's ModelOptQuantConfigBase.from_config / ModelOptNvFp4Config.
//
// Which modules are quantized should be decided from the tensors a checkpoint actually holds; is_excluded() is the
// cross-check, reproducing vLLM's matching of the exclude patterns.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tern {

struct QuantConfig {
  std::string quant_algo;                    // upper-cased: "NVFP4", "FP8", "MIXED_PRECISION", "W4A16_NVFP4", ...
  int64_t group_size = 0;                    // 16 for NVFP4 (0 when the algorithm has no groups)
  std::string kv_cache_quant_algo;           // "" when none, else "FP8" / "NVFP4"
  std::vector<std::string> exclude_modules;  // patterns as written
  std::map<std::string, std::string> quantized_layers;  // MIXED_PRECISION: module -> algo (upper-cased)
  bool activations_quantized = true;                    // false for weight-only algorithms (W4A16_NVFP4, FP8_PB_WO)
  std::string source;                                   // "hf_quant_config.json" or "config.json quantization_config"

  // True when `module_name` (a checkpoint module path such as "model.layers.3.self_attn.q_proj") stays
  // unquantized, by vLLM's rules: vision modules always; then an exact (or fused-name) match, vLLM's legacy
  // substring match (also with "language_model." stripped), then fnmatch. A pattern "foo*" with no '.' before the
  // '*' is first rewritten to "foo" and "foo.*" (vLLM apply_vllm_mapper). A fused name (qkv_proj, gate_up_proj, ...)
  // is excluded when all its parts are; a fused name with only some parts excluded is not.
  bool is_excluded(std::string_view module_name) const;
  // Like is_excluded, but a fused name whose parts disagree is an error (vLLM refuses to load such a layer).
  Expected<bool> is_excluded_checked(std::string_view module_name) const;
  // True when the exporter leaves `module_name` unquantized: ModelOpt matches its exclude patterns as shell-style
  // wildcards against the module's whole name (no vLLM rewrite), and never quantizes vision modules. This is what a
  // checkpoint holds, so weights made without one (--load-format dummy) follow it. It differs from is_excluded for
  // a pattern like "*shared_expert*": vLLM rewrites it to "*shared_expert" and "*shared_expert.*", which miss
  // "mlp.shared_expert_gate", while the export (and every Qwen3.5 NVFP4 recipe) keeps that gate in BF16.
  bool producer_excludes(std::string_view module_name) const;
};

// Python fnmatch.fnmatchcase semantics on a whole name: '*' any run of characters (dots included), '?' one
// character, '[seq]' / '[!seq]' a character set with ranges; an unclosed '[' is a literal; no backslash escapes.
bool quant_fnmatch(std::string_view name, std::string_view pattern);

// Reads <dir>/hf_quant_config.json and/or config.json's "quantization_config"; std::nullopt when neither exists.
// Both present and disagreeing (algo, group size, kv-cache algo, exclude list) is an error naming both files.
Expected<std::optional<QuantConfig>> quant_config_load(const std::filesystem::path& dir);
Expected<QuantConfig> quant_config_parse_hf_quant(const nlohmann::json& hf_quant_config, std::string_view source);
Expected<QuantConfig> quant_config_parse_quantization_config(const nlohmann::json& quantization_config,
                                                             std::string_view source);

}  // namespace tern
