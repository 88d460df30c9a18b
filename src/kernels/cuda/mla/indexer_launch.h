// Argument structs and unchecked launchers of the CUDA kernels of GLM-5's DeepSeek Sparse Attention "lightning
// indexer", with the semantics of the CPU reference MlaAttention::select and MlaAttention::rope (layers/mla.h,
// layers/mla.cc). Per new token t at position pos(t) of its sequence:
//
//   ki = LayerNorm(wk(x)) (weight, bias, eps; over head_dim), RoPE on its first rope_dim values; cached per token
//   qi = wq_b(cq), n_heads heads of head_dim, RoPE on each head's first rope_dim values
//   I(t, s) = sum_h w_h * n_heads^-0.5 * relu(qi_h . ki_s * head_dim^-0.5)    w = weights_proj(x), keys s <= pos(t)
//   with n = pos(t) + 1 keys: all of 0..n-1 when n <= topk, else the topk best, ties to the earlier key; ascending.
//
// The projections (wq_b, wk, weights_proj) are GEMMs of the caller; these kernels do the rest: indexer_prepare (norm,
// RoPE, the key into its cache slot) and indexer_select (scores on the tensor cores, then an exact top-k). Activations
// are bf16 (uint16_t bit patterns), the math fp32. The .cu side cannot include core/error.h (nvcc rejects fmt's
// consteval format strings), so validation lives in indexer.cc and callers use indexer.h.
//
// Every pointer, metadata included, is a device pointer.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/device.h"

namespace tern {

// One layer's paged indexer key cache (one key head): bf16 [n_blocks, block_size, head_dim]. Token slot
// `block * block_size + offset` holds one token's key, stored after LayerNorm and RoPE. The block tables and slot
// mapping follow PagedKvCache's convention (kernels/cuda/attention/attention_launch.h). block_size is a power of two
// in [1, 1024] (the kernels index with shifts and masks).
struct PagedIndexerKeys {
  uint16_t* k = nullptr;
  int64_t n_blocks = 0;
  int64_t block_size = 0;
  int64_t head_dim = 0;
};

// Supported shapes: head_dim a multiple of 16 in [16, kIndexerMaxHeadDim], n_heads in [1, kIndexerMaxHeads] (the
// score kernel pads the heads to a multiple of 16 with zero rows, the rows of its mma tiles).
inline constexpr int64_t kIndexerMaxHeadDim = 256;
inline constexpr int64_t kIndexerMaxHeads = 64;

// The step's new tokens: q rotated and written contiguous to q_out; k normed (LayerNorm with weight and bias, eps),
// rotated and written to the cache at slot_mapping[t]. RoPE: angle = float(positions[t]) * inv_freq[i] in fp32, on
// the first rope_dim values of each vector, as GPT-J pairs (x[2i], x[2i + 1]) when interleaved (GLM-5) or NeoX halves
// (x[i], x[i + rope_dim / 2]); rope_dim 0 means no RoPE (positions and inv_freq may then be null). A slot outside
// [0, n_blocks * block_size) (-1 for a padding row) writes nothing to the cache; q_out is written for every row. fp32
// math, one rounding to bf16.
struct IndexerPrepareArgs {
  const uint16_t* q = nullptr;  // [tokens, q_stride]: per token n_heads * head_dim values, per head [rope | nope]
  int64_t q_stride = 0;
  uint16_t* q_out = nullptr;    // [tokens, n_heads, head_dim]
  const uint16_t* k = nullptr;  // [tokens, k_stride], first head_dim values used
  int64_t k_stride = 0;
  const uint16_t* k_norm_weight = nullptr;  // [head_dim] bf16
  const uint16_t* k_norm_bias = nullptr;    // [head_dim] bf16
  float eps = 1e-6f;
  const int32_t* positions = nullptr;  // [tokens]
  const float* inv_freq = nullptr;     // [rope_dim / 2] fp32
  int64_t rope_dim = 0;
  float attention_factor = 1.0f;  // cos and sin times this (YaRN's attention factor)
  bool interleaved = true;
  const int32_t* slot_mapping = nullptr;  // [tokens]
  PagedIndexerKeys cache;
  int64_t tokens = 0;
  int64_t n_heads = 0;
  int64_t head_dim = 0;
};

// The top-k keys of every new token, over its sequence's cache (which already holds this step's keys). Sequence s owns
// query rows [query_start[s], query_start[s+1]) and seq_lens[s] cached tokens including its new ones; its row i sits
// at position seq_lens[s] - n_q(s) + i and scores the keys 0..that position (causal), exactly as PagedAttentionArgs.
// Contract on the device metadata (not checkable on the host): query_start[0] = 0, query_start[n_seqs] = tokens,
// n_q(s) <= seq_lens[s] <= max_seq_len, and block_tables[s] lists ceil(seq_lens[s] / block_size) valid block ids;
// the kernels never read table entries past max_blocks_per_seq nor keys past max_seq_len.
//
// selected[t] lists the chosen key positions in ascending order: min(n, topk) of them, then -1 up to topk.
// The workspace holds the fp32 scores [tokens, indexer_scores_ld(max_seq_len)]: row t's keys 0..n-1 are its scores
// after the call for the rows with n > topk (rows with n <= topk need no scores and leave theirs unwritten).
struct IndexerSelectArgs {
  const uint16_t* q = nullptr;        // [tokens, n_heads, head_dim], roped (indexer_prepare's q_out)
  const uint16_t* weights = nullptr;  // [tokens, weights_stride]: weights_proj(x), first n_heads used, unscaled
  int64_t weights_stride = 0;
  PagedIndexerKeys cache;                 // read only here
  const int32_t* block_tables = nullptr;  // [n_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq = 0;
  const int32_t* query_start = nullptr;  // [n_seqs + 1]
  const int32_t* seq_lens = nullptr;     // [n_seqs]
  int64_t n_seqs = 0;
  int64_t tokens = 0;
  int64_t n_heads = 0;
  int64_t head_dim = 0;
  int64_t topk = 0;
  int64_t max_seq_len = 0;  // host-known bound over the batch, for grid and workspace sizing
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int32_t* selected = nullptr;  // [tokens, topk]
  // Blocks (one thread-block cluster) per row of the top-k: 0 = indexer_topk_blocks' rule; benchmarks and tests
  // force 1, 2, 4 or 8.
  int64_t topk_blocks = 0;
};

// Row stride (in floats) of the score workspace: max_seq_len rounded up to 4, so every row starts 16-byte aligned and
// the top-k kernel reads it four scores at a time.
inline int64_t indexer_scores_ld(int64_t max_seq_len) {
  return (max_seq_len + 3) / 4 * 4;
}

// Bytes of the workspace indexer_select needs for up to `tokens` rows and this max_seq_len.
inline size_t indexer_select_workspace_bytes(int64_t tokens, int64_t max_seq_len) {
  if (tokens <= 0 || max_seq_len <= 0) return 0;
  return static_cast<size_t>(tokens) * static_cast<size_t>(indexer_scores_ld(max_seq_len)) * sizeof(float);
}

// Score tiles: a block of kIndexerScoreWarps warps owns one query row (its n_heads x head_dim queries, padded to
// m_tiles * 16 rows, in shared memory) and a range of keys, gathered kIndexerKeyTile at a time with cp.async, `stages`
// tiles deep; warp w computes the scores of keys 16w..16w+15 of each tile. Shared memory: the scaled head weights
// [m_tiles * 16] fp32, Q [m_tiles * 16][head_dim + 8] bf16, then K [stages][kIndexerKeyTile][head_dim + 8] bf16 (rows
// padded by 16 bytes so ldmatrix's eight row reads fall in distinct banks).
inline constexpr int kIndexerScoreWarps = 4;
inline constexpr int kIndexerKeyTile = 16 * kIndexerScoreWarps;

struct IndexerSelectTiles {
  int m_tiles = 0;        // 16-row mma tiles over the heads: ceil(n_heads / 16)
  int stages = 0;         // 1 or 2 K tiles in shared memory; 0 when nothing fits the device
  size_t smem_bytes = 0;  // dynamic shared memory per score block
  int blocks_per_sm = 0;  // resident score blocks per SM assumed when sizing the key ranges
};

inline size_t indexer_score_smem_bytes(int64_t head_dim, int64_t n_heads, int stages) {
  const size_t rows = static_cast<size_t>((n_heads + 15) / 16 * 16);
  const size_t row_bytes = static_cast<size_t>(head_dim + 8) * 2;
  return rows * sizeof(float) + (rows + static_cast<size_t>(stages) * kIndexerKeyTile) * row_bytes;
}

// Two K stages (the next tile's loads under this tile's math) where the opt-in shared memory per block allows it, one
// otherwise (every supported shape fits one stage in 99 KiB); computed from the device's numbers only.
inline IndexerSelectTiles indexer_select_tiles(const DeviceProps& props, int64_t head_dim, int64_t n_heads) {
  const int m_tiles = static_cast<int>((n_heads + 15) / 16);
  for (int stages = 2; stages >= 1; --stages) {
    const size_t bytes = indexer_score_smem_bytes(head_dim, n_heads, stages);
    if (bytes > props.shared_mem_per_block_optin) continue;
    const size_t per_sm = props.shared_mem_per_sm > 0 ? props.shared_mem_per_sm : props.shared_mem_per_block_optin;
    const int by_smem = static_cast<int>(per_sm / (bytes + 1024));  // 1 KiB reserved per block by the driver
    const int by_threads = props.max_threads_per_sm > 0 ? props.max_threads_per_sm / (32 * kIndexerScoreWarps) : 16;
    const int blocks = std::max(1, std::min({by_smem, by_threads, 8}));
    return {.m_tiles = m_tiles, .stages = stages, .smem_bytes = bytes, .blocks_per_sm = blocks};
  }
  return {.m_tiles = m_tiles, .stages = 0, .smem_bytes = 0, .blocks_per_sm = 0};
}

// Keys per score block (a multiple of kIndexerKeyTile): enough blocks for about two waves of the device over
// tokens x max_seq_len keys, at most 32 tiles per block, and never more than 65535 blocks per row (the grid's y).
inline int64_t indexer_keys_per_block(const DeviceProps& props, const IndexerSelectTiles& tiles, int64_t tokens,
                                      int64_t max_seq_len) {
  const int64_t key_tiles = (max_seq_len + kIndexerKeyTile - 1) / kIndexerKeyTile;
  const int64_t waves = int64_t{2} * std::max(props.num_sms, 1) * std::max(tiles.blocks_per_sm, 1);
  int64_t per_block = std::clamp<int64_t>(tokens * key_tiles / waves, 1, 32);
  per_block = std::max(per_block, (key_tiles + 65534) / 65535);
  return per_block * kIndexerKeyTile;
}

// The top-k's blocks per row (a thread-block cluster, 1, 2, 4 or 8, each block a slice of the row's keys): the most
// that keep tokens x blocks within the SMs and slices of at least kIndexerTopkMinSliceKeys of a max_seq_len row.
// Few rows then use many SMs (a single block per row was bound by one SM's reads of the row from L2); many rows keep
// one. Measured in docs/perf/gpu.md §indexer-topk.
inline constexpr int64_t kIndexerTopkMinSliceKeys = 8192;
inline int64_t indexer_topk_blocks(const DeviceProps& props, int64_t tokens, int64_t max_seq_len) {
  int64_t blocks = 1;
  while (blocks < 8 && tokens * 2 * blocks <= props.num_sms && max_seq_len / (2 * blocks) >= kIndexerTopkMinSliceKeys) {
    blocks *= 2;
  }
  return blocks;
}

// Dynamic shared memory of a top-k block: the order keys of a whole slice (max_seq_len / blocks rounded up to 4) when
// they fit the device's opt-in limit with 4 KiB to spare (the passes then read shared memory, not the workspace), else
// none.
inline size_t indexer_topk_stage_bytes(const DeviceProps& props, int64_t max_seq_len, int64_t blocks) {
  const auto bytes = static_cast<size_t>(((max_seq_len + blocks - 1) / blocks + 3) / 4 * 4) * 4;
  return bytes + 4096 <= props.shared_mem_per_block_optin ? bytes : 0;
}

// Unchecked launches on ctx.stream() for arguments the checked launchers have validated (counts >= 1).
// indexer_select_launch is indexer_scores_launch (the scores of the rows with n > topk into the workspace) followed by
// indexer_topk_launch (the selection from them); the two are separate for the benchmark.
void indexer_prepare_launch(const DeviceContext& ctx, const IndexerPrepareArgs& args);
void indexer_scores_launch(const DeviceContext& ctx, const IndexerSelectArgs& args);
void indexer_topk_launch(const DeviceContext& ctx, const IndexerSelectArgs& args);
void indexer_select_launch(const DeviceContext& ctx, const IndexerSelectArgs& args);

}  // namespace tern
