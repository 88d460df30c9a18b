// Qwen3-MoE: Qwen3's attention; layer i is a sparse MoE block when i is not in mlp_only_layers and
// (i + 1) % decoder_sparse_step == 0 (ModelConfig::is_moe_layer), otherwise a dense SwiGLU MLP. Softmax router, top-k,
// renormalised when norm_topk_prob. Also the MoE builder shared with Qwen3.5 / Qwen3-Next.
#include <fmt/format.h>

#include <algorithm>

#include "models/builders.h"

namespace tern {

Expected<std::unique_ptr<FeedForward>> build_moe(const ModelConfig& c, WeightStore& w, const WeightSchema& schema,
                                                 int64_t layer, bool renormalize) {
  auto group = std::find_if(schema.expert_groups.begin(), schema.expert_groups.end(),
                            [&](const ExpertGroupSpec& g) { return g.layer == layer; });
  if (group == schema.expert_groups.end()) return make_error("layer {} has no expert group in the schema", layer);
  MoeWeights m;
  TERN_ASSIGN_OR_RETURN(m.router, w.linear(layer_tensor(schema, layer, "mlp.gate"), c.num_experts, c.hidden_size));
  TERN_ASSIGN_OR_RETURN(WeightStore::Experts experts, w.experts(*group));
  m.first_expert = experts.first;
  m.experts = std::move(experts.experts);
  if (c.shared_expert_intermediate_size > 0) {
    TERN_ASSIGN_OR_RETURN(MlpWeights shared, build_mlp_weights(w, layer_tensor(schema, layer, "mlp.shared_expert"),
                                                               c.hidden_size, c.shared_expert_intermediate_size));
    m.shared_expert = std::make_unique<Mlp>(std::move(shared));
    TERN_ASSIGN_OR_RETURN(m.shared_expert_gate, w.linear(layer_tensor(schema, layer, "mlp.shared_expert_gate"), 1,
                                                         c.hidden_size));
  }
  return std::make_unique<Moe>(MoeShape{.top_k = c.num_experts_per_tok, .renormalize = renormalize}, std::move(m));
}

Expected<void> qwen3_moe_build(CausalLm& model, WeightStore& w, const WeightSchema& schema) {
  const ModelConfig& c = model.config();
  TERN_TRY(build_embeddings_and_head(model, w, schema, false));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    DecoderLayer layer;
    TERN_TRY(build_layer_norms(c, w, schema, i, /*zero_centred=*/false, layer));
    TERN_ASSIGN_OR_RETURN(layer.mixer, build_attention(c, w, schema, i, false));
    if (c.is_moe_layer(i)) {
      TERN_ASSIGN_OR_RETURN(layer.ffn, build_moe(c, w, schema, i, c.norm_topk_prob));
    } else {
      TERN_ASSIGN_OR_RETURN(layer.ffn, build_dense_mlp(c, w, schema, i));
    }
    model.layers.push_back(std::move(layer));
  }
  return {};
}

}  // namespace tern
