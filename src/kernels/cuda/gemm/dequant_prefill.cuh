// The prefill kernel of the dense weight-only GEMMs (NVFP4 W4A16 in gemm_nvfp4_w4a16.cu, block-wise FP8 W8A16 in
// gemm_fp8_w8a16.cu): the prefill scheme of nvfp4_device.cuh, one kernel template over the weight format. x tiles
// stream into shared memory with cp.async (kStages deep); W's bytes for step s + 2 are loaded into registers while
// step s computes, then dequantized into one of two bf16 W tiles (NVFP4: e2m1 * e4m3 block scale, exact; FP8:
// e4m3 * row scale rounded to bf16, fp8_device.cuh). Include from those two .cu files only.
#pragma once

#include <cstdint>
#include <limits>

#include "kernels/cuda/fp8/fp8_device.cuh"
#include "kernels/cuda/gemm/gemm_nvfp4_w4a16_launch.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/nvfp4/nvfp4_device.cuh"
#include "kernels/cuda/ptx.cuh"

namespace tern::dequant_prefill {

using namespace nvfp4_device;

// The output scale of each column: NVFP4's weight_scale_2 of the part its weight row belongs to (Nvfp4WeightView),
// times a power of two the kernel folds in; 1 for FP8, whose scales are applied to the weight.
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

inline ColumnScales column_scales(const Nvfp4WeightView& w, float multiplier) {
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

inline ColumnScales unit_column_scales() {
  ColumnScales c{};
  c.scale[0] = 1.0f;
  for (int i = 0; i < kNvfp4MaxExtraParts; ++i) c.begin[i] = std::numeric_limits<int>::max();
  return c;
}

enum class Format { kNvfp4, kFp8 };

struct PrefillParams {
  const uint16_t* x;
  const uint8_t* packed;     // NVFP4 packed e2m1 [n, k/2]; FP8 e4m3 codes [n, k]
  const uint8_t* scales;     // NVFP4 e4m3 block scales [n, k/16]
  const float* row_scales;   // FP8 [n, ceil(k/128)]
  uint16_t* y;               // [m, ldy]
  ColumnScales out_scale;
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

template <Format kFormat>
struct WeightRegs {
  using type = PrefillWRegs;
};
template <>
struct WeightRegs<Format::kFp8> {
  using type = fp8_device::Fp8PrefillWRegs;
};

template <Format kFormat>
__device__ __forceinline__ typename WeightRegs<kFormat>::type prefill_load_weight(const PrefillParams& p, int n0,
                                                                                  int kstep) {
  if constexpr (kFormat == Format::kFp8) {
    return fp8_device::fp8_prefill_load_w(p.packed, p.row_scales, p.n, p.k, n0, kstep);
  } else {
    return prefill_load_w(p.packed, p.scales, p.n, p.k, n0, kstep);
  }
}

template <Format kFormat>
__device__ __forceinline__ void prefill_store_weight(const typename WeightRegs<kFormat>::type& w, const uint32_t* lut,
                                                     uint16_t* ws) {
  if constexpr (kFormat == Format::kFp8) {
    fp8_device::fp8_prefill_store_w(w, ws);
  } else {
    prefill_store_w(w, lut, ws);
  }
}

template <Format kFormat, int kBm, int kStages>
__global__ void __launch_bounds__(kPrefillThreads) prefill_kernel(PrefillParams p) {
  ptx::grid_dependency_begin();
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem);             // [kStages][kBm][kPrefillLd]
  uint16_t* ws = xs + kStages * kBm * kPrefillLd;                // [2][kPrefillBn][kPrefillLd]
  uint32_t* lut = reinterpret_cast<uint32_t*>(ws + 2 * kPrefillBn * kPrefillLd);  // [256], NVFP4
  const int n0 = blockIdx.x * kPrefillBn, m0 = blockIdx.y * kBm;
  const int n_ksteps = (p.k + kPrefillBk - 1) / kPrefillBk;

  if constexpr (kFormat == Format::kNvfp4) {
    lut[threadIdx.x] = e2m1_bf16_bits(threadIdx.x & 0xF) | (e2m1_bf16_bits(threadIdx.x >> 4) << 16);
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_ksteps) prefill_load_x_async<kBm>(p, m0, s, xs + s * kBm * kPrefillLd);
    cp_async_commit();  // always, so the group count per step stays uniform
  }
  auto w = prefill_load_weight<kFormat>(p, n0, 0);
  __syncthreads();  // lut
  prefill_store_weight<kFormat>(w, lut, ws);
  if (n_ksteps > 1) w = prefill_load_weight<kFormat>(p, n0, 1);

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
      prefill_store_weight<kFormat>(w, lut, ws + ((ks + 1) % 2) * kPrefillBn * kPrefillLd);
      if (ks + 2 < n_ksteps) w = prefill_load_weight<kFormat>(p, n0, ks + 2);
    }
  }
  cp_async_wait<0>();
  prefill_store_y<kBm>(p, m0, n0, acc);
}

template <Format kFormat, int kBm, int kStages>
void launch_tiles(const PrefillParams& p, const DeviceContext& ctx) {
  constexpr size_t kSmem = prefill_smem_bytes(kBm, kStages);
  TERN_CUDA_CHECK(cudaFuncSetAttribute(prefill_kernel<kFormat, kBm, kStages>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  const dim3 grid(static_cast<unsigned>((p.n + kPrefillBn - 1) / kPrefillBn),
                  static_cast<unsigned>((p.m + kBm - 1) / kBm));
  launch_kernel(ctx, prefill_kernel<kFormat, kBm, kStages>, grid, dim3(kPrefillThreads), kSmem, p);
  TERN_CUDA_CHECK_LAUNCH();
}

// Tile choice. kBm = 128 halves the W dequantization per output and reuses each x tile over more columns, but
// when 128-row tiles would leave SMs idle (fewer tiles than SMs) 64-row tiles double the block count. Stages:
// as many x buffers (up to 4) as fit twice in one SM's shared memory, so two blocks overlap one another's
// barriers, and at least within the per-block opt-in limit.
template <Format kFormat>
void launch(const PrefillParams& p, const DeviceContext& ctx) {
  const DeviceProps& props = ctx.props();
  const int64_t n_tiles = (p.n + kPrefillBn - 1) / kPrefillBn;
  const bool big = ((p.m + 127) / 128) * n_tiles >= props.num_sms;
  const int bm = big ? 128 : 64;
  auto fits = [&](int stages) {
    const size_t bytes = prefill_smem_bytes(bm, stages);
    return bytes <= props.shared_mem_per_block_optin && 2 * bytes <= props.shared_mem_per_sm;
  };
  const int stages = fits(4) ? 4 : fits(3) ? 3 : 2;
  if (bm == 128) {
    if (stages == 4) return launch_tiles<kFormat, 128, 4>(p, ctx);
    if (stages == 3) return launch_tiles<kFormat, 128, 3>(p, ctx);
    return launch_tiles<kFormat, 128, 2>(p, ctx);
  }
  if (stages == 4) return launch_tiles<kFormat, 64, 4>(p, ctx);
  if (stages == 3) return launch_tiles<kFormat, 64, 3>(p, ctx);
  return launch_tiles<kFormat, 64, 2>(p, ctx);
}

}  // namespace tern::dequant_prefill
