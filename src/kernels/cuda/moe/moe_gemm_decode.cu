// The decode variant of the grouped expert GEMM (contract in moe_launch.h; both variants in moe_gemm_device.cuh):
// grid (blocks of weight-row tiles, active-expert slots), the weight streamed straight into mma fragments, K split
// over the warps of a block, optionally the SiLU-and-mul of x and the routing of one token in the same launch.
#include <algorithm>
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/ptx.cuh"

#include "kernels/cuda/fp8/fp8_device.cuh"
#include "kernels/cuda/moe/moe_gemm_device.cuh"
#include "kernels/cuda/moe/moe_launch.h"
#include "kernels/cuda/moe/moe_route_block.cuh"
#include "kernels/cuda/nvfp4/nvfp4_device.cuh"
#include "kernels/cuda/silu_mul.cuh"

namespace tern {

using namespace nvfp4_device;

namespace {

struct ActiveExpert {
  int expert;  // -1: fewer active experts than the slot
  int row_begin, row_end;
};

// The s-th expert (in index order) that has rows; the whole warp calls it and gets the same answer. Each lane
// reads the end offsets of experts lane, lane + 32, ... before any is used, so the lookup costs one memory round
// trip rather than one per 32 experts, and the weight loads that depend on it leave that much sooner. The loops
// have fixed trip counts (no early exit), so the offsets stay in registers.
__device__ __noinline__ ActiveExpert find_active_expert(const int32_t* off, int n_experts, int s) {
  constexpr int kGroups = kMoeMaxExperts / 32;
  const int lane = threadIdx.x % 32;
  int end[kGroups];
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
    const int e = i * 32 + lane;
    end[i] = e < n_experts ? __ldg(off + e + 1) : 0;
  }
  int group_begin = __ldg(off);  // where the group's first expert begins
  int group = -1, rank = s, lane_begin = 0, lane_end = 0;
  unsigned group_mask = 0;
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
    const int up = __shfl_up_sync(kFullMask, end[i], 1);
    const int begin = lane == 0 ? group_begin : up;
    const bool active = i * 32 + lane < n_experts && end[i] > begin;
    const unsigned mask = __ballot_sync(kFullMask, active);
    if (group < 0 && rank < __popc(mask)) {  // warp-uniform
      group = i;
      group_mask = mask;
      lane_begin = begin;
      lane_end = end[i];
    } else if (group < 0) {
      rank -= __popc(mask);
    }
    group_begin = __shfl_sync(kFullMask, end[i], 31);
  }
  if (group < 0) return {-1, 0, 0};
  const bool mine = (group_mask >> lane & 1u) != 0 && __popc(group_mask & ((1u << lane) - 1u)) == rank;
  const int owner = __ffs(__ballot_sync(kFullMask, mine)) - 1;
  return {group * 32 + owner, __shfl_sync(kFullMask, lane_begin, owner), __shfl_sync(kFullMask, lane_end, owner)};
}

// MoeGemmArgs::route: the block routes the one token (moe_route_block.cuh); slot s takes the expert of permuted
// row s, the s-th smallest winner. The block of slot 0 and tile 0 writes the routing for the later launches.
__device__ __forceinline__ ActiveExpert route_one_token(const GemmParams& p) {
  __shared__ moe_route_block::Smem s;
  moe_route_block::route(p.route.logits, p.n_experts, p.top_k, s);
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    moe_route_block::write_routing(s, p.n_experts, p.top_k, p.route.renormalize, p.route, p.align);
  }
  const int row = static_cast<int>(blockIdx.y);
  return {moe_route_block::expert_of_row(s, p.top_k, row), row, row + 1};
}

// MoeGemmArgs::decode_passes: slot s is pass s of the list (expert -1 past the last).
__device__ __forceinline__ ActiveExpert decode_pass(const GemmParams& p) {
  const int4 pass = __ldg(p.passes + blockIdx.y);
  return {pass.x, pass.y, pass.z};
}

// The slot's expert and rows, however the launch finds them.
__device__ __forceinline__ ActiveExpert find_slot(const GemmParams& p) {
  return p.passes != nullptr ? decode_pass(p) : find_active_expert(p.offsets, p.n_experts, blockIdx.y);
}

// ---------------------------------------------------------------------------------------------------------------
// Decode. A block takes decode_block_tiles(kSplitK) tiles of 16 * kMTiles weight rows of one expert, kSplitK warps
// per tile splitting K, and the expert's rows 8 * kTokenTiles at a time (mma N). NVFP4 uses the dense decode
// scheme of nvfp4_device.cuh unchanged, x gathered from the pass's rows. For bf16 (kMTiles = 1), lane (g, t) loads
// 16 consecutive k (32 bytes) of weight rows g and g + 8 per 64-k warp step; mma q of the step feeds words 2q,
// 2q+1 of the row pair as the A slots (2t, 2t+1) and (2t+8, 2t+9), and x's words 2q, 2q+1 at the same k as B,
// which is all the mma needs (it sums over its 16 k slots in any assignment). FP8 (kMTiles = 1) takes the same
// tiles and steps with fp8_device.cuh's decode scheme: 16 codes per row and lane, converted to bf16 in registers,
// each step's sums scaled by their rows' scales of the step's 128-column block.

constexpr int kBf16DecodeUnroll = 2;  // bf16 steps whose loads are issued before any is used
constexpr int kBf16DecodeStepK = 64;

template <int kTokenTiles>
struct Bf16DecodeChunk {
  uint4 w[2][2];            // rows g and g+8: 16 bf16 each
  uint4 x[kTokenTiles][2];  // token g of each tile: the same 16 k
};

__device__ __forceinline__ uint32_t word_of(const uint4 (&v)[2], int m) {  // bf16 pair m of 16 values
  return uint4_word(v[m / 4], m % 4);
}

// x rows at x + xoff[tt]: global memory (read-only for the kernel's life), or with kXShared the act rows a block
// staged in shared memory.
template <int kTokenTiles, bool kXShared>
__device__ __forceinline__ void bf16_decode_load(const GemmParams& p, const uint16_t* w, int n, int n0, int step,
                                                 const uint16_t* x, const int64_t (&xoff)[kTokenTiles],
                                                 Bf16DecodeChunk<kTokenTiles>& c) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int k0 = step * kBf16DecodeStepK + t * 16;  // k is a multiple of 16: the 16 values are all in or all out
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = n0 + g + 8 * r;
    const bool ok = row < n && k0 < p.k;
    const uint4* src = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(row) * p.k + k0);
    c.w[r][0] = ok ? __ldcs(src) : make_uint4(0, 0, 0, 0);
    c.w[r][1] = ok ? __ldcs(src + 1) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int tt = 0; tt < kTokenTiles; ++tt) {
    const bool ok = xoff[tt] >= 0 && k0 < p.k;
    const uint4* src = reinterpret_cast<const uint4*>(x + xoff[tt] + k0);
    c.x[tt][0] = ok ? (kXShared ? src[0] : __ldg(src)) : make_uint4(0, 0, 0, 0);
    c.x[tt][1] = ok ? (kXShared ? src[1] : __ldg(src + 1)) : make_uint4(0, 0, 0, 0);
  }
}

template <int kTokenTiles>
__device__ __forceinline__ void bf16_decode_mma(const Bf16DecodeChunk<kTokenTiles>& c,
                                                float (&acc)[kTokenTiles][1][4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t a[4] = {word_of(c.w[0], 2 * q), word_of(c.w[1], 2 * q), word_of(c.w[0], 2 * q + 1),
                           word_of(c.w[1], 2 * q + 1)};
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) {
      const uint32_t b[2] = {word_of(c.x[tt], 2 * q), word_of(c.x[tt], 2 * q + 1)};
      mma_bf16_16816(acc[tt][0], a, b);
    }
  }
}

// The bf16 K loop of a warp over the expert's [n, k] weight w: steps split, split + kSplitK, ...,
// kBf16DecodeUnroll at a time.
template <int kSplitK, int kTokenTiles, bool kXShared>
__device__ __forceinline__ void bf16_decode_k_loop(const GemmParams& p, const uint16_t* w, int n, int n0, int split,
                                                   const uint16_t* x, const int64_t (&xoff)[kTokenTiles],
                                                   float (&acc)[kTokenTiles][1][4]) {
  const int n_steps = (p.k + kBf16DecodeStepK - 1) / kBf16DecodeStepK;
  for (int s = split; s < n_steps; s += kSplitK * kBf16DecodeUnroll) {
    Bf16DecodeChunk<kTokenTiles> chunks[kBf16DecodeUnroll];
#pragma unroll
    for (int u = 0; u < kBf16DecodeUnroll; ++u) {
      bf16_decode_load<kTokenTiles, kXShared>(p, w, n, n0, s + u * kSplitK, x, xoff, chunks[u]);
    }
#pragma unroll
    for (int u = 0; u < kBf16DecodeUnroll; ++u) bf16_decode_mma<kTokenTiles>(chunks[u], acc);
  }
}

// Blocks per SM the launch bounds ask for. bf16 keeps the budget of 16 resident warps per SM (twice the bytes per
// warp step of NVFP4), and FP8 the same (its steps keep more loads in flight, fp8_decode_unroll). NVFP4 follows the
// dense kernel, except that 32-row tiles in blocks of several tiles (the MoE kernel holds the expert's rows and
// pointers on top) need 3 blocks' budget of 85 registers to avoid spilling.
__host__ __device__ constexpr int moe_decode_min_blocks(MoeWeightFormat format, int m_tiles, int split_k,
                                                        int token_tiles) {
  if (format != MoeWeightFormat::kNvfp4) return 16 > decode_block_warps(split_k) ? 16 / decode_block_warps(split_k) : 1;
  if (m_tiles == 2 && split_k < 8) return 3;
  return decode_min_blocks(split_k, token_tiles);
}

// SiLU-and-mul of the input (MoeGemmArgs::x_silu_mul). x rows hold [gate | up]; each block computes the act rows
// of its pass once into shared memory, [8 * kTokenTiles][k + kActPad] bf16, and its warps read their x fragments
// from there, with silu_mul's arithmetic (silu_mul.cuh).

constexpr int kActPad = 8;  // bf16 after each act row, so the rows of a warp's 8 tokens start in different banks
// The largest split-K reduction buffer of any decode kernel (32 warps x 128 floats), which shares the block's
// shared memory with the act rows.
constexpr size_t kDecodeMaxRedBytes = kDecodeMaxSplitK * 128 * sizeof(float);

// Act row i of the pass (permuted row r0 + i, i < 8 * kTokenTiles, while below row_end) into act, 8 values per
// thread and step. Every thread of the block calls it: the first barrier keeps the previous pass's readers ahead of
// the rewrite, the second makes the rows visible.
template <int kTokenTiles>
__device__ __forceinline__ void stage_silu_act(const GemmParams& p, int r0, int row_end, uint16_t* act) {
  const int chunks = p.k / 8, rows = min(8 * kTokenTiles, row_end - r0);
  __syncthreads();
  for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
    const int row = i / chunks, c = i % chunks;
    const uint4* gate = reinterpret_cast<const uint4*>(p.x + x_row_offset(p, r0 + row) + c * 8);
    const uint4 g = __ldg(gate), u = __ldg(gate + p.k / 8);
    *reinterpret_cast<uint4*>(act + row * (p.k + kActPad) + c * 8) = make_uint4(
        silu_mul_bf16x2(g.x, u.x), silu_mul_bf16x2(g.y, u.y), silu_mul_bf16x2(g.z, u.z), silu_mul_bf16x2(g.w, u.w));
  }
  __syncthreads();
}

// kLoads (nvfp4_device.cuh; NVFP4 only): kUnchecked16 where both projections' n is a multiple of the warp tile's rows
// and k of 128 (the host's choice), the unchecked loop of DecodeRows; else the checked one.
template <MoeWeightFormat kFormat, int kMTiles, int kSplitK, int kTokenTiles, DecodeLoads kLoads, bool kSiluX>
__global__ void __launch_bounds__(decode_block_warps(kSplitK) * 32,
                                  moe_decode_min_blocks(kFormat, kMTiles, kSplitK, kTokenTiles))
    moe_decode_kernel(const GemmParams p) {
  ptx::grid_dependency_begin();
  constexpr bool kIsNvfp4 = kFormat == MoeWeightFormat::kNvfp4, kIsFp8 = kFormat == MoeWeightFormat::kFp8;
  static_assert(kIsNvfp4 || kMTiles == 1);
  constexpr bool kVec16 = kLoads != DecodeLoads::kBytes, kFull = kLoads == DecodeLoads::kUnchecked16;
  static_assert(kIsNvfp4 || kLoads == DecodeLoads::kBytes);
  constexpr int kTiles = decode_block_tiles(kSplitK), kRows = 16 * kMTiles;
  __shared__ __align__(16) float red[decode_red_floats<kSplitK, kMTiles, kTokenTiles>()];
  static_assert(sizeof(red) <= kDecodeMaxRedBytes);
  extern __shared__ __align__(16) unsigned char smem[];  // kSiluX: the act rows
  uint16_t* act = reinterpret_cast<uint16_t*>(smem);
  ActiveExpert ae;
  if constexpr (kSiluX) {
    ae = find_slot(p);
  } else {
    ae = p.route.logits != nullptr ? route_one_token(p) : find_slot(p);
  }
  if (ae.expert < 0) return;  // every warp found the same: the whole block leaves
  const int e = ae.expert;
  // Block-uniform: which projection this block computes, and its block index within that projection's tiles.
  const bool second = static_cast<int>(blockIdx.x) >= p.w2_block;
  const int block = second ? static_cast<int>(blockIdx.x) - p.w2_block : static_cast<int>(blockIdx.x);
  const int n = second ? p.n2 : p.n;
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4;
  const int split = warp % kSplitK;
  const int n0 = (block * kTiles + warp / kSplitK) * kRows;
  auto weight = [&] {
    return second ? DecodeWeightPtrs{p.packed2 + e * p.packed_stride2, p.scales2 + e * p.scales_stride2}
                  : DecodeWeightPtrs{p.packed + e * p.packed_stride, p.scales + e * p.scales_stride};
  };
  auto bf16_weight = [&] { return second ? p.wbf2 + e * p.wbf_stride2 : p.wbf + e * p.wbf_stride; };
  auto fp8_codes = [&] { return second ? p.packed2 + e * p.packed_stride2 : p.packed + e * p.packed_stride; };
  auto fp8_scales = [&] {
    return second ? p.row_scales2 + e * p.row_scales_stride2 : p.row_scales + e * p.row_scales_stride;
  };
  constexpr bool kPrefetch = decode_prefetch(kMTiles, kTokenTiles);
  for (int r0 = ae.row_begin; r0 < ae.row_end; r0 += 8 * kTokenTiles) {
    float acc[kTokenTiles][kMTiles][4] = {};
    int64_t xoff[kTokenTiles];  // the x (or act) row of the lane's token in each token tile, -1: past the rows
    auto find_x_rows = [&] {
#pragma unroll
      for (int tt = 0; tt < kTokenTiles; ++tt) {
        const int r = r0 + tt * 8 + g;
        xoff[tt] = r >= ae.row_end ? -1 : kSiluX ? int64_t{tt * 8 + g} * (p.k + kActPad) : x_row_offset(p, r);
      }
    };
    // The unchecked loop's x: a lane past the pass's rows reads its last row (those columns are never stored).
    auto x_row_pointers = [&](const uint16_t* base, const uint16_t*(&xp)[kTokenTiles]) {
#pragma unroll
      for (int tt = 0; tt < kTokenTiles; ++tt) {
        const int r = min(r0 + tt * 8 + g, ae.row_end - 1);
        xp[tt] = decode_x_at(base + (kSiluX ? int64_t{r - r0} * (p.k + kActPad) : x_row_offset(p, r)), split);
      }
    };
    // Stage 1: the K loop of each warp whose tile is inside n (warp-uniform; a tile past n still takes part in
    // the barriers of the staging and the reduction).
    if constexpr (kSiluX && kIsNvfp4 && kFull) {
      // The first weight loads leave before the act rows are computed, which they do not depend on.
      DecodeW<kMTiles> w;
      const DecodeRows rows = decode_rows(weight().packed, weight().scales, p.k, n0, split);
      if (n0 < n) decode_load_rows<kMTiles>(rows, w);
      stage_silu_act<kTokenTiles>(p, r0, ae.row_end, act);
      if (n0 < n) {
        const uint16_t* xp[kTokenTiles];
        x_row_pointers(act, xp);
        decode_k_loop_rows<kMTiles, kTokenTiles, kPrefetch, true>(rows, xp, p.k, split, kSplitK, w, acc);
      }
    } else if constexpr (kSiluX && kIsNvfp4) {
      DecodeW<kMTiles> w;
      if (n0 < n) decode_load_w<kMTiles, kVec16>(weight().packed, weight().scales, n, p.k, n0, split, w);
      stage_silu_act<kTokenTiles>(p, r0, ae.row_end, act);
      find_x_rows();
      auto load_x = [&](int step, uint4(&xv)[kTokenTiles][4]) {
        decode_load_x<kTokenTiles, true>(act, xoff, p.k, step, xv);
      };
      if (n0 < n) {
        decode_k_loop_with_x<kMTiles, kTokenTiles, kVec16, kPrefetch>(weight, load_x, n, p.k, n0, split, kSplitK, w,
                                                                      acc);
      }
    } else if constexpr (kSiluX && kIsFp8) {
      stage_silu_act<kTokenTiles>(p, r0, ae.row_end, act);
      find_x_rows();
      if (n0 < n) {
        fp8_device::fp8_decode_k_loop<kTokenTiles, true>(fp8_codes(), fp8_scales(), n, p.k, n0, split, kSplitK, act,
                                                         xoff, acc);
      }
    } else if constexpr (kSiluX) {
      stage_silu_act<kTokenTiles>(p, r0, ae.row_end, act);
      find_x_rows();
      if (n0 < n) bf16_decode_k_loop<kSplitK, kTokenTiles, true>(p, bf16_weight(), n, n0, split, act, xoff, acc);
    } else if (n0 < n) {
      if constexpr (kFull) {
        // The first weight loads leave before the gathered row lookups, which they do not depend on.
        DecodeW<kMTiles> w;
        const DecodeRows rows = decode_rows(weight().packed, weight().scales, p.k, n0, split);
        decode_load_rows<kMTiles>(rows, w);
        const uint16_t* xp[kTokenTiles];
        x_row_pointers(p.x, xp);
        decode_k_loop_rows<kMTiles, kTokenTiles, kPrefetch, false>(rows, xp, p.k, split, kSplitK, w, acc);
      } else if constexpr (kIsNvfp4) {
        DecodeW<kMTiles> w;
        const DecodeWeightPtrs first = weight();
        decode_load_w<kMTiles, kVec16>(first.packed, first.scales, n, p.k, n0, split, w);
        find_x_rows();
        decode_k_loop<kMTiles, kTokenTiles, kVec16, kPrefetch>(weight, n, p.k, n0, p.x, xoff, split, kSplitK, w, acc);
      } else if constexpr (kIsFp8) {
        find_x_rows();
        fp8_device::fp8_decode_k_loop<kTokenTiles, false>(fp8_codes(), fp8_scales(), n, p.k, n0, split, kSplitK, p.x,
                                                          xoff, acc);
      } else {
        find_x_rows();
        bf16_decode_k_loop<kSplitK, kTokenTiles, false>(p, bf16_weight(), n, n0, split, p.x, xoff, acc);
      }
    }
    // Stage 2: the split-K sums, scaled, to y (FP8's scales are already in them).
    const float out_scale =
        kIsNvfp4 ? (second ? p.global_scales2 : p.global_scales)[e] * static_cast<float>(1 << kDecodeShift) : 1.0f;
    uint16_t* y = second ? p.y2 : p.y;
    decode_reduce_store<kSplitK, kMTiles, kTokenTiles>(acc, red, [&](int tile, int row, int token, float sum) {
      const int col = (block * kTiles + tile) * kRows + row;
      const int prow = r0 + token;
      if (col < n && prow < ae.row_end) {
        y[static_cast<int64_t>(prow) * p.ldy + col] = f32_to_bf16(sum * out_scale);
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Host side: tile choices, launches.

// A decode launch's parameters: the kernel's, the active-expert slots (grid y), and the shared memory a block gets
// without opting in.
struct DecodeLaunch {
  GemmParams p;
  int64_t slots;
  size_t default_smem;
  const DeviceContext* ctx;
};

constexpr size_t silu_act_bytes(int64_t k, int token_tiles) {
  return static_cast<size_t>(8 * token_tiles * (k + kActPad)) * sizeof(uint16_t);
}

// Grid x: the tiles of w, then those of w2 (none without it), so both projections share one wave of blocks.
template <MoeWeightFormat kFormat, int kMTiles, int kSplitK, int kTokenTiles, DecodeLoads kLoads, bool kSiluX>
void decode_launch_kernel(const DecodeLaunch& l) {
  if constexpr (kLoads == DecodeLoads::kUnchecked16 && kMTiles == 2 && kSplitK >= 8) {
    return;  // never chosen (decode_launch_format), so not compiled
  } else {
    constexpr int kTileRows = 16 * kMTiles * decode_block_tiles(kSplitK);
    GemmParams p = l.p;
    const int64_t blocks = (p.n + kTileRows - 1) / kTileRows, blocks2 = (p.n2 + kTileRows - 1) / kTileRows;
    p.w2_block = static_cast<int>(blocks);
    const dim3 grid(static_cast<unsigned>(blocks + blocks2), static_cast<unsigned>(l.slots));
    auto* kernel = moe_decode_kernel<kFormat, kMTiles, kSplitK, kTokenTiles, kLoads, kSiluX>;
    const size_t act_bytes = kSiluX ? silu_act_bytes(p.k, kTokenTiles) : 0;
    constexpr size_t kRedBytes = decode_red_floats<kSplitK, kMTiles, kTokenTiles>() * sizeof(float);
    if (act_bytes + kRedBytes > l.default_smem) {
      TERN_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(act_bytes)));
    }
    launch_kernel(*l.ctx, kernel, grid, dim3(decode_block_warps(kSplitK) * 32), act_bytes, p);
    TERN_CUDA_CHECK_LAUNCH();
  }
}

template <MoeWeightFormat kFormat, int kMTiles, int kTokenTiles, DecodeLoads kLoads, bool kSiluX>
void decode_launch_split(const DecodeLaunch& l, int split_k) {
  switch (split_k) {
    case 1:
      return decode_launch_kernel<kFormat, kMTiles, 1, kTokenTiles, kLoads, kSiluX>(l);
    case 2:
      return decode_launch_kernel<kFormat, kMTiles, 2, kTokenTiles, kLoads, kSiluX>(l);
    case 4:
      return decode_launch_kernel<kFormat, kMTiles, 4, kTokenTiles, kLoads, kSiluX>(l);
    case 8:
      return decode_launch_kernel<kFormat, kMTiles, 8, kTokenTiles, kLoads, kSiluX>(l);
    case 16:
      return decode_launch_kernel<kFormat, kMTiles, 16, kTokenTiles, kLoads, kSiluX>(l);
  }
  if constexpr (kFormat == MoeWeightFormat::kNvfp4 && decode_max_split_k(kMTiles, kTokenTiles) == 32) {
    decode_launch_kernel<kFormat, kMTiles, 32, kTokenTiles, kLoads, kSiluX>(l);
  }
}

// bf16, and FP8's starting point (both in 64-k warp steps): K split over 4..16 warps per 16-row tile, more when
// tiles are scarce (at least ~16 resident warps per SM for enough loads in flight), never more warps than steps.
// Tiles of w2 count with those of w.
static_assert(fp8_device::kFp8DecodeStepK == kBf16DecodeStepK);
int step64_decode_split(const DeviceProps& props, const MoeGemmArgs& a, int64_t slots) {
  const int64_t tiles = ((a.w.n + 15) / 16 + (a.w2.n + 15) / 16) * slots;
  const int64_t steps = (a.w.k + kBf16DecodeStepK - 1) / kBf16DecodeStepK;
  int split = 16;
  if (tiles >= 2LL * props.num_sms) split = 8;
  if (tiles >= 4LL * props.num_sms) split = 4;
  while (split > 4 && split > steps) split /= 2;
  return split;
}

// FP8: the bf16 rule, then halved while a warp would have fewer than fp8_decode_unroll steps: each warp issues that
// many steps' loads, conversions and mmas at a time, those past k included, and fewer warps without empty steps
// were faster (H200, moe_bench --decode --fp8, down [2048, 512] over 256 experts: T=1 10.5 -> 6.8 us, T=8 67.4 ->
// 38.6 us; gate_up unchanged).
template <int kTokenTiles>
int fp8_decode_split(const DeviceProps& props, const MoeGemmArgs& a, int64_t slots) {
  const int64_t steps = (a.w.k + fp8_device::kFp8DecodeStepK - 1) / fp8_device::kFp8DecodeStepK;
  int split = step64_decode_split(props, a, slots);
  while (split > 1 && split * fp8_device::fp8_decode_unroll(kTokenTiles) > steps) split /= 2;
  return split;
}

constexpr int kPassMinSplitK = 2;  // NVFP4 with a pass list (decode_launch_format)

template <int kTokenTiles, bool kSiluX>
void decode_launch_format(const MoeGemmArgs& a, const DeviceProps& props, const DeviceContext& ctx) {
  // The active experts (passes) are unknown on the host; min(n_experts, rows) (moe_decode_pass_slots) bounds them.
  const int64_t slots =
      a.decode_passes != nullptr ? moe_decode_pass_slots(a.rows, a.w.n_experts) : std::min(a.w.n_experts, a.rows);
  const DecodeLaunch l{make_params(a), slots, props.shared_mem_per_block, &ctx};
  if (a.w.format == MoeWeightFormat::kBf16) {
    return decode_launch_split<MoeWeightFormat::kBf16, 1, kTokenTiles, DecodeLoads::kBytes, kSiluX>(
        l, step64_decode_split(props, a, slots));
  }
  if (a.w.format == MoeWeightFormat::kFp8) {
    return decode_launch_split<MoeWeightFormat::kFp8, 1, kTokenTiles, DecodeLoads::kBytes, kSiluX>(
        l, fp8_decode_split<kTokenTiles>(props, a, slots));
  }
  // 16-byte weight loads need 16-byte aligned rows (k % 32) in every expert of both projections; the 2-byte scale
  // loads 2-byte ones.
  auto vec16_ok = [](const MoeExpertWeights& w) {
    return w.n == 0 || (is_aligned(w.packed, 16) && w.packed_expert_stride % 16 == 0 && is_aligned(w.scales, 2) &&
                        w.scales_expert_stride % 2 == 0);
  };
  const bool vec16 = a.w.k % 32 == 0 && vec16_ok(a.w) && vec16_ok(a.w2);
  // Two m16 tiles per warp only with 16-byte loads (the byte-wise path serves odd k and is not worth the code) and
  // one token tile (with two, the MoE kernel's 32-row tiles would spill). The shape is chosen for the rows of both
  // projections, which share the grid.
  constexpr bool kTwoMTilesOk = kTokenTiles == 1;
  DecodeShape shape =
      decode_choose_shape(props.num_sms, a.w.n + a.w2.n, a.w.k, slots, kTokenTiles, vec16 && kTwoMTilesOk);
  // A pass list's slots are a bound the active passes rarely reach, and past 8 tokens the launch takes more than
  // one wave of blocks whatever the split; K over at least kPassMinSplitK warps halves each block's walk, which the
  // model's steps measured much faster (docs/perf/gpu.md §decode-passes).
  if (a.decode_passes != nullptr && shape.split_k < kPassMinSplitK && a.w.k >= kPassMinSplitK * kDecodeStepK) {
    shape.split_k = kPassMinSplitK;
  }
  constexpr MoeWeightFormat kNvfp4 = MoeWeightFormat::kNvfp4;
  constexpr DecodeLoads kChecked16 = DecodeLoads::kChecked16, kUnchecked16 = DecodeLoads::kUnchecked16;
  if (!vec16) return decode_launch_split<kNvfp4, 1, kTokenTiles, DecodeLoads::kBytes, kSiluX>(l, shape.split_k);
  // The unchecked loop wants whole tiles of both projections over whole steps, and every warp a step.
  const int tile_rows = 16 * shape.m_tiles;
  const bool full = a.w.n % tile_rows == 0 && a.w2.n % tile_rows == 0 && a.w.k % kDecodeStepK == 0 &&
                    shape.split_k <= a.w.k / kDecodeStepK;
  if constexpr (kTwoMTilesOk) {
    if (shape.m_tiles == 2) {
      // At 8 or more warps a tile (64 registers, moe_decode_min_blocks) the unchecked loop's pointers spill.
      if (full && shape.split_k < 8)
        return decode_launch_split<kNvfp4, 2, kTokenTiles, kUnchecked16, kSiluX>(l, shape.split_k);
      return decode_launch_split<kNvfp4, 2, kTokenTiles, kChecked16, kSiluX>(l, shape.split_k);
    }
  }
  if (full) return decode_launch_split<kNvfp4, 1, kTokenTiles, kUnchecked16, kSiluX>(l, shape.split_k);
  decode_launch_split<kNvfp4, 1, kTokenTiles, kChecked16, kSiluX>(l, shape.split_k);
}

}  // namespace

void moe_gemm_launch_decode(const DeviceContext& ctx, const MoeGemmArgs& a) {
  // One 8-row tile per pass covers every expert while tokens <= 8 (a token picks an expert once). Past that, a pass
  // list gives each 8-row pass its own blocks (moe_forward passes one); without a list, two tiles (the rule measured
  // before the list: docs/perf/gpu.md §decode-token-tiles, §decode-passes).
  static_assert(kMoeDecodePassRows == 8);  // a pass is one token tile
  const bool one_tile =
      a.decode_passes != nullptr || a.decode_token_tiles == 1 || (a.decode_token_tiles == 0 && a.rows <= 8 * a.top_k);
  if (a.x_silu_mul) {
    if (one_tile) return decode_launch_format<1, true>(a, ctx.props(), ctx);
    return decode_launch_format<2, true>(a, ctx.props(), ctx);
  }
  if (one_tile) return decode_launch_format<1, false>(a, ctx.props(), ctx);
  decode_launch_format<2, false>(a, ctx.props(), ctx);
}

size_t moe_gemm_silu_smem_bytes(int64_t k) {
  return silu_act_bytes(k, 2) + kDecodeMaxRedBytes;
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t moe_gemm_decode_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out,
                               moe_decode_kernel<MoeWeightFormat::kNvfp4, 1, 4, 1, DecodeLoads::kUnchecked16, false>);
}

}  // namespace tern
