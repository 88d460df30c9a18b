// NVFP4 W4A16 GEMM kernels; see gemm_nvfp4_w4a16.h for the contract and docs/perf/gemm.md for measurements.
//
// Both kernels use mma.sync.m16n8k16 (bf16 in, fp32 accumulate); the dequantisation, the mma and the weight-load
// schemes they share with the grouped MoE GEMM are in nvfp4_device.cuh.
#include "kernels/cuda/gemm/gemm_nvfp4_w4a16_launch.h"

#include <limits>

#include "kernels/cuda/gemm/dequant_prefill.cuh"
#include "kernels/cuda/gemm/weight_batch.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/nvfp4/nvfp4_device.cuh"
#include "kernels/cuda/ptx.cuh"

namespace tern {

using namespace nvfp4_device;

namespace {

using dequant_prefill::column_scales;
using dequant_prefill::ColumnScales;

// ---------------------------------------------------------------------------------------------------------------
// Decode kernel (M <= 16): the decode scheme of nvfp4_device.cuh over x [m, k] with m <= 16 tokens. Block b holds
// tiles b * kTiles .. of 16 * kMTiles weight rows, kSplitK warps per tile.

struct DecodeParams {
  const uint16_t* x;       // [m, k]
  const uint8_t* packed;   // [n, k/2]
  const uint8_t* scales;   // [n, k/16]
  uint16_t* y;             // [m, ldy], columns [0, n) written
  ColumnScales out_scale;  // weight_scale_2 * 2^kDecodeShift
  int m, n, k;
  int64_t ldy;
};

// kLoads (nvfp4_device.cuh): kUnchecked16 where n is a multiple of the warp tile's rows and k of 128 (the host's
// choice), the unchecked loop of DecodeRows; else the checked one.
template <int kMTiles, int kSplitK, int kTokenTiles, DecodeLoads kLoads>
__global__ void __launch_bounds__(decode_block_warps(kSplitK) * 32, decode_min_blocks(kSplitK, kTokenTiles))
    nvfp4_decode_kernel(const DecodeParams p) {
  constexpr bool kVec16 = kLoads != DecodeLoads::kBytes, kFull = kLoads == DecodeLoads::kUnchecked16;
  constexpr int kTiles = decode_block_tiles(kSplitK), kRows = 16 * kMTiles;
  __shared__ __align__(16) float red[decode_red_floats<kSplitK, kMTiles, kTokenTiles>()];
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4;
  const int split = warp % kSplitK;
  const int n0 = (blockIdx.x * kTiles + warp / kSplitK) * kRows;
  float acc[kTokenTiles][kMTiles][4] = {};
  constexpr bool kPrefetch = decode_prefetch(kMTiles, kTokenTiles);
  // The warp's first weight step leaves before the programmatic-launch wait (ptx.cuh): no kernel writes weights,
  // and at one token most warps have no other step, so their whole read overlaps the kernel before.
  ptx::grid_dependents_launch();
  DecodeW<kMTiles> w;
  if constexpr (kFull) {
    // Warp-uniform: a block's last tiles may lie past n (they still take part in the reduction's barriers). The
    // launcher splits K over no more warps than steps, so every warp has step `split`.
    const DecodeRows rows = decode_rows(p.packed, p.scales, p.k, n0, split);
    if (n0 < p.n) decode_load_rows<kMTiles>(rows, w);
    ptx::grid_dependency_wait();
    if (n0 < p.n) {
      const uint16_t* xp[kTokenTiles];
#pragma unroll
      for (int tt = 0; tt < kTokenTiles; ++tt) {
        xp[tt] = decode_x_at(p.x + static_cast<int64_t>(min(tt * 8 + g, p.m - 1)) * p.k, split);
      }
      decode_k_loop_rows<kMTiles, kTokenTiles, kPrefetch, false>(rows, xp, p.k, split, kSplitK, w, acc);
    }
  } else {
    if (n0 < p.n) decode_load_w<kMTiles, kVec16>(p.packed, p.scales, p.n, p.k, n0, split, w);
    ptx::grid_dependency_wait();
    if (n0 < p.n) {  // warp-uniform; a tile past n still takes part in the reduction's barriers
      int64_t xoff[kTokenTiles];
      decode_token_offsets<kTokenTiles>(p.m, p.k, xoff);
      auto weight = [&] { return DecodeWeightPtrs{p.packed, p.scales}; };
      decode_k_loop<kMTiles, kTokenTiles, kVec16, kPrefetch>(weight, p.n, p.k, n0, p.x, xoff, split, kSplitK, w, acc);
    }
  }
  decode_reduce_store<kSplitK, kMTiles, kTokenTiles>(acc, red, [&](int tile, int row, int token, float sum) {
    const int col = (blockIdx.x * kTiles + tile) * kRows + row;
    if (col < p.n && token < p.m) {
      p.y[static_cast<int64_t>(token) * p.ldy + col] = f32_to_bf16(sum * p.out_scale.at(col));
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Host side: validation, tile choice, launch.

bool is_aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

template <int kMTiles, int kSplitK, int kTokenTiles, DecodeLoads kLoads>
void decode_launch_kernel(const DecodeParams& p, const DeviceContext& ctx) {
  constexpr int kTileRows = 16 * kMTiles * decode_block_tiles(kSplitK);
  const dim3 grid(static_cast<unsigned>((p.n + kTileRows - 1) / kTileRows));
  launch_kernel(ctx, nvfp4_decode_kernel<kMTiles, kSplitK, kTokenTiles, kLoads>, grid,
                dim3(decode_block_warps(kSplitK) * 32), 0, p);
  TERN_CUDA_CHECK_LAUNCH();
}

template <int kMTiles, int kTokenTiles, DecodeLoads kLoads>
void decode_launch_split(const DecodeParams& p, int split_k, const DeviceContext& ctx) {
  switch (split_k) {
    case 1:
      return decode_launch_kernel<kMTiles, 1, kTokenTiles, kLoads>(p, ctx);
    case 2:
      return decode_launch_kernel<kMTiles, 2, kTokenTiles, kLoads>(p, ctx);
    case 4:
      return decode_launch_kernel<kMTiles, 4, kTokenTiles, kLoads>(p, ctx);
    case 8:
      return decode_launch_kernel<kMTiles, 8, kTokenTiles, kLoads>(p, ctx);
    case 16:
      return decode_launch_kernel<kMTiles, 16, kTokenTiles, kLoads>(p, ctx);
  }
  if constexpr (decode_max_split_k(kMTiles, kTokenTiles) == 32) {
    decode_launch_kernel<kMTiles, 32, kTokenTiles, kLoads>(p, ctx);
  }
}

// Two m16 tiles per warp only with 16-byte loads: the byte-wise path serves odd k and is not worth the code.
template <int kTokenTiles>
void decode_launch_tiles(const DecodeParams& p, const DecodeShape& shape, DecodeLoads loads,
                         const DeviceContext& ctx) {
  constexpr DecodeLoads kBytes = DecodeLoads::kBytes, kChecked16 = DecodeLoads::kChecked16,
                        kUnchecked16 = DecodeLoads::kUnchecked16;
  if (loads == kBytes) return decode_launch_split<1, kTokenTiles, kBytes>(p, shape.split_k, ctx);
  if (loads == kUnchecked16) {
    if (shape.m_tiles == 2) return decode_launch_split<2, kTokenTiles, kUnchecked16>(p, shape.split_k, ctx);
    return decode_launch_split<1, kTokenTiles, kUnchecked16>(p, shape.split_k, ctx);
  }
  if (shape.m_tiles == 2) return decode_launch_split<2, kTokenTiles, kChecked16>(p, shape.split_k, ctx);
  decode_launch_split<1, kTokenTiles, kChecked16>(p, shape.split_k, ctx);
}

}  // namespace

void nvfp4_w4a16_launch_decode(const DeviceContext& ctx, const GemmNvfp4W4a16Args& a) {
  const DecodeParams p{.x = a.x,
                       .packed = a.w.packed,
                       .scales = a.w.scales,
                       .y = a.y,
                       .out_scale = column_scales(a.w, static_cast<float>(1 << kDecodeShift)),
                       .m = static_cast<int>(a.m),
                       .n = static_cast<int>(a.w.n),
                       .k = static_cast<int>(a.w.k),
                       .ldy = a.ldy > 0 ? a.ldy : a.w.n};
  // 16-byte weight loads need 16-byte aligned rows (k % 32) and base; the 2-byte scale loads 2-byte ones.
  const bool vec16 = a.w.k % 32 == 0 && is_aligned(a.w.packed, 16) && is_aligned(a.w.scales, 2);
  const int token_tiles = a.m <= 8 ? 1 : 2;
  const DecodeShape shape = decode_choose_shape(ctx.props().num_sms, a.w.n, a.w.k, 1, token_tiles, vec16);
  // The unchecked loop wants whole tiles over whole steps, and no warp without a step (decode_choose_shape splits K
  // over at most as many warps as steps).
  const bool full = vec16 && a.w.n % (16 * shape.m_tiles) == 0 && a.w.k % kDecodeStepK == 0;
  const DecodeLoads loads = full ? DecodeLoads::kUnchecked16 : vec16 ? DecodeLoads::kChecked16 : DecodeLoads::kBytes;
  if (token_tiles == 1) return decode_launch_tiles<1>(p, shape, loads, ctx);
  decode_launch_tiles<2>(p, shape, loads, ctx);
}

namespace {

// The operands as the prefill and batch kernels take them; `out_multiplier` folds the kernel's power of two into
// each part's weight_scale_2.
dequant_prefill::PrefillParams operands(const GemmNvfp4W4a16Args& a, float out_multiplier) {
  return dequant_prefill::PrefillParams{.x = a.x,
                                        .packed = a.w.packed,
                                        .scales = a.w.scales,
                                        .row_scales = nullptr,
                                        .y = a.y,
                                        .out_scale = column_scales(a.w, out_multiplier),
                                        .m = static_cast<int>(a.m),
                                        .n = static_cast<int>(a.w.n),
                                        .k = static_cast<int>(a.w.k),
                                        .ldy = a.ldy > 0 ? a.ldy : a.w.n};
}

}  // namespace

void nvfp4_w4a16_launch_batch(const DeviceContext& ctx, const GemmNvfp4W4a16Args& a) {
  weight_batch::launch<dequant_prefill::Format::kNvfp4>(operands(a, static_cast<float>(1 << kDecodeShift)), ctx);
}

void nvfp4_w4a16_launch_prefill(const DeviceContext& ctx, const GemmNvfp4W4a16Args& a) {
  dequant_prefill::launch<dequant_prefill::Format::kNvfp4>(operands(a, 1.0f), ctx);
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t gemm_nvfp4_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, dequant_prefill::prefill_kernel<dequant_prefill::Format::kNvfp4, 128, 2>);
}

}  // namespace tern
