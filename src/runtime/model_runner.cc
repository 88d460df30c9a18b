#include "runtime/model_runner.h"

#include "runtime/cpu_runner.h"
#include "runtime/tp_runner.h"

#if TERN_RUNTIME_CUDA
#include "runtime/cuda_runner.h"
#endif

namespace tern {

SequenceCache DeviceRunner::new_sequence() {
  SequenceCache cache = model_->new_cache();
  cache.device = new_device_state();
  return cache;
}

Expected<void> DeviceRunner::place() {
  TERN_TRY(model_->place(ops()));
  return finish_load();
}

Expected<std::vector<float>> ModelRunner::forward(std::span<const SequenceInput> batch, LogitsFor which,
                                                  const Tracer* tracer) {
  TERN_ASSIGN_OR_RETURN(std::vector<float> logits, step(batch, which, tracer));
  for (const SequenceInput& in : batch) in.cache->length += static_cast<int64_t>(in.tokens.size());
  return logits;
}

Expected<SampleResults> ModelRunner::forward_sample(std::span<const SequenceInput> batch,
                                                    std::span<const SampleRow> rows) {
  if (rows.size() != batch.size()) {
    return make_error("forward_sample: {} sampling rows for {} sequences", rows.size(), batch.size());
  }
  TERN_ASSIGN_OR_RETURN(SampleResults results, sample_step(batch, rows));
  for (const SequenceInput& in : batch) in.cache->length += static_cast<int64_t>(in.tokens.size());
  return results;
}

Expected<void> ModelRunner::check_inputs(std::span<const SequenceInput> batch) const {
  const int64_t vocab = config().vocab_size;
  for (const SequenceInput& in : batch) {
    for (const int32_t id : in.tokens) {
      if (id < 0 || id >= vocab) return make_error("token id {} is outside the vocabulary [0, {})", id, vocab);
    }
  }
  return {};
}

Expected<SampleResults> ModelRunner::sample_step(std::span<const SequenceInput> batch,
                                                 std::span<const SampleRow> rows) {
  TERN_ASSIGN_OR_RETURN(const std::vector<float> logits, step(batch, LogitsFor::kLastToken, nullptr));
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

Expected<std::unique_ptr<ModelRunner>> runner_load(const std::filesystem::path& dir, const ModelLoadOptions& options) {
  if ((options.tensor_parallel_size != 1 || options.nnodes != 1) && options.communicator == nullptr) {
    return tp_runner_load(dir, options);
  }
  TERN_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> model, model_build_host(dir, options));
  Expected<std::unique_ptr<ModelRunner>> runner;
  if (options.device == ModelDevice::kCuda) {
#if TERN_RUNTIME_CUDA
    runner = cuda_runner_create(std::move(model), options.device_options);
#else
    return make_error("this tern was built without CUDA: --device cuda is not available");
#endif
  } else {
    runner = cpu_runner_create(std::move(model));
  }
  if (!runner) return wrap_error(runner.error(), dir.string());
  return runner;
}

int runner_cuda_device_count() {
#if TERN_RUNTIME_CUDA
  return cuda_device_count();
#else
  return 0;
#endif
}

}  // namespace tern
