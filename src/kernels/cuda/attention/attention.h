// Checked launchers of the paged attention kernels (argument structs and semantics in attention_launch.h). Each
// validates shapes, pointers and alignment on the host and queues the kernels on ctx.stream(); errors name the
// kernel and the bad argument. Zero tokens (or sequences) is a no-op.
//
// Supported: head_dim 32, 64, 128 or 256; n_heads a multiple of n_kv_heads with at most kAttentionMaxGroup query
// heads per kv head; block_size a power of two in [8, 1024]. The attention kernels move 16 bytes at a time, so q,
// gate, out and the cache pools must be 16-byte aligned; attention_prepare reads and writes single elements and has
// no alignment needs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/attention/attention_launch.h"

namespace tern {

// The split-K workspace paged_attention needs for any n_kv_heads, any variant and any token count up to `tokens`
// with these bounds (0: none).
size_t paged_attention_workspace_bytes(const DeviceProps& props, int64_t tokens, int64_t n_heads, int64_t head_dim,
                                       int64_t max_seq_len);

Expected<void> attention_prepare(const DeviceContext& ctx, const AttentionPrepareArgs& args);
Expected<void> paged_attention(const DeviceContext& ctx, const PagedAttentionArgs& args,
                               AttentionVariant variant = AttentionVariant::kAuto);

}  // namespace tern
