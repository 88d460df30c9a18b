// Argument structs and unchecked launchers of the multi-head latent attention kernels (DeepSeek-V3, GLM-5) in the
// weight-absorbed form over a paged latent cache, with the semantics of the CPU layer (layers/mla.cc,
// MlaAttention::attend_absorbed): per head, score_s = (q_lat . c_s + q_pe . k_pe_s) * scale over the keys the row
// attends (causal, or the DSA indexer's selection), o_lat = sum_s softmax(score)_s c_s. The per-head products around
// it (q_lat = W_UK^T q_nope, o = W_UV o_lat) are batched BF16 GEMMs (gemm_bf16 with batch), the indexer's kernels
// are in indexer_launch.h. Activations are bf16 (uint16_t bit patterns), the math inside fp32. Validation lives in
// mla.cc; callers use mla.h.
//
// Every pointer, metadata included, is a device pointer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/latent_fp8.h"
#include "kernels/cuda/device.h"

namespace tern {

// How a latent cache holds a token: kBf16, the kv_lora_rank + rope_dim values as bf16; kFp8, the FP8 entry of
// core/latent_fp8.h (656 bytes for GLM-5 / DeepSeek-V3: e4m3 codes of c with an fp32 scale per 128 values, then k_pe
// as bf16), whose values the attention reads back as the bf16 products latent_fp8_unpack defines.
enum class LatentCacheDtype : int32_t { kBf16, kFp8 };

// One layer's paged latent cache: [n_blocks, block_size] entries of entry_bytes(), per token the normed latent c then
// the roped k_pe (the 576 values a GLM-5 / DeepSeek-V3 token keeps). Token slot `block * block_size + offset`;
// block_size a power of two (as PagedKvCache).
struct PagedLatentCache {
  void* data = nullptr;
  int64_t n_blocks = 0;
  int64_t block_size = 0;
  int64_t kv_lora_rank = 0;
  int64_t rope_dim = 0;
  LatentCacheDtype dtype = LatentCacheDtype::kBf16;
  bool pow2_scales = false;  // kFp8: mla_prepare rounds the tile scales up to powers of two (DeepSeek's form)
  int64_t width() const { return kv_lora_rank + rope_dim; }
  int64_t entry_bytes() const {
    return dtype == LatentCacheDtype::kFp8 ? latent_fp8_bytes(kv_lora_rank, rope_dim) : 2 * width();
  }
};

// Before attention, per new token t: c = RMSNorm(kv_a[t, :kv_lora_rank]) * weight and k_pe = RoPE(kv_a[t,
// kv_lora_rank:]) written to the cache at slot_mapping[t] (a slot outside the pool, e.g. -1 for a padding row,
// writes nothing; an FP8 cache gets the entry latent_fp8_pack makes of the fp32 c and k_pe); each head's q_pe =
// RoPE(q[t, h, nope_dim:]) written to the last rope_dim columns of q_latent[t, h] (its first kv_lora_rank columns
// are the absorbed query, which the batched GEMM writes). RoPE:
// angle = float(positions[t]) * inv_freq[i] in fp32; interleaved pairs (x[2i], x[2i + 1]) or NeoX halves (x[i],
// x[i + rope_dim / 2]). fp32 math, one rounding to bf16.
struct MlaPrepareArgs {
  const uint16_t* kv_a = nullptr;  // [tokens, kv_a_stride]: c then k_pe
  int64_t kv_a_stride = 0;
  const uint16_t* kv_norm_weight = nullptr;  // [kv_lora_rank]
  float eps = 1e-6f;
  bool zero_centred = false;  // (1 + w) * x̂ instead of w * x̂
  const uint16_t* q = nullptr;  // [tokens, q_stride]: per head [nope_dim | rope_dim]
  int64_t q_stride = 0;
  uint16_t* q_latent = nullptr;  // [tokens, n_heads, kv_lora_rank + rope_dim]
  const int32_t* positions = nullptr;  // [tokens]
  const float* inv_freq = nullptr;     // [rope_dim / 2]
  float attention_factor = 1.0f;       // cos and sin times this (YaRN's attention factor)
  bool interleaved = true;
  const int32_t* slot_mapping = nullptr;  // [tokens]
  PagedLatentCache cache;
  int64_t tokens = 0;
  int64_t n_heads = 0;
  int64_t nope_dim = 0;
};

// Attention of every new token's heads over its sequence's latent cache (which already holds the new tokens).
// Sequence s owns query rows [query_start[s], query_start[s+1]) and seq_lens[s] cached tokens; its row i sits at
// position seq_lens[s] - n_q(s) + i. Without `selected` the row attends keys 0..its position (causal); with it, the
// keys selected[t, 0..topk) (ascending positions, -1 ends the list; DSA). Contract on the device metadata, as
// PagedAttentionArgs: n_q(s) <= seq_lens[s], block_tables[s] lists ceil(seq_lens[s] / block_size) valid block ids,
// a selection lists positions below its row's position + 1.
struct MlaAttentionArgs {
  const uint16_t* q_latent = nullptr;  // [tokens, n_heads, kv_lora_rank + rope_dim]
  uint16_t* out_latent = nullptr;      // [tokens, n_heads, kv_lora_rank]
  PagedLatentCache cache;              // read only here
  const int32_t* block_tables = nullptr;  // [n_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq = 0;
  const int32_t* query_start = nullptr;  // [n_seqs + 1]
  const int32_t* seq_lens = nullptr;     // [n_seqs]
  int64_t n_seqs = 0;
  int64_t tokens = 0;
  int64_t n_heads = 0;
  const int32_t* selected = nullptr;  // optional [tokens, topk]
  int64_t topk = 0;
  float scale = 1.0f;
  int64_t max_seq_len = 0;     // host-known bound over the batch (causal rows), for the split count
  void* workspace = nullptr;   // split-K partials; mla_attention_workspace_bytes()
  size_t workspace_bytes = 0;
  // Key ranges per (row, head group): 0 = mla_attention_splits' rule; benchmarks and tests force others (at most
  // the rule's bound of rows x groups x splits < 3 x num_sms).
  int64_t splits = 0;
};

// Limits of the kernels: the latent's widths (multiples of 16: whole k16 steps and n16 pairs of the tensor-core
// tiles), and the heads one attention block shares its key tiles between (the M dimension of its products).
inline constexpr int64_t kMlaMaxLoraRank = 512;
inline constexpr int64_t kMlaMaxRopeDim = 128;
inline constexpr int kMlaHeadsPerBlock = 16;  // one m16 tile
inline constexpr int kMlaKeysPerTile = 32;    // two k16 steps of the output product
inline constexpr int64_t kMlaMinKeysPerSplit = 64;
// An FP8 cache's one kv_lora_rank and its largest rope_dim (GLM-5's and DeepSeek-V3's: 512 and 64).
inline constexpr int64_t kMlaFp8LoraRank = 512;
inline constexpr int64_t kMlaFp8MaxRopeDim = 64;

// Dynamic shared memory of the attention kernel for a latent of `width` values (two key tiles, the warps' partial
// scores, three tiles' slots and the row's sequence).
size_t mla_attention_smem_bytes(int64_t width);
// Split-K: the key ranges each (row, head group) is cut into, so that a decode step of few rows still fills the
// GPU: as many as keep all of rows x groups x splits blocks resident at once (one wave: the blocks the shared memory
// of a `width`-value latent lets an SM hold, at most two), each range at least kMlaMinKeysPerSplit keys; 1 when rows
// x groups alone fill that. rows x groups x splits stays below 3 x num_sms, which bounds the workspace. Measured in
// docs/perf/gpu.md §mla-splits.
int64_t mla_attention_splits(const DeviceProps& props, int64_t tokens, int64_t n_heads, int64_t max_keys,
                             int64_t width);
// Bytes of split-K partials any call on this device may need: fp32 outputs [rows, heads, splits, lora], then (m, l).
size_t mla_attention_workspace_bytes(const DeviceProps& props, int64_t kv_lora_rank);

// Unchecked launches on ctx.stream() for arguments mla.cc has validated (counts >= 1).
void mla_prepare_launch(const DeviceContext& ctx, const MlaPrepareArgs& args);
void mla_attention_launch(const DeviceContext& ctx, const MlaAttentionArgs& args);

}  // namespace tern
