// The CUDA implementations of the Gated DeltaNet ops (built only with CUDA): "cuda" for gdn_conv, "cuda-recurrent"
// and "cuda-chunked" for gdn_delta_rule, "fused" and "separate" for gdn_delta_rule_norm, run through the harnesses of
// ops/gdn_op.h and the same verdicts as the CPU ones. The runners upload a case's inputs, let a caller adjust the
// kernel arguments (the GPU tests inject faults that way), and time the kernel with the states restored before every
// run, since the kernels update them in place.
#pragma once

#include <functional>
#include <memory>

#include "core/error.h"
#include "kernels/cuda/gated_delta/gated_delta_launch.h"
#include "ops/gdn_op.h"
#include "ops/registry.h"

namespace tern {

template <class Args>
using GdnArgsTweak = std::function<void(Args&)>;

// Outputs in the harnesses' layout: [y or out (bf16 widened, unwritten elements as the poison pattern) | states].
Expected<RunOutput> gdn_conv_cuda_run(const DeviceContext& ctx, const GdnConvInputs& in,
                                      const GdnArgsTweak<GdnConvArgs>& tweak = {});
Expected<RunOutput> gdn_delta_rule_cuda_run(const DeviceContext& ctx, const GdnDeltaRuleInputs& in, GdnVariant variant,
                                            const GdnArgsTweak<GdnDeltaRuleArgs>& tweak = {});
// gdn_delta_rule_norm: the gated norm in the recurrent kernel (fused) or the recurrent kernel then rms_norm.
Expected<RunOutput> gdn_delta_rule_norm_cuda_run(const DeviceContext& ctx, const GdnDeltaRuleNormInputs& in, bool fused,
                                                 const GdnArgsTweak<GdnDeltaRuleArgs>& tweak = {});

// Registers the implementations on `context`'s device and stream.
Expected<void> gdn_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context);

}  // namespace tern
