// The small MoE kernels: routing (softmax + top-k, or DeepSeek-V3's sigmoid + grouped top-k), the alignment of pairs
// by expert, and the weighted combine of the expert outputs. Contracts in moe_launch.h; the grouped expert GEMM in
// moe_gemm_*.cu.
#include <cuda_bf16.h>
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/ptx.cuh"

#include <algorithm>

#include "kernels/cuda/moe/moe_launch.h"

namespace tern {
namespace {

constexpr unsigned kFullMask = 0xFFFFFFFFu;

using cuda_common::bf16_to_f32;
using cuda_common::load_bf16x8;
using cuda_common::sigmoid_f32;
using cuda_common::store_bf16x8;

__device__ __forceinline__ unsigned lanemask_lt(int lane) { return (1u << lane) - 1u; }

// ---------------------------------------------------------------------------------------------------------------
// Route: one warp per token. Lane l holds experts l, l + 32, ... (up to kMoeMaxExperts / 32 of them) in registers;
// the k winners are found one at a time by a warp arg-max over the experts not yet taken. The comparison (higher
// probability, then lower index) is a total order, so every lane agrees on each winner.

constexpr int kRouteWarps = 4;
constexpr int kRoutePerLane = static_cast<int>(kMoeMaxExperts / 32);

__device__ __forceinline__ void warp_argmax(float& key, int& index) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other_key = __shfl_xor_sync(kFullMask, key, offset);
    const int other_index = __shfl_xor_sync(kFullMask, index, offset);
    if (other_key > key || (other_key == key && other_index < index)) {
      key = other_key;
      index = other_index;
    }
  }
}

// One token's choices: lane j < top_k gets the j-th (descending probability) expert and its weight. The whole warp
// calls it.
struct RouteChoice {
  int id;
  float weight;
};

__device__ __forceinline__ RouteChoice route_token(const MoeRouteArgs& a, int64_t token) {
  const int lane = threadIdx.x % 32;
  const int n_experts = static_cast<int>(a.n_experts), top_k = static_cast<int>(a.top_k);
  const uint16_t* logits = a.logits + token * a.logits_stride;

  // Stage 1: softmax in fp32 as layers/moe.cc: p = exp(l - max) / sum.
  float p[kRoutePerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < n_experts ? bf16_to_f32(logits[e]) : -INFINITY;
    mx = fmaxf(mx, p[i]);
  }
  for (int offset = 16; offset > 0; offset /= 2) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, offset));
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) {
    p[i] = lane + 32 * i < n_experts ? expf(p[i] - mx) : 0.0f;
    sum += p[i];
  }
  // (Not warp_sum: the call changes this kernel's register allocation.)
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) p[i] /= sum;

  // Stage 2: top-k. Keys are the probabilities (>= 0), a NaN ranks as -1 and a taken or absent expert as -2.
  uint32_t taken = 0;
  float my_p = 0.0f, top_sum = 0.0f;
  int my_id = 0;
  for (int j = 0; j < top_k; ++j) {
    float key = -2.0f;
    int index = INT_MAX;
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) {
      const int e = lane + 32 * i;
      const float k_i = p[i] == p[i] ? p[i] : -1.0f;
      if (e < n_experts && !((taken >> i) & 1u) && k_i > key) {  // ascending e: ties keep the lower index
        key = k_i;
        index = e;
      }
    }
    warp_argmax(key, index);
    if (index % 32 == lane) taken |= 1u << (index / 32);
    const float winner_p = key >= 0.0f ? key : __int_as_float(0x7FC00000);
    top_sum += winner_p;  // in selection order, as layers/moe.cc sums
    if (lane == j) {
      my_p = winner_p;
      my_id = index;
    }
  }
  return {my_id, a.renormalize ? my_p / top_sum : my_p};
}

// warp_argmax carrying a payload along with the winner (every lane ends with the winner's).
__device__ __forceinline__ void warp_argmax(float& key, int& index, float& payload) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other_key = __shfl_xor_sync(kFullMask, key, offset);
    const int other_index = __shfl_xor_sync(kFullMask, index, offset);
    const float other_payload = __shfl_xor_sync(kFullMask, payload, offset);
    if (other_key > key || (other_key == key && other_index < index)) {
      key = other_key;
      index = other_index;
      payload = other_payload;
    }
  }
}

// Sigmoid routing (MoeRouteArgs::sigmoid; layers/moe.cc route_sigmoid), with route_token's layout: lane l holds the
// score and choice value of experts l, l + 32, ...; the groups' worths are warp reductions, one group per pass, and
// lane g ranks group g; the k winners are then found as route_token finds them, among the kept groups' experts.
__device__ __forceinline__ RouteChoice route_token_sigmoid(const MoeRouteArgs& a, int64_t token) {
  const int lane = threadIdx.x % 32;
  const int n_experts = static_cast<int>(a.n_experts), top_k = static_cast<int>(a.top_k);
  const uint16_t* logits = a.logits_f32 != nullptr ? nullptr : a.logits + token * a.logits_stride;
  const float* logits_f32 = a.logits_f32 != nullptr ? a.logits_f32 + token * a.logits_stride : nullptr;

  // Stage 1: score = 1 / (1 + exp(-l)) and choice = score + bias in fp32, as layers/moe.cc. A NaN choice becomes
  // -inf, below every number; absent experts (e >= n_experts) are never candidates.
  float score[kRoutePerLane], choice[kRoutePerLane];
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) {
    const int e = lane + 32 * i;
    score[i] = 0.0f;
    choice[i] = -INFINITY;
    if (e < n_experts) {
      score[i] = sigmoid_f32(logits_f32 != nullptr ? logits_f32[e] : bf16_to_f32(logits[e]));
      const float c = score[i] + (a.correction_bias != nullptr ? a.correction_bias[e] : 0.0f);
      choice[i] = c == c ? c : -INFINITY;
    }
  }

  // Stage 2: the kept groups. Bit i of `dropped`: expert lane + 32 i is outside them. With every group kept (one
  // group, as GLM-5) there is nothing to rank.
  uint32_t dropped = 0;
  if (a.topk_group < a.n_group) {  // warp-uniform
    const int n_group = static_cast<int>(a.n_group), per_group = n_experts / n_group;
    float my_worth = -INFINITY;  // lane g < n_group: group g's worth
    for (int g = 0; g < n_group; ++g) {
      // The group's two best choice values: each lane's, then merged over the warp (max and second max of a
      // multiset, so every lane ends with the same two).
      const int first = g * per_group, end = first + per_group;
      float best = -INFINITY, second = -INFINITY;
#pragma unroll
      for (int i = 0; i < kRoutePerLane; ++i) {
        const int e = lane + 32 * i;
        if (e >= first && e < end) {
          second = fmaxf(second, fminf(best, choice[i]));
          best = fmaxf(best, choice[i]);
        }
      }
      for (int offset = 16; offset > 0; offset /= 2) {
        const float other_best = __shfl_xor_sync(kFullMask, best, offset);
        const float other_second = __shfl_xor_sync(kFullMask, second, offset);
        second = fmaxf(fminf(best, other_best), fmaxf(second, other_second));
        best = fmaxf(best, other_best);
      }
      if (lane == g) my_worth = best + (per_group > 1 ? second : 0.0f);  // layers/moe.cc's sum
    }
    // Group g's rank: the groups worth more, or as much with a lower index.
    int rank = 0;
    for (int h = 0; h < n_group; ++h) {
      const float other = __shfl_sync(kFullMask, my_worth, h);
      rank += other > my_worth || (other == my_worth && h < lane);
    }
    const uint32_t kept = __ballot_sync(kFullMask, lane < n_group && rank < a.topk_group);
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < n_experts && !((kept >> (e / per_group)) & 1u)) dropped |= 1u << i;
    }
  }

  // Stage 3: top-k by choice value among the kept groups' experts not yet taken (the validated shapes leave at least
  // top_k of them); the first such expert of a lane is its candidate whatever its value, a later one only when
  // higher. The winner's score comes along for its weight.
  uint32_t unavailable = dropped;  // bit i: expert lane + 32 i is taken or outside the kept groups
  float my_score = 0.0f, top_sum = 0.0f;
  int my_id = 0;
  for (int j = 0; j < top_k; ++j) {
    float key = -INFINITY, key_score = 0.0f;
    int index = INT_MAX;
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < n_experts && !((unavailable >> i) & 1u) && (choice[i] > key || index == INT_MAX)) {
        key = choice[i];  // ascending e: ties keep the lower index
        key_score = score[i];
        index = e;
      }
    }
    warp_argmax(key, index, key_score);
    if (index % 32 == lane) unavailable |= 1u << (index / 32);
    top_sum += key_score;  // in selection order, as layers/moe.cc sums
    if (lane == j) {
      my_score = key_score;
      my_id = index;
    }
  }
  const float w = a.renormalize ? my_score / (top_sum + 1e-20f) : my_score;
  return {my_id, w * a.routed_scaling};
}

// The routing a kernel instance does: softmax (route_token) or sigmoid (route_token_sigmoid), chosen at launch so
// the softmax kernels stay as they were.
template <bool kSigmoid>
__device__ __forceinline__ RouteChoice route_one(const MoeRouteArgs& a, int64_t token) {
  if constexpr (kSigmoid) {
    return route_token_sigmoid(a, token);
  } else {
    return route_token(a, token);
  }
}

template <bool kSigmoid>
__global__ void __launch_bounds__(kRouteWarps * 32) moe_route_kernel(const MoeRouteArgs a) {
  ptx::grid_dependency_begin();
  const int lane = threadIdx.x % 32;
  const int64_t token = int64_t{blockIdx.x} * kRouteWarps + threadIdx.x / 32;
  if (token >= a.tokens) return;  // the whole warp
  const RouteChoice c = route_one<kSigmoid>(a, token);
  if (lane < a.top_k) {
    a.topk_ids[token * a.top_k + lane] = c.id;
    a.topk_weights[token * a.top_k + lane] = c.weight;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Align: one block. Warp w owns a contiguous chunk of the pairs, so "stable in pair order" means: by warp, then by
// 32-pair step inside the warp's chunk, then by lane. Stage 1 counts each warp's pairs per bucket (match_any groups
// the lanes of one expert; their leader adds the group size), stage 2 turns the counts into each warp's first row
// per bucket, stage 3 walks the chunks again and places every pair at its bucket's next row.

constexpr int kAlignWarps = 16;  // counts[16][513] ints = 32.8 KB of static shared memory

// Expert id - expert_begin, or n_experts for an id outside this rank's [expert_begin, expert_begin + n_experts):
// out-of-range ids (other ranks' experts, under expert parallelism) share the last bucket.
__device__ __forceinline__ int align_bucket(int32_t id, const MoeAlignArgs& a) {
  const int64_t local = int64_t{id} - a.expert_begin;
  return local >= 0 && local < a.n_experts ? static_cast<int>(local) : static_cast<int>(a.n_experts);
}

// Exclusive scan of totals[0, n) in place, by warp 0.
__device__ void align_scan_buckets(int* totals, int n) {
  const int lane = threadIdx.x % 32;
  int carry = 0;
  for (int base = 0; base < n; base += 32) {
    const int b = base + lane;
    const int total = b < n ? totals[b] : 0;
    int incl = total;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int other = __shfl_up_sync(kFullMask, incl, d);
      if (lane >= d) incl += other;
    }
    if (b < n) totals[b] = carry + incl - total;
    carry += __shfl_sync(kFullMask, incl, 31);
  }
}

// MoeAlignArgs::decode_passes from the buckets' first rows (bucket_start, n_experts + 1 of them) by the whole block:
// each expert's pass count, their exclusive scan, then every expert's passes and the -1 entries after the last.
__device__ void align_write_passes(const int* bucket_start, const MoeAlignArgs& a) {
  __shared__ int pass_start[kMoeMaxExperts + 1];
  constexpr int kPass = static_cast<int>(kMoeDecodePassRows);
  const int n_experts = static_cast<int>(a.n_experts);
  for (int e = threadIdx.x; e <= n_experts; e += blockDim.x) {
    pass_start[e] = e < n_experts ? (bucket_start[e + 1] - bucket_start[e] + kPass - 1) / kPass : 0;
  }
  __syncthreads();
  if (threadIdx.x < 32) align_scan_buckets(pass_start, n_experts + 1);
  __syncthreads();
  int4* passes = reinterpret_cast<int4*>(a.decode_passes);
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
    const int end = bucket_start[e + 1];
    int at = pass_start[e];
    for (int r = bucket_start[e]; r < end; r += kPass) passes[at++] = make_int4(e, r, min(r + kPass, end), 0);
  }
  const int slots = static_cast<int>(moe_decode_pass_slots(a.tokens * a.top_k, a.n_experts));
  for (int i = pass_start[n_experts] + static_cast<int>(threadIdx.x); i < slots; i += blockDim.x) {
    passes[i] = make_int4(-1, 0, 0, 0);
  }
}

using AlignCounts = int[kAlignWarps][kMoeMaxExperts + 1];

// Stage 1 over a block's pairs [begin, end), in kAlignWarps consecutive chunks, one a warp: counts[w][b] = the pairs
// of chunk w in bucket b. Lanes past the chunk form their own group (bucket -1) and add nothing.
// This warp's chunk [first, end) of the block's pairs [begin, end), as align_count and align_scatter walk them.
struct AlignChunk {
  int first, end;
};
__device__ __forceinline__ AlignChunk align_warp_chunk(int begin, int end) {
  const int chunk = (end - begin + kAlignWarps - 1) / kAlignWarps;
  const int first = min(end, begin + static_cast<int>(threadIdx.x / 32) * chunk);
  return {first, min(end, first + chunk)};
}

__device__ void align_count(const int32_t* ids, int begin, int end, const MoeAlignArgs& a, AlignCounts& counts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_buckets = static_cast<int>(a.n_experts) + 1;
  for (int i = threadIdx.x; i < kAlignWarps * n_buckets; i += blockDim.x) counts[i / n_buckets][i % n_buckets] = 0;
  __syncthreads();
  const AlignChunk c = align_warp_chunk(begin, end);
  for (int base = c.first; base < c.end; base += 32) {
    const int pair = base + lane;
    const int b = pair < c.end ? align_bucket(ids[pair], a) : -1;
    const unsigned peers = __match_any_sync(kFullMask, b);
    if (b >= 0 && lane == __ffs(peers) - 1) counts[warp][b] += __popc(peers);
    __syncwarp();  // the next step's leader of the same bucket may be another lane
  }
  __syncthreads();
}

// Stage 2 inside the block: counts[w][b] becomes the rows of bucket b in the warps before w, and totals[b] the
// block's rows of bucket b.
__device__ void align_warp_offsets(AlignCounts& counts, int n_buckets, int* totals) {
  for (int b = threadIdx.x; b < n_buckets; b += blockDim.x) {
    int run = 0;
    for (int w = 0; w < kAlignWarps; ++w) {
      const int c = counts[w][b];
      counts[w][b] = run;
      run += c;
    }
    totals[b] = run;
  }
  __syncthreads();
}

// Stage 3: every pair of the block's [begin, end) (the chunks of align_count) to row first[b] + counts[w][b] + its
// rank among the warp's pairs of bucket b so far.
__device__ void align_scatter(const int32_t* ids, int begin, int end, AlignCounts& counts, const int* first,
                              const MoeAlignArgs& a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const AlignChunk c = align_warp_chunk(begin, end);
  for (int base = c.first; base < c.end; base += 32) {
    const int pair = base + lane;
    const int b = pair < c.end ? align_bucket(ids[pair], a) : -1;
    const unsigned peers = __match_any_sync(kFullMask, b);
    if (b >= 0) {
      const int row = first[b] + counts[warp][b] + __popc(peers & lanemask_lt(lane));
      a.sorted_pairs[row] = pair;
      a.pair_row[pair] = row;
    }
    __syncwarp();  // every lane has read counts[warp][b] before the leader moves it on
    if (b >= 0 && lane == __ffs(peers) - 1) counts[warp][b] += __popc(peers);
    __syncwarp();
  }
}

// The buckets' first rows from their sizes (bucket_start, in place), then expert_offsets and the decode passes.
__device__ void align_finish(int* bucket_start, int n_buckets, const MoeAlignArgs& a) {
  if (threadIdx.x < 32) align_scan_buckets(bucket_start, n_buckets);
  __syncthreads();
  for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) a.expert_offsets[e] = bucket_start[e];
  if (a.decode_passes != nullptr) align_write_passes(bucket_start, a);  // block-uniform
}

// The sort of the pairs' ids (a.topk_ids, or the fused kernel's copy in shared memory) by the whole block.
__device__ __forceinline__ void align_pairs(const int32_t* ids, const MoeAlignArgs& a) {
  __shared__ AlignCounts counts;
  __shared__ int bucket_start[kMoeMaxExperts + 1];
  const int n_buckets = static_cast<int>(a.n_experts) + 1;
  const int rows = static_cast<int>(a.tokens * a.top_k);
  align_count(ids, 0, rows, a, counts);
  align_warp_offsets(counts, n_buckets, bucket_start);
  align_finish(bucket_start, n_buckets, a);
  align_scatter(ids, 0, rows, counts, bucket_start, a);
}

__global__ void __launch_bounds__(kAlignWarps * 32) moe_align_kernel(const MoeAlignArgs a) {
  ptx::grid_dependency_begin();
  align_pairs(a.topk_ids, a);
}

// Past one block's worth of pairs (kAlignBlockPairs) the sort runs in three launches over blocks of that many
// consecutive pairs: count (each block's rows per bucket into the workspace, [blocks][n_buckets] ints), scan (one
// block: those become each block's first row inside each bucket; the buckets' first rows, expert_offsets, the
// decode passes), scatter (each block counts per warp again and places its pairs). Stable in pair order, as the one
// block's sort.
constexpr int kAlignBlockPairs = kAlignWarps * 32 * 4;

__global__ void __launch_bounds__(kAlignWarps * 32) moe_align_count_kernel(const MoeAlignArgs a) {
  ptx::grid_dependency_begin();
  __shared__ AlignCounts counts;
  const int n_buckets = static_cast<int>(a.n_experts) + 1;
  const int rows = static_cast<int>(a.tokens * a.top_k), begin = static_cast<int>(blockIdx.x) * kAlignBlockPairs;
  align_count(a.topk_ids, begin, min(rows, begin + kAlignBlockPairs), a, counts);
  align_warp_offsets(counts, n_buckets, static_cast<int*>(a.workspace) + int64_t{blockIdx.x} * n_buckets);
}

__global__ void __launch_bounds__(kAlignWarps * 32) moe_align_scan_kernel(const MoeAlignArgs a, int blocks) {
  ptx::grid_dependency_begin();
  __shared__ int bucket_start[kMoeMaxExperts + 1];
  const int n_buckets = static_cast<int>(a.n_experts) + 1;
  int* block_rows = static_cast<int*>(a.workspace);
  for (int b = threadIdx.x; b < n_buckets; b += blockDim.x) {
    int run = 0;
    for (int k = 0; k < blocks; ++k) {
      const int c = block_rows[k * n_buckets + b];
      block_rows[k * n_buckets + b] = run;
      run += c;
    }
    bucket_start[b] = run;
  }
  __syncthreads();
  align_finish(bucket_start, n_buckets, a);
}

__global__ void __launch_bounds__(kAlignWarps * 32) moe_align_scatter_kernel(const MoeAlignArgs a) {
  ptx::grid_dependency_begin();
  __shared__ AlignCounts counts;
  __shared__ int first[kMoeMaxExperts + 1];
  const int n_buckets = static_cast<int>(a.n_experts) + 1;
  const int rows = static_cast<int>(a.tokens * a.top_k), begin = static_cast<int>(blockIdx.x) * kAlignBlockPairs;
  const int end = min(rows, begin + kAlignBlockPairs);
  align_count(a.topk_ids, begin, end, a, counts);
  align_warp_offsets(counts, n_buckets, first);  // first[] is overwritten below
  const int* block_rows = static_cast<const int*>(a.workspace) + int64_t{blockIdx.x} * n_buckets;
  for (int b = threadIdx.x; b < n_buckets; b += blockDim.x) first[b] = a.expert_offsets[b] + block_rows[b];
  __syncthreads();
  align_scatter(a.topk_ids, begin, end, counts, first, a);
}

int64_t align_blocks(int64_t tokens, int64_t top_k) { return (tokens * top_k + kAlignBlockPairs - 1) / kAlignBlockPairs; }

// Route and align in one block: warp w routes tokens w, w + kAlignWarps, ..., writing the choices out and the ids
// also to shared memory, from where the block sorts them once all are in. route_token and align_pairs are the two
// kernels' code, so every output is the same bits.
template <bool kSigmoid>
__global__ void __launch_bounds__(kAlignWarps * 32) moe_route_align_kernel(const MoeRouteArgs r, const MoeAlignArgs a) {
  ptx::grid_dependency_begin();
  __shared__ int32_t ids[kMoeRouteAlignMaxPairs];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t token = warp; token < r.tokens; token += kAlignWarps) {  // warp-uniform
    const RouteChoice c = route_one<kSigmoid>(r, token);
    if (lane < r.top_k) {
      r.topk_ids[token * r.top_k + lane] = c.id;
      r.topk_weights[token * r.top_k + lane] = c.weight;
      ids[token * r.top_k + lane] = c.id;
    }
  }
  __syncthreads();
  align_pairs(ids, a);
}

// Route and align of at most 32 pairs (a decode step or a verification of a few tokens): warp w routes tokens w,
// w + W, ... (W warps, one per token up to kRouteAlignWarpWarps) into shared memory, then warp 0 holds pair p's
// bucket in lane p, and the sort becomes counting in registers: pair p's row is the number of pairs before it in
// (bucket, pair index) order, which is the order the block sort's stable scatter gives, and expert_offsets[e] the
// number of pairs in buckets below e. No pass over n_experts + 1 buckets and one barrier: at a few tokens the block
// version's passes and barriers were most of its time, and routing the tokens one after another in one warp took
// 22 us at 4 tokens (docs/perf/gpu.md).
constexpr int kRouteAlignWarpPairs = 32;
constexpr int kRouteAlignWarpWarps = 8;

template <bool kSigmoid>
__global__ void __launch_bounds__(kRouteAlignWarpWarps * 32)
    moe_route_align_warp_kernel(const MoeRouteArgs r, const MoeAlignArgs a) {
  ptx::grid_dependency_begin();
  __shared__ int pair_bucket[kRouteAlignWarpPairs];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int top_k = static_cast<int>(r.top_k), rows = static_cast<int>(r.tokens) * top_k;
  const int n_experts = static_cast<int>(a.n_experts);
  for (int token = warp; token < static_cast<int>(r.tokens); token += warps) {  // warp-uniform
    const RouteChoice c = route_one<kSigmoid>(r, token);
    if (lane < top_k) {
      r.topk_ids[int64_t{token} * top_k + lane] = c.id;
      r.topk_weights[int64_t{token} * top_k + lane] = c.weight;
      pair_bucket[token * top_k + lane] = align_bucket(c.id, a);
    }
  }
  __syncthreads();
  if (warp != 0) return;
  // Lanes past the pairs sort after all of them and are never written.
  const int bucket = lane < rows ? pair_bucket[lane] : INT_MAX;
  int buckets[kRouteAlignWarpPairs];
#pragma unroll
  for (int q = 0; q < kRouteAlignWarpPairs; ++q) buckets[q] = __shfl_sync(kFullMask, bucket, q);
  if (lane < rows) {
    int row = 0;
#pragma unroll
    for (int q = 0; q < kRouteAlignWarpPairs; ++q)
      row += q < rows && (buckets[q] < bucket || (buckets[q] == bucket && q < lane));
    a.sorted_pairs[row] = lane;
    a.pair_row[lane] = row;
  }
  for (int e = lane; e <= n_experts; e += 32) {
    int below = 0;
#pragma unroll
    for (int q = 0; q < kRouteAlignWarpPairs; ++q) below += q < rows && buckets[q] < e;
    a.expert_offsets[e] = below;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Combine: block (token, 1024-column slice). The first top_k threads rank the token's pairs by expert id; every
// thread then sums its 8 columns over the pairs in that order, in fp32, and adds the shared expert (gated, or
// unweighted without a gate).

constexpr int kCombineThreads = 128;
constexpr int kVec = 8;  // load_bf16x8, store_bf16x8

__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(const MoeCombineArgs a) {
  ptx::grid_dependency_begin();
  // order[s]: the j of the token's s-th smallest expert id; -1 past the pairs of experts in [begin, end)
  __shared__ int order[kMoeMaxTopK];
  const int64_t token = blockIdx.x;
  const int top_k = static_cast<int>(a.top_k);
  const int64_t pair0 = token * top_k;
  if (threadIdx.x < top_k) {
    const int j = threadIdx.x;
    const int id = moe_combine_key(a.topk_ids[pair0 + j], a.expert_begin, a.expert_end);
    int rank = 0;
    for (int i = 0; i < top_k; ++i) {
      const int other = moe_combine_key(a.topk_ids[pair0 + i], a.expert_begin, a.expert_end);
      rank += other < id || (other == id && i < j);
    }
    order[rank] = id == INT_MAX ? -1 : j;
  }
  __syncthreads();
  const int64_t col = (int64_t{blockIdx.y} * kCombineThreads + threadIdx.x) * kVec;
  if (col >= a.hidden) return;
  float acc[kVec] = {};
  for (int s = 0; s < top_k && order[s] >= 0; ++s) {
    const int j = order[s];
    const float w = a.topk_weights[pair0 + j];
    float v[kVec];
    load_bf16x8(a.expert_out + int64_t{a.pair_row[pair0 + j]} * a.hidden + col, v);
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = fmaf(v[i], w, acc[i]);  // explicit, as gemv_bf16's combine epilogue
  }
  if (a.shared_out != nullptr) {
    // layers/moe.cc's form; 1 for an ungated shared expert (fmaf(1, v, acc) below is the plain sum)
    const float sig =
        a.shared_gate != nullptr ? sigmoid_f32(bf16_to_f32(a.shared_gate[token * a.shared_gate_stride])) : 1.0f;
    float v[kVec];
    load_bf16x8(a.shared_out + token * a.hidden + col, v);
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = fmaf(sig, v[i], acc[i]);
  }
  store_bf16x8(a.y + token * a.hidden + col, acc);
}

}  // namespace

void moe_route_launch(const DeviceContext& ctx, const MoeRouteArgs& a) {
  const auto blocks = static_cast<unsigned>((a.tokens + kRouteWarps - 1) / kRouteWarps);
  if (a.sigmoid) {
    launch_kernel(ctx, moe_route_kernel<true>, dim3(blocks), dim3(kRouteWarps * 32), 0, a);
  } else {
    launch_kernel(ctx, moe_route_kernel<false>, dim3(blocks), dim3(kRouteWarps * 32), 0, a);
  }
  TERN_CUDA_CHECK_LAUNCH();
}

// One block up to kAlignBlockPairs pairs (a few microseconds at decode sizes), else the three launches. The one
// block at 4096 tokens x top-8 walked 64 steps of 32 pairs twice per warp: docs/perf/gpu.md §align-blocks.
void moe_align_launch(const DeviceContext& ctx, const MoeAlignArgs& a) {
  const int64_t blocks = align_blocks(a.tokens, a.top_k);
  if (blocks <= 1) {
    launch_kernel(ctx, moe_align_kernel, dim3(1), dim3(kAlignWarps * 32), 0, a);
  } else {
    const dim3 grid(static_cast<unsigned>(blocks)), block(kAlignWarps * 32);
    launch_kernel(ctx, moe_align_count_kernel, grid, block, 0, a);
    launch_kernel(ctx, moe_align_scan_kernel, dim3(1), block, 0, a, static_cast<int>(blocks));
    launch_kernel(ctx, moe_align_scatter_kernel, grid, block, 0, a);
  }
  TERN_CUDA_CHECK_LAUNCH();
}

size_t moe_align_workspace_ints(int64_t tokens, int64_t top_k, int64_t n_experts) {
  const int64_t blocks = align_blocks(tokens, top_k);
  return blocks <= 1 ? 0 : static_cast<size_t>(blocks * (n_experts + 1));
}

// The one-block route + align routes a warp's tokens one after another (each warp argmax round waits on the last),
// so past half a token per warp the two launches are faster: 10.2 against 33.0 us at 64 tokens, 8.6 against 9.3
// at 8 (moe_bench --small on the H200; docs/perf/gpu.md §route-align).
constexpr int64_t kRouteAlignBlockMaxTokens = kAlignWarps / 2;

void moe_route_align_launch(const DeviceContext& ctx, const MoeRouteArgs& route, const MoeAlignArgs& align) {
  if (route.tokens > kRouteAlignBlockMaxTokens) {
    moe_route_launch(ctx, route);
    return moe_align_launch(ctx, align);
  }
  const bool warp = route.tokens * route.top_k <= kRouteAlignWarpPairs && align.decode_passes == nullptr;
  const int64_t route_warps = std::min<int64_t>(std::max<int64_t>(route.tokens, 1), kRouteAlignWarpWarps);
  const dim3 warps(static_cast<unsigned>(32 * route_warps));
  if (warp && route.sigmoid) {
    launch_kernel(ctx, moe_route_align_warp_kernel<true>, dim3(1), warps, 0, route, align);
  } else if (warp) {
    launch_kernel(ctx, moe_route_align_warp_kernel<false>, dim3(1), warps, 0, route, align);
  } else if (route.sigmoid) {
    launch_kernel(ctx, moe_route_align_kernel<true>, dim3(1), dim3(kAlignWarps * 32), 0, route, align);
  } else {
    launch_kernel(ctx, moe_route_align_kernel<false>, dim3(1), dim3(kAlignWarps * 32), 0, route, align);
  }
  TERN_CUDA_CHECK_LAUNCH();
}

void moe_combine_launch(const DeviceContext& ctx, const MoeCombineArgs& a) {
  const int64_t slices = (a.hidden / kVec + kCombineThreads - 1) / kCombineThreads;
  const dim3 grid(static_cast<unsigned>(a.tokens), static_cast<unsigned>(slices));
  launch_kernel(ctx, moe_combine_kernel, grid, dim3(kCombineThreads), 0, a);
  TERN_CUDA_CHECK_LAUNCH();
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t moe_route_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, moe_route_kernel<false>);
}

}  // namespace tern
