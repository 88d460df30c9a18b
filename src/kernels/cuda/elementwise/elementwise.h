// Checked launchers of the elementwise kernels (argument structs and semantics in elementwise_launch.h). Each
// validates shapes, pointers and alignment and queues the kernel on ctx.stream(); errors name the kernel and the
// bad argument. A count of zero (rows, tokens, n) is a no-op.
//
// The vectorised kernels (rms_norm, silu_mul, embedding, residual_add) move 16 bytes at a time: their bf16
// pointers must be 16-byte aligned and their row lengths multiples of 8.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/elementwise/elementwise_launch.h"

namespace tern {

Expected<void> rms_norm(const DeviceContext& ctx, const RmsNormArgs& args);
Expected<void> rope(const DeviceContext& ctx, const RopeArgs& args);
Expected<void> silu_mul(const DeviceContext& ctx, const SiluMulArgs& args);
Expected<void> residual_add(const DeviceContext& ctx, const ResidualAddArgs& args);

// Queues the lookup; the ids are range-checked on the device (an out-of-range id reads nothing and gives a zero
// row). embedding_check_ids() then waits for the stream and reports the first bad id with its token.
Expected<void> embedding_lookup(const DeviceContext& ctx, const EmbeddingArgs& args);
Expected<void> embedding_check_ids(const DeviceContext& ctx, const EmbeddingArgs& args);

// The default RoPE frequency table, computed as layers/rope.cc does (fp32 pow), for RopeArgs::inv_freq.
std::vector<float> rope_inv_freq(int64_t rotary_dim, double theta);

}  // namespace tern
