// What the paged attention kernels share (attention_prepare.cu, attention_decode.cu, attention_prefill.cu): the
// device helpers they use and the tensor-core and cp.async wrappers. Internal to those files.
//
// prepare:  one block per token; q/k per-head RMSNorm and RoPE in fp32, one bf16 rounding, k/v into their slot.
// decode:   split-K flash decoding on tensor cores. A block owns (token, kv head, range of keys) and all query heads
//           of that kv head, so each K/V row is read once per group; its warps stream their own chunks of keys
//           through cp.async buffers without block barriers; a reduce kernel merges the ranges' partial softmaxes.
// prefill:  flash attention on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulation) over 64-row query tiles
//           of one head, K/V tiles gathered from the paged cache with cp.async, online softmax in the log2 domain;
//           on sm_90a the same over 128-row tiles with wgmma (attention_prefill_sm90.cu).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/attention/attention_launch.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ptx.cuh"

namespace tern {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

using cuda_common::bf16_to_f32;
using cuda_common::f32_to_bf16;
using cuda_common::pack_bf16x2;
using cuda_common::sigmoid_f32;  // as layers/attention.cc
using cuda_common::warp_sum;

inline int log2_int(int64_t v) {
  int l = 0;
  while ((int64_t{1} << l) < v) ++l;
  return l;
}

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core and cp.async helpers (decode and prefill).

using ptx::cp_async_16_zfill;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::mma_bf16_16816;
using ptx::smem_addr;

// ---------------------------------------------------------------------------------------------------------------
// Prefill: what the mma.sync kernel (attention_prefill.cu) and the wgmma kernel (attention_prefill_sm90.cu) share.

struct PrefillParams {
  PagedAttentionArgs a;
  int group;
  int log2_bs;
  float scale_log2;
};

// Where the tile of a block sits in its sequence.
struct PrefillTile {
  int q0;      // first query row of the sequence
  int row0;    // first row of the tile within the sequence
  int n_q;     // the sequence's query rows
  int pos0;    // position of the tile's row 0
  int n_keys;  // keys the tile's last valid row attends
  int64_t table_row;
};

// The tile of block (blockIdx.x, head, blockIdx.z = sequence) for query tiles of `rows` rows, the latest (longest)
// tiles first; false when the sequence has no rows there.
__device__ __forceinline__ bool prefill_tile(const PrefillParams& p, int rows, PrefillTile& tile) {
  const PagedAttentionArgs& a = p.a;
  const int seq = blockIdx.z;
  tile.q0 = a.query_start[seq];
  tile.n_q = a.query_start[seq + 1] - tile.q0;
  tile.row0 = (gridDim.x - 1 - blockIdx.x) * rows;
  if (tile.row0 >= tile.n_q) return false;
  const int past = a.seq_lens[seq] - tile.n_q;
  tile.pos0 = past + tile.row0;
  tile.n_keys = min(past + min(tile.row0 + rows, tile.n_q), static_cast<int>(a.max_blocks_per_seq << p.log2_bs));
  tile.table_row = int64_t{seq} * a.max_blocks_per_seq;
  return true;
}

// Causal mask (when `mask`: the tile may hold keys past a row's position) and the online softmax update of one K/V
// tile of kKeys keys, in the log2 domain, for the two rows a thread holds in mma.m16n8's accumulator layout (also
// wgmma's, per warp): s(i), i = 4 n + e, is the score of key key0 + 8 n + 2 (lane % 4) + e % 2 in row lane / 4 + 8
// (e / 2), and o(i) the same over head_dim / 2 output columns. s becomes P = 2^(S - max); m and l are the running
// row maxima and this thread's part of the row sums.
template <int kKeys, int kHeadDim, class S, class O>
__device__ __forceinline__ void prefill_softmax(S s, O o, float (&m)[2], float (&l)[2], const int (&qpos)[2], int key0,
                                                bool mask, float scale_log2) {
  const int lane = threadIdx.x % 32;
  float mx[2] = {m[0], m[1]};
#pragma unroll
  for (int i = 0; i < kKeys / 2; ++i) {
    const int key = key0 + (i / 4) * 8 + (lane % 4) * 2 + (i % 2), r = (i % 4) / 2;
    const float v = !mask || key <= qpos[r] ? s(i) * scale_log2 : -INFINITY;
    s(i) = v;
    mx[r] = fmaxf(mx[r], v);
  }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xFFFFFFFFu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xFFFFFFFFu, mx[r], 2));
    base[r] = mx[r] == -INFINITY ? 0.0f : mx[r];  // a row with no key yet keeps p = 0 instead of NaN
    const float corr = exp2f(m[r] - base[r]);
    m[r] = mx[r];
    l[r] *= corr;
#pragma unroll
    for (int i = 0; i < kHeadDim / 8; ++i) {
      o(4 * i + 2 * r) *= corr;
      o(4 * i + 2 * r + 1) *= corr;
    }
  }
#pragma unroll
  for (int i = 0; i < kKeys / 2; ++i) {
    s(i) = exp2f(s(i) - base[(i % 4) / 2]);
    l[(i % 4) / 2] += s(i);
  }
}

// The end of a prefill tile: row sums over the quad, normalise, gate, store bf16 pairs of the thread's rows `row`
// and row + 8 of the tile (o as in prefill_softmax).
template <int kHeadDim, class O>
__device__ __forceinline__ void prefill_store(const PagedAttentionArgs& a, const PrefillTile& tile, int h, int row,
                                              float (&l)[2], O o) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xFFFFFFFFu, l[r], 1);
    l[r] += __shfl_xor_sync(0xFFFFFFFFu, l[r], 2);
    const int q_row = tile.row0 + row + 8 * r;
    if (q_row >= tile.n_q) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const int64_t base = ((int64_t{tile.q0} + q_row) * a.n_heads + h) * kHeadDim + (lane % 4) * 2;
#pragma unroll
    for (int dn = 0; dn < kHeadDim / 8; ++dn) {
      float y0 = o(4 * dn + 2 * r) * inv, y1 = o(4 * dn + 2 * r + 1) * inv;
      if (a.gate != nullptr) {
        y0 *= sigmoid_f32(bf16_to_f32(a.gate[base + dn * 8]));
        y1 *= sigmoid_f32(bf16_to_f32(a.gate[base + dn * 8 + 1]));
      }
      *reinterpret_cast<uint32_t*>(a.out + base + dn * 8) = pack_bf16x2(y0, y1);
    }
  }
}

// The cache slot of key j of a sequence whose block table row is `table`.
__device__ __forceinline__ int64_t key_slot(const int32_t* table, int j, int log2_bs) {
  return int64_t{table[j >> log2_bs]} * (int64_t{1} << log2_bs) + (j & ((1 << log2_bs) - 1));
}

// The prefill kernels' gathers by cp.async, kThreads threads sharing the 16-byte copies; at(r, c) is the byte offset
// of row r's dims 8 c .. 8 c + 7 in a shared-memory tile (each kernel's own layout). Query rows row0 .. row0 + kRows
// - 1 of head h into q_s, zero past the sequence's rows:
template <int kHeadDim, int kRows, int kThreads, class At>
__device__ __forceinline__ void prefill_load_q(const PrefillParams& p, const PrefillTile& tile, int h, uint8_t* q_s,
                                               At at) {
  constexpr int kChunks = kHeadDim / 8;
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = tile.row0 + r < tile.n_q;
    const int64_t offset = valid ? ((int64_t{tile.q0} + tile.row0 + r) * p.a.n_heads + h) * kHeadDim + c * 8 : 0;
    cp_async_16_zfill(q_s + at(r, c), p.a.q + offset, valid);
  }
}

// and keys key0 .. key0 + kKeys - 1 of kv head kvh into the K and V tiles k_s and v_s, zero past n_keys.
template <int kHeadDim, int kKeys, int kThreads, class At>
__device__ __forceinline__ void prefill_load_kv(const PrefillParams& p, const PrefillTile& tile, int kvh, int key0,
                                                uint8_t* k_s, uint8_t* v_s, At at) {
  constexpr int kChunks = kHeadDim / 8;
  const PagedKvCache& cache = p.a.cache;
  const int32_t* table = p.a.block_tables + tile.table_row;
  for (int i = threadIdx.x; i < kKeys * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks, key = key0 + r;
    const bool valid = key < tile.n_keys;
    const int64_t offset = valid ? (key_slot(table, key, p.log2_bs) * cache.n_kv_heads + kvh) * kHeadDim + c * 8 : 0;
    cp_async_16_zfill(k_s + at(r, c), cache.k + offset, valid);
    cp_async_16_zfill(v_s + at(r, c), cache.v + offset, valid);
  }
}

}  // namespace
}  // namespace tern
