// Device code shared by the dense NVFP4 W4A16 GEMM (gemm_nvfp4_w4a16.cu) and the grouped MoE GEMM (moe_gemm_*.cu):
// the bf16 operand loads of the mma.sync (ptx.cuh), and the two ways an NVFP4 weight (ModelOpt layout,
// docs/model-specs.md §1) reaches the tensor cores:
//   decode:  16-byte loads of the packed weight dequantized straight into mma A fragments in registers;
//   prefill: a 128 x 32 weight tile dequantized to bf16 in shared memory, then ldmatrix + mma.
// The weight factor fed to the tensor cores is e2m1 · e4m3 block scale, which is exact in bf16 (at most 2 + 4
// significant bits, magnitudes 2^-10 .. 2688), so every product is exact and the only roundings are the fp32
// accumulation and the final bf16 store. Include from .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ptx.cuh"

namespace tern::nvfp4_device {

using cuda_common::f32_to_bf16;
using ptx::cp_async_16_zfill;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4;
using ptx::mma_bf16_16816;
using ptx::smem_addr;

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core and conversion helpers

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
  return __byte_perm(a, b, selector);
}

// 32-bit word j (0..3) of v; j is a compile-time constant wherever it is called, so this is a register.
__device__ __forceinline__ uint32_t uint4_word(const uint4& v, int j) {
  switch (j) {
    case 0:
      return v.x;
    case 1:
      return v.y;
    case 2:
      return v.z;
    default:
      return v.w;
  }
}

// e4m3 block scale times 2^exp2, as a bf16 pair (both halves equal). Exact: e4m3 has 4 significant bits.
__device__ __forceinline__ uint32_t e4m3_scale_bf16x2(uint32_t code, float multiplier) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code & 0xFF), __NV_E4M3);
  const float value = __half2float(__half(h)) * multiplier;
  const uint32_t bits = f32_to_bf16(value);
  return bits | (bits << 16);
}

// ---------------------------------------------------------------------------------------------------------------
// Decode scheme (few activation rows: a bandwidth problem). A warp owns a tile of 16 * kMTiles weight rows and a
// share of K. Per 128-k step, lane (g, t) = (lane / 4, lane % 4) loads 16 bytes (32 consecutive k) of rows g + 8h
// (h < 2 * kMTiles: the row pair of every m16 tile's mma A fragment) with their two block scales, and x for the
// same 32 k of token g, the mma B fragment, which all m16 tiles of the warp share. The mma only sums over its 16 k
// slots, so which k each slot holds is free as long as x uses the same assignment: nibbles p and p + 4 of each
// 8-nibble word become one bf16 pair (decode_e2m1_pairs), and x is permuted to match with byte_perm. The bf16
// pattern with the e2m1 exponent/mantissa in bits [8:6] equals e2m1 · 2^-126 (e2m1's subnormal 0.5 becomes a bf16
// subnormal), so the block scale is applied as e4m3 · 2^(126 - kDecodeShift) and the fp32 sum is multiplied by
// global_scale · 2^kDecodeShift; the shift keeps the scale within bf16's range.
//
// Why it is shaped this way. (1) Issue rate: at the H200's ~4.3 TB/s an SM receives 1 KiB of packed weight about
// every 63 cycles, and a KiB is 2048 weights to dequantize. Logic ops, shifts and permutes issue to a pipe with 16
// lanes per SM partition (half the FMA pipes' rate), so a shift-and-mask decode at 15 of them per 8 weights would
// alone need ~70 cycles per KiB. decode_e2m1_pairs takes 9 logic ops and 4 integer multiply-adds (FMA pipe) per 8
// weights, and the 32-row warp tile halves the x loads and permutes per weight. (2) Bytes in flight: HBM needs
// ~32 KiB of loads in flight per SM (bandwidth x latency), and the matrices of a decode step are small (a few MB),
// so the whole read should be in flight at once. A warp step is 2 KiB (kMTiles = 2), the one-token-tile kernels
// fit 64 registers so 32 warps are resident per SM (64 KiB in flight), and the launchers split K over up to 32
// warps per tile so the grid fills those slots in one wave (decode_choose_shape). (3) Latency: a warp's first weight
// loads leave before anything that depends on other loads (the MoE kernel's gathered x rows).
//
// Blocks: kSplitK warps share each tile's K (warp w of a block takes tile w / kSplitK and the steps w % kSplitK,
// + kSplitK, ...); a block holds decode_block_tiles(kSplitK) tiles, 8, 16 or 32 warps. The partial sums meet in shared
// memory and are added in a fixed order, so a run's bits do not depend on timing.

constexpr int kDecodeShift = 10;
constexpr int kDecodeStepK = 128;     // k per warp step: 4 lanes x 32
constexpr int kDecodeMaxSplitK = 32;  // 16-row tiles and one token tile only (decode_max_split_k)

__host__ __device__ constexpr int decode_block_tiles(int split_k) {
  return split_k >= 8 ? 1 : 8 / split_k;
}
__host__ __device__ constexpr int decode_block_warps(int split_k) {
  return split_k * decode_block_tiles(split_k);
}
// A 32-warp split has 1024 threads and, with 32-row tiles or two token tiles, more reduction floats than fit.
__host__ __device__ constexpr int decode_max_split_k(int m_tiles, int token_tiles) {
  return m_tiles == 1 && token_tiles == 1 ? kDecodeMaxSplitK : kDecodeMaxSplitK / 2;
}
// Resident warps per SM the launch bounds ask for: with one token tile a lane fits in 64 registers; a second token
// tile doubles x and the accumulators.
__host__ __device__ constexpr int decode_warps_per_sm(int token_tiles) {
  return token_tiles == 1 ? 32 : 16;
}
__host__ __device__ constexpr int decode_min_blocks(int split_k, int token_tiles) {
  return decode_warps_per_sm(token_tiles) > decode_block_warps(split_k)
             ? decode_warps_per_sm(token_tiles) / decode_block_warps(split_k)
             : 1;
}

// Tile height (kMTiles m16 tiles) and K split of a decode launch, for n rows, k, and `slots` independent weights
// (MoE experts) side by side. Two m16 tiles per warp cost fewer instructions per weight, but when that leaves
// fewer blocks than SMs (small n) one m16 tile per warp spreads the work over twice the SMs. K splits in two while
// the warps still fit the resident slots once (decode_warps_per_sm): more warps, each with fewer steps, have more
// of the read in flight at once; past one wave they would only queue. No more warps than steps.
struct DecodeShape {
  int m_tiles, split_k;
};

inline DecodeShape decode_choose_shape(int num_sms, int64_t n, int64_t k, int64_t slots, int token_tiles,
                                       bool two_m_tiles_ok) {
  const int64_t target_warps = static_cast<int64_t>(decode_warps_per_sm(token_tiles)) * num_sms;
  const int64_t steps = (k + kDecodeStepK - 1) / kDecodeStepK;
  auto shape = [&](int m_tiles, int64_t* blocks) {
    const int64_t tiles = (n + 16 * m_tiles - 1) / (16 * m_tiles);
    const int max_split = decode_max_split_k(m_tiles, token_tiles);
    int split_k = 1;
    while (split_k < max_split && 2 * split_k <= steps && tiles * slots * 2 * split_k <= target_warps) split_k *= 2;
    *blocks = (tiles + decode_block_tiles(split_k) - 1) / decode_block_tiles(split_k) * slots;
    return DecodeShape{m_tiles, split_k};
  };
  int64_t blocks = 0;
  if (two_m_tiles_ok) {
    const DecodeShape two = shape(2, &blocks);
    if (blocks >= num_sms) return two;
  }
  return shape(1, &blocks);
}

// Where one [n, k] NVFP4 weight starts.
struct DecodeWeightPtrs {
  const uint8_t* packed;  // [n, k/2]
  const uint8_t* scales;  // [n, k/16]
};

// One step of a lane's weight: 32 e2m1 codes of each row g + 8h of the warp tile, and per m16 tile mt the four
// block scales of its rows g and g + 8 as bytes [row g block 2t, row g + 8 block 2t, row g block 2t + 1,
// row g + 8 block 2t + 1], so each 16-bit half is the scale pair of one block (decode_scales).
template <int kMTiles>
struct DecodeW {
  uint4 q[2 * kMTiles];
  uint32_t s[kMTiles];
};

// The packed weight is read once: it bypasses L1 (x, which every warp of a tile reads, stays there) and asks L2
// for the surrounding 256 bytes, the neighbouring steps that the other warps of the tile read next. (An L2
// evict-first policy would hold a 64-bit register for the kernel's life, which the 64-register budget lacks.)
__device__ __forceinline__ uint4 ld_weight_16(const uint8_t* p) {
  return ptx::ld_stream_16(p);
}
__device__ __forceinline__ uint2 ld_weight_8(const uint8_t* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ld_scale_2(const uint8_t* p) {
  unsigned short v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ld_scale_1(const uint8_t* p) {
  unsigned short v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.u8 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}

// How a decode kernel reads its NVFP4 weight steps (kernels of other formats take kBytes and ignore it): byte-wise
// with bounds checks (decode_load_w), 16-byte loads with bounds checks (decode_load_w<kVec16>), or 16-byte loads
// without them, for whole tiles over whole steps (DecodeRows, the host's choice).
enum class DecodeLoads { kBytes, kChecked16, kUnchecked16 };

// Step `step` of rows n0 + g + 8h of an [n, k] NVFP4 weight (zeros past n or k). kVec16: one 16-byte load and one
// 2-byte scale load per row (k % 32 == 0, 16-byte aligned packed rows); else 8-byte loads and byte scales, since a
// row may end after the first 16 codes of a lane's 32 (k is a multiple of 16).
template <int kMTiles, bool kVec16>
__device__ __forceinline__ void decode_load_w(const uint8_t* packed, const uint8_t* scales, int n, int k, int n0,
                                              int step, DecodeW<kMTiles>& w) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int k0 = step * kDecodeStepK + t * 32;
  const int valid = k - k0;  // a multiple of 16
  uint32_t s[2 * kMTiles];   // row g + 8h: block 2t in bits 7:0, block 2t + 1 in bits 15:8
#pragma unroll
  for (int h = 0; h < 2 * kMTiles; ++h) {
    const int row = n0 + g + 8 * h;
    w.q[h] = make_uint4(0, 0, 0, 0);
    s[h] = 0;
    if (row >= n || valid <= 0) continue;
    const uint8_t* wp = packed + static_cast<int64_t>(row) * (k / 2) + k0 / 2;
    const uint8_t* sp = scales + static_cast<int64_t>(row) * (k / 16) + k0 / 16;
    if constexpr (kVec16) {
      w.q[h] = ld_weight_16(wp);
      s[h] = ld_scale_2(sp);
    } else {
      const uint2 lo = ld_weight_8(wp);
      w.q[h].x = lo.x;
      w.q[h].y = lo.y;
      s[h] = ld_scale_1(sp);
      if (valid >= 32) {
        const uint2 hi = ld_weight_8(wp + 8);
        w.q[h].z = hi.x;
        w.q[h].w = hi.y;
        s[h] |= ld_scale_1(sp + 1) << 8;
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) w.s[mt] = byte_perm(s[2 * mt], s[2 * mt + 1], 0x5140);
}

// The offset of the lane's token row (token 8 tt + g of each token tile) in a dense x of m rows of k, -1 past the
// last row: the checked decode loops' xoff (this NVFP4 kernel's and the FP8 one's).
template <int kTokenTiles>
__device__ __forceinline__ void decode_token_offsets(int m, int k, int64_t (&xoff)[kTokenTiles]) {
  const int g = (threadIdx.x % 32) / 4;
#pragma unroll
  for (int tt = 0; tt < kTokenTiles; ++tt) {
    const int token = tt * 8 + g;
    xoff[tt] = token < m ? static_cast<int64_t>(token) * k : -1;
  }
}

// x for step `step`: the 32 k of the lane's token in each token tile, from x + xoff[tt] (xoff < 0: no token).
// x is global memory, read-only for the kernel's life, or with kXShared rows a block staged in shared memory.
template <int kTokenTiles, bool kXShared = false>
__device__ __forceinline__ void decode_load_x(const uint16_t* x, const int64_t (&xoff)[kTokenTiles], int k, int step,
                                              uint4 (&xv)[kTokenTiles][4]) {
  const int k0 = step * kDecodeStepK + (threadIdx.x % 4) * 32;
  const int valid = k - k0;  // a multiple of 16, so 16-byte pieces are whole
#pragma unroll
  for (int tt = 0; tt < kTokenTiles; ++tt) {
    const uint4* src = reinterpret_cast<const uint4*>(x + xoff[tt] + k0);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      xv[tt][j] = xoff[tt] >= 0 && 8 * j < valid ? (kXShared ? src[j] : __ldg(src + j)) : make_uint4(0, 0, 0, 0);
    }
  }
}

// The four bf16 pairs of an 8-nibble word q, pair i = (nibble i', nibble i' + 4) with i' = 0, 1, 2, 3 for
// i = 0, 1, 2, 3, each equal to e2m1 · 2^-126. For nibble p of the low half, (q & mask) * (2^a + 2^b) places two
// copies of the nibble: the one shifted by a has its sign at bit 15, the one shifted by b has its exponent and
// mantissa at bits 8:6; the high half's nibble p + 4 lands 16 bits higher. The copies do not overlap, so the
// product is their bitwise or, and 0x81C081C0 keeps the sign and the three magnitude bits of each half.
__device__ __forceinline__ void decode_e2m1_pairs(uint32_t q, uint32_t (&pairs)[4]) {
  constexpr uint32_t kKeep = 0x81C081C0u;
  const uint32_t q2 = q >> 8;                        // nibbles 2, 3 (and 6, 7) where 0, 1 (and 4, 5) were
  pairs[0] = ((q & 0x000F000Fu) * 0x1040u) & kKeep;  // nibble 0: shifts 12 and 6
  pairs[1] = ((q & 0x00F000F0u) * 0x104u) & kKeep;   // nibble 1: shifts 8 and 2
  pairs[2] = ((q2 & 0x000F000Fu) * 0x1040u) & kKeep;
  pairs[3] = ((q2 & 0x00F000F0u) * 0x104u) & kKeep;
}

// The x pairs matching decode_e2m1_pairs for the 8 bf16 values in v (v.x holds elements 0, 1): (x0, x4), (x1, x5),
// (x2, x6), (x3, x7).
__device__ __forceinline__ void decode_x_pairs(const uint4& v, uint32_t (&pairs)[4]) {
  pairs[0] = byte_perm(v.x, v.z, 0x5410);
  pairs[1] = byte_perm(v.x, v.z, 0x7632);
  pairs[2] = byte_perm(v.y, v.w, 0x5410);
  pairs[3] = byte_perm(v.y, v.w, 0x7632);
}

// The e4m3 scale pair in the low 16 bits of `codes` (rows g and g + 8 of one block) as bf16 pairs (c, c) of
// code · 2^(126 - kDecodeShift): bits 7:0 to out[0], bits 15:8 to out[1]. Exact: e4m3 has 4 significant bits and
// the range fits bf16.
__device__ __forceinline__ void decode_scales(uint32_t codes, uint32_t (&out)[2]) {
  constexpr float kScaleMul = 0x1p116f;
  static_assert(126 - kDecodeShift == 116);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const float v[2] = {f.x * kScaleMul, f.y * kScaleMul};
#pragma unroll
  for (int i = 0; i < 2; ++i) asm("cvt.rn.bf16x2.f32 %0, %1, %1;\n" : "=r"(out[i]) : "f"(v[i]));
}

// One step's mmas: acc[tt][mt] += rows 16 mt .. 16 mt + 15 of the tile times token tile tt. Words 2b and 2b + 1 of
// a lane's 32 codes per row are block b; its scales are decoded when they are first needed.
template <int kMTiles, int kTokenTiles>
__device__ __forceinline__ void decode_mma_step(const DecodeW<kMTiles>& w, const uint4 (&xv)[kTokenTiles][4],
                                                float (&acc)[kTokenTiles][kMTiles][4]) {
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    uint32_t sc[kMTiles][2];  // [m16 tile][row g, row g + 8]
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) decode_scales(w.s[mt] >> (16 * b), sc[mt]);
#pragma unroll
    for (int j = 2 * b; j < 2 * b + 2; ++j) {  // word j of each row: elements 8j .. 8j + 7 of the lane's 32
      uint32_t xb[kTokenTiles][4];
#pragma unroll
      for (int tt = 0; tt < kTokenTiles; ++tt) decode_x_pairs(xv[tt][j], xb[tt]);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        uint32_t lo[4], hi[4];  // rows g and g + 8 of m16 tile mt
        decode_e2m1_pairs(uint4_word(w.q[2 * mt], j), lo);
        decode_e2m1_pairs(uint4_word(w.q[2 * mt + 1], j), hi);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          lo[i] = bf16x2_mul(lo[i], sc[mt][0]);
          hi[i] = bf16x2_mul(hi[i], sc[mt][1]);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // A slots (2t, 2t+1), (2t+8, 2t+9): pairs 2 half, 2 half + 1
          const uint32_t a[4] = {lo[2 * half], hi[2 * half], lo[2 * half + 1], hi[2 * half + 1]};
#pragma unroll
          for (int tt = 0; tt < kTokenTiles; ++tt) {
            const uint32_t bx[2] = {xb[tt][2 * half], xb[tt][2 * half + 1]};
            mma_bf16_16816(acc[tt][mt], a, bx);
          }
        }
      }
    }
  }
}

// A warp's share of its tile: steps first, first + stride, ... below ceil(k / 128). w holds step `first` on entry
// (the caller loads it before computing the x offsets, so those loads leave first). weight() returns the
// DecodeWeightPtrs; the MoE kernel computes them from the expert on demand rather than holding four more
// registers through the loop. kPrefetch: the next step's weight loads leave before this step's mmas, for warps
// that walk many steps (no K split) and have the registers for a second DecodeW. decode_k_loop reads x rows from
// global memory (decode_load_x); decode_k_loop_with_x leaves each step's x to load_x(step, xv), which fills xv as
// decode_load_x would (the MoE kernel's activations computed into shared memory).
template <int kMTiles, int kTokenTiles, bool kVec16, bool kPrefetch, class WeightOf, class LoadX>
__device__ __forceinline__ void decode_k_loop_with_x(WeightOf&& weight, LoadX&& load_x, int n, int k, int n0, int first,
                                                     int stride, DecodeW<kMTiles>& w,
                                                     float (&acc)[kTokenTiles][kMTiles][4]) {
  const int n_steps = (k + kDecodeStepK - 1) / kDecodeStepK;
  for (int step = first; step < n_steps; step += stride) {
    const bool more = step + stride < n_steps;
    DecodeW<kMTiles> next;
    if (kPrefetch && more) {
      const DecodeWeightPtrs ptrs = weight();
      decode_load_w<kMTiles, kVec16>(ptrs.packed, ptrs.scales, n, k, n0, step + stride, next);
    }
    uint4 xv[kTokenTiles][4];
    load_x(step, xv);
    decode_mma_step<kMTiles, kTokenTiles>(w, xv, acc);
    if (kPrefetch && more) {
      w = next;
    } else if (more) {
      const DecodeWeightPtrs ptrs = weight();
      decode_load_w<kMTiles, kVec16>(ptrs.packed, ptrs.scales, n, k, n0, step + stride, w);
    }
  }
}

template <int kMTiles, int kTokenTiles, bool kVec16, bool kPrefetch, class WeightOf>
__device__ __forceinline__ void decode_k_loop(WeightOf&& weight, int n, int k, int n0, const uint16_t* x,
                                              const int64_t (&xoff)[kTokenTiles], int first, int stride,
                                              DecodeW<kMTiles>& w, float (&acc)[kTokenTiles][kMTiles][4]) {
  auto load_x = [&](int step, uint4(&xv)[kTokenTiles][4]) { decode_load_x<kTokenTiles>(x, xoff, k, step, xv); };
  decode_k_loop_with_x<kMTiles, kTokenTiles, kVec16, kPrefetch>(weight, load_x, n, k, n0, first, stride, w, acc);
}

// Full tiles: n a multiple of the warp tile's rows (a tile lies inside n or wholly past it, and a warp past it
// skips the loop), k a multiple of 128, 16-byte aligned rows. The lane keeps pointers to its row g at the current
// step (the other rows are whole multiples of 8 rows further) and advances them by the warp's stride of steps, with
// no bounds checks or zero fills; x likewise, one pointer per token tile to a valid row (a lane past the last token
// reads the last token's row: its columns are never stored). Against the checked loop this removes a fifth of the
// instructions of a step (docs/perf/gemm.md, "Decode, the unchecked loop").
struct DecodeRows {
  const uint8_t* packed;  // row n0 + g, the lane's 16 bytes of the current step
  const uint8_t* scales;  // row n0 + g, the lane's 2 scale bytes of the current step
  int64_t packed_row8;    // 8 rows, in bytes
  int64_t scales_row8;
};

__device__ __forceinline__ DecodeRows decode_rows(const uint8_t* packed, const uint8_t* scales, int k, int n0,
                                                  int step) {
  const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
  const int64_t row = n0 + g;
  return DecodeRows{packed + row * (k / 2) + step * (kDecodeStepK / 2) + t * 16,
                    scales + row * (k / 16) + step * (kDecodeStepK / 16) + t * 2, int64_t{4} * k, int64_t{k} / 2};
}

__device__ __forceinline__ void decode_rows_advance(DecodeRows& r, int steps) {
  r.packed += steps * (kDecodeStepK / 2);
  r.scales += steps * (kDecodeStepK / 16);
}

template <int kMTiles>
__device__ __forceinline__ void decode_load_rows(const DecodeRows& r, DecodeW<kMTiles>& w) {
  uint32_t s[2 * kMTiles];
#pragma unroll
  for (int h = 0; h < 2 * kMTiles; ++h) {
    w.q[h] = ld_weight_16(r.packed + h * r.packed_row8);
    s[h] = ld_scale_2(r.scales + h * r.scales_row8);
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) w.s[mt] = byte_perm(s[2 * mt], s[2 * mt + 1], 0x5140);
}

// Where the lane's x of step `step` starts in an x row: its 32 k of the step (the unchecked loop's xp).
__device__ __forceinline__ const uint16_t* decode_x_at(const uint16_t* row, int step) {
  return row + step * kDecodeStepK + (threadIdx.x % 4) * 32;
}

// The lane's x for the current step of each token tile: xp[tt] points at its token's row, k offset t * 32 of the
// step. Global memory read-only for the kernel's life, or with kXShared a block's rows in shared memory.
template <int kTokenTiles, bool kXShared>
__device__ __forceinline__ void decode_load_x_rows(const uint16_t* (&xp)[kTokenTiles], uint4 (&xv)[kTokenTiles][4]) {
#pragma unroll
  for (int tt = 0; tt < kTokenTiles; ++tt) {
    const uint4* src = reinterpret_cast<const uint4*>(xp[tt]);
#pragma unroll
    for (int j = 0; j < 4; ++j) xv[tt][j] = kXShared ? src[j] : __ldg(src + j);
  }
}

// decode_k_loop_with_x for full tiles: w holds step `first` (decode_load_rows at r), r and xp point at it.
template <int kMTiles, int kTokenTiles, bool kPrefetch, bool kXShared>
__device__ __forceinline__ void decode_k_loop_rows(DecodeRows r, const uint16_t* (&xp)[kTokenTiles], int k, int first,
                                                   int stride, DecodeW<kMTiles>& w,
                                                   float (&acc)[kTokenTiles][kMTiles][4]) {
  const int n_steps = k / kDecodeStepK;
  for (int step = first; step < n_steps; step += stride) {
    const bool more = step + stride < n_steps;
    decode_rows_advance(r, stride);
    DecodeW<kMTiles> next;
    if (kPrefetch && more) decode_load_rows<kMTiles>(r, next);
    uint4 xv[kTokenTiles][4];
    decode_load_x_rows<kTokenTiles, kXShared>(xp, xv);
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) xp[tt] += stride * kDecodeStepK;
    decode_mma_step<kMTiles, kTokenTiles>(w, xv, acc);
    if (kPrefetch && more) {
      w = next;
    } else if (more) {
      decode_load_rows<kMTiles>(r, w);
    }
  }
}

// Prefetching doubles the weight registers: only the two-token-tile kernels (128-register budget) with 16-row tiles.
__host__ __device__ constexpr bool decode_prefetch(int m_tiles, int token_tiles) {
  return m_tiles == 1 && token_tiles == 2;
}

// The block's tiles: sums each tile's kSplitK partial fragments (through `red`, in split order) and hands every
// element to store(tile in block, row in tile, token in pass, sum). Fragment element e of lane (g, t), m16 tile mt,
// token tile tt is row 16 mt + g + 8 (e / 2), token 8 tt + 2t + e % 2. Every thread of the block must call it.
template <int kSplitK, int kMTiles, int kTokenTiles>
__host__ __device__ constexpr int decode_red_floats() {
  return kSplitK == 1 ? 1 : decode_block_warps(kSplitK) * kTokenTiles * kMTiles * 128;
}

template <int kSplitK, int kMTiles, int kTokenTiles, class Store>
__device__ __forceinline__ void decode_reduce_store(const float (&acc)[kTokenTiles][kMTiles][4], float* red,
                                                    Store&& store) {
  constexpr int kFrag = kTokenTiles * kMTiles * 128;  // floats per warp
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto element = [&](int tile, int f, float v) {
    const int tt = f / (kMTiles * 128), mt = (f / 128) % kMTiles, l = (f / 4) % 32, e = f % 4;
    store(tile, 16 * mt + l / 4 + 8 * (e / 2), 8 * tt + 2 * (l % 4) + e % 2, v);
  };
  if constexpr (kSplitK == 1) {
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) element(warp, ((tt * kMTiles + mt) * 32 + lane) * 4 + e, acc[tt][mt][e]);
      }
    }
  } else {
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        *reinterpret_cast<float4*>(&red[warp * kFrag + ((tt * kMTiles + mt) * 32 + lane) * 4]) =
            make_float4(acc[tt][mt][0], acc[tt][mt][1], acc[tt][mt][2], acc[tt][mt][3]);
      }
    }
    __syncthreads();
    constexpr int kTiles = decode_block_tiles(kSplitK);
    for (int idx = threadIdx.x; idx < kTiles * kFrag; idx += decode_block_warps(kSplitK) * 32) {
      const int tile = idx / kFrag, f = idx % kFrag;
      float sum = 0.0f;
#pragma unroll
      for (int s = 0; s < kSplitK; ++s) sum += red[(tile * kSplitK + s) * kFrag + f];
      element(tile, f, sum);
    }
    __syncthreads();  // red is rewritten by a next pass
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Prefill scheme (many activation rows: arithmetic-bound). A block computes a kBm x 128 tile over K in 32-k steps.
// W's packed bytes for a step are loaded into registers ahead of use, then dequantized (a 256-entry byte -> bf16-pair
// table, times the block scale) into a bf16 W tile in shared memory. 8 warps as 2 (M) x 4 (N), each a (kBm / 2) x 32
// tile of m16n8k16 mmas fed by ldmatrix. Rows are padded by 16 bytes so ldmatrix's eight 16-byte rows fall in
// distinct banks.

constexpr int kPrefillBn = 128;
constexpr int kPrefillBk = 32;
constexpr int kPrefillThreads = 256;
constexpr int kPrefillRowPad = 8;  // bf16 elements
constexpr int kPrefillLd = kPrefillBk + kPrefillRowPad;

// Thread tid owns W row tid / 2, k half tid % 2 (one 16-element NVFP4 block) of each 32-k step.
struct PrefillWRegs {
  uint2 packed;
  uint32_t scale;
};

// The thread's share of step kstep of an [n, k] NVFP4 weight, rows from n0 (zeros past n or k).
__device__ __forceinline__ PrefillWRegs prefill_load_w(const uint8_t* packed, const uint8_t* scales, int n, int k,
                                                       int n0, int kstep) {
  const int row = n0 + threadIdx.x / 2;
  const int kb = kstep * kPrefillBk + (threadIdx.x % 2) * 16;
  PrefillWRegs r{make_uint2(0, 0), 0};
  if (row < n && kb < k) {  // k is a multiple of 16: a block is all in or all out
    r.packed = __ldcs(reinterpret_cast<const uint2*>(packed + static_cast<int64_t>(row) * (k / 2) + kb / 2));
    r.scale = __ldcs(scales + static_cast<int64_t>(row) * (k / 16) + kb / 16);
  }
  return r;
}

__device__ __forceinline__ void prefill_store_w(const PrefillWRegs& r, const uint32_t* lut, uint16_t* ws) {
  const uint32_t sc = e4m3_scale_bf16x2(r.scale, 1.0f);
  const uint32_t b[2] = {r.packed.x, r.packed.y};
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = bf16x2_mul(lut[(b[i / 4] >> (8 * (i % 4))) & 0xFF], sc);
  uint4* dst = reinterpret_cast<uint4*>(ws + (threadIdx.x / 2) * kPrefillLd + (threadIdx.x % 2) * 16);
  dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
  dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

// One 32-k step of the block's kBm x 128 tile: xs [kBm][kPrefillLd] and ws [128][kPrefillLd] bf16 in shared memory.
template <int kBm>
__device__ __forceinline__ void prefill_mma_step(const uint16_t* xs, const uint16_t* ws, float (&acc)[kBm / 32][4][4]) {
  constexpr int kMt = kBm / 32;  // m16 tiles per warp
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp / 4) * (kBm / 2), wn = (warp % 4) * 32;
#pragma unroll
  for (int kk = 0; kk < kPrefillBk; kk += 16) {
    uint32_t a[kMt][4], b[4][2];
#pragma unroll
    for (int mi = 0; mi < kMt; ++mi) {
      ldmatrix_x4(a[mi], xs + (wm + mi * 16 + lane % 16) * kPrefillLd + kk + (lane / 16) * 8);
    }
#pragma unroll
    for (int nj = 0; nj < 4; nj += 2) {
      uint32_t r[4];
      ldmatrix_x4(r, ws + (wn + nj * 8 + (lane / 16) * 8 + lane % 8) * kPrefillLd + kk + ((lane / 8) % 2) * 8);
      b[nj][0] = r[0];
      b[nj][1] = r[1];
      b[nj + 1][0] = r[2];
      b[nj + 1][1] = r[3];
    }
#pragma unroll
    for (int mi = 0; mi < kMt; ++mi) {
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) mma_bf16_16816(acc[mi][ni], a[mi], b[ni]);
    }
  }
}

// e2m1 bf16 patterns of magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
// Packed four to a 64-bit word so the table stays in registers.
__device__ __forceinline__ uint32_t e2m1_bf16_bits(uint32_t code) {
  constexpr uint64_t kLow = 0x3FC03F803F000000ull, kHigh = 0x40C0408040404000ull;  // magnitudes 0..3, 4..7
  const uint64_t table = (code & 4) ? kHigh : kLow;
  return static_cast<uint32_t>((table >> (16 * (code & 3))) & 0xFFFF) | ((code & 8) << 12);
}

// The byte -> bf16-pair table prefill_store_w reads: entry b holds e2m1(b & 0xF) low, e2m1(b >> 4) high.
__device__ __forceinline__ uint32_t e2m1_byte_to_bf16x2(uint32_t byte) {
  return e2m1_bf16_bits(byte & 0xF) | (e2m1_bf16_bits(byte >> 4) << 16);
}

}  // namespace tern::nvfp4_device
