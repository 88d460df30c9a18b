#include "models/causal_lm.h"

#include <fmt/format.h>

#include "models/cpu/cpu_runner.h"
#include "models/weight_schema.h"

#if TERN_MODELS_CUDA
#include "models/gpu/gpu_runner.h"
#endif

namespace tern {

SequenceCache CausalLm::new_sequence() const {
  SequenceCache cache;
  cache.layers.resize(layers.size());
  cache.device = runner_->new_sequence();
  return cache;
}

Expected<std::vector<std::unique_ptr<Block>>> CausalLm::make_blocks(BlockOps& ops) const {
  std::vector<std::unique_ptr<Block>> blocks;
  blocks.reserve(2 * layers.size() + 2);
  TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), ops.embedding(embed_tokens));
  for (const DecoderLayer& layer : layers) {
    TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), layer.mixer->place(ops, layer.input_norm));
    TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), layer.ffn->place(ops, layer.post_attention_norm));
  }
  TERN_ASSIGN_OR_RETURN(blocks.emplace_back(), ops.lm_head(final_norm, lm_head));
  return blocks;
}

Expected<void> CausalLm::place(std::unique_ptr<ModelRunner> runner) {
  TERN_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Block>> blocks, make_blocks(runner->ops()));
  embedding_block_ = std::move(blocks.front());
  for (size_t i = 0; i < layers.size(); ++i) {
    layers[i].mixer_block = std::move(blocks[1 + 2 * i]);
    layers[i].ffn_block = std::move(blocks[2 + 2 * i]);
  }
  head_block_ = std::move(blocks.back());
  TERN_TRY(runner->finish_load());
  runner_ = std::move(runner);
  return {};
}

Expected<void> CausalLm::visit_blocks(BlockOps& ops) const {
  TERN_TRY(make_blocks(ops));
  return {};
}

Expected<void> CausalLm::run_blocks() const {
  BlockOps& ops = runner_->ops();
  TERN_TRY(embedding_block_->forward(-1));
  for (size_t i = 0; i < layers.size(); ++i) {
    const int64_t li = static_cast<int64_t>(i);
    TERN_TRY(layers[i].mixer_block->forward(li));
    TERN_TRY(ops.all_reduce_output());
    TERN_TRY(ops.trace_output(trace_name(li, "mixer_out")));
    TERN_TRY(layers[i].ffn_block->forward(li));
    TERN_TRY(ops.all_reduce_output());
    TERN_TRY(ops.trace_output(trace_name(li, "ffn_out")));
  }
  return head_block_->forward(-1);
}

Expected<SampleResults> CausalLm::forward_sample(std::span<const SequenceInput> batch,
                                                 std::span<const SampleRow> rows) const {
  if (rows.size() != batch.size()) {
    return make_error("forward_sample: {} sampling rows for {} sequences", rows.size(), batch.size());
  }
  TERN_ASSIGN_OR_RETURN(SampleResults results, runner_->forward_sample(batch, rows, [this] { return run_blocks(); }));
  for (const SequenceInput& in : batch) in.cache->length += static_cast<int64_t>(in.tokens.size());
  return results;
}

Expected<std::vector<float>> CausalLm::forward(std::span<const SequenceInput> batch, LogitsFor which,
                                               const Tracer* tracer) const {
  TERN_ASSIGN_OR_RETURN(std::vector<float> logits,
                        runner_->forward(batch, which, tracer, [this] { return run_blocks(); }));
  for (const SequenceInput& in : batch) in.cache->length += static_cast<int64_t>(in.tokens.size());
  return logits;
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

}  // namespace

Expected<std::unique_ptr<CausalLm>> model_build_host(const std::filesystem::path& dir, const ModelLoadOptions& options) {
  TERN_ASSIGN_OR_RETURN(ModelConfig config, model_config_load(dir));
  TERN_ASSIGN_OR_RETURN(std::unique_ptr<WeightStore> weights, open_weights(dir, config, options));
  const WeightSchema schema = weight_schema_build(config, weights->text_prefix());
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

Expected<std::unique_ptr<CausalLm>> model_load(const std::filesystem::path& dir, const ModelLoadOptions& options) {
  TERN_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> model, model_build_host(dir, options));
  const ModelConfig& config = model->config();
  std::unique_ptr<ModelRunner> runner;
  if (options.device == ModelDevice::kCuda) {
#if TERN_MODELS_CUDA
    auto cuda = gpu_runner_create(config, options.device_options);
    if (!cuda) return wrap_error(cuda.error(), dir.string());
    runner = std::move(*cuda);
#else
    return make_error("this tern was built without CUDA: --device cuda is not available");
#endif
  } else {
    runner = cpu_runner_create(config);
  }
  if (auto placed = model->place(std::move(runner)); !placed) return wrap_error(placed.error(), dir.string());
  return model;
}

int model_cuda_device_count() {
#if TERN_MODELS_CUDA
  return gpu_device_count();
#else
  return 0;
#endif
}

}  // namespace tern
