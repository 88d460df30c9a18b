// The text model's weights as an architecture expects them, derived from its config alone: every linear layer with
// its logical [out, in], every other parameter with its shape, and the routed-expert groups (which checkpoints
// store either fused, `experts.gate_up_proj` [E, 2I, H] + `experts.down_proj` [E, H, I], or one module per
// expert). Loading, `tern info` and the model code all read weights through this one description. Every tensor and
// cached state also declares how it splits across tensor-parallel ranks (models/shard.h, docs/architecture.md
// "Sharding seam").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/model_config.h"
#include "io/safetensors.h"
#include "models/shard.h"

namespace tern {

enum class LinearRole { kAttention, kLinearAttention, kIndexer, kMlp, kRouter, kSharedExpert, kSharedExpertGate,
                        kLmHead, kDraftInput };

struct LinearSpec {
  std::string module;     // checkpoint name without ".weight"
  int64_t out_features;
  int64_t in_features;
  LinearRole role;
  int64_t layer;          // -1 outside the decoder layers
  bool has_bias = false;
  Shard shard;            // the bias follows the rows of a kOutput split and stays on rank 0 for kInput
};

struct ParamSpec {
  std::string name;             // full tensor name
  std::vector<int64_t> shape;
  Shard shard;                  // along dim 0
};

struct ExpertGroupSpec {
  std::string prefix;     // e.g. "model.layers.3.mlp.experts"
  int64_t layer;
  int64_t num_experts;
  int64_t hidden;         // H: gate/up in_features, down out_features
  int64_t intermediate;   // I: gate/up out_features, down in_features
  Shard gate_up_shard;    // each expert's gate_proj and up_proj (TP inside the expert: by output)
  Shard down_shard;       // each expert's down_proj (by input)
  Shard experts_shard;    // expert parallelism instead: the experts themselves, consecutive ranges of whole ones
  int64_t parameters_per_expert() const { return 3 * hidden * intermediate; }
};

// What one rank holds of an expert group: experts [first, first + count), each sliced by gate_up / down (whole
// experts under expert parallelism, a slice of every expert under tensor parallelism).
struct ExpertGroupRank {
  int64_t first = 0, count = 0;
  Shard gate_up, down;
};
// Errors name the group and why it cannot split (experts, or an expert's width, that do not divide by the world).
Expected<ExpertGroupRank> expert_group_rank(const ExpertGroupSpec& g, ShardRank rank);

// A per-sequence cache a layer keeps, with the shape of one token's (KV) or one sequence's (GDN) state, split along
// dim 0. Declared for the tensor-parallel execution to size per-rank caches; the loader does not read these.
struct StateSpec {
  std::string name;  // e.g. "model.layers.3.self_attn.kv_cache"
  std::vector<int64_t> shape;
  Shard shard;
};

struct WeightSchema {
  std::string text_prefix;                  // "model." or "model.language_model."
  std::vector<LinearSpec> linears;          // lm_head last
  std::vector<ParamSpec> params;            // embeddings, norms, convolutions, gates' biases, ...
  std::vector<ExpertGroupSpec> expert_groups;
  std::vector<StateSpec> states;            // caches: KV (K and V each), GDN conv and recurrent state, MLA latent
  std::vector<std::string> skipped_prefixes;  // present in checkpoints but not served: vision tower, MTP layers
  std::vector<std::string> skipped_reasons;   // one per skipped prefix
  bool tied_embeddings = false;             // lm_head may be absent and reuse embed_tokens
  // The decoder layers 0 .. num_layers - 1 live at "<text_prefix>layers.<i>."; a draft module's layer (the MTP
  // layer, declared only when asked for) follows as layer num_layers, at "<draft_prefix>layers.0." (Qwen) or, with
  // draft_in_text_layers, at "<text_prefix>layers.<num_layers>." (DeepSeek-V3 / GLM-5).
  int64_t num_layers = 0;
  // "mtp." (Qwen3.5 / Qwen3-Next), or with draft_in_text_layers "<text_prefix>layers.<num_layers>." (DeepSeek-V3 /
  // GLM-5, whose MTP layer is the text model's next decoder layer); empty: no draft module declared.
  std::string draft_prefix;
  bool draft_in_text_layers = false;

  // Where layer `layer`'s tensors are named: "<text_prefix>layers.<layer>." or a draft layer's place.
  std::string layer_prefix(int64_t layer) const;
};

// text_prefix is where the checkpoint keeps the text model ("model." for *ForCausalLM, "model.language_model." for
// the multimodal *ForConditionalGeneration layout). `with_draft`: also the model's multi-token-prediction module
// (Qwen3.5 / Qwen3-Next `mtp.*`: two norms, `mtp.fc` [hidden, 2 * hidden], one gated-attention MoE decoder layer and
// its final norm; DeepSeek-V3 / GLM-5 decoder layer num_hidden_layers: enorm, hnorm, eh_proj, one MLA MoE layer,
// shared_head.norm) instead of listing it as skipped; only for configs with weight_schema_has_draft.
WeightSchema weight_schema_build(const ModelConfig& config, std::string_view text_prefix, bool with_draft = false);
// Whether tern can run this config's MTP module as a draft model (Qwen3.5-MoE / Qwen3-Next with
// mtp_num_hidden_layers > 0, GLM-5 / DeepSeek-V3 with num_nextn_predict_layers > 0; MoE models).
bool weight_schema_has_draft(const ModelConfig& config);

// Where a checkpoint keeps its text model: "model.language_model." when any tensor lives there, else "model.".
std::string weight_schema_text_prefix(const SafetensorsSet& tensors);
// Where a checkpoint of this config would keep it (for weights made from the config alone): the multimodal
// layout for configs with a vision tower.
std::string weight_schema_default_text_prefix(const ModelConfig& config);

}  // namespace tern
