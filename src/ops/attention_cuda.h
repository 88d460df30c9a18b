// The CUDA implementations of the attention op (built only with CUDA): "cuda-decode" (split-K flash decoding) and
// "cuda-prefill" (tensor-core flash attention), run through the harness of ops/attention_op.h and the same verdicts
// as the CPU one. The runner pages a case's caches into shuffled blocks of a pool whose unused slots hold NaN (a
// read of a wrong slot shows in the output), lets a caller adjust the kernel arguments (the GPU tests inject faults
// that way) and times the kernel with cuda_run_timed.
#pragma once

#include <memory>

#include "core/error.h"
#include "kernels/cuda/attention/attention_launch.h"
#include "ops/attention_op.h"
#include "ops/elementwise_cuda.h"
#include "ops/registry.h"

namespace tern {

inline constexpr int64_t kAttentionCaseBlockSize = 16;

// Output [tokens, n_heads, head_dim] as the harness defines it.
Expected<RunOutput> attention_cuda_run(const DeviceContext& ctx, const AttentionInputs& in, AttentionVariant variant,
                                       const ArgsTweak<PagedAttentionArgs>& tweak = {});

// bf16 output: its rounding is at most 2^-8 of the largest output. Decode keeps probabilities in fp32 (2^-12 more
// covers the fp32 sums and exp2); prefill feeds them to the tensor cores as bf16, one more rounding of up to 2^-8
// per term, hence 2^-7. A wrong scale, mask, head mapping or block lookup is off by far more on short contexts.
inline constexpr Tolerance kAttentionDecodeTolerance{.rel = 1.0 / 256 + 1.0 / 4096, .abs = 0.0};
inline constexpr Tolerance kAttentionPrefillTolerance{.rel = 1.0 / 128, .abs = 0.0};

// Registers "cuda-decode" and "cuda-prefill" for "attention" on `context`'s device and stream.
Expected<void> attention_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context);

}  // namespace tern
