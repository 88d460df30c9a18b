#include "models/causal_lm.h"

#include <fmt/format.h>

#include "models/weight_schema.h"

#if TERN_MODELS_CUDA
#include "models/gpu/gpu_model.h"
#endif

namespace tern {

SequenceCache CausalLm::new_sequence() const {
  SequenceCache cache;
  cache.layers.resize(layers.size());
  if (backend_) cache.device = backend_->new_sequence();
  return cache;
}

Expected<SampleResults> CausalLm::forward_sample(std::span<const SequenceInput> batch,
                                                 std::span<const SampleRow> rows) const {
  if (rows.size() != batch.size()) {
    return make_error("forward_sample: {} sampling rows for {} sequences", rows.size(), batch.size());
  }
  if (backend_) {
    TERN_ASSIGN_OR_RETURN(SampleResults results, backend_->forward_sample(batch, rows));
    for (const SequenceInput& in : batch) in.cache->length += static_cast<int64_t>(in.tokens.size());
    return results;
  }
  TERN_ASSIGN_OR_RETURN(const std::vector<float> logits, forward(batch, LogitsFor::kLastToken));
  const size_t vocab = batch.empty() ? 0 : logits.size() / batch.size();
  SampleResults results;
  results.reserve(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].sampler == nullptr) {
      results.emplace_back(SampledToken{});
      continue;
    }
    results.push_back(rows[i].sampler->sample(std::span<const float>(logits).subspan(i * vocab, vocab),
                                              rows[i].prompt_ids, rows[i].output_ids));
  }
  return results;
}

Expected<std::vector<float>> CausalLm::forward(std::span<const SequenceInput> batch, LogitsFor which,
                                               const Tracer* tracer) const {
  if (backend_) {
    TERN_ASSIGN_OR_RETURN(std::vector<float> logits, backend_->forward(batch, which, tracer));
    for (const SequenceInput& in : batch) in.cache->length += static_cast<int64_t>(in.tokens.size());
    return logits;
  }
  const int64_t hidden = config_.hidden_size, vocab = lm_head.out_features();
  Batch b;
  for (const SequenceInput& in : batch) {
    b.sequences.push_back({b.n_rows, static_cast<int64_t>(in.tokens.size()), in.cache->length, in.cache});
    b.n_rows += static_cast<int64_t>(in.tokens.size());
  }
  std::vector<float> x(b.n_rows * hidden), normed(b.n_rows * hidden), out(b.n_rows * hidden);
  int64_t row = 0;
  for (const SequenceInput& in : batch) {
    for (int32_t id : in.tokens) {
      if (id < 0 || id >= embed_tokens.rows) return make_error("token id {} is outside the vocabulary [0, {})", id,
                                                               embed_tokens.rows);
      cpu_matrix_row(embed_tokens, id, &x[row++ * hidden]);
    }
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    const DecoderLayer& layer = layers[l];
    const int64_t li = static_cast<int64_t>(l);
    layer.input_norm.forward(x.data(), b.n_rows, normed.data());
    layer.mixer->forward(normed.data(), out.data(), b, li, tracer);
    if (tracer) (*tracer)(trace_name(li, "mixer_out"), out.data(), b.n_rows, hidden);
    for (size_t i = 0; i < x.size(); ++i) x[i] += out[i];
    layer.post_attention_norm.forward(x.data(), b.n_rows, normed.data());
    layer.ffn->forward(normed.data(), out.data(), b.n_rows, trace_name(li, ""), tracer);
    if (tracer) (*tracer)(trace_name(li, "ffn_out"), out.data(), b.n_rows, hidden);
    for (size_t i = 0; i < x.size(); ++i) x[i] += out[i];
    if (tracer) (*tracer)(trace_name(li, "out"), x.data(), b.n_rows, hidden);
  }
  for (const BatchSlice& s : b.sequences) s.cache->length += s.n_rows;

  // Only the rows whose logits are wanted go through the final norm and lm_head.
  std::vector<float> rows;
  if (which == LogitsFor::kAllTokens) {
    rows = std::move(x);
  } else {
    for (const BatchSlice& s : b.sequences) {
      const float* last = &x[(s.row_begin + s.n_rows - 1) * hidden];
      rows.insert(rows.end(), last, last + hidden);
    }
  }
  const int64_t n = static_cast<int64_t>(rows.size()) / hidden;
  final_norm.forward(rows.data(), n, rows.data());
  if (tracer) (*tracer)("final_norm", rows.data(), n, hidden);
  std::vector<float> logits(n * vocab);
  lm_head.forward(rows.data(), n, logits.data());
  return logits;
}

namespace {

Expected<std::unique_ptr<WeightStore>> open_weights(const std::filesystem::path& dir, const ModelConfig& config,
                                                    const ModelLoadOptions& options) {
  if (options.load_format == LoadFormat::kAuto) return WeightStore::open_checkpoint(dir);
  TERN_ASSIGN_OR_RETURN(std::optional<QuantConfig> quant, quant_config_load(dir));
  return WeightStore::make_dummy(config, weight_schema_build(config, weight_schema_default_text_prefix(config)), quant,
                                 options.dummy_seed);
}

}  // namespace

Expected<std::unique_ptr<CausalLm>> model_load(const std::filesystem::path& dir, const ModelLoadOptions& options) {
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
  if (options.device == ModelDevice::kCuda) {
#if TERN_MODELS_CUDA
    auto backend = gpu_backend_create(*model, options.device_options);
    if (!backend) return wrap_error(backend.error(), dir.string());
    model->set_backend(std::move(*backend));
#else
    return make_error("this tern was built without CUDA: --device cuda is not available");
#endif
  }
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
