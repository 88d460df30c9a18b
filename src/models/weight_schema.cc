#include "models/weight_schema.h"

#include <fmt/format.h>

namespace tern {
namespace {

// Builds the schema layer by layer; each add_* mirrors one HF module and its parameter names.
class SchemaBuilder {
 public:
  SchemaBuilder(const ModelConfig& c, std::string_view prefix) : c_(c) { schema_.text_prefix = prefix; }

  WeightSchema build() {
    const int64_t h = c_.hidden_size;
    param("embed_tokens.weight", {c_.vocab_size, h});
    for (int64_t i = 0; i < c_.num_hidden_layers; ++i) add_layer(i);
    param("norm.weight", {h});
    schema_.tied_embeddings = c_.tie_word_embeddings;
    schema_.linears.push_back({"lm_head", c_.vocab_size, h, LinearRole::kLmHead, -1});
    add_skipped();
    return std::move(schema_);
  }

 private:
  std::string layer_name(int64_t layer, std::string_view rest) const {
    return fmt::format("{}layers.{}.{}", schema_.text_prefix, layer, rest);
  }
  void param(std::string_view rest, std::vector<int64_t> shape) {
    schema_.params.push_back({schema_.text_prefix + std::string(rest), std::move(shape)});
  }
  void layer_param(int64_t layer, std::string_view rest, std::vector<int64_t> shape) {
    schema_.params.push_back({layer_name(layer, rest), std::move(shape)});
  }
  void linear(int64_t layer, std::string_view rest, int64_t out, int64_t in, LinearRole role, bool bias = false) {
    schema_.linears.push_back({layer_name(layer, rest), out, in, role, layer, bias});
  }

  void add_layer(int64_t i) {
    layer_param(i, "input_layernorm.weight", {c_.hidden_size});
    layer_param(i, "post_attention_layernorm.weight", {c_.hidden_size});
    if (c_.layer_types[static_cast<size_t>(i)] == LayerType::kLinearAttention) {
      add_gated_deltanet(i);
    } else if (c_.attention == AttentionKind::kMla) {
      add_mla(i);
    } else {
      add_attention(i);
    }
    if (c_.is_moe_layer(i)) {
      add_moe(i);
    } else {
      add_mlp(i, "mlp", c_.intermediate_size, LinearRole::kMlp);
    }
  }

  // Qwen3 attention, and the gated variant of Qwen3-Next / Qwen3.5 whose q_proj also yields the output gate.
  void add_attention(int64_t i) {
    const int64_t h = c_.hidden_size, hd = c_.head_dim;
    const int64_t q_out = c_.num_attention_heads * hd * (c_.attention == AttentionKind::kGatedGqa ? 2 : 1);
    const bool bias = c_.attention_bias;
    linear(i, "self_attn.q_proj", q_out, h, LinearRole::kAttention, bias);
    linear(i, "self_attn.k_proj", c_.num_key_value_heads * hd, h, LinearRole::kAttention, bias);
    linear(i, "self_attn.v_proj", c_.num_key_value_heads * hd, h, LinearRole::kAttention, bias);
    linear(i, "self_attn.o_proj", h, c_.num_attention_heads * hd, LinearRole::kAttention, bias);
    layer_param(i, "self_attn.q_norm.weight", {hd});
    layer_param(i, "self_attn.k_norm.weight", {hd});
  }

  // Gated DeltaNet: Qwen3.5 keeps q/k/v, z, b and a in separate projections; Qwen3-Next fuses them per key head.
  void add_gated_deltanet(int64_t i) {
    const int64_t h = c_.hidden_size;
    const int64_t key_dim = c_.linear_num_key_heads * c_.linear_key_head_dim;
    const int64_t value_dim = c_.linear_num_value_heads * c_.linear_value_head_dim;
    const int64_t n_v = c_.linear_num_value_heads;
    if (c_.architecture == Architecture::kQwen3Next) {
      linear(i, "linear_attn.in_proj_qkvz", 2 * key_dim + 2 * value_dim, h, LinearRole::kLinearAttention);
      linear(i, "linear_attn.in_proj_ba", 2 * n_v, h, LinearRole::kLinearAttention);
    } else {
      linear(i, "linear_attn.in_proj_qkv", 2 * key_dim + value_dim, h, LinearRole::kLinearAttention);
      linear(i, "linear_attn.in_proj_z", value_dim, h, LinearRole::kLinearAttention);
      linear(i, "linear_attn.in_proj_b", n_v, h, LinearRole::kLinearAttention);
      linear(i, "linear_attn.in_proj_a", n_v, h, LinearRole::kLinearAttention);
    }
    layer_param(i, "linear_attn.conv1d.weight", {2 * key_dim + value_dim, 1, c_.linear_conv_kernel_dim});
    layer_param(i, "linear_attn.dt_bias", {n_v});
    layer_param(i, "linear_attn.A_log", {n_v});
    layer_param(i, "linear_attn.norm.weight", {c_.linear_value_head_dim});
    linear(i, "linear_attn.out_proj", h, value_dim, LinearRole::kLinearAttention);
  }

  // Multi-head latent attention (DeepSeek-V3, GLM-5), plus GLM-5's DSA indexer.
  void add_mla(int64_t i) {
    const int64_t h = c_.hidden_size, n_heads = c_.num_attention_heads;
    const int64_t qk_head_dim = c_.qk_nope_head_dim + c_.qk_rope_head_dim;
    if (c_.q_lora_rank > 0) {
      linear(i, "self_attn.q_a_proj", c_.q_lora_rank, h, LinearRole::kAttention);
      layer_param(i, "self_attn.q_a_layernorm.weight", {c_.q_lora_rank});
      linear(i, "self_attn.q_b_proj", n_heads * qk_head_dim, c_.q_lora_rank, LinearRole::kAttention);
    } else {
      linear(i, "self_attn.q_proj", n_heads * qk_head_dim, h, LinearRole::kAttention);
    }
    linear(i, "self_attn.kv_a_proj_with_mqa", c_.kv_lora_rank + c_.qk_rope_head_dim, h, LinearRole::kAttention);
    layer_param(i, "self_attn.kv_a_layernorm.weight", {c_.kv_lora_rank});
    linear(i, "self_attn.kv_b_proj", n_heads * (c_.qk_nope_head_dim + c_.v_head_dim), c_.kv_lora_rank,
           LinearRole::kAttention);
    linear(i, "self_attn.o_proj", h, n_heads * c_.v_head_dim, LinearRole::kAttention);
    if (c_.architecture == Architecture::kGlmMoeDsa) {
      const int64_t index_dim = c_.index_head_dim;
      linear(i, "self_attn.indexer.wq_b", c_.index_n_heads * index_dim, c_.q_lora_rank, LinearRole::kIndexer);
      linear(i, "self_attn.indexer.wk", index_dim, h, LinearRole::kIndexer);
      layer_param(i, "self_attn.indexer.k_norm.weight", {index_dim});
      layer_param(i, "self_attn.indexer.k_norm.bias", {index_dim});
      linear(i, "self_attn.indexer.weights_proj", c_.index_n_heads, h, LinearRole::kIndexer);
    }
  }

  void add_mlp(int64_t i, std::string_view name, int64_t intermediate, LinearRole role) {
    const int64_t h = c_.hidden_size;
    linear(i, fmt::format("{}.gate_proj", name), intermediate, h, role);
    linear(i, fmt::format("{}.up_proj", name), intermediate, h, role);
    linear(i, fmt::format("{}.down_proj", name), h, intermediate, role);
  }

  void add_moe(int64_t i) {
    const int64_t h = c_.hidden_size;
    linear(i, "mlp.gate", c_.num_experts, h, LinearRole::kRouter);
    if (c_.router_scoring == RouterScoring::kSigmoid && c_.topk_method == "noaux_tc") {
      layer_param(i, "mlp.gate.e_score_correction_bias", {c_.num_experts});
    }
    schema_.expert_groups.push_back({layer_name(i, "mlp.experts"), i, c_.num_experts, h, c_.moe_intermediate_size});
    if (c_.shared_expert_intermediate_size > 0) {  // Qwen3-Next / Qwen3.5: one shared expert behind a sigmoid gate
      add_mlp(i, "mlp.shared_expert", c_.shared_expert_intermediate_size, LinearRole::kSharedExpert);
      linear(i, "mlp.shared_expert_gate", 1, h, LinearRole::kSharedExpertGate);
    } else if (c_.n_shared_experts > 0) {  // DeepSeek-V3 / GLM-5: shared experts fused into one wider MLP
      add_mlp(i, "mlp.shared_experts", c_.n_shared_experts * c_.moe_intermediate_size, LinearRole::kSharedExpert);
    }
  }

  void add_skipped() {
    if (c_.has_vision) {
      for (std::string_view p : {"model.visual.", "model.vision_tower.", "visual."}) {
        schema_.skipped_prefixes.emplace_back(p);
        schema_.skipped_reasons.emplace_back("vision tower (tern serves the text model)");
      }
    }
    schema_.skipped_prefixes.emplace_back("mtp.");  // Qwen3.5 / Qwen3-Next multi-token prediction
    schema_.skipped_reasons.emplace_back("multi-token-prediction layers (not used for plain decoding)");
    for (int64_t m = 0; m < c_.num_mtp_layers; ++m) {  // DeepSeek-V3 / GLM-5 keep MTP as extra decoder layers
      schema_.skipped_prefixes.push_back(fmt::format("{}layers.{}.", schema_.text_prefix, c_.num_hidden_layers + m));
      schema_.skipped_reasons.emplace_back("multi-token-prediction layers (not used for plain decoding)");
    }
  }

  const ModelConfig& c_;
  WeightSchema schema_;
};

}  // namespace

std::string weight_schema_text_prefix(const SafetensorsSet& tensors) {
  for (const TensorView* t : tensors.tensors()) {
    if (t->name.starts_with("model.language_model.")) return "model.language_model.";
  }
  return "model.";
}

std::string weight_schema_default_text_prefix(const ModelConfig& config) {
  return config.has_vision ? "model.language_model." : "model.";
}

WeightSchema weight_schema_build(const ModelConfig& config, std::string_view text_prefix) {
  return SchemaBuilder(config, text_prefix).build();
}

}  // namespace tern
