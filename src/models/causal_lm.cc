#include "models/causal_lm.h"

#include <fmt/format.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <new>
#include <stdexcept>

#include "models/weight_schema.h"

namespace tern {

SequenceCache CausalLm::new_cache() const {
  SequenceCache cache;
  cache.layers.resize(layers.size() + (draft ? 1 : 0));
  return cache;
}

Expected<std::vector<std::unique_ptr<Block>>> CausalLm::make_blocks(BlockOps& ops, bool with_draft) const {
  if (host_released_) return make_error("the model's host weights were released when it was placed on its device");
  std::vector<std::unique_ptr<Block>> blocks;
  blocks.reserve(2 * layers.size() + 6);
  TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), ops.embedding(embed_tokens, vocab));
  for (const DecoderLayer& layer : layers) {
    TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), layer.mixer->place(ops, layer.input_norm));
    TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), layer.ffn->place(ops, layer.post_attention_norm));
  }
  TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), ops.lm_head(final_norm, lm_head, vocab));
  if (with_draft && draft) {
    TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), ops.draft_input(draft->norm_embedding, draft->norm_hidden, draft->fc));
    TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), draft->layer.mixer->place(ops, draft->layer.input_norm));
    TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), draft->layer.ffn->place(ops, draft->layer.post_attention_norm));
    TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), ops.lm_head(draft->final_norm, lm_head, vocab));
  }
  return blocks;
}

Expected<void> CausalLm::place(BlockOps& ops) {
  TERN_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Block>> blocks, make_blocks(ops, true));
  size_t b = 0;
  embedding_block_ = std::move(blocks[b++]);
  for (DecoderLayer& layer : layers) {
    layer.mixer_block = std::move(blocks[b++]);
    layer.ffn_block = std::move(blocks[b++]);
  }
  head_block_ = std::move(blocks[b++]);
  if (draft) {
    draft->input_block = std::move(blocks[b++]);
    draft->layer.mixer_block = std::move(blocks[b++]);
    draft->layer.ffn_block = std::move(blocks[b++]);
    draft->head_block = std::move(blocks[b++]);
  }
  return {};
}

void CausalLm::release_host_weights() {
  const auto release = [](DecoderLayer& layer) {
    layer.mixer.reset();
    layer.ffn.reset();
  };
  embed_tokens = {};
  for (DecoderLayer& layer : layers) release(layer);
  lm_head = {};
  if (draft) {
    draft->fc = {};
    release(draft->layer);
  }
  weights_.reset();
  host_released_ = true;
#if defined(__GLIBC__)
  malloc_trim(0);  // the freed tensors below glibc's mmap threshold go back to the system too
#endif
}

Expected<void> CausalLm::visit_blocks(BlockOps& ops, bool with_draft) const {
  TERN_TRY(make_blocks(ops, with_draft));
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

Expected<void> CausalLm::run_draft_blocks(BlockOps& ops) const {
  if (!draft) return make_error("the model has no draft module (load it with ModelLoadOptions::load_draft)");
  if (!draft->input_block) return make_error("the draft module's blocks were not placed on a device");
  const int64_t li = static_cast<int64_t>(layers.size());
  TERN_TRY(embedding_block_->forward(-1));
  TERN_TRY(draft->input_block->forward(li));
  TERN_TRY(draft->layer.mixer_block->forward(li));
  TERN_TRY(ops.trace_output(trace_name(li, "mixer_out")));
  TERN_TRY(draft->layer.ffn_block->forward(li));
  TERN_TRY(ops.trace_output(trace_name(li, "ffn_out")));
  return draft->head_block->forward(-1);
}

namespace {

Expected<std::unique_ptr<WeightStore>> open_weights(const std::filesystem::path& dir, const ModelConfig& config,
                                                    const ModelLoadOptions& options) {
  // The tensors decide each layer's format; the quantization config is still checked, so that one tern cannot run
  // (another quant_method, FP8 blocks other than 128 x 128) is refused by name rather than at its first tensor.
  TERN_ASSIGN_OR_RETURN(std::optional<QuantConfig> quant, quant_config_load(dir));
  if (options.load_format == LoadFormat::kAuto) return WeightStore::open_checkpoint(dir);
  const WeightSchema schema =
      weight_schema_build(config, weight_schema_default_text_prefix(config), options.load_draft);
  if (options.load_format == LoadFormat::kShapes) return WeightStore::make_shapes_only(schema, quant);
  return WeightStore::make_dummy(config, schema, quant, options.dummy_seed);
}

Expected<std::unique_ptr<CausalLm>> build_host(const std::filesystem::path& dir, const ModelLoadOptions& options) {
  TERN_ASSIGN_OR_RETURN(ModelConfig config, model_config_load(dir));
  // Before any weights are made: dummy weights of a model tern cannot build (GLM-5: 1.5 TB) would only be thrown away.
  if (!model_build_supported(config.architecture)) {
    return make_error("{}: architecture '{}' is not supported on the CPU yet", dir.string(),
                      architecture_name(config.architecture));
  }
  if (options.load_draft && !weight_schema_has_draft(config)) {
    return make_error("{}: this model has no multi-token-prediction layers to draft with (config.json: "
                      "mtp_num_hidden_layers / num_nextn_predict_layers is 0, or the architecture '{}' has none tern "
                      "can run)", dir.string(), architecture_name(config.architecture));
  }
  const bool fp8_cache = options.kv_cache_dtype == KvCacheDtype::kFp8E4m3;
  if (fp8_cache && config.attention != AttentionKind::kMla) {
    return make_error("{}: --kv-cache-dtype fp8_e4m3: tern's FP8 cache is the multi-head latent attention form "
                      "(GLM-5, DeepSeek-V3); this model's attention ('{}') caches bf16 keys and values; use "
                      "--kv-cache-dtype auto", dir.string(), architecture_name(config.architecture));
  }
  TERN_ASSIGN_OR_RETURN(std::unique_ptr<WeightStore> weights, open_weights(dir, config, options));
  const WeightSchema schema = weight_schema_build(config, weights->text_prefix(), options.load_draft);
  if (options.shard.world != 1 || options.shard.rank != 0) weights->set_sharding(schema, options.shard);
  WeightStore& store = *weights;
  auto model = std::make_unique<CausalLm>(config, std::move(weights));
  if (config.has_vision) model->notices.push_back("the vision tower's weights are skipped (text model only)");
  if (options.expert_parallel || options.shard.expert_parallel) {
    if (schema.expert_groups.empty()) {
      model->notices.push_back("--enable-expert-parallel: this model has no routed experts, so nothing changes");
    } else if (options.shard.world == 1) {
      model->notices.push_back("--enable-expert-parallel with one rank: it holds every expert");
    }
  }
  if (options.nvfp4_activations != Nvfp4Activations::kDequantize && config.attention == AttentionKind::kMla) {
    return make_error("{}: NVFP4 with quantized activations (W4A4) is not supported for MLA models yet; use "
                      "--nvfp4-activations dequantize (W4A16)", dir.string());
  }
  store.set_nvfp4_activations(options.nvfp4_activations);
  Expected<void> built;
  switch (config.architecture) {
    case Architecture::kQwen3: built = qwen3_build(*model, store, schema); break;
    case Architecture::kQwen3Moe: built = qwen3_moe_build(*model, store, schema); break;
    case Architecture::kQwen35Moe:
    case Architecture::kQwen3Next: built = qwen3_5_moe_build(*model, store, schema); break;
    case Architecture::kGlmMoeDsa:
    case Architecture::kDeepseekV3: built = glm_moe_dsa_build(*model, store, schema, fp8_cache); break;
    default:
      return make_error("{}: architecture '{}' is not supported on the CPU yet", dir.string(),
                        architecture_name(config.architecture));
  }
  if (built && options.load_draft) {
    built = config.attention == AttentionKind::kMla ? glm_moe_dsa_build_draft(*model, store, schema, fp8_cache)
                                                    : qwen3_5_moe_build_draft(*model, store, schema);
  }
  if (!built) return wrap_error(built.error(), dir.string());
  return model;
}

}  // namespace

bool model_build_supported(Architecture a) {
  return a == Architecture::kQwen3 || a == Architecture::kQwen3Moe || a == Architecture::kQwen35Moe ||
         a == Architecture::kQwen3Next || a == Architecture::kGlmMoeDsa || a == Architecture::kDeepseekV3;
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
