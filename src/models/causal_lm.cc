#include "models/causal_lm.h"

#include <fmt/format.h>

#include <new>
#include <stdexcept>

#include "models/weight_schema.h"

namespace tern {

SequenceCache CausalLm::new_cache() const {
  SequenceCache cache;
  cache.layers.resize(layers.size());
  return cache;
}

Expected<std::vector<std::unique_ptr<Block>>> CausalLm::make_blocks(BlockOps& ops) const {
  std::vector<std::unique_ptr<Block>> blocks;
  blocks.reserve(2 * layers.size() + 2);
  TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), ops.embedding(embed_tokens, vocab));
  for (const DecoderLayer& layer : layers) {
    TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), layer.mixer->place(ops, layer.input_norm));
    TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), layer.ffn->place(ops, layer.post_attention_norm));
  }
  TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), ops.lm_head(final_norm, lm_head, vocab));
  return blocks;
}

Expected<void> CausalLm::place(BlockOps& ops) {
  TERN_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Block>> blocks, make_blocks(ops));
  embedding_block_ = std::move(blocks.front());
  for (size_t i = 0; i < layers.size(); ++i) {
    layers[i].mixer_block = std::move(blocks[1 + 2 * i]);
    layers[i].ffn_block = std::move(blocks[2 + 2 * i]);
  }
  head_block_ = std::move(blocks.back());
  return {};
}

Expected<void> CausalLm::visit_blocks(BlockOps& ops) const {
  TERN_TRY(make_blocks(ops));
  return {};
}

Expected<void> CausalLm::run_blocks(BlockOps& ops) const {
  if (!embedding_block_) return make_error("the model's blocks were not placed on a device");
  TERN_TRY(embedding_block_->forward(-1));
  for (size_t i = 0; i < layers.size(); ++i) {
    const int64_t li = static_cast<int64_t>(i);
    TERN_TRY(layers[i].mixer_block->forward(li));
    TERN_TRY(ops.trace_output(trace_name(li, "mixer_out")));
    TERN_TRY(layers[i].ffn_block->forward(li));
    TERN_TRY(ops.trace_output(trace_name(li, "ffn_out")));
  }
  return head_block_->forward(-1);
}

namespace {

Expected<std::unique_ptr<WeightStore>> open_weights(const std::filesystem::path& dir, const ModelConfig& config,
                                                    const ModelLoadOptions& options) {
  if (options.load_format == LoadFormat::kAuto) return WeightStore::open_checkpoint(dir);
  TERN_ASSIGN_OR_RETURN(std::optional<QuantConfig> quant, quant_config_load(dir));
  if (options.load_format == LoadFormat::kShapes) {
    return WeightStore::make_shapes_only(weight_schema_build(config, weight_schema_default_text_prefix(config)),
                                         quant);
  }
  return WeightStore::make_dummy(config, weight_schema_build(config, weight_schema_default_text_prefix(config)), quant,
                                 options.dummy_seed);
}

Expected<std::unique_ptr<CausalLm>> build_host(const std::filesystem::path& dir, const ModelLoadOptions& options) {
  TERN_ASSIGN_OR_RETURN(ModelConfig config, model_config_load(dir));
  // Before any weights are made: dummy weights of a model tern cannot build (GLM-5: 1.5 TB) would only be thrown away.
  if (!model_build_supported(config.architecture)) {
    return make_error("{}: architecture '{}' is not supported on the CPU yet", dir.string(),
                      architecture_name(config.architecture));
  }
  TERN_ASSIGN_OR_RETURN(std::unique_ptr<WeightStore> weights, open_weights(dir, config, options));
  const WeightSchema schema = weight_schema_build(config, weights->text_prefix());
  if (options.shard.world != 1 || options.shard.rank != 0) weights->set_sharding(schema, options.shard);
  WeightStore& store = *weights;
  auto model = std::make_unique<CausalLm>(config, std::move(weights));
  if (config.has_vision) model->notices.push_back("the vision tower's weights are skipped (text model only)");
  const bool wa4 = options.nvfp4_quantize_activations;
  Expected<void> built;
  switch (config.architecture) {
    case Architecture::kQwen3: built = qwen3_build(*model, store, schema, wa4); break;
    case Architecture::kQwen3Moe: built = qwen3_moe_build(*model, store, schema, wa4); break;
    case Architecture::kQwen35Moe:
    case Architecture::kQwen3Next: built = qwen3_5_moe_build(*model, store, schema, wa4); break;
    default:
      return make_error("{}: architecture '{}' is not supported on the CPU yet", dir.string(),
                        architecture_name(config.architecture));
  }
  if (!built) return wrap_error(built.error(), dir.string());
  return model;
}

}  // namespace

bool model_build_supported(Architecture a) {
  return a == Architecture::kQwen3 || a == Architecture::kQwen3Moe || a == Architecture::kQwen35Moe ||
         a == Architecture::kQwen3Next;
}

Expected<std::unique_ptr<CausalLm>> model_build_host(const std::filesystem::path& dir,
                                                     const ModelLoadOptions& options) {
  // The config bounds every size (io/model_config.h), but a model within them can still need more host memory
  // than there is (dummy weights, a column-split copy): an error, not an abort.
  try {
    return build_host(dir, options);
  } catch (const std::bad_alloc&) {
    return make_error("{}: out of host memory while building the model's weights", dir.string());
  } catch (const std::length_error&) {
    return make_error("{}: the model's weights are larger than host memory can address", dir.string());
  }
}

}  // namespace tern
