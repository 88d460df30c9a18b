// The model path on a CUDA device: the host CausalLm's weights uploaded once (models/gpu/gpu_weights.h), bf16
// activations with fp32 math inside every kernel, a paged KV cache per attention layer, fp32 Gated DeltaNet states
// in per-sequence slots, and one forward call per batch of sequences (prefill and decode rows mixed), the same
// contract as CausalLm::forward on the CPU.
//
// A forward step: embedding -> per layer [RMSNorm (+ residual) -> attention | Gated DeltaNet -> RMSNorm + residual
// -> MLP | MoE] -> final RMSNorm -> lm_head over the rows whose logits are wanted. Every buffer is allocated at
// creation for DeviceModelOptions::max_batch_tokens rows, so a step allocates nothing.
#pragma once

#include <memory>

#include "core/error.h"
#include "models/causal_lm.h"

namespace tern {

// Uploads `model`'s weights to options.device and sizes its caches. Errors name what does not fit or what the
// CUDA path does not support yet (a layer kind, a bias, W4A4).
// CUDA devices present (0 without a driver or a GPU).
int gpu_device_count();

Expected<std::unique_ptr<ForwardBackend>> gpu_backend_create(const CausalLm& model, const DeviceModelOptions& options);

}  // namespace tern
