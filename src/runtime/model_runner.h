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
// Which hidden states the rows of a draft step read (ModelRunner::draft).
enum class DraftHidden {
  kModel,  // the model's own, after its final norm (before it for a DeepSeek / GLM draft module, DraftModule):
            // the sequence's rows in the runner's last forward step
  kDraft,  // the draft module's output: the sequence's last row in the runner's last draft step
};

// One sequence of a draft step: row j runs the draft module at position `position + j` on seq.tokens[j] (the
// token that followed that position) with hidden state j of the sequence `source` of the step named by `hidden`:
// its rows from the first on (kModel), or its last row (kDraft, one row only).
struct DraftInput {
  SequenceInput seq;  // the cache, the tokens and the KV ids; `verify` is not used
  int64_t position = 0;
  DraftHidden hidden = DraftHidden::kModel;
  int64_t source = 0;  // the sequence's index in that step's batch
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
  // One step that samples a token for every row forward() would return logits for (each sequence's last row, every
  // row of a verified one: SequenceInput::verify), each with its own entry of `rows` (a null sampler: no token), on
  // the device where the logits are: a speculative verification's rows without their logits leaving the GPU.
  Expected<SampleResults> forward_sample_rows(std::span<const SequenceInput> batch, std::span<const SampleRow> rows);

  // Speculative decoding (runtime/speculative.h): whether the model's draft module was loaded
  // (ModelLoadOptions::load_draft).
  bool has_draft() const { return model().draft != nullptr; }
  // After a step that verified `seq` (SequenceInput::verify) over n rows, keeps its first `rows` (1 <= rows <= n):
  // the cache holds `rows` more tokens than before that step and its recurrent states are those after row `rows`,
  // as if only those rows had run. The KV entries of the rows dropped are overwritten by later steps.
  Expected<void> keep_rows(SequenceCache& seq, int64_t rows);
  // The draft module over `inputs` (each sequence's cache gets the draft layer's KV at the inputs' positions; its
  // length is not changed): logits of every row (kAllTokens) or of each input's last row (kLastToken). The hidden
  // states of the last forward step and of this draft step stay with the runner until the next of each.
  Expected<std::vector<float>> draft(std::span<const DraftInput> inputs, LogitsFor which);
  // draft(inputs, kLastToken) reduced to each input's greedy proposal (the arg-max of its last row, the lowest id
  // among equal logits), computed where the logits are (on the GPU only the ids come back).
  Expected<std::vector<int32_t>> draft_argmax(std::span<const DraftInput> inputs);

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

  // The time of one all-reduce of `elements` activations over the runner's tensor-parallel ranks, in the type its
  // steps reduce (bf16 on GPUs, fp32 on the CPU): the slowest rank's median of `repeats` (each repeat on the GPU a
  // back-to-back batch timed by events, so that the launch gaps of a graph step are not counted). For `tern bench`;
  // an error where there is nothing to time (one rank) or it cannot be timed from here (ranks on other nodes).
  virtual Expected<double> all_reduce_ms(int64_t elements, int repeats);

  // The bytes of step plans this process has sent to the other nodes' ranks so far (node 0 of several); 0 elsewhere.
  virtual int64_t plan_bytes_sent() const { return 0; }

 protected:
  ModelRunner() = default;

  // One step: logits as forward returns them; the caches' lengths are advanced by forward.
  virtual Expected<std::vector<float>> step(std::span<const SequenceInput> batch, LogitsFor which,
                                            const Tracer* tracer) = 0;
  // step(kLastToken) ending in a token per sequence. The default samples step's logits through each row's Sampler;
  // a device that samples on its own (CUDA) overrides it.
  virtual Expected<SampleResults> sample_step(std::span<const SequenceInput> batch, std::span<const SampleRow> rows);
  // forward_sample_rows' step. The default samples step's logits through each row's Sampler.
  virtual Expected<SampleResults> sample_rows_step(std::span<const SequenceInput> batch,
                                                   std::span<const SampleRow> rows);
  // The device's part of keep_rows: every recurrent state of `seq` set to the one after row `rows` of its last
  // verification (the KV length is the caller's). The default: a device without a draft module.
  virtual Expected<void> restore_verified(SequenceCache& seq, int64_t rows);
  // The device's part of draft(), on inputs draft() checked: `hidden_rows[k]` is the row, in the buffer of hidden
  // states of the step inputs.front().hidden names, that the k-th row of the draft step reads.
  virtual Expected<std::vector<float>> draft_step(std::span<const DraftInput> inputs, LogitsFor which,
                                                  std::span<const int64_t> hidden_rows);
  // draft_argmax's part: the default takes draft_step's last-row logits to the host.
  virtual Expected<std::vector<int32_t>> draft_argmax_step(std::span<const DraftInput> inputs,
                                                           std::span<const int64_t> hidden_rows);

 private:
  // Where each sequence's rows sat in the last forward step and the last draft step, for draft()'s checks.
  struct StepRows {
    int64_t row_begin = 0, n_rows = 0, position = 0;
  };
  static std::vector<StepRows> rows_of(std::span<const SequenceInput> batch);
  // draft()'s checks of the inputs against the steps their hidden states come from: the hidden row each draft row
  // reads, and where each input's rows sit in the draft step.
  Expected<std::vector<int64_t>> draft_rows(std::span<const DraftInput> inputs, std::vector<StepRows>& rows) const;
  std::vector<StepRows> last_forward_, last_draft_;
};

// A runner of one device holding the model it runs (the CPU's, a GPU's; or one tensor-parallel rank's slice).
class DeviceRunner : public ModelRunner {
 public:
  const CausalLm& model() const override { return *model_; }
  SequenceCache new_sequence() override;

 protected:
  explicit DeviceRunner(std::unique_ptr<CausalLm> model) : model_(std::move(model)) {}

  // Makes the model's blocks through ops(), then sizes the device's activations and caches from them
  // (finish_load), then releases the host weights where the device's blocks hold copies of them
  // (BlockOps::blocks_copy_weights). A device's factory calls it once, before the runner is handed out.
  Expected<void> place();
  // The model's layer loop over the step the device has set up.
  Expected<void> run_model() { return model_->run_blocks(ops()); }
  // The draft module's loop over the draft step the device has set up.
  Expected<void> run_draft() { return model_->run_draft_blocks(ops()); }

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
