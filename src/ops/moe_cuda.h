// The CUDA implementation ("cuda") of the moe op (built only with CUDA), run through the harness of ops/moe_op.h:
// the router GEMM (cuBLASLt, with the shared expert gate as one more output column), the bf16 shared expert
// (cuBLASLt + silu_mul), then moe_forward (route, align, grouped GEMMs, combine; kernels/cuda/moe/moe.h).
#pragma once

#include <memory>

#include "core/error.h"
#include "kernels/cuda/moe/moe.h"
#include "ops/elementwise_cuda.h"
#include "ops/moe_op.h"
#include "ops/registry.h"

namespace tern {

// Uploads the case, lets a caller adjust the routed part's arguments (the GPU tests inject faults that way) and times
// the whole block; the output is y [tokens, hidden].
Expected<RunOutput> moe_cuda_run(const DeviceContext& ctx, const MoeInputs& in,
                                 const ArgsTweak<MoeForwardArgs>& tweak = {},
                                 MoeGemmVariant variant = MoeGemmVariant::kAuto);

// Against the fp64 reference, relative to the largest |y|: the GPU rounds gate/up, the activation, each expert's
// output and the shared expert's to bf16 (2^-9 each, random in sign), which leaves a row's largest error near
// 2^-8.5 of its largest value; 2^-6 keeps a margin of several times and still rejects a dropped or misweighted
// expert (>= 1/top_k of the output) or a missing shared expert.
inline constexpr Tolerance kMoeCudaTolerance{.rel = 1.0 / 64, .abs = 0.0};

// Registers "cuda" for moe on `context`'s device and stream.
Expected<void> moe_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context);

}  // namespace tern
