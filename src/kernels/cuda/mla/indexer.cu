// The DSA lightning indexer kernels of the GPU model path: indexer_prepare (LayerNorm and RoPE of the key into its
// cache slot, RoPE of the queries), the score kernel on the tensor cores and the exact top-k; contracts in
// indexer_launch.h.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mla/indexer_launch.h"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/ptx.cuh"

namespace tern {
namespace {

using cuda_common::bf16_to_f32;
using cuda_common::f32_to_bf16;
using cuda_common::warp_sum;
using ptx::cp_async_16_zfill;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4;
using ptx::mma_bf16_16816;

constexpr int kMaxHeadDim = static_cast<int>(kIndexerMaxHeadDim);

int log2_int(int64_t v) {
  int l = 0;
  while ((int64_t{1} << l) < v) ++l;
  return l;
}

// The sequence owning query row t: the largest s with query_start[s] <= t (empty sequences are skipped over).
__device__ __forceinline__ int find_sequence(const int32_t* query_start, int n_seqs, int t) {
  int lo = 0, hi = n_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_start[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Row t's sequence and its key count n = position + 1, clamped to [0, key_limit] (key_limit: the keys the cache and
// the workspace hold per row), so metadata that breaks the contract cannot make a kernel read or write out of bounds.
struct RowKeys {
  int seq;
  int n;
};

__device__ __forceinline__ RowKeys row_keys(const IndexerSelectArgs& a, int t, int key_limit) {
  const int s = find_sequence(a.query_start, static_cast<int>(a.n_seqs), t);
  const int q0 = a.query_start[s], n_q = a.query_start[s + 1] - q0;
  const int n = a.seq_lens[s] - n_q + (t - q0) + 1;
  return {s, max(0, min(n, key_limit))};
}

// ---------------------------------------------------------------------------------------------------------------
// indexer_prepare. Block (token, group of kPrepareWarps rows): sin/cos of the token's position once into shared
// memory, then each warp takes one row: q heads 0..n_heads-1, then row n_heads, the key (skipped for a padding slot).
// The warp stages its row in shared memory in fp32 (the key after its LayerNorm), so RoPE reads each value's partner
// from there; lane d % 32 owns dim d.

constexpr int kPrepareWarps = 4;
constexpr int kPrepareThreads = 32 * kPrepareWarps;

__global__ void __launch_bounds__(kPrepareThreads) indexer_prepare_kernel(const IndexerPrepareArgs a) {
  ptx::grid_dependency_begin();
  __shared__ float cos_s[kMaxHeadDim / 2], sin_s[kMaxHeadDim / 2];
  __shared__ float row_s[kPrepareWarps][kMaxHeadDim];
  const int64_t t = blockIdx.x;
  const int hd = static_cast<int>(a.head_dim), rope = static_cast<int>(a.rope_dim), half = rope / 2;
  if (half > 0) {
    const float position = static_cast<float>(a.positions[t]);
    for (int i = threadIdx.x; i < half; i += kPrepareThreads) {
      cuda_common::rope_cos_sin(position * a.inv_freq[i], a.attention_factor, &cos_s[i], &sin_s[i]);
    }
  }
  __syncthreads();
  const int64_t slot = a.slot_mapping[t];
  const bool cached = slot >= 0 && slot < a.cache.n_blocks * a.cache.block_size;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* row = row_s[warp];
  for (int64_t r = int64_t{blockIdx.y} * kPrepareWarps + warp; r <= a.n_heads;
       r += int64_t{gridDim.y} * kPrepareWarps) {
    const bool is_k = r == a.n_heads;
    if (is_k && !cached) continue;
    const uint16_t* src = is_k ? a.k + t * a.k_stride : a.q + t * a.q_stride + r * hd;
    uint16_t* dst = is_k ? a.cache.k + slot * hd : a.q_out + (t * a.n_heads + r) * hd;
    __syncwarp();  // the previous row's partner reads are done
    for (int d = lane; d < hd; d += 32) row[d] = bf16_to_f32(src[d]);
    if (is_k) {  // LayerNorm as layers/mla.cc: (x - mean) * rsqrt(var + eps) * w + b, biased variance
      float sum = 0.0f;
      for (int d = lane; d < hd; d += 32) sum += row[d];
      const float mean = warp_sum(sum) / static_cast<float>(hd);
      float var = 0.0f;
      for (int d = lane; d < hd; d += 32) {
        const float c = row[d] - mean;
        var += c * c;
      }
      const float inv = 1.0f / sqrtf(warp_sum(var) / static_cast<float>(hd) + a.eps);
      for (int d = lane; d < hd; d += 32) {
        row[d] = (row[d] - mean) * inv * bf16_to_f32(a.k_norm_weight[d]) + bf16_to_f32(a.k_norm_bias[d]);
      }
    }
    __syncwarp();  // every value of the row is staged before the partners are read
    for (int d = lane; d < hd; d += 32) {
      float v = row[d];
      if (d < rope) {
        if (a.interleaved) {  // GPT-J pairs (2i, 2i + 1), frequency i
          const int i = d / 2;
          v = d % 2 == 0 ? v * cos_s[i] - row[d + 1] * sin_s[i] : v * cos_s[i] + row[d - 1] * sin_s[i];
        } else if (d < half) {  // NeoX halves (i, i + half), frequency i
          v = v * cos_s[d] - row[d + half] * sin_s[d];
        } else {
          v = v * cos_s[d - half] + row[d - half] * sin_s[d - half];
        }
      }
      dst[d] = f32_to_bf16(v);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Scores. Block (query row t, range of keys_per_block keys), kIndexerScoreWarps warps. The row's queries (n_heads x
// head_dim, zero rows up to kMTiles * 16) and its scaled head weights stay in shared memory; K tiles of kKeyTile keys
// are gathered from the paged cache slot by slot with cp.async (zero-filled past the range). Per K tile, warp w takes
// keys 16w..16w+15:
//   S = Q K^T on the tensor cores (ldmatrix of Q rows as A; K stored [key][dim] is exactly the mma's col-major B),
//   fp32 accumulation of the exact bf16 products; a thread holds heads lane/4 and lane/4 + 8 of each 16-row tile and
//   keys 2 * (lane % 4) + {0, 1} of each 8-key group;
//   score = sum_h w_h * relu(S * scale): each thread sums its heads, then the 8 lanes of a key column add up with
//   three xor shuffles (a fixed order: the scores are the same bits on every run), and lanes 0..3 store them.
// Rows with n <= topk need no scores (every causal key is selected) and return at once.

constexpr int kScoreThreads = 32 * kIndexerScoreWarps;
constexpr int kKeyTile = kIndexerKeyTile;
static_assert(kKeyTile == 16 * kIndexerScoreWarps, "each warp owns 16 keys (two n tiles) of a K tile");

struct ScoreParams {
  IndexerSelectArgs a;
  int log2_bs;
  int key_limit;       // keys per row the cache and the workspace hold: min(max_seq_len, max_blocks_per_seq * bs)
  int keys_per_block;  // a multiple of kKeyTile
  int stages;          // 1 or 2
  int64_t ld;          // row stride of the score workspace in floats
  float scale;         // head_dim^-0.5
  float head_weight;   // n_heads^-0.5
};

// Gathers keys [key0, key0 + kKeyTile) of a sequence (block table row `table`) into dst [kKeyTile][hd + 8], zeros at
// and past key_end.
__device__ __forceinline__ void score_load_keys(const ScoreParams& p, const int32_t* table, int key0, int key_end,
                                                uint16_t* dst) {
  const int hd = static_cast<int>(p.a.head_dim), ld_s = hd + 8, chunks = hd / 8;
  const int bs_mask = (1 << p.log2_bs) - 1;
  for (int i = threadIdx.x; i < kKeyTile * chunks; i += kScoreThreads) {
    const int r = i / chunks, c = i % chunks, key = key0 + r;
    const bool valid = key < key_end;
    const int64_t slot = valid ? (int64_t{table[key >> p.log2_bs]} << p.log2_bs) + (key & bs_mask) : 0;
    cp_async_16_zfill(dst + r * ld_s + c * 8, p.a.cache.k + slot * hd + c * 8, valid);
  }
}

template <int kMTiles>
__global__ void __launch_bounds__(kScoreThreads) indexer_scores_kernel(const ScoreParams p) {
  ptx::grid_dependency_begin();
  constexpr int kRows = 16 * kMTiles;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const IndexerSelectArgs& a = p.a;
  const int hd = static_cast<int>(a.head_dim), ld_s = hd + 8, chunks = hd / 8;
  float* w_s = reinterpret_cast<float*>(smem_raw);                                // [kRows]
  uint16_t* q_s = reinterpret_cast<uint16_t*>(smem_raw + kRows * sizeof(float));  // [kRows][ld_s]
  uint16_t* k_s = q_s + kRows * ld_s;                                             // [stages][kKeyTile][ld_s]
  const int t = blockIdx.x;
  const RowKeys row = row_keys(a, t, p.key_limit);
  if (row.n <= a.topk) return;
  const int k_begin = static_cast<int>(blockIdx.y) * p.keys_per_block;
  if (k_begin >= row.n) return;
  const int k_end = static_cast<int>(min(int64_t{row.n}, int64_t{k_begin} + p.keys_per_block));
  const int n_tiles = (k_end - k_begin + kKeyTile - 1) / kKeyTile;
  const int32_t* table = a.block_tables + int64_t{row.seq} * a.max_blocks_per_seq;

  for (int h = threadIdx.x; h < kRows; h += kScoreThreads) {
    w_s[h] = h < a.n_heads ? bf16_to_f32(a.weights[int64_t{t} * a.weights_stride + h]) * p.head_weight : 0.0f;
  }
  // The queries and the first K tile in one cp.async group.
  for (int i = threadIdx.x; i < kRows * chunks; i += kScoreThreads) {
    const int r = i / chunks, c = i % chunks;
    const bool valid = r < a.n_heads;
    const int64_t offset = valid ? (int64_t{t} * a.n_heads + r) * hd + c * 8 : 0;
    cp_async_16_zfill(q_s + r * ld_s + c * 8, a.q + offset, valid);
  }
  score_load_keys(p, table, k_begin, k_end, k_s);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* out = static_cast<float*>(a.workspace) + int64_t{t} * p.ld;
  for (int j = 0; j < n_tiles; ++j) {
    if (p.stages == 2) {  // prefetch tile j + 1 into the other stage, then wait for tile j only
      if (j + 1 < n_tiles) {
        score_load_keys(p, table, k_begin + (j + 1) * kKeyTile, k_end, k_s + ((j + 1) % 2) * kKeyTile * ld_s);
      }
      cp_async_commit();  // always, so the group count per step stays uniform
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint16_t* tile = k_s + (p.stages == 2 ? j % 2 : 0) * kKeyTile * ld_s;
    float acc[kMTiles][2][4] = {};
#pragma unroll 2
    for (int kk = 0; kk < hd; kk += 16) {
      uint32_t b[4];
      ldmatrix_x4(b, tile + (warp * 16 + (lane / 16) * 8 + lane % 8) * ld_s + kk + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        uint32_t q_frag[4];
        ldmatrix_x4(q_frag, q_s + (mt * 16 + lane % 16) * ld_s + kk + (lane / 16) * 8);
        mma_bf16_16816(acc[mt][0], q_frag, {b[0], b[1]});
        mma_bf16_16816(acc[mt][1], q_frag, {b[2], b[3]});
      }
    }
    const int key0 = k_begin + j * kKeyTile + warp * 16;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float sum = 0.0f;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float x = acc[mt][nt][2 * r + e] * p.scale;
            sum += w_s[mt * 16 + lane / 4 + 8 * r] * (x < 0.0f ? 0.0f : x);  // relu as std::max(x, 0): NaN stays
          }
        }
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 4);
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 8);
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 16);
        const int key = key0 + nt * 8 + 2 * (lane % 4) + e;
        if (lane < 4 && key < k_end) out[key] = sum;
      }
    }
    __syncthreads();  // the stage just read is overwritten by the next load
    if (p.stages == 1 && j + 1 < n_tiles) {
      score_load_keys(p, table, k_begin + (j + 1) * kKeyTile, k_end, k_s);
      cp_async_commit();
    }
  }
  cp_async_wait<0>();
}

// ---------------------------------------------------------------------------------------------------------------
// Top-k. One thread-block cluster of p.cluster blocks (1, 2, 4 or 8) per query row; block r of a row owns the slice
// [r L, (r + 1) L) of its keys (L = n / p.cluster rounded up to a multiple of 4). Rows with n <= topk list 0..n-1 and
// -1 after. Otherwise the scores are mapped to order-preserving uint32 keys (-0 counted as +0, so equal scores are
// equal keys), held in shared memory when the slice fits p.stage_keys (else re-read from the workspace each pass),
// and a radix select finds the k-th largest key thr, 8 bits per pass from the top: each block histograms the next
// digit over its keys whose higher digits match the prefix so far, the cluster meets, every block adds all the
// blocks' histograms (distributed shared memory, in rank order) and finds the digit where the count from the top
// reaches the keys still wanted. After four passes thr is exact, (topk - take) keys lie above it and the `take`
// earliest keys equal to it complete the selection. Each block knows its own counts of keys above and equal to thr
// from its histograms; after a last cluster barrier a block adds those of the blocks before it, and a stable
// compaction in key order writes its keys: a key's output index is the number of selected keys before it,
// gt_before + min(eq_before, take), from block prefix sums of (above, equal) counts over chunks of kTopkChunk keys
// (kTopkRun consecutive keys per thread), so the list comes out ascending. Every step is a fixed function of the
// scores: the selection is deterministic, and the same for every cluster size. Spreading a row over several SMs is
// for few rows: one block per row was bound by one SM's reads of the row (five passes) from L2.

constexpr int kTopkThreads = 512;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kTopkLoads = 4;             // float4 loads in flight per thread (the scores come from L2)
constexpr int kTopkStageLoads = 8;        // float4 loads in flight per thread while a slice is staged
constexpr int kTopkRun = 4 * kTopkLoads;  // consecutive keys per thread in a compaction chunk
constexpr int kTopkChunk = kTopkRun * kTopkThreads;
static_assert(kTopkChunk < 65536, "per-chunk counts are packed in 16 bits");
static_assert(kTopkWarps <= 32, "one warp scans the warp totals");

struct TopkParams {
  IndexerSelectArgs a;
  int key_limit;
  int64_t ld;
  int cluster;     // blocks per row
  int stage_keys;  // slice keys the dynamic shared memory holds; 0: none staged
};

__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t b = __float_as_uint(f);
  if ((b << 1) == 0) b = 0;  // -0 -> +0
  return (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
}

// f(i, row4[i]) for i in [0, len4) over the block's threads, kLoads loads in flight per thread.
template <int kLoads, class F>
__device__ __forceinline__ void for_each_float4(const float4* row4, int len4, F&& f) {
  for (int base = static_cast<int>(threadIdx.x); base < len4; base += kLoads * kTopkThreads) {
    float4 v[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int i = base + l * kTopkThreads;
      v[l] = i < len4 ? row4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      if (base + l * kTopkThreads < len4) f(base + l * kTopkThreads, v[l]);
    }
  }
}

__global__ void __launch_bounds__(kTopkThreads) indexer_topk_kernel(const TopkParams p) {
  ptx::grid_dependency_begin();
  extern __shared__ __align__(16) uint32_t stage[];  // [stage_keys]: the slice's order keys
  __shared__ __align__(16) uint32_t hist[2][256];   // by pass parity: the last pass's is still read by the others
  __shared__ uint32_t warp_prefix[kTopkWarps];
  __shared__ uint32_t chosen_digit, chosen_remaining, chunk_total;
  __shared__ uint32_t slice_counts[2];  // this block's keys above and equal to thr
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  auto meet = [&] {  // the row's blocks at a barrier (one block: the block's barrier, cheaper)
    if (p.cluster > 1) {
      cluster.sync();
    } else {
      __syncthreads();
    }
  };
  const IndexerSelectArgs& a = p.a;
  const int rank = static_cast<int>(blockIdx.x) % p.cluster, t = static_cast<int>(blockIdx.x) / p.cluster;
  const int n = row_keys(a, t, p.key_limit).n;
  const int topk = static_cast<int>(a.topk);
  int32_t* out = a.selected + int64_t{t} * topk;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  if (n <= topk) {  // the same for every block of the cluster: none meets the others
    for (int i = rank * kTopkThreads + tid; i < topk; i += p.cluster * kTopkThreads) out[i] = i < n ? i : -1;
    return;
  }
  const float* row = static_cast<const float*>(a.workspace) + int64_t{t} * p.ld;
  const int slice = ((n + p.cluster - 1) / p.cluster + 3) / 4 * 4;
  const int begin = min(n, rank * slice), end = min(n, begin + slice), len = end - begin;
  const bool staged = slice <= p.stage_keys;
  const float4* row4 = reinterpret_cast<const float4*>(row + begin);  // begin is a multiple of 4
  const int len4 = (len + 3) / 4;
  if (staged) {
    for_each_float4<kTopkStageLoads>(row4, len4, [&](int i, float4 v) {
      reinterpret_cast<uint4*>(stage)[i] = make_uint4(order_key(v.x), order_key(v.y), order_key(v.z), order_key(v.w));
    });
  }
  // f(key offset in the slice, order key) over the slice, from shared memory or the workspace.
  auto for_each_key = [&](auto&& f) {
    if (staged) {
      for (int i = tid; i < len; i += kTopkThreads) f(i, stage[i]);
      return;
    }
    for_each_float4<kTopkLoads>(row4, len4, [&](int i, float4 v) {
      f(4 * i, order_key(v.x));
      f(4 * i + 1, order_key(v.y));
      f(4 * i + 2, order_key(v.z));
      f(4 * i + 3, order_key(v.w));
    });
  };

  // Radix select of the topk-th largest key over the whole row.
  uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(topk), above_here = 0;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    uint32_t* h = hist[pass & 1];
    for (int i = tid; i < 256; i += kTopkThreads) h[i] = 0;
    __syncthreads();  // also publishes the staged keys before the first pass
    for_each_key([&](int key, uint32_t u) {
      if (key < len && (u & mask) == prefix) atomicAdd(&h[(u >> shift) & 0xFFu], 1u);
    });
    meet();  // every block's histogram is complete (and in pass 0, every block has started)
    if (warp == 0) {  // lane l owns digits 8l..8l+7; the one lane whose range holds the wanted rank finds the digit
      uint32_t bins[8] = {}, own[8];
      {
        const uint4* mine = reinterpret_cast<const uint4*>(h) + 2 * lane;
        const uint4 lo = mine[0], hi = mine[1];
        own[0] = lo.x, own[1] = lo.y, own[2] = lo.z, own[3] = lo.w, own[4] = hi.x, own[5] = hi.y, own[6] = hi.z;
        own[7] = hi.w;
      }
      for (int r = 0; r < p.cluster; ++r) {  // every block's counts in rank order (one block: its own)
        uint32_t v[8];
        if (r == rank) {
#pragma unroll
          for (int b = 0; b < 8; ++b) v[b] = own[b];
        } else {
          const uint4* src = reinterpret_cast<const uint4*>(cluster.map_shared_rank(h, r)) + 2 * lane;
          const uint4 lo = src[0], hi = src[1];
          v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
        }
#pragma unroll
        for (int b = 0; b < 8; ++b) bins[b] += v[b];
      }
      uint32_t local = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) local += bins[b];
      uint32_t suffix = local;  // keys in the digits of lanes >= lane
#pragma unroll
      for (int offset = 1; offset < 32; offset *= 2) {
        const uint32_t v = __shfl_down_sync(0xFFFFFFFFu, suffix, offset);
        if (lane + offset < 32) suffix += v;
      }
      const uint32_t above = suffix - local;
      uint32_t digit = 0, rest = 0;
      const bool found = above < remaining && remaining <= suffix;
      if (found) {
        uint32_t cum = above;
#pragma unroll
        for (int b = 7; b >= 0; --b) {
          if (cum + bins[b] >= remaining) {
            digit = static_cast<uint32_t>(8 * lane + b);
            rest = remaining - cum;
            break;
          }
          cum += bins[b];
        }
      }
      const int from = __ffs(__ballot_sync(0xFFFFFFFFu, found)) - 1;
      digit = __shfl_sync(0xFFFFFFFFu, digit, from);
      rest = __shfl_sync(0xFFFFFFFFu, rest, from);
      // This block's keys with this pass's prefix and a higher digit lie above thr; with the last digit, the ones
      // with exactly it equal thr. (Only the later blocks of a row need them.)
      if (p.cluster > 1) {
        uint32_t mine_above = 0;
#pragma unroll
        for (int b = 0; b < 8; ++b) mine_above += static_cast<uint32_t>(8 * lane + b) > digit ? own[b] : 0u;
        above_here += warp_sum(mine_above);
      }
      if (p.cluster > 1 && pass == 3 && lane == static_cast<int>(digit / 8)) {
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          if (static_cast<uint32_t>(8 * lane + b) == digit) slice_counts[1] = own[b];
        }
      }
      if (lane == 0) chosen_digit = digit, chosen_remaining = rest;
    }
    __syncthreads();
    prefix |= chosen_digit << shift;
    mask |= 0xFFu << shift;
    remaining = chosen_remaining;
  }
  const uint32_t thr = prefix, take = remaining, gt_total = static_cast<uint32_t>(topk) - take;
  if (tid == 0) slice_counts[0] = above_here;  // warp 0's count (the same on each of its lanes)

  // The blocks before this one in the row: their keys above and equal to thr.
  uint32_t gt_run = 0, eq_run = 0;  // above / equal keys in the slices and chunks before this one
  if (p.cluster > 1) {
    cluster.sync();
    for (int r = 0; r < rank; ++r) {
      const uint32_t* counts = cluster.map_shared_rank(slice_counts, r);
      gt_run += counts[0];
      eq_run += counts[1];
    }
    cluster.sync();  // no block leaves while another may still read its shared memory
  }

  // Stable compaction of the slice in key order.
  for (int c0 = 0; c0 < len; c0 += kTopkChunk) {
    const int key0 = c0 + kTopkRun * tid;  // offset in the slice
    uint32_t u[kTopkRun];
    if (staged) {
#pragma unroll
      for (int l = 0; l < kTopkLoads; ++l) {
        const uint4 v =
            key0 + 4 * l < len ? reinterpret_cast<const uint4*>(stage)[key0 / 4 + l] : make_uint4(0u, 0u, 0u, 0u);
        u[4 * l] = v.x, u[4 * l + 1] = v.y, u[4 * l + 2] = v.z, u[4 * l + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int l = 0; l < kTopkLoads; ++l) {
        const float4 v = key0 + 4 * l < len ? row4[key0 / 4 + l] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        u[4 * l] = order_key(v.x), u[4 * l + 1] = order_key(v.y), u[4 * l + 2] = order_key(v.z);
        u[4 * l + 3] = order_key(v.w);
      }
    }
    uint32_t gt = 0, eq = 0;
#pragma unroll
    for (int j = 0; j < kTopkRun; ++j) {
      if (key0 + j < len) {
        gt += u[j] > thr ? 1u : 0u;
        eq += u[j] == thr ? 1u : 0u;
      }
    }
    const uint32_t packed = gt | (eq << 16);
    uint32_t incl = packed;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const uint32_t v = __shfl_up_sync(0xFFFFFFFFu, incl, offset);
      if (lane >= offset) incl += v;
    }
    if (lane == 31) warp_prefix[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      const uint32_t total = lane < kTopkWarps ? warp_prefix[lane] : 0u;
      uint32_t scan = total;
#pragma unroll
      for (int offset = 1; offset < 32; offset *= 2) {
        const uint32_t v = __shfl_up_sync(0xFFFFFFFFu, scan, offset);
        if (lane >= offset) scan += v;
      }
      if (lane < kTopkWarps) warp_prefix[lane] = scan - total;  // exclusive
      if (lane == 31) chunk_total = scan;
    }
    __syncthreads();
    const uint32_t before = warp_prefix[warp] + incl - packed;
    uint32_t gt_before = gt_run + (before & 0xFFFFu), eq_before = eq_run + (before >> 16);
#pragma unroll
    for (int j = 0; j < kTopkRun; ++j) {
      if (key0 + j >= len) break;
      if (u[j] > thr) {
        out[gt_before + min(eq_before, take)] = begin + key0 + j;
        ++gt_before;
      } else if (u[j] == thr) {
        if (eq_before < take) out[gt_before + eq_before] = begin + key0 + j;
        ++eq_before;
      }
    }
    const uint32_t total = chunk_total;
    gt_run += total & 0xFFFFu;
    eq_run += total >> 16;
    __syncthreads();                                  // warp_prefix and chunk_total are rewritten by the next chunk
    if (gt_run == gt_total && eq_run >= take) break;  // the same on every thread: all topk written
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Launchers.

int select_key_limit(const IndexerSelectArgs& a) {
  return static_cast<int>(std::min(a.max_seq_len, a.max_blocks_per_seq * a.cache.block_size));
}

template <int kMTiles>
void scores_launch_m(const DeviceContext& ctx, const ScoreParams& p, size_t smem) {
  auto* kernel = indexer_scores_kernel<kMTiles>;
  TERN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>(p.a.tokens),
                  static_cast<unsigned>((p.key_limit + p.keys_per_block - 1) / p.keys_per_block));
  launch_kernel(ctx, kernel, grid, dim3(kScoreThreads), smem, p);
}

}  // namespace

void indexer_prepare_launch(const DeviceContext& ctx, const IndexerPrepareArgs& args) {
  const dim3 grid(static_cast<unsigned>(args.tokens),
                  static_cast<unsigned>((args.n_heads + 1 + kPrepareWarps - 1) / kPrepareWarps));
  launch_kernel(ctx, indexer_prepare_kernel, grid, dim3(kPrepareThreads), 0, args);
  TERN_CUDA_CHECK_LAUNCH();
}

void indexer_scores_launch(const DeviceContext& ctx, const IndexerSelectArgs& args) {
  const IndexerSelectTiles tiles = indexer_select_tiles(ctx.props(), args.head_dim, args.n_heads);
  const ScoreParams p{
      .a = args,
      .log2_bs = log2_int(args.cache.block_size),
      .key_limit = select_key_limit(args),
      .keys_per_block = static_cast<int>(indexer_keys_per_block(ctx.props(), tiles, args.tokens, args.max_seq_len)),
      .stages = tiles.stages,
      .ld = indexer_scores_ld(args.max_seq_len),
      .scale = 1.0f / std::sqrt(static_cast<float>(args.head_dim)),
      .head_weight = 1.0f / std::sqrt(static_cast<float>(args.n_heads))};
  switch (tiles.m_tiles) {
    case 1:
      scores_launch_m<1>(ctx, p, tiles.smem_bytes);
      break;
    case 2:
      scores_launch_m<2>(ctx, p, tiles.smem_bytes);
      break;
    case 3:
      scores_launch_m<3>(ctx, p, tiles.smem_bytes);
      break;
    default:
      scores_launch_m<4>(ctx, p, tiles.smem_bytes);
      break;
  }
  TERN_CUDA_CHECK_LAUNCH();
}

void indexer_topk_launch(const DeviceContext& ctx, const IndexerSelectArgs& args) {
  const int key_limit = select_key_limit(args);
  const int cluster = static_cast<int>(args.topk_blocks > 0 ? args.topk_blocks
                                                            : indexer_topk_blocks(ctx.props(), args.tokens, key_limit));
  const size_t stage = indexer_topk_stage_bytes(ctx.props(), key_limit, cluster);
  const TopkParams p{.a = args,
                     .key_limit = key_limit,
                     .ld = indexer_scores_ld(args.max_seq_len),
                     .cluster = cluster,
                     .stage_keys = static_cast<int>(stage / 4)};
  TERN_CUDA_CHECK(
      cudaFuncSetAttribute(indexer_topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(stage)));
  launch_kernel_clustered(ctx, indexer_topk_kernel, dim3(static_cast<unsigned>(args.tokens * cluster)),
                          dim3(kTopkThreads), stage, dim3(static_cast<unsigned>(cluster), 1, 1), p);
  TERN_CUDA_CHECK_LAUNCH();
}

void indexer_select_launch(const DeviceContext& ctx, const IndexerSelectArgs& args) {
  indexer_scores_launch(ctx, args);
  indexer_topk_launch(ctx, args);
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t mla_indexer_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, indexer_scores_kernel<1>);
}

}  // namespace tern
