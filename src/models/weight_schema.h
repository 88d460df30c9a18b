// The text model's weights as an architecture expects them, derived from its config alone: every linear layer with
// its logical [out, in], every other parameter with its shape, and the routed-expert groups (which checkpoints
// store either fused, `experts.gate_up_proj` [E, 2I, H] + `experts.down_proj` [E, H, I], or one module per
// expert). Loading, `tern info` and the model code all read weights through this one description.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/model_config.h"
#include "io/safetensors.h"

namespace tern {

enum class LinearRole { kAttention, kLinearAttention, kIndexer, kMlp, kRouter, kSharedExpert, kSharedExpertGate,
                        kLmHead };

struct LinearSpec {
  std::string module;     // checkpoint name without ".weight"
  int64_t out_features;
  int64_t in_features;
  LinearRole role;
  int64_t layer;          // -1 outside the decoder layers
  bool has_bias = false;
};

struct ParamSpec {
  std::string name;             // full tensor name
  std::vector<int64_t> shape;
};

struct ExpertGroupSpec {
  std::string prefix;     // e.g. "model.layers.3.mlp.experts"
  int64_t layer;
  int64_t num_experts;
  int64_t hidden;         // H: gate/up in_features, down out_features
  int64_t intermediate;   // I: gate/up out_features, down in_features
  int64_t parameters_per_expert() const { return 3 * hidden * intermediate; }
};

struct WeightSchema {
  std::string text_prefix;                  // "model." or "model.language_model."
  std::vector<LinearSpec> linears;          // lm_head last
  std::vector<ParamSpec> params;            // embeddings, norms, convolutions, gates' biases, ...
  std::vector<ExpertGroupSpec> expert_groups;
  std::vector<std::string> skipped_prefixes;  // present in checkpoints but not served: vision tower, MTP layers
  std::vector<std::string> skipped_reasons;   // one per skipped prefix
  bool tied_embeddings = false;             // lm_head may be absent and reuse embed_tokens
};

// text_prefix is where the checkpoint keeps the text model ("model." for *ForCausalLM, "model.language_model." for
// the multimodal *ForConditionalGeneration layout).
WeightSchema weight_schema_build(const ModelConfig& config, std::string_view text_prefix);

// Where a checkpoint keeps its text model: "model.language_model." when any tensor lives there, else "model.".
std::string weight_schema_text_prefix(const SafetensorsSet& tensors);
// Where a checkpoint of this config would keep it (for weights made from the config alone): the multimodal
// layout for configs with a vision tower.
std::string weight_schema_default_text_prefix(const ModelConfig& config);

}  // namespace tern
