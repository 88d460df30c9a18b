// NVFP4 W4A16 GEMM kernels; see gemm_nvfp4_w4a16.h for the contract and docs/perf/gemm.md for measurements.
//
// Both kernels use mma.sync.m16n8k16 (bf16 in, fp32 accumulate); the dequantisation, the mma and the weight-load
// schemes they share with the grouped MoE GEMM are in nvfp4_device.cuh.
#include "kernels/cuda/gemm/gemm_nvfp4_w4a16_launch.h"

#include <limits>

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/nvfp4/nvfp4_device.cuh"
#include "kernels/cuda/ptx.cuh"

namespace tern {

using namespace nvfp4_device;

namespace {

// The output scale of each column: weight_scale_2 of the part its weight row belongs to (Nvfp4WeightView), times a
// power of two the kernel folds in.
struct ColumnScales {
  float scale[kNvfp4MaxExtraParts + 1];
  int begin[kNvfp4MaxExtraParts];  // INT_MAX past the last part

  __device__ __forceinline__ float at(int col) const {
    float v = scale[0];
#pragma unroll
    for (int i = 0; i < kNvfp4MaxExtraParts; ++i) v = col >= begin[i] ? scale[i + 1] : v;
    return v;
  }
};

ColumnScales column_scales(const Nvfp4WeightView& w, float multiplier) {
  ColumnScales c{};
  c.scale[0] = w.global_scale * multiplier;
  bool more = true;
  for (int i = 0; i < kNvfp4MaxExtraParts; ++i) {
    more = more && w.part_begin[i] != 0;
    c.begin[i] = more ? static_cast<int>(w.part_begin[i]) : std::numeric_limits<int>::max();
    c.scale[i + 1] = more ? w.part_scale[i] * multiplier : 0.0f;
  }
  return c;
}

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

template <int kMTiles, int kSplitK, int kTokenTiles, bool kVec16>
__global__ void __launch_bounds__(decode_block_warps(kSplitK) * 32, decode_min_blocks(kSplitK, kTokenTiles))
    nvfp4_decode_kernel(const DecodeParams p) {
  constexpr int kTiles = decode_block_tiles(kSplitK), kRows = 16 * kMTiles;
  __shared__ __align__(16) float red[decode_red_floats<kSplitK, kMTiles, kTokenTiles>()];
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4;
  const int split = warp % kSplitK;
  const int n0 = (blockIdx.x * kTiles + warp / kSplitK) * kRows;
  float acc[kTokenTiles][kMTiles][4] = {};
  // The warp's first weight step leaves before the programmatic-launch wait (ptx.cuh): no kernel writes weights,
  // and at one token most warps have no other step, so their whole read overlaps the kernel before.
  ptx::grid_dependents_launch();
  DecodeW<kMTiles> w;
  if (n0 < p.n) decode_load_w<kMTiles, kVec16>(p.packed, p.scales, p.n, p.k, n0, split, w);
  ptx::grid_dependency_wait();
  if (n0 < p.n) {  // warp-uniform; a tile past n still takes part in the reduction's barriers
    int64_t xoff[kTokenTiles];
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) {
      const int token = tt * 8 + g;
      xoff[tt] = token < p.m ? static_cast<int64_t>(token) * p.k : -1;
    }
    auto weight = [&] { return DecodeWeightPtrs{p.packed, p.scales}; };
    constexpr bool kPrefetch = decode_prefetch(kMTiles, kTokenTiles);
    decode_k_loop<kMTiles, kTokenTiles, kVec16, kPrefetch>(weight, p.n, p.k, n0, p.x, xoff, split, kSplitK, w, acc);
  }
  decode_reduce_store<kSplitK, kMTiles, kTokenTiles>(acc, red, [&](int tile, int row, int token, float sum) {
    const int col = (blockIdx.x * kTiles + tile) * kRows + row;
    if (col < p.n && token < p.m) {
      p.y[static_cast<int64_t>(token) * p.ldy + col] = f32_to_bf16(sum * p.out_scale.at(col));
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Prefill kernel (M large): the prefill scheme of nvfp4_device.cuh. x tiles stream into shared memory with cp.async
// (kStages deep); W's packed bytes for step s + 2 are loaded into registers while step s computes, then dequantized
// into one of two bf16 W tiles.

struct PrefillParams {
  const uint16_t* x;
  const uint8_t* packed;
  const uint8_t* scales;
  uint16_t* y;               // [m, ldy]
  ColumnScales out_scale;    // weight_scale_2
  int m, n, k;
  int64_t ldy;
};

constexpr size_t prefill_smem_bytes(int bm, int stages) {
  return sizeof(uint16_t) * kPrefillLd * (static_cast<size_t>(stages) * bm + 2 * kPrefillBn) + 256 * sizeof(uint32_t);
}

template <int kBm>
__device__ __forceinline__ void prefill_load_x_async(const PrefillParams& p, int m0, int kstep, uint16_t* xs) {
  constexpr int kPieces = kBm * kPrefillBk / 8;  // 16-byte pieces
#pragma unroll
  for (int i = threadIdx.x; i < kPieces; i += kPrefillThreads) {
    const int r = i / (kPrefillBk / 8), c = i % (kPrefillBk / 8);
    const int row = m0 + r, kk = kstep * kPrefillBk + c * 8;
    const bool valid = row < p.m && kk < p.k;
    const uint16_t* src = valid ? p.x + static_cast<int64_t>(row) * p.k + kk : p.x;
    cp_async_16_zfill(xs + r * kPrefillLd + c * 8, src, valid);
  }
}

template <int kBm>
__device__ __forceinline__ void prefill_store_y(const PrefillParams& p, int m0, int n0,
                                                const float (&acc)[kBm / 32][4][4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const bool pairs = p.n % 2 == 0 && p.ldy % 2 == 0;  // then (col, col + 1) is a 4-byte aligned bf16 pair
#pragma unroll
  for (int mi = 0; mi < kBm / 32; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + (warp / 4) * (kBm / 2) + mi * 16 + g + 8 * h;
        const int col = n0 + (warp % 4) * 32 + ni * 8 + 2 * t;
        if (row >= p.m || col >= p.n) continue;
        uint16_t* dst = p.y + static_cast<int64_t>(row) * p.ldy + col;
        const uint16_t v0 = f32_to_bf16(acc[mi][ni][2 * h] * p.out_scale.at(col));
        const uint16_t v1 = f32_to_bf16(acc[mi][ni][2 * h + 1] * p.out_scale.at(col + 1));
        if (pairs) {
          *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(v0) | (static_cast<uint32_t>(v1) << 16);
        } else {
          dst[0] = v0;
          if (col + 1 < p.n) dst[1] = v1;
        }
      }
    }
  }
}

template <int kBm, int kStages>
__global__ void __launch_bounds__(kPrefillThreads) nvfp4_prefill_kernel(PrefillParams p) {
  ptx::grid_dependency_begin();
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem);             // [kStages][kBm][kPrefillLd]
  uint16_t* ws = xs + kStages * kBm * kPrefillLd;                // [2][kPrefillBn][kPrefillLd]
  uint32_t* lut = reinterpret_cast<uint32_t*>(ws + 2 * kPrefillBn * kPrefillLd);  // [256]
  const int n0 = blockIdx.x * kPrefillBn, m0 = blockIdx.y * kBm;
  const int n_ksteps = (p.k + kPrefillBk - 1) / kPrefillBk;

  lut[threadIdx.x] = e2m1_bf16_bits(threadIdx.x & 0xF) | (e2m1_bf16_bits(threadIdx.x >> 4) << 16);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_ksteps) prefill_load_x_async<kBm>(p, m0, s, xs + s * kBm * kPrefillLd);
    cp_async_commit();  // always, so the group count per step stays uniform
  }
  PrefillWRegs w = prefill_load_w(p.packed, p.scales, p.n, p.k, n0, 0);
  __syncthreads();  // lut
  prefill_store_w(w, lut, ws);
  if (n_ksteps > 1) w = prefill_load_w(p.packed, p.scales, p.n, p.k, n0, 1);

  float acc[kBm / 32][4][4] = {};
  for (int ks = 0; ks < n_ksteps; ++ks) {
    cp_async_wait<kStages - 2>();
    // Step ks's x and W tiles are complete and every warp has finished step ks - 1, whose buffers we refill.
    __syncthreads();
    const int next = ks + kStages - 1;
    if (next < n_ksteps) prefill_load_x_async<kBm>(p, m0, next, xs + (next % kStages) * kBm * kPrefillLd);
    cp_async_commit();
    prefill_mma_step<kBm>(xs + (ks % kStages) * kBm * kPrefillLd, ws + (ks % 2) * kPrefillBn * kPrefillLd, acc);
    if (ks + 1 < n_ksteps) {
      prefill_store_w(w, lut, ws + ((ks + 1) % 2) * kPrefillBn * kPrefillLd);
      if (ks + 2 < n_ksteps) w = prefill_load_w(p.packed, p.scales, p.n, p.k, n0, ks + 2);
    }
  }
  cp_async_wait<0>();
  prefill_store_y<kBm>(p, m0, n0, acc);
}

// ---------------------------------------------------------------------------------------------------------------
// Host side: validation, tile choice, launch.

bool is_aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

template <int kMTiles, int kSplitK, int kTokenTiles, bool kVec16>
void decode_launch_kernel(const DecodeParams& p, const DeviceContext& ctx) {
  constexpr int kTileRows = 16 * kMTiles * decode_block_tiles(kSplitK);
  const dim3 grid(static_cast<unsigned>((p.n + kTileRows - 1) / kTileRows));
  launch_kernel(ctx, nvfp4_decode_kernel<kMTiles, kSplitK, kTokenTiles, kVec16>, grid,
                dim3(decode_block_warps(kSplitK) * 32), 0, p);
  TERN_CUDA_CHECK_LAUNCH();
}

template <int kMTiles, int kTokenTiles, bool kVec16>
void decode_launch_split(const DecodeParams& p, int split_k, const DeviceContext& ctx) {
  switch (split_k) {
    case 1:
      return decode_launch_kernel<kMTiles, 1, kTokenTiles, kVec16>(p, ctx);
    case 2:
      return decode_launch_kernel<kMTiles, 2, kTokenTiles, kVec16>(p, ctx);
    case 4:
      return decode_launch_kernel<kMTiles, 4, kTokenTiles, kVec16>(p, ctx);
    case 8:
      return decode_launch_kernel<kMTiles, 8, kTokenTiles, kVec16>(p, ctx);
    case 16:
      return decode_launch_kernel<kMTiles, 16, kTokenTiles, kVec16>(p, ctx);
  }
  if constexpr (decode_max_split_k(kMTiles, kTokenTiles) == 32) {
    decode_launch_kernel<kMTiles, 32, kTokenTiles, kVec16>(p, ctx);
  }
}

// Two m16 tiles per warp only with 16-byte loads: the byte-wise path serves odd k and is not worth the code.
template <int kTokenTiles>
void decode_launch_tiles(const DecodeParams& p, const DecodeShape& shape, bool vec16, const DeviceContext& ctx) {
  if (!vec16) return decode_launch_split<1, kTokenTiles, false>(p, shape.split_k, ctx);
  if (shape.m_tiles == 2) return decode_launch_split<2, kTokenTiles, true>(p, shape.split_k, ctx);
  decode_launch_split<1, kTokenTiles, true>(p, shape.split_k, ctx);
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
  if (token_tiles == 1) return decode_launch_tiles<1>(p, shape, vec16, ctx);
  decode_launch_tiles<2>(p, shape, vec16, ctx);
}

namespace {

template <int kBm, int kStages>
void prefill_launch_tiles(const PrefillParams& p, const DeviceContext& ctx) {
  constexpr size_t kSmem = prefill_smem_bytes(kBm, kStages);
  TERN_CUDA_CHECK(cudaFuncSetAttribute(nvfp4_prefill_kernel<kBm, kStages>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  const dim3 grid(static_cast<unsigned>((p.n + kPrefillBn - 1) / kPrefillBn),
                  static_cast<unsigned>((p.m + kBm - 1) / kBm));
  launch_kernel(ctx, nvfp4_prefill_kernel<kBm, kStages>, grid, dim3(kPrefillThreads), kSmem, p);
  TERN_CUDA_CHECK_LAUNCH();
}

// Tile choice. kBm = 128 halves the W dequantization per output and reuses each x tile over more columns, but
// when 128-row tiles would leave SMs idle (fewer tiles than SMs) 64-row tiles double the block count. Stages:
// as many x buffers (up to 4) as fit twice in one SM's shared memory, so two blocks overlap one another's
// barriers, and at least within the per-block opt-in limit.
}  // namespace

void nvfp4_w4a16_launch_prefill(const DeviceContext& ctx, const GemmNvfp4W4a16Args& a) {
  const DeviceProps& props = ctx.props();
  const PrefillParams p{.x = a.x,
                        .packed = a.w.packed,
                        .scales = a.w.scales,
                        .y = a.y,
                        .out_scale = column_scales(a.w, 1.0f),
                        .m = static_cast<int>(a.m),
                        .n = static_cast<int>(a.w.n),
                        .k = static_cast<int>(a.w.k),
                       .ldy = a.ldy > 0 ? a.ldy : a.w.n};
  const int64_t n_tiles = (a.w.n + kPrefillBn - 1) / kPrefillBn;
  const bool big = ((a.m + 127) / 128) * n_tiles >= props.num_sms;
  const int bm = big ? 128 : 64;
  auto fits = [&](int stages) {
    const size_t bytes = prefill_smem_bytes(bm, stages);
    return bytes <= props.shared_mem_per_block_optin && 2 * bytes <= props.shared_mem_per_sm;
  };
  const int stages = fits(4) ? 4 : fits(3) ? 3 : 2;
  if (bm == 128) {
    if (stages == 4) return prefill_launch_tiles<128, 4>(p, ctx);
    if (stages == 3) return prefill_launch_tiles<128, 3>(p, ctx);
    return prefill_launch_tiles<128, 2>(p, ctx);
  }
  if (stages == 4) return prefill_launch_tiles<64, 4>(p, ctx);
  if (stages == 3) return prefill_launch_tiles<64, 3>(p, ctx);
  return prefill_launch_tiles<64, 2>(p, ctx);
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t gemm_nvfp4_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, nvfp4_prefill_kernel<128, 2>);
}

}  // namespace tern
