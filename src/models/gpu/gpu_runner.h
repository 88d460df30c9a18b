// The model's steps on a CUDA device: the KV blocks and Gated DeltaNet state slots of each sequence, the step's
// metadata (planned on the host, uploaded in one copy), decode steps replayed as CUDA graphs per batch size and
// context bucket, and sampling on the device (gpu_sampler.h). The blocks themselves are cuda_ops.h's. The same
// contract as the CPU runner: one forward per batch of sequences, prefill and decode rows mixed.
//
// Every buffer is allocated at load for DeviceModelOptions::max_batch_tokens rows, so a step allocates nothing
// (except the logits of a prefill asking for more rows than any step before).
#pragma once

#include <memory>

#include "core/error.h"
#include "io/model_config.h"
#include "models/causal_lm.h"
#include "models/model_runner.h"

namespace tern {

// CUDA devices present (0 without a driver or a GPU).
int gpu_device_count();

// A runner on options.device; the model's blocks are made through its ops() and sized by finish_load(). Errors
// name what does not fit or what the CUDA path does not support yet (a layer kind, a bias, W4A4).
Expected<std::unique_ptr<ModelRunner>> gpu_runner_create(const ModelConfig& config, const DeviceModelOptions& options);

}  // namespace tern
