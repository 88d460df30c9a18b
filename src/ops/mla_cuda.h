// The CUDA implementations of the multi-head latent attention ops (built only with CUDA), run through the harnesses
// of ops/mla_op.h and the same verdicts as the CPU ones: "cuda" for mla_attention (kernels/cuda/mla/mla.h) and
// "cuda" for indexer_select (kernels/cuda/mla/indexer.h). The runners page a case's latent cache or indexer keys
// into shuffled blocks of a pool whose unused slots hold NaN (a read of a wrong slot shows in the output), poison the
// outputs before every run, let a caller adjust the kernel arguments (the GPU tests inject faults that way) and time
// the kernels with cuda_time_best.
#pragma once

#include <memory>

#include "core/error.h"
#include "kernels/cuda/mla/indexer_launch.h"
#include "kernels/cuda/mla/mla_launch.h"
#include "ops/elementwise_cuda.h"
#include "ops/mla_op.h"
#include "ops/registry.h"

namespace tern {

inline constexpr int64_t kMlaCaseBlockSize = 16;

// Output [tokens, n_heads, kv_lora_rank] as the harness defines it.
Expected<RunOutput> mla_attention_cuda_run(const DeviceContext& ctx, const MlaAttentionInputs& in,
                                           const ArgsTweak<MlaAttentionArgs>& tweak = {});

// The op's output (indexer_select_output of the kernel's selection).
Expected<RunOutput> indexer_select_cuda_run(const DeviceContext& ctx, const IndexerSelectInputs& in,
                                            const ArgsTweak<IndexerSelectArgs>& tweak = {});

// bf16 output: its rounding is at most 2^-8 of the largest output; the kernel keeps scores, probabilities and sums
// in fp32 (2^-12 more covers them, as for the attention op's decode kernel). A wrong scale, key, selection or block
// lookup is off by far more.
inline constexpr Tolerance kMlaAttentionCudaTolerance{.rel = 1.0 / 256 + 1.0 / 4096, .abs = 0.0};

// Registers "cuda" for "mla_attention" and for "indexer_select" on `context`'s device and stream.
Expected<void> mla_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context);

}  // namespace tern
