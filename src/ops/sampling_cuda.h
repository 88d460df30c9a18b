// The CUDA implementation ("cuda") of the sampling op (built only with CUDA), run through the harness of
// ops/sampling_op.h: kernels/cuda/sampling/sampling.h samples every row of a case in one launch, each row with its own
// parameters, penalty ids and the draw the CPU Sampler would take. The runner uploads a case, lets a caller adjust
// the kernel arguments (the GPU tests inject faults that way) and times the launch with the outputs poisoned first.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/sampling/sampling_launch.h"
#include "ops/elementwise_cuda.h"
#include "ops/registry.h"
#include "ops/sampling_op.h"

namespace tern {

// The kernel's per-row outputs as it left them; entries it never wrote hold kSamplingPoisonWord (as int32 or float
// bits).
inline constexpr int32_t kSamplingPoisonWord = static_cast<int32_t>(kPoisonF32Bits);
struct SamplingCudaResult {
  std::vector<int32_t> ids, status;  // [rows]
  std::vector<float> logprobs;       // [rows]
  double seconds = 0.0;              // the fastest of the timed launches
};

Expected<SamplingCudaResult> sampling_cuda_sample(const DeviceContext& ctx, const SamplingInputs& in,
                                                  const ArgsTweak<SampleArgs>& tweak = {});

// The op's output layout from a result: a row the kernel failed (non-zero status) is an error naming the row and
// the cause; unwritten entries become the poison pattern.
Expected<RunOutput> sampling_cuda_output(const SamplingInputs& in, const SamplingCudaResult& result);

// sampling_cuda_sample, then sampling_cuda_output.
Expected<RunOutput> sampling_cuda_run(const DeviceContext& ctx, const SamplingInputs& in,
                                      const ArgsTweak<SampleArgs>& tweak = {});

// Registers "cuda" for sampling on `context`'s device and stream.
Expected<void> sampling_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context);

}  // namespace tern
