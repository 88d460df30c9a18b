// The CUDA implementations ("cuda") of the elementwise ops (built only with CUDA), run through the harnesses of
// ops/elementwise_op.h and the same verdicts as the CPU ones. The runners upload a case's inputs, let a caller
// adjust the kernel arguments (the GPU tests inject faults that way) and time the kernel with cuda_run_timed.
#pragma once

#include <functional>
#include <memory>

#include "core/error.h"
#include "kernels/cuda/elementwise/elementwise_launch.h"
#include "ops/elementwise_op.h"
#include "ops/registry.h"

namespace tern {

template <class Args>
using ArgsTweak = std::function<void(Args&)>;

// Output layouts as the harnesses define them (rms_norm with a residual: [h | y]).
Expected<RunOutput> rms_norm_cuda_run(const DeviceContext& ctx, const RmsNormInputs& in,
                                      const ArgsTweak<RmsNormArgs>& tweak = {});
Expected<RunOutput> rope_cuda_run(const DeviceContext& ctx, const RopeInputs& in, const ArgsTweak<RopeArgs>& tweak = {});
Expected<RunOutput> silu_mul_cuda_run(const DeviceContext& ctx, const SiluMulInputs& in,
                                      const ArgsTweak<SiluMulArgs>& tweak = {});
// Also fails when the kernel reports an out-of-range id.
Expected<RunOutput> embedding_cuda_run(const DeviceContext& ctx, const EmbeddingInputs& in,
                                       const ArgsTweak<EmbeddingArgs>& tweak = {});
Expected<RunOutput> residual_add_cuda_run(const DeviceContext& ctx, const ResidualAddInputs& in,
                                          const ArgsTweak<ResidualAddArgs>& tweak = {});

// bf16 outputs: one rounding of each element is at most half an ulp, below 2^-8 of the element and so of the
// largest output; 2^-16 more covers the fp32 arithmetic (a 16k-term sum of squares, expf, sincosf). A wrong
// formula (a missing 1 + w, a wrong pair, a wrong half) is off by O(1) of the output's scale.
inline constexpr Tolerance kBf16ElementwiseTolerance{.rel = 1.0 / 256 + 1.0 / 65536, .abs = 0.0};

// Registers "cuda" for rms_norm, rope, silu_mul, embedding and residual_add on `context`'s device and stream.
Expected<void> elementwise_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context);

}  // namespace tern
