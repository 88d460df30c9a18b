// Argument structs and unchecked launchers of the attention kernels of the GPU model path over a paged KV cache.
// Activations are bf16 (uint16_t bit patterns), the math inside is fp32, with the semantics of the CPU layers
// (layers/attention.cc: per-head q/k RMSNorm, NeoX RoPE on the first rotary_dim dims, causal grouped-query softmax
// attention as kernels/cpu/attention.cc, output * sigmoid(gate) for the gated Qwen3.5 form). The .cu side cannot
// include core/error.h (nvcc rejects fmt's consteval format strings), so validation lives in attention.cc and
// callers use attention.h.
//
// Every pointer, metadata included, is a device pointer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/device.h"

namespace tern {

// One layer's paged KV cache: K and V pools [n_blocks, block_size, n_kv_heads, head_dim] bf16. Token slot
// `block * block_size + offset` of a pool holds one token's n_kv_heads rows. K is stored after norm and RoPE.
// block_size must be a power of two in [8, 1024] (the kernels index with shifts and masks).
struct PagedKvCache {
  uint16_t* k = nullptr;
  uint16_t* v = nullptr;
  int64_t n_blocks = 0;
  int64_t block_size = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
};

// Fused pre-attention step for `tokens` new tokens: per-head RMSNorm of q and k (a null weight means no norm),
// RoPE on both (angle = float(positions[t]) * inv_freq[i] in fp32, cos and sin times attention_factor, NeoX
// rotate-half on the first rotary_dim dims; rotary_dim 0 means no RoPE and inv_freq may be null), q written
// contiguous to q_out, the gate half of a gated q_proj copied to gate_out, and k (normed + roped) and v written into
// the cache at slot_mapping[t]. A slot outside [0, n_blocks * block_size) (e.g. -1 for a padding token) writes
// nothing to the cache. Norm and RoPE are computed in fp32 and rounded to bf16 once.
struct AttentionPrepareArgs {
  const uint16_t* q_proj = nullptr;  // [tokens, q_proj_stride]: per token n_heads * (gated ? 2 : 1) * head_dim,
  int64_t q_proj_stride = 0;         //   per head [query hd | gate hd] when gated
  const uint16_t* k = nullptr;       // [tokens, kv_stride], first n_kv_heads * head_dim used
  const uint16_t* v = nullptr;       // [tokens, kv_stride], first n_kv_heads * head_dim used
  int64_t kv_stride = 0;
  const uint16_t* q_norm_weight = nullptr;  // optional [head_dim] bf16
  const uint16_t* k_norm_weight = nullptr;  // optional [head_dim] bf16
  float eps = 1e-6f;
  bool zero_centred = false;           // (1 + w) * x̂ (Qwen3.5) instead of w * x̂
  const int32_t* positions = nullptr;  // [tokens]
  const float* inv_freq = nullptr;     // [rotary_dim / 2] fp32
  int64_t rotary_dim = 0;
  float attention_factor = 1.0f;  // cos and sin times this (YaRN's attention factor)
  const int32_t* slot_mapping = nullptr;  // [tokens]
  uint16_t* q_out = nullptr;              // [tokens, n_heads, head_dim]
  uint16_t* gate_out = nullptr;           // [tokens, n_heads, head_dim], when gated
  PagedKvCache cache;
  int64_t tokens = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  bool gated = false;
};

// Attention of every new token over its sequence's cache (which already holds the new tokens' k/v). Sequence s owns
// query rows [query_start[s], query_start[s+1]) and seq_lens[s] cached tokens (including its new ones); its query i
// sits at position seq_lens[s] - n_q(s) + i and attends keys 0..that position (causal). Query head h reads kv head
// h / (n_heads / cache.n_kv_heads). Contract on the device metadata (not checkable on the host): n_q(s) <=
// seq_lens[s] <= max_seq_len, n_q(s) <= max_query_len, and block_tables[s] lists ceil(seq_lens[s] / block_size)
// valid block ids; the kernels never read table entries past max_blocks_per_seq.
struct PagedAttentionArgs {
  const uint16_t* q = nullptr;            // [tokens, n_heads, head_dim]
  const uint16_t* gate = nullptr;         // optional [tokens, n_heads, head_dim]: out *= sigmoid(gate)
  uint16_t* out = nullptr;                // [tokens, n_heads, head_dim]
  PagedKvCache cache;                     // read only here
  const int32_t* block_tables = nullptr;  // [n_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq = 0;
  const int32_t* query_start = nullptr;  // [n_seqs + 1]
  const int32_t* seq_lens = nullptr;     // [n_seqs]
  int64_t n_seqs = 0;
  int64_t tokens = 0;
  int64_t n_heads = 0;
  int64_t max_query_len = 0;  // host-known bounds over the batch, for grid sizing
  int64_t max_seq_len = 0;
  float scale = 1.0f;
  void* workspace = nullptr;  // split-K partials; size from paged_attention_workspace_bytes()
  size_t workspace_bytes = 0;
};

enum class AttentionVariant {
  kAuto,        // decode for max_query_len <= kAttentionDecodeMaxQueryLen, else prefill
  kDecode,      // split-K flash decoding, one block per (token, kv head, split); any query count, best for few
  kPrefill,     // tensor-core flash attention: on wgmma where attention_prefill_sm90_fits, else as kPrefillMma
  kPrefillMma,  // tensor-core flash attention on mma.sync over 64-row query tiles (every sm_80+ device)
};

inline constexpr int64_t kAttentionDecodeMaxQueryLen = 4;
inline constexpr int64_t kAttentionMaxGroup = 16;  // query heads per kv head: the 16 rows of the decode mma tiles

// Decode tiles: a block of kAttentionDecodeWarps warps owns (query row, kv head, key range); each warp walks its own
// chunks of kAttentionDecodeKeys keys (round robin over the range), gathering K and V rows with cp.async into its own
// `stages` buffers in shared memory, and keeps its own online softmax; the warps merge once at the end.
// blocks_per_sm is the occupancy the split count plans with (shared memory and a register estimate).
inline constexpr int kAttentionDecodeWarps = 4;
inline constexpr int kAttentionDecodeKeys = 16;
struct AttentionDecodeTiles {
  int stages = 0;         // 1 or 2 K/V buffers per warp; 0 when head_dim does not fit the device at all
  size_t smem_bytes = 0;  // dynamic shared memory per block
  int blocks_per_sm = 0;  // resident blocks per SM assumed by attention_decode_splits
};
AttentionDecodeTiles attention_decode_tiles(const DeviceProps& props, int64_t head_dim);

// Decode split-K: how many key ranges each (token, kv head) is cut into. Each query row cuts its own keys into
// n_splits equal ranges of at least kDecodeMinSplitKeys, so the count depends on max_seq_len only through the cost
// model and a cap: a decode step sized for a longer context (a CUDA graph's bucket) still spreads a short sequence
// over every split. The count minimises waves(n) * (max_seq_len / n + kDecodeMinSplitKeys) plus the partials' write
// and reduce, where a wave is num_sms * blocks_per_sm blocks (so a batch that leaves the last wave mostly empty gets
// more, shorter blocks). It never exceeds attention_decode_max_splits, which the workspace is sized from.
inline constexpr int64_t kDecodeMinSplitKeys = 64;
int64_t attention_decode_max_splits(const DeviceProps& props, int64_t head_dim, int64_t tokens, int64_t n_kv_heads,
                                    int64_t max_seq_len);
int64_t attention_decode_splits(const DeviceProps& props, int64_t head_dim, int64_t tokens, int64_t n_heads,
                                int64_t n_kv_heads, int64_t max_seq_len);

// Bytes of the split-K workspace: partial outputs [tokens, n_heads, n_splits, head_dim] fp32, then (max, sum)
// pairs [tokens, n_heads, n_splits, 2] fp32; 0 when one split suffices (the kernel then writes `out` directly).
inline size_t attention_decode_workspace_bytes(int64_t n_splits, int64_t tokens, int64_t n_heads, int64_t head_dim) {
  if (n_splits <= 1) return 0;
  const size_t rows = static_cast<size_t>(tokens * n_heads * n_splits);
  const size_t partial = (rows * static_cast<size_t>(head_dim) * 4 + 255) / 256 * 256;
  return partial + rows * 8;
}

// Prefill tiles: 64 query rows (4 warps x 16 mma rows) by kv_tile keys, K/V tiles `stages` deep in shared memory.
struct AttentionPrefillTiles {
  int kv_tile = 0;        // keys per K/V tile
  int stages = 0;         // 1 or 2 (cp.async double buffering)
  size_t smem_bytes = 0;  // dynamic shared memory per block; 0 when head_dim does not fit the device at all
};
AttentionPrefillTiles attention_prefill_tiles(const DeviceProps& props, int64_t head_dim);

// The prefill on wgmma (attention_prefill_sm90.cu): 128-row query tiles of two warpgroups; an sm_90 device, a build
// with sm_90a code, head_dim 64, 128 or 256 and the shared memory for its tiles.
bool attention_prefill_sm90_fits(const DeviceProps& props, int64_t head_dim);

// Unchecked launches on ctx.stream() for arguments the checked launchers have validated (counts >= 1).
void attention_prepare_launch(const DeviceContext& ctx, const AttentionPrepareArgs& args);
void paged_attention_decode_launch(const DeviceContext& ctx, const PagedAttentionArgs& args);
void paged_attention_prefill_launch(const DeviceContext& ctx, const PagedAttentionArgs& args);
void paged_attention_prefill_sm90_launch(const DeviceContext& ctx, const PagedAttentionArgs& args);

}  // namespace tern
