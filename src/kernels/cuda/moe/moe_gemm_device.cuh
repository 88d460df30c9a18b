// What the two files of the grouped expert GEMM share (moe_gemm_decode.cu, moe_gemm_prefill.cu): the kernels'
// parameters, made on the host from MoeGemmArgs, and the offset of a permuted row's activations. Internal to those
// files.
//
// The grouped expert GEMM of the MoE block (contract in moe_launch.h): every expert's rows times that expert's
// weight, bf16, NVFP4 or block-wise FP8, in one launch, with no host synchronisation. Both variants size their grid
// for the worst case and each block looks its work up in expert_offsets:
//   decode:  grid (blocks of weight-row tiles, active-expert slots). Slot s takes the s-th expert that has rows;
//            slots past the active count exit at once. With a pass list (MoeGemmArgs::decode_passes) slot s is
//            pass s instead, 8 rows of one expert. At one token the blocks may route it themselves
//            (MoeGemmArgs::route; moe_route_block.cuh) instead of reading the offsets. With a second projection (w2)
//            its tiles follow those of w along x, so gate and up stored apart still fill the SMs in one launch. The
//            weight streams once per 8 (T > 8: 16) of the expert's rows with 16-byte loads straight into mma fragments,
//            K split over the warps of a block (nvfp4_device.cuh's decode scheme and block layout; bf16 the same way,
//            unconverted; FP8 with fp8_device.cuh's decode scheme, the codes converted to bf16 in registers and each
//            64-k step's sums scaled per row). With x_silu_mul each block first computes the act rows of its pass
//            into shared memory.
//   prefill: grid (row tiles, 128-column weight tiles). The worst case needs ceil(rows / BM) + n_experts row tiles
//            (every expert's last tile may be partial); tile i belongs to the expert whose tile range holds i.
//            x rows are gathered through sorted_pairs by cp.async, W tiles go to shared memory as bf16 (NVFP4
//            dequantised as in the dense prefill kernel, FP8 as e4m3 * scale rounded once to bf16), mma.sync
//            m16n8k16 with fp32 accumulation.
// NVFP4 semantics are W4A16 (docs/model-specs.md §1.5): exact bf16 weight factors, weight_scale_2 times the fp32 sum.
// FP8 is W8A16 (§1.7): bf16 activations against e4m3 * scale.
#pragma once

#include <cstdint>
#include <limits>

#include "kernels/cuda/moe/moe_launch.h"

namespace tern {
namespace {

constexpr unsigned kFullMask = 0xFFFFFFFFu;

struct GemmParams {
  const uint16_t* x;
  int64_t ldx;
  const int32_t* sorted_pairs;
  int top_k;
  bool gather;
  const int32_t* offsets;  // [n_experts + 1]
  int n_experts, n, k;
  const uint16_t* wbf;     // bf16 [n_experts][n][k] at wbf_stride elements
  int64_t wbf_stride;
  const uint8_t* packed;   // NVFP4 [n_experts][n][k/2] or FP8 codes [n_experts][n][k] at packed_stride bytes
  int64_t packed_stride;
  const uint8_t* scales;   // NVFP4 [n_experts][n][k/16] at scales_stride bytes
  int64_t scales_stride;
  const float* global_scales;
  uint16_t* y;
  int64_t ldy;
  bool y_pairs;  // (col, col + 1) of y may be stored as one 4-byte word
  // The decode kernel's second projection (MoeGemmArgs::w2): blocks x >= w2_block compute it into y2. Without one,
  // w2_block is past the grid. The prefill kernel reads only the fields above.
  int w2_block;
  int n2;
  const uint16_t* wbf2;
  int64_t wbf_stride2;
  const uint8_t* packed2;
  int64_t packed_stride2;
  const uint8_t* scales2;
  int64_t scales_stride2;
  const float* global_scales2;
  uint16_t* y2;
  // MoeGemmArgs::route and align (decode kernel): route.logits set routes the one token in the launch.
  MoeRouteArgs route;
  MoeAlignArgs align;
  // FP8 per-row block scales of w and w2 ([n_experts][n][ceil(k/128)] at their strides in floats); both kernels read
  // row_scales, the decode kernel row_scales2. Last, so the fields before keep their parameter offsets.
  const float* row_scales;
  int64_t row_scales_stride;
  const float* row_scales2;
  int64_t row_scales_stride2;
  const int4* passes;  // MoeGemmArgs::decode_passes (decode kernel); null: slots look their expert up in offsets
};

// The element offset of permuted row r's activations in x.
__device__ __forceinline__ int64_t x_row_offset(const GemmParams& p, int r) {
  // Routed in the launch, every row is a pair of the one token (sorted_pairs is being written meanwhile).
  const int src = p.gather ? (p.route.logits != nullptr ? 0 : p.sorted_pairs[r] / p.top_k) : r;
  return static_cast<int64_t>(src) * p.ldx;
}

// y[row][col] = v0 and, when col + 1 < n, y[row][col + 1] = v1: one 4-byte store where p.y_pairs allows it (the
// prefill kernels' epilogues).
__device__ __forceinline__ void store_y_pair(const GemmParams& p, int row, int col, uint16_t v0, uint16_t v1) {
  uint16_t* dst = p.y + static_cast<int64_t>(row) * p.ldy + col;
  if (p.y_pairs) {
    *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(v0) | (static_cast<uint32_t>(v1) << 16);
  } else {
    dst[0] = v0;
    if (col + 1 < p.n) dst[1] = v1;
  }
}

// The prefill kernels' row tiles (moe_gemm_prefill.cu, moe_gemm_prefill_sm90.cu).
struct TileWork {
  int expert;   // -1: no tile with this index
  int row0;     // first permuted row of the tile
  int row_end;  // the expert's end row
};

// Row tile `tile` when expert e owns ceil(rows_e / bm) consecutive tiles, in expert order. Whole warp.
__device__ inline TileWork find_row_tile(const int32_t* off, int n_experts, int tile, int bm) {
  const int lane = threadIdx.x % 32;
  int first = 0;  // tiles of the experts before this group of 32
  for (int base = 0; base < n_experts; base += 32) {
    const int e = base + lane;
    const int lo = e < n_experts ? off[e] : 0, hi = e < n_experts ? off[e + 1] : 0;
    const int tiles = hi > lo ? (hi - lo + bm - 1) / bm : 0;
    int incl = tiles;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int other = __shfl_up_sync(kFullMask, incl, d);
      if (lane >= d) incl += other;
    }
    const int total = __shfl_sync(kFullMask, incl, 31);
    if (tile < first + total) {
      const bool mine = tile >= first + incl - tiles && tile < first + incl;
      const int owner = __ffs(__ballot_sync(kFullMask, mine)) - 1;
      const int local = tile - first - __shfl_sync(kFullMask, incl - tiles, owner);
      return {base + owner, __shfl_sync(kFullMask, lo, owner) + local * bm, __shfl_sync(kFullMask, hi, owner)};
    }
    first += total;
  }
  return {-1, 0, 0};
}

// The arguments of w2 alone, for the prefill kernels' second launch (both prefill launchers run w2 that way).
inline MoeGemmArgs second_projection(const MoeGemmArgs& a) {
  MoeGemmArgs b = a;
  b.w = a.w2;
  b.y = a.y + a.y2_offset;
  b.w2 = MoeExpertWeights{};
  b.y2_offset = 0;
  return b;
}

bool is_aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

GemmParams make_params(const MoeGemmArgs& a) {
  const MoeExpertWeights& w = a.w;
  return GemmParams{.x = a.x,
                    .ldx = a.ldx,
                    .sorted_pairs = a.sorted_pairs,
                    .top_k = static_cast<int>(a.top_k),
                    .gather = a.gather,
                    .offsets = a.expert_offsets,
                    .n_experts = static_cast<int>(w.n_experts),
                    .n = static_cast<int>(w.n),
                    .k = static_cast<int>(w.k),
                    .wbf = w.bf16,
                    .wbf_stride = w.bf16_expert_stride,
                    .packed = w.packed,
                    .packed_stride = w.packed_expert_stride,
                    .scales = w.scales,
                    .scales_stride = w.scales_expert_stride,
                    .global_scales = w.global_scales,
                    .y = a.y,
                    .ldy = a.ldy,
                    .y_pairs = w.n % 2 == 0 && a.ldy % 2 == 0 && is_aligned(a.y, 4),
                    .w2_block = std::numeric_limits<int>::max(),  // the decode launch sets it
                    .n2 = static_cast<int>(a.w2.n),
                    .wbf2 = a.w2.bf16,
                    .wbf_stride2 = a.w2.bf16_expert_stride,
                    .packed2 = a.w2.packed,
                    .packed_stride2 = a.w2.packed_expert_stride,
                    .scales2 = a.w2.scales,
                    .scales_stride2 = a.w2.scales_expert_stride,
                    .global_scales2 = a.w2.global_scales,
                    .y2 = a.y + a.y2_offset,
                    .route = a.route,
                    .align = a.align,
                    .row_scales = w.row_scales,
                    .row_scales_stride = w.row_scales_expert_stride,
                    .row_scales2 = a.w2.row_scales,
                    .row_scales_stride2 = a.w2.row_scales_expert_stride,
                    .passes = reinterpret_cast<const int4*>(a.decode_passes)};
}

}  // namespace
}  // namespace tern
