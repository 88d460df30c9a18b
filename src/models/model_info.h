// What a checkpoint holds, checked against what its architecture expects (`tern info`): layer structure, parameter
// counts, weight formats, memory, and every problem found (a missing or unexpected tensor, a wrong shape or type).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/model_config.h"
#include "io/quant_config.h"

namespace tern {

struct ModelInfo {
  std::filesystem::path model_dir;
  ModelConfig config;
  std::optional<QuantConfig> quant;
  std::string text_prefix;
  int64_t full_attention_layers = 0;
  int64_t linear_attention_layers = 0;
  int64_t moe_layers = 0;
  int64_t dense_mlp_layers = 0;
  int64_t total_parameters = 0;       // logical elements of the text model's weights (NVFP4 counted as out x in)
  int64_t active_parameters = 0;      // what one token uses: top-k of the routed experts
  std::map<std::string, int64_t> linear_layers;  // weight format -> count; each routed expert counts three
  int64_t weight_bytes = 0;           // text model as stored (NVFP4 packed, scales included)
  int64_t skipped_bytes = 0;          // vision tower, MTP layers
  int64_t num_tensors = 0;
  int64_t num_files = 0;
  // What serving it holds besides the weights, as the CUDA path allocates it: the cache one token adds over all
  // layers (bf16 keys and values; MLA's latent and the DSA indexer's key), with the FP8 latent cache
  // (--kv-cache-dtype fp8_e4m3) where the model has one (MLA with kv_lora_rank in 128-value tiles), and the state one
  // sequence holds whatever its length (Gated DeltaNet's conv and recurrent state, for one draft-free step).
  int64_t kv_bytes_per_token = 0;
  std::optional<int64_t> kv_bytes_per_token_fp8;
  int64_t state_bytes_per_sequence = 0;
  std::vector<std::string> problems;  // make `tern info` exit non-zero
  std::vector<std::string> notes;     // worth knowing, not wrong (e.g. the exclude list disagrees with the files)
};

// Errors only when the checkpoint cannot be read at all (no config, unreadable safetensors); everything else is
// reported in `problems`.
Expected<ModelInfo> model_info_inspect(const std::filesystem::path& model_dir);

nlohmann::ordered_json model_info_to_json(const ModelInfo& info);
std::string model_info_to_text(const ModelInfo& info);

}  // namespace tern
