// The routing of one token by a whole block, for a kernel that routes before its own work (the decode GEMM of a
// one-token step, MoeGemmArgs::route). Same choices and the same bits as moe_route's warp (moe_route.cu): the
// softmax computes exp(l - max) with the same expressions, adds the terms in the warp's order (lane l takes
// experts l, l + 32, ... in turn, then a butterfly over the lanes) and divides each by the sum; the winners are
// the k highest probabilities, ties to the lower index, NaN below every number; top_sum adds the winners in
// selection order. Only the selection is spread over the block, in two rounds: each group of 32 experts (one
// warp's lanes) ranks its members with 32 shuffles and keeps its best k as candidates, then the candidates rank
// among themselves (the k best of all are among them). Softmax routing only (MoeGemmArgs::route rejects sigmoid
// routing). Include from .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/moe/moe_launch.h"

namespace tern::moe_route_block {

struct Smem {
  float v[kMoeMaxExperts];         // logits, then exp(logit - max)
  float cand_key[kMoeMaxExperts];  // candidates: slot g * top_k + r is group g's r-th best (id -1: none)
  int cand_id[kMoeMaxExperts];
  float warp_max[32];
  float sum;
  float pick_key[kMoeMaxTopK];  // the winners in selection order; key -1 is a NaN probability
  int pick_id[kMoeMaxTopK];
};

// (key, id) ranks before (other_key, other_id): the selection's total order.
__device__ __forceinline__ bool ranks_before(float other_key, int other_id, float key, int id) {
  return other_key > key || (other_key == key && other_id < id);
}

// Routes one token from its n_experts bf16 logits with every thread of the block (blockDim.x a multiple of 32) and
// leaves the winners in s.pick_id / s.pick_key. Every thread must call it; it ends with a barrier.
__device__ __forceinline__ void route(const uint16_t* logits, int n_experts, int top_k, Smem& s) {
  constexpr unsigned kFull = 0xFFFFFFFFu;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, n_threads = blockDim.x, n_warps = n_threads / 32;
  const int groups = (n_experts + 31) / 32, n_cand = groups * top_k;

  // Maximum (fmaxf skips NaN: -inf when every logit is NaN).
  float mx = -INFINITY;
  for (int e = tid; e < n_experts; e += n_threads) {
    const float l = cuda_common::bf16_to_f32(logits[e]);
    s.v[e] = l;
    mx = fmaxf(mx, l);
  }
  for (int c = tid; c < n_cand; c += n_threads) s.cand_id[c] = -1;
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
  if (lane == 0) s.warp_max[warp] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int w = 0; w < n_warps; ++w) mx = fmaxf(mx, s.warp_max[w]);
  for (int e = tid; e < n_experts; e += n_threads) s.v[e] = expf(s.v[e] - mx);
  __syncthreads();

  // The sum, in the warp route's order.
  if (warp == 0) {
    float sum = 0.0f;
    for (int e = lane; e < n_experts; e += 32) sum += s.v[e];
    sum = cuda_common::warp_sum(sum);
    if (lane == 0) s.sum = sum;
  }
  __syncthreads();

  // Round 1: group g (experts 32 g + lane) ranks its members; the best top_k become candidates.
  const float sum = s.sum;
  for (int g = warp; g < groups; g += n_warps) {  // warp-uniform
    const int e = 32 * g + lane;
    float key = -2.0f;  // no expert: after every real one
    if (e < n_experts) {
      const float p = s.v[e] / sum;
      key = p == p ? p : -1.0f;
    }
    int rank = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) rank += ranks_before(__shfl_sync(kFull, key, j), j, key, lane);
    if (e < n_experts && rank < top_k) {
      s.cand_key[g * top_k + rank] = key;
      s.cand_id[g * top_k + rank] = e;
    }
  }
  __syncthreads();

  // Round 2: eight lanes rank each candidate among all of them, every eighth candidate each.
  const int sub = lane % 8;
  for (int c0 = warp * 4; c0 < n_cand; c0 += n_warps * 4) {  // warp-uniform
    const int c = c0 + lane / 8;
    const int id = c < n_cand ? s.cand_id[c] : -1;
    const float key = c < n_cand ? s.cand_key[c] : 0.0f;
    int rank = 0;
    for (int o = sub; o < n_cand; o += 8) {
      const int other = s.cand_id[o];
      rank += other >= 0 && ranks_before(s.cand_key[o], other, key, id);
    }
    rank += __shfl_xor_sync(kFull, rank, 1);
    rank += __shfl_xor_sync(kFull, rank, 2);
    rank += __shfl_xor_sync(kFull, rank, 4);
    if (sub == 0 && id >= 0 && rank < top_k) {
      s.pick_key[rank] = key;
      s.pick_id[rank] = id;
    }
  }
  __syncthreads();
}

// Winner j's weight: its probability (NaN for a NaN one), divided by the winners' sum (added in selection order)
// when renormalize.
__device__ __forceinline__ float weight(const Smem& s, int top_k, bool renormalize, int j) {
  auto winner_p = [&](int i) { return s.pick_key[i] >= 0.0f ? s.pick_key[i] : __int_as_float(0x7FC00000); };
  float top_sum = 0.0f;
  for (int i = 0; i < top_k; ++i) top_sum += winner_p(i);
  return renormalize ? winner_p(j) / top_sum : winner_p(j);
}

// Winner j's place among the winners by expert index: its permuted row, as moe_align sorts one token's pairs.
__device__ __forceinline__ int row_of(const Smem& s, int top_k, int j) {
  int row = 0;
  for (int i = 0; i < top_k; ++i) row += s.pick_id[i] < s.pick_id[j];
  return row;
}

// The expert of permuted row `row` (the row-th smallest winner), -1 past the winners. Whole warp.
__device__ __forceinline__ int expert_of_row(const Smem& s, int top_k, int row) {
  const int lane = threadIdx.x % 32;
  const bool mine = lane < top_k && row_of(s, top_k, lane) == row;
  const unsigned owner = __ballot_sync(0xFFFFFFFFu, mine);
  return owner == 0 ? -1 : s.pick_id[__ffs(owner) - 1];
}

// What moe_route and moe_align write for this one token: ids and weights in selection order, the expert offsets,
// sorted_pairs and pair_row. One block calls it, all its threads.
__device__ __forceinline__ void write_routing(const Smem& s, int n_experts, int top_k, bool renormalize,
                                              const MoeRouteArgs& route, const MoeAlignArgs& align) {
  const int tid = threadIdx.x;
  if (tid < top_k) {
    const int row = row_of(s, top_k, tid);
    route.topk_ids[tid] = s.pick_id[tid];
    route.topk_weights[tid] = weight(s, top_k, renormalize, tid);
    align.pair_row[tid] = row;
    align.sorted_pairs[row] = tid;
  }
  for (int e = tid; e <= n_experts; e += blockDim.x) {
    int below = 0;
    for (int i = 0; i < top_k; ++i) below += s.pick_id[i] < e;
    align.expert_offsets[e] = below;
  }
}

}  // namespace tern::moe_route_block
