// Where a model's steps run: a device's step metadata, activations and caches, and its BlockOps, which made the
// model's blocks for that device at load. One per device kind: CPU (models/cpu/cpu_runner.h) and CUDA
// (models/gpu/gpu_runner.h). A step hands the runner the model's layer loop (CausalLm::run_blocks) as `body`; the
// runner prepares the step's inputs for the blocks, runs the body (or, on CUDA, replays its graph) and returns what
// it produced.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "layers/batch.h"
#include "layers/block_ops.h"
#include "runtime/sampler.h"

namespace tern {

struct SequenceInput {
  SequenceCache* cache = nullptr;
  std::span<const int32_t> tokens;  // appended after what the cache holds
  // Where the sequence's state lives on a device with a paged KV cache, when a scheduler allocated it (the serving
  // engine: runtime/scheduler.h owns the ids): the KV blocks holding its tokens, in order (at least enough for
  // cache->length + tokens.size()), and its recurrent-state slot. Empty / -1: the sequence's own cache lease
  // (ModelRunner::new_sequence) takes them from the runner as it grows, for callers without a scheduler.
  std::span<const int32_t> kv_blocks;
  int32_t state_slot = -1;
};

enum class LogitsFor { kAllTokens, kLastToken };

// How one sequence of a step picks its next token: its own Sampler (parameters and random stream) and the ids its
// penalties read. A null sampler: the sequence is mid-prompt and samples nothing this step.
struct SampleRow {
  Sampler* sampler = nullptr;
  std::span<const int32_t> prompt_ids, output_ids;
};
// Per sequence of the step: the token, or why this sequence could not sample (a non-finite logit, a penalty id
// outside the vocabulary); an entry for a null sampler holds an unused token.
using SampleResults = std::vector<Expected<SampledToken>>;

enum class ModelDevice { kCpu, kCuda };

// The model's blocks from embedding to logits, run on the runner's device.
using StepBody = std::function<Expected<void>()>;

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;

  // Makes the model's blocks for this device (at load, before finish_load).
  virtual BlockOps& ops() = 0;
  // Once every block is made: sizes the activations and caches from them.
  virtual Expected<void> finish_load() = 0;

  // A sequence's device-side state (KV blocks, state slots), released with it; null where the cache lives in the
  // sequence's LayerCache (the CPU).
  virtual std::shared_ptr<DeviceSequenceState> new_sequence() = 0;
  // Logits [rows, vocab] as CausalLm::forward returns them. `tracer` (optional) receives the intermediates named
  // by the blocks ("layers.N.mixer_out", "layers.N.ffn_out", "layers.N.gdn_core", "layers.N.router_logits",
  // "final_norm"), widened to fp32.
  virtual Expected<std::vector<float>> forward(std::span<const SequenceInput> batch, LogitsFor which,
                                               const Tracer* tracer, const StepBody& body) = 0;
  // forward(kLastToken) ending in a token per sequence, sampled where the logits are. The default samples forward's
  // logits through each row's Sampler; a device that samples on its own (CUDA) overrides it with the same tokens,
  // up to the last-ulp differences runtime/sampler.h bounds.
  virtual Expected<SampleResults> forward_sample(std::span<const SequenceInput> batch, std::span<const SampleRow> rows,
                                                 const StepBody& body);
  virtual ModelDevice device() const = 0;
  virtual std::string describe() const = 0;  // one line: device and what it holds
  // Tokens the KV cache holds over all sequences (what DeviceModelOptions::kv_cache_tokens asked for, or what fit in
  // device memory when it was 0); 0 where the cache grows with each sequence (the CPU) or the model has no
  // attention layers.
  virtual int64_t kv_cache_tokens() const = 0;
};

}  // namespace tern
