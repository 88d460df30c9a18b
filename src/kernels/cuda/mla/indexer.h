// Checked launchers of the DSA lightning indexer kernels (argument structs and semantics in indexer_launch.h). Each
// validates shapes, pointers and alignment on the host and queues the kernels on ctx.stream(); errors name the kernel
// and the bad argument. Zero tokens (or sequences) is a no-op.
//
// Supported: head_dim a multiple of 16 in [16, 256], n_heads in [1, 64], any topk >= 1, block_size a power of two in
// [1, 1024]. indexer_select moves 16 bytes at a time, so q, the cache pool and the workspace must be 16-byte aligned;
// indexer_prepare reads and writes single elements and has no alignment needs.
#pragma once

#include "core/error.h"
#include "kernels/cuda/mla/indexer_launch.h"

namespace tern {

Expected<void> indexer_prepare(const DeviceContext& ctx, const IndexerPrepareArgs& args);
Expected<void> indexer_select(const DeviceContext& ctx, const IndexerSelectArgs& args);

}  // namespace tern
