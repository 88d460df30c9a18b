// config.json -> one typed, validated ModelConfig per checkpoint. Missing fields take the defaults of the matching
// transformers (v5) configuration class, derived values (layer types, MoE layers, head_dim, rotary dim) are computed
// the way transformers computes them, and anything unknown or inconsistent is an error naming the field and file.
// Field meanings and sources: docs/model-specs.md §2.1, §3.1 and §4.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tern {

enum class Architecture { kQwen3, kQwen3Moe, kQwen3Next, kQwen35Moe, kGlmMoeDsa, kDeepseekV3 };
// The HF model_type of the top-level config: "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "glm_moe_dsa",
// "deepseek_v3".
std::string_view architecture_name(Architecture architecture);

enum class LayerType { kFullAttention, kLinearAttention };  // linear = Gated DeltaNet
enum class AttentionKind { kGqa, kGatedGqa, kMla };
enum class RouterScoring { kSoftmax, kSigmoid };
enum class IndexerType { kFull, kShared };  // DSA: "full" runs the indexer, "shared" reuses the previous top-k

struct RopeConfig {
  double theta = 10000.0;
  std::string type = "default";  // "default", "linear", "dynamic", "yarn", "llama3"
  double partial_rotary_factor = 1.0;
  int64_t rotary_dim = 0;              // int(head_dim * partial_rotary_factor), as HF's default rope init
  std::vector<int64_t> mrope_section;  // [t, h, w] frequency counts (sum = rotary_dim / 2); empty = 1-D rope
  bool mrope_interleaved = false;
  bool interleaved = false;  // GPT-J pairs (x[2i], x[2i+1]) instead of NeoX halves
  // Scaling (rope_type != "default"); factor is 1 when unscaled.
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;  // yarn/llama3: defaults to max_position_embeddings
  std::optional<double> attention_factor;        // yarn: absent = derived from factor/mscale by the rope code
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  std::optional<double> mscale;  // DeepSeek-style yarn
  std::optional<double> mscale_all_dim;
  bool truncate = true;           // yarn: round the correction range to integers
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
};

struct ModelConfig {
  Architecture architecture = Architecture::kQwen3;
  std::string model_type;  // top-level HF model_type

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;           // MLA: qk_rope_head_dim, as HF sets it (the width RoPE acts on)
  int64_t intermediate_size = 0;  // dense MLP width (0 when the architecture has none)
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  std::string hidden_act = "silu";
  RopeConfig rope;
  AttentionKind attention = AttentionKind::kGqa;
  std::vector<LayerType> layer_types;  // one per layer

  // MoE (num_experts == 0: dense model)
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;  // Qwen3-Next / 3.5 gated shared expert (0: none)
  int64_t n_shared_experts = 0;                 // DeepSeek / GLM ungated shared experts (0: none)
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  int64_t first_k_dense_replace = 0;
  RouterScoring router_scoring = RouterScoring::kSoftmax;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  std::string topk_method;       // "greedy" (plain top-k) or "noaux_tc" (bias-corrected, grouped)
  std::vector<bool> moe_layers;  // derived: one per layer, true where the MLP is the MoE block

  // Gated DeltaNet
  int64_t linear_conv_kernel_dim = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;

  // MLA + DSA indexer
  int64_t q_lora_rank = 0;  // 0 = no query LoRA (q_proj)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t qk_head_dim = 0;  // qk_nope_head_dim + qk_rope_head_dim
  int64_t v_head_dim = 0;
  int64_t index_topk = 0;  // 0: no DSA indexer
  int64_t index_head_dim = 0;
  int64_t index_n_heads = 0;
  bool indexer_rope_interleave = false;
  std::vector<IndexerType> indexer_types;  // one per layer for DSA models, else empty

  // extras
  bool has_vision = false;
  int64_t num_mtp_layers = 0;  // MTP weights are not part of the served text model
  std::vector<int64_t> eos_token_ids;
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> pad_token_id;

  bool is_moe_layer(int64_t layer) const;
};

// Parses a config.json document. `source` names the file in error messages.
Expected<ModelConfig> model_config_parse(const nlohmann::json& config, std::string_view source);
// Reads <dir>/config.json, or the file itself when given a file path.
Expected<ModelConfig> model_config_load(const std::filesystem::path& dir_or_config_json);

}  // namespace tern
