#include "runtime/model_runner.h"

#include <algorithm>

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
  TERN_TRY(finish_load());
  // A device that copied every weight never reads the host's again: the dummy weights and the tensor-parallel
  // slices the store copied (all of a rank's row-parallel weights) are freed, not held for the server's life.
  if (ops().blocks_copy_weights()) model_->release_host_weights();
  return {};
}

Expected<std::vector<float>> ModelRunner::forward(std::span<const SequenceInput> batch, LogitsFor which,
                                                  const Tracer* tracer) {
  // Where each sequence's rows sit, for a draft step after this one (nothing to keep without a draft module).
  std::vector<StepRows> rows = has_draft() ? rows_of(batch) : std::vector<StepRows>{};
  TERN_ASSIGN_OR_RETURN(std::vector<float> logits, step(batch, which, tracer));
  last_forward_ = std::move(rows);
  for (const SequenceInput& in : batch) {
    in.cache->length += static_cast<int64_t>(in.tokens.size());
    in.cache->verified_rows = in.verify ? static_cast<int64_t>(in.tokens.size()) : 0;
  }
  return logits;
}

Expected<void> ModelRunner::keep_rows(SequenceCache& seq, int64_t rows) {
  if (seq.verified_rows == 0) return make_error("keep_rows: the sequence's last step verified nothing");
  if (rows < 1 || rows > seq.verified_rows) {
    return make_error("keep_rows: {} rows asked of a verification of {}", rows, seq.verified_rows);
  }
  TERN_TRY(restore_verified(seq, rows));
  seq.length -= seq.verified_rows - rows;
  seq.verified_rows = 0;
  return {};
}

std::vector<ModelRunner::StepRows> ModelRunner::rows_of(std::span<const SequenceInput> batch) {
  std::vector<StepRows> rows;
  int64_t begin = 0;
  for (const SequenceInput& in : batch) {
    rows.push_back({begin, static_cast<int64_t>(in.tokens.size()), in.cache->length});
    begin += static_cast<int64_t>(in.tokens.size());
  }
  return rows;
}

Expected<std::vector<int64_t>> ModelRunner::draft_rows(std::span<const DraftInput> inputs,
                                                       std::vector<StepRows>& rows) const {
  if (!has_draft()) return make_error("the model was loaded without its draft module");
  const int64_t vocab = config().vocab_size;
  std::vector<int64_t> hidden_rows;
  int64_t begin = 0;
  for (const DraftInput& in : inputs) {
    const int64_t n = static_cast<int64_t>(in.seq.tokens.size());
    if (in.seq.cache == nullptr || n == 0) return make_error("a draft input without a cache or tokens");
    if (in.hidden != inputs.front().hidden) return make_error("a draft step reads the hidden states of one step");
    for (const int32_t id : in.seq.tokens) {
      if (id < 0 || id >= vocab) return make_error("token id {} is outside the vocabulary [0, {})", id, vocab);
    }
    const std::vector<StepRows>& from = in.hidden == DraftHidden::kModel ? last_forward_ : last_draft_;
    if (in.source < 0 || in.source >= static_cast<int64_t>(from.size())) {
      return make_error("a draft input reads sequence {} of a step of {}", in.source, from.size());
    }
    const StepRows& src = from[static_cast<size_t>(in.source)];
    if (in.hidden == DraftHidden::kModel) {
      // Row j is position src.position + j, whose hidden state the model computed.
      if (in.position != src.position || n > src.n_rows) {
        return make_error("draft rows at positions {}..{} read the model's rows at {}..{}", in.position,
                          in.position + n - 1, src.position, src.position + src.n_rows - 1);
      }
      for (int64_t j = 0; j < n; ++j) hidden_rows.push_back(src.row_begin + j);
    } else {
      // A chain: one row at the position after the source's last.
      if (n != 1 || in.position != src.position + src.n_rows) {
        return make_error("a chained draft row at position {} (of {}) after draft rows ending at {}", in.position, n,
                          src.position + src.n_rows - 1);
      }
      hidden_rows.push_back(src.row_begin + src.n_rows - 1);
    }
    rows.push_back({begin, n, in.position});
    begin += n;
  }
  return hidden_rows;
}

Expected<std::vector<float>> ModelRunner::draft(std::span<const DraftInput> inputs, LogitsFor which) {
  std::vector<StepRows> rows;
  TERN_ASSIGN_OR_RETURN(const std::vector<int64_t> hidden_rows, draft_rows(inputs, rows));
  TERN_ASSIGN_OR_RETURN(std::vector<float> logits, draft_step(inputs, which, hidden_rows));
  last_draft_ = std::move(rows);
  return logits;
}

Expected<std::vector<int32_t>> ModelRunner::draft_argmax(std::span<const DraftInput> inputs) {
  std::vector<StepRows> rows;
  TERN_ASSIGN_OR_RETURN(const std::vector<int64_t> hidden_rows, draft_rows(inputs, rows));
  TERN_ASSIGN_OR_RETURN(std::vector<int32_t> ids, draft_argmax_step(inputs, hidden_rows));
  last_draft_ = std::move(rows);
  return ids;
}

Expected<std::vector<int32_t>> ModelRunner::draft_argmax_step(std::span<const DraftInput> inputs,
                                                             std::span<const int64_t> hidden_rows) {
  TERN_ASSIGN_OR_RETURN(const std::vector<float> logits, draft_step(inputs, LogitsFor::kLastToken, hidden_rows));
  const size_t vocab = static_cast<size_t>(config().vocab_size);
  std::vector<int32_t> ids;
  for (size_t r = 0; r < inputs.size(); ++r) {
    const auto row = std::span<const float>(logits).subspan(r * vocab, vocab);
    ids.push_back(static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin()));
  }
  return ids;
}

Expected<double> ModelRunner::all_reduce_ms(int64_t, int) {
  return make_error("{}: one rank, no collectives to time", describe());
}

Expected<void> ModelRunner::restore_verified(SequenceCache&, int64_t) {
  return make_error("{} cannot verify speculative tokens", describe());
}

Expected<std::vector<float>> ModelRunner::draft_step(std::span<const DraftInput>, LogitsFor, std::span<const int64_t>) {
  return make_error("{} cannot run a draft module", describe());
}

Expected<SampleResults> ModelRunner::forward_sample(std::span<const SequenceInput> batch,
                                                    std::span<const SampleRow> rows) {
  if (rows.size() != batch.size()) {
    return make_error("forward_sample: {} sampling rows for {} sequences", rows.size(), batch.size());
  }
  for (const SequenceInput& in : batch) {
    if (in.verify) return make_error("forward_sample: a verification step returns logits (forward), not tokens");
  }
  std::vector<StepRows> step_rows = has_draft() ? rows_of(batch) : std::vector<StepRows>{};
  TERN_ASSIGN_OR_RETURN(SampleResults results, sample_step(batch, rows));
  last_forward_ = std::move(step_rows);
  for (const SequenceInput& in : batch) {
    in.cache->length += static_cast<int64_t>(in.tokens.size());
    in.cache->verified_rows = 0;
  }
  return results;
}

Expected<SampleResults> ModelRunner::forward_sample_rows(std::span<const SequenceInput> batch,
                                                         std::span<const SampleRow> rows) {
  size_t want = 0;
  for (const SequenceInput& in : batch) want += in.verify ? in.tokens.size() : 1;
  if (rows.size() != want) {
    return make_error("forward_sample_rows: {} sampling rows for {} logit rows", rows.size(), want);
  }
  std::vector<StepRows> step_rows = has_draft() ? rows_of(batch) : std::vector<StepRows>{};
  TERN_ASSIGN_OR_RETURN(SampleResults results, sample_rows_step(batch, rows));
  last_forward_ = std::move(step_rows);
  for (const SequenceInput& in : batch) {
    in.cache->length += static_cast<int64_t>(in.tokens.size());
    in.cache->verified_rows = in.verify ? static_cast<int64_t>(in.tokens.size()) : 0;
  }
  return results;
}

Expected<SampleResults> ModelRunner::sample_rows_step(std::span<const SequenceInput> batch,
                                                      std::span<const SampleRow> rows) {
  TERN_ASSIGN_OR_RETURN(const std::vector<float> logits, step(batch, LogitsFor::kLastToken, nullptr));
  const size_t vocab = static_cast<size_t>(config().vocab_size);
  SampleResults results;
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
  return sample_rows_step(batch, rows);  // no verification: one logit row per sequence
}

Expected<std::unique_ptr<ModelRunner>> runner_load(const std::filesystem::path& dir, const ModelLoadOptions& options) {
  const bool group = options.tensor_parallel_size != 1 || options.nnodes != 1 || options.front_end;
  if (group && options.communicator == nullptr) {
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
