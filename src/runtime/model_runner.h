// Where a model's steps run. A runner owns the model (models/causal_lm.h), made its blocks for its device at load
// through that device's BlockOps, and runs every step: it prepares the step's inputs for the blocks (the step's
// metadata, caches, activations), runs the model's one layer loop (CausalLm::run_blocks) — or, on CUDA, replays its
// graph — and returns the logits, or a sampled token per sequence. One runner per device kind: the CPU
// (runtime/cpu_runner.h) and a CUDA GPU (runtime/cuda_runner.h).
//
//   TERN_ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner, runner_load("/models/qwen3", {}));
//   SequenceCache seq = runner->new_sequence();
//   std::vector<SequenceInput> batch{{&seq, prompt_ids}};
//   TERN_ASSIGN_OR_RETURN(auto logits, runner->forward(batch, LogitsFor::kLastToken));  // [1, vocab]
//
// Not thread-safe: one thread drives a runner (the serving engine's).
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "layers/batch.h"
#include "layers/block_ops.h"
#include "models/causal_lm.h"
#include "kernels/cpu/sampler.h"

namespace tern {

// How one sequence of a step picks its next token: its own Sampler (parameters and random stream) and the ids its
// penalties read. A null sampler: the sequence is mid-prompt and samples nothing this step.
struct SampleRow {
  Sampler* sampler = nullptr;
  std::span<const int32_t> prompt_ids, output_ids;
};
// Per sequence of the step: the token, or why this sequence could not sample (a non-finite logit, a penalty id
// outside the vocabulary); an entry for a null sampler holds an unused token.
using SampleResults = std::vector<Expected<SampledToken>>;

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  ModelRunner(const ModelRunner&) = delete;
  ModelRunner& operator=(const ModelRunner&) = delete;

  // The model this runner runs (under tensor parallelism, rank 0's slice of it); its config is the whole model's.
  virtual const CausalLm& model() const = 0;
  const ModelConfig& config() const { return model().config(); }

  // A new sequence: its host caches and its device-side state (KV blocks, state slots), released with it.
  virtual SequenceCache new_sequence() = 0;
  // Runs the tokens of every sequence (each extends its cache) and returns logits [rows, vocab]: one row per token
  // in batch order (kAllTokens) or one per sequence (kLastToken). Errors on an out-of-range token id. `tracer`
  // (optional) receives the intermediates named by the blocks ("layers.N.mixer_out", "layers.N.ffn_out",
  // "layers.N.gdn_core", "layers.N.router_logits", "final_norm"), widened to fp32.
  Expected<std::vector<float>> forward(std::span<const SequenceInput> batch, LogitsFor which,
                                       const Tracer* tracer = nullptr);
  // One step that ends in a token per sequence (rows.size() == batch.size()): sampled where the logits are (on the
  // GPU for the CUDA runner; on the CPU through each row's Sampler), the same tokens up to the last-ulp differences
  // kernels/cpu/sampler.h bounds. An error fails the whole step; a row's own failure (non-finite logits) is in its
  // entry.
  Expected<SampleResults> forward_sample(std::span<const SequenceInput> batch, std::span<const SampleRow> rows);

  // What a step would refuse of this batch, found before anything runs: token ids outside the vocabulary (the
  // default) and, on a device, sizes and cache ids beyond what it holds. The tensor-parallel runner asks every rank
  // first, so that a refused batch fails alike on every rank and leaves the group working.
  virtual Expected<void> check_inputs(std::span<const SequenceInput> batch) const;

  // Why this runner can run no more steps (a tensor-parallel rank failed and its group was aborted); nullopt while
  // it works. Read by the thread that drives the runner.
  virtual std::optional<std::string> failure() const { return std::nullopt; }

  virtual ModelDevice device() const = 0;
  virtual std::string describe() const = 0;  // one line: device and what it holds
  // Tokens the KV cache holds over all sequences (what DeviceModelOptions::kv_cache_tokens asked for, or what fit in
  // device memory when it was 0); 0 where the cache grows with each sequence (the CPU) or the model has no
  // attention layers.
  virtual int64_t kv_cache_tokens() const = 0;

 protected:
  ModelRunner() = default;

  // One step: logits as forward returns them; the caches' lengths are advanced by forward.
  virtual Expected<std::vector<float>> step(std::span<const SequenceInput> batch, LogitsFor which,
                                            const Tracer* tracer) = 0;
  // step(kLastToken) ending in a token per sequence. The default samples step's logits through each row's Sampler;
  // a device that samples on its own (CUDA) overrides it.
  virtual Expected<SampleResults> sample_step(std::span<const SequenceInput> batch, std::span<const SampleRow> rows);
};

// A runner of one device holding the model it runs (the CPU's, a GPU's; or one tensor-parallel rank's slice).
class DeviceRunner : public ModelRunner {
 public:
  const CausalLm& model() const override { return *model_; }
  SequenceCache new_sequence() override;

 protected:
  explicit DeviceRunner(std::unique_ptr<CausalLm> model) : model_(std::move(model)) {}

  // Makes the model's blocks through ops(), then sizes the device's activations and caches from them
  // (finish_load). A device's factory calls it once, before the runner is handed out.
  Expected<void> place();
  // The model's layer loop over the step the device has set up.
  Expected<void> run_model() { return model_->run_blocks(ops()); }

  virtual BlockOps& ops() = 0;
  virtual Expected<void> finish_load() = 0;
  // A sequence's device-side state; null where the cache lives in the sequence's LayerCache (the CPU).
  virtual std::shared_ptr<DeviceSequenceState> new_device_state() = 0;

 private:
  std::unique_ptr<CausalLm> model_;
};

// Builds the model's host blocks from `dir` (models/causal_lm.h's model_build_host) and places them on
// options.device. Errors name the directory and what does not fit or is not supported on the device.
Expected<std::unique_ptr<ModelRunner>> runner_load(const std::filesystem::path& dir, const ModelLoadOptions& options);

// CUDA devices this binary can run a model on (0 when built without CUDA or when none is present).
int runner_cuda_device_count();

}  // namespace tern
