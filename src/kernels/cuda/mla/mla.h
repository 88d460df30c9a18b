// Checked launchers of the multi-head latent attention kernels (argument structs and semantics in mla_launch.h).
// Each validates shapes, pointers and alignment on the host and queues its kernel on ctx.stream(); errors name the
// kernel and the bad argument. Zero tokens is a no-op.
//
// Supported: kv_lora_rank and rope_dim multiples of 16, kv_lora_rank <= 512, rope_dim <= 128; block_size a power
// of two; an FP8 cache (LatentCacheDtype::kFp8) with kv_lora_rank 512 and rope_dim <= 64; the attention kernel's
// shared memory (mla_attention_smem_bytes) within the device's per-block limit (GLM-5's 576-value latent fits
// sm_120's 101,376 bytes).
#pragma once

#include "core/error.h"
#include "kernels/cuda/mla/mla_launch.h"

namespace tern {

Expected<void> mla_prepare(const DeviceContext& ctx, const MlaPrepareArgs& args);
Expected<void> mla_attention(const DeviceContext& ctx, const MlaAttentionArgs& args);
// Whether the attention kernel's tiles for a latent of `width` values fit the device's shared memory per block.
bool mla_attention_fits(const DeviceProps& props, int64_t width);

}  // namespace tern
