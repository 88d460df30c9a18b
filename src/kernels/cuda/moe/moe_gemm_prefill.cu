// The prefill variant of the grouped expert GEMM (contract in moe_launch.h; both variants in moe_gemm_device.cuh):
// grid (row tiles, 128-column weight tiles), each row tile looked up in expert_offsets, x rows gathered by cp.async
// and W tiles dequantised to bf16 in shared memory as in the dense prefill kernels (NVFP4: nvfp4_device.cuh, FP8:
// fp8_device.cuh).
#include <type_traits>
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/ptx.cuh"

#include "kernels/cuda/fp8/fp8_device.cuh"
#include "kernels/cuda/moe/moe_gemm_device.cuh"
#include "kernels/cuda/moe/moe_launch.h"
#include "kernels/cuda/nvfp4/nvfp4_device.cuh"

namespace tern {

using namespace nvfp4_device;

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Prefill. The dense prefill kernel's pipeline over one expert's row tile: x stages by cp.async (kStages deep) from
// the gathered rows, W for step s + 2 in registers while step s computes, W tiles double-buffered as bf16.

struct Bf16WRegs {
  uint4 v[2];  // thread tid: W row tid / 2, k half tid % 2 (16 values) of a 32-k step
};

__device__ __forceinline__ Bf16WRegs bf16_prefill_load_w(const uint16_t* w, int n, int k, int n0, int kstep) {
  const int row = n0 + threadIdx.x / 2;
  const int kb = kstep * kPrefillBk + (threadIdx.x % 2) * 16;
  Bf16WRegs r{{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)}};
  if (row < n && kb < k) {
    const uint4* src = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(row) * k + kb);
    r.v[0] = __ldcs(src);
    r.v[1] = __ldcs(src + 1);
  }
  return r;
}

__device__ __forceinline__ void bf16_prefill_store_w(const Bf16WRegs& r, uint16_t* ws) {
  uint4* dst = reinterpret_cast<uint4*>(ws + (threadIdx.x / 2) * kPrefillLd + (threadIdx.x % 2) * 16);
  dst[0] = r.v[0];
  dst[1] = r.v[1];
}

template <int kBm>
constexpr size_t prefill_smem_bytes(int stages) {
  return sizeof(uint16_t) * kPrefillLd * (static_cast<size_t>(stages) * kBm + 2 * kPrefillBn) +
         256 * sizeof(uint32_t) + kBm * sizeof(int64_t);
}

// x tile rows from their gathered offsets (xoff[r] < 0: past the expert's rows, zero-filled).
template <int kBm>
__device__ __forceinline__ void prefill_load_x(const GemmParams& p, const int64_t* xoff, int kstep, uint16_t* xs) {
  constexpr int kPieces = kBm * kPrefillBk / 8;  // 16-byte pieces
#pragma unroll
  for (int i = threadIdx.x; i < kPieces; i += kPrefillThreads) {
    const int r = i / (kPrefillBk / 8), c = i % (kPrefillBk / 8);
    const int kk = kstep * kPrefillBk + c * 8;
    const bool valid = xoff[r] >= 0 && kk < p.k;
    cp_async_16_zfill(xs + r * kPrefillLd + c * 8, valid ? p.x + xoff[r] + kk : p.x, valid);
  }
}

template <int kBm>
__device__ __forceinline__ void prefill_store_y(const GemmParams& p, const TileWork& tw, int n0, float out_scale,
                                                const float (&acc)[kBm / 32][4][4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mi = 0; mi < kBm / 32; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = tw.row0 + (warp / 4) * (kBm / 2) + mi * 16 + g + 8 * h;
        const int col = n0 + (warp % 4) * 32 + ni * 8 + 2 * t;
        if (row >= tw.row_end || col >= p.n) continue;
        store_y_pair(p, row, col, f32_to_bf16(acc[mi][ni][2 * h] * out_scale),
                     f32_to_bf16(acc[mi][ni][2 * h + 1] * out_scale));
      }
    }
  }
}

template <MoeWeightFormat kFormat, int kBm, int kStages>
__global__ void __launch_bounds__(kPrefillThreads) moe_prefill_kernel(const GemmParams p) {
  constexpr bool kIsNvfp4 = kFormat == MoeWeightFormat::kNvfp4, kIsFp8 = kFormat == MoeWeightFormat::kFp8;
  ptx::grid_dependency_begin();
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem);                              // [kStages][kBm][kPrefillLd]
  uint16_t* ws = xs + kStages * kBm * kPrefillLd;                                 // [2][kPrefillBn][kPrefillLd]
  uint32_t* lut = reinterpret_cast<uint32_t*>(ws + 2 * kPrefillBn * kPrefillLd);  // [256]
  int64_t* xoff = reinterpret_cast<int64_t*>(lut + 256);                          // [kBm]
  const TileWork tw = find_row_tile(p.offsets, p.n_experts, blockIdx.x, kBm);
  if (tw.expert < 0) return;  // every warp found the same: the whole block leaves
  const int e = tw.expert, n0 = blockIdx.y * kPrefillBn;
  const int n_ksteps = (p.k + kPrefillBk - 1) / kPrefillBk;
  const float out_scale = kIsNvfp4 ? p.global_scales[e] : 1.0f;

  // Stage 1: gathered row offsets and the e2m1 table; then the pipeline's first x stages and W tiles.
  for (int i = threadIdx.x; i < kBm; i += kPrefillThreads) {
    xoff[i] = tw.row0 + i < tw.row_end ? x_row_offset(p, tw.row0 + i) : -1;
  }
  if constexpr (kIsNvfp4) lut[threadIdx.x] = e2m1_byte_to_bf16x2(threadIdx.x);
  __syncthreads();
  using WRegs =
      std::conditional_t<kIsNvfp4, PrefillWRegs, std::conditional_t<kIsFp8, fp8_device::Fp8PrefillWRegs, Bf16WRegs>>;
  auto load_w = [&](int kstep) -> WRegs {
    if constexpr (kIsNvfp4) {
      return prefill_load_w(p.packed + e * p.packed_stride, p.scales + e * p.scales_stride, p.n, p.k, n0, kstep);
    } else if constexpr (kIsFp8) {
      return fp8_device::fp8_prefill_load_w(p.packed + e * p.packed_stride, p.row_scales + e * p.row_scales_stride,
                                            p.n, p.k, n0, kstep);
    } else {
      return bf16_prefill_load_w(p.wbf + e * p.wbf_stride, p.n, p.k, n0, kstep);
    }
  };
  auto store_w = [&](const WRegs& r, int buffer) {
    if constexpr (kIsNvfp4) {
      prefill_store_w(r, lut, ws + buffer * kPrefillBn * kPrefillLd);
    } else if constexpr (kIsFp8) {
      fp8_device::fp8_prefill_store_w(r, ws + buffer * kPrefillBn * kPrefillLd);
    } else {
      bf16_prefill_store_w(r, ws + buffer * kPrefillBn * kPrefillLd);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_ksteps) prefill_load_x<kBm>(p, xoff, s, xs + s * kBm * kPrefillLd);
    cp_async_commit();  // always, so the group count per step stays uniform
  }
  WRegs w = load_w(0);
  store_w(w, 0);
  if (n_ksteps > 1) w = load_w(1);

  // Stage 2: the K loop, the dense prefill kernel's (gemm/dequant_prefill.cuh): change both together. One shared function
  // would not be a pure refactor: called from it, the dense kernel's W addresses compile to other instructions.
  float acc[kBm / 32][4][4] = {};
  for (int ks = 0; ks < n_ksteps; ++ks) {
    cp_async_wait<kStages - 2>();
    // Step ks's x and W tiles are complete and every warp has finished step ks - 1, whose buffers we refill.
    __syncthreads();
    const int next = ks + kStages - 1;
    if (next < n_ksteps) prefill_load_x<kBm>(p, xoff, next, xs + (next % kStages) * kBm * kPrefillLd);
    cp_async_commit();
    prefill_mma_step<kBm>(xs + (ks % kStages) * kBm * kPrefillLd, ws + (ks % 2) * kPrefillBn * kPrefillLd, acc);
    if (ks + 1 < n_ksteps) {
      store_w(w, (ks + 1) % 2);
      if (ks + 2 < n_ksteps) w = load_w(ks + 2);
    }
  }
  cp_async_wait<0>();

  // Stage 3: y.
  prefill_store_y<kBm>(p, tw, n0, out_scale, acc);
}

// ---------------------------------------------------------------------------------------------------------------
// Host side: tile choices, launches.

template <MoeWeightFormat kFormat, int kBm, int kStages>
void prefill_launch_tiles(const GemmParams& p, int64_t rows, int64_t n_experts, const DeviceContext& ctx) {
  constexpr size_t kSmem = prefill_smem_bytes<kBm>(kStages);
  TERN_CUDA_CHECK(cudaFuncSetAttribute(moe_prefill_kernel<kFormat, kBm, kStages>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  const dim3 grid(static_cast<unsigned>((rows + kBm - 1) / kBm + n_experts),
                  static_cast<unsigned>((p.n + kPrefillBn - 1) / kPrefillBn));
  launch_kernel(ctx, moe_prefill_kernel<kFormat, kBm, kStages>, grid, dim3(kPrefillThreads), kSmem, p);
  TERN_CUDA_CHECK_LAUNCH();
}

template <MoeWeightFormat kFormat, int kBm>
void prefill_launch_stages(const GemmParams& p, const MoeGemmArgs& a, int stages, const DeviceContext& ctx) {
  if (stages == 4) return prefill_launch_tiles<kFormat, kBm, 4>(p, a.rows, a.w.n_experts, ctx);
  if (stages == 3) return prefill_launch_tiles<kFormat, kBm, 3>(p, a.rows, a.w.n_experts, ctx);
  prefill_launch_tiles<kFormat, kBm, 2>(p, a.rows, a.w.n_experts, ctx);
}

template <int kBm>
void prefill_launch_format(const GemmParams& p, const MoeGemmArgs& a, const DeviceProps& props,
                           const DeviceContext& ctx) {
  // As many x stages (up to 4) as fit twice in one SM's shared memory, so two blocks overlap each other's
  // barriers, and at least within the per-block opt-in limit.
  auto fits = [&](int stages) {
    const size_t bytes = prefill_smem_bytes<kBm>(stages);
    return bytes <= props.shared_mem_per_block_optin && 2 * bytes <= props.shared_mem_per_sm;
  };
  const int stages = fits(4) ? 4 : fits(3) ? 3 : 2;
  switch (a.w.format) {
    case MoeWeightFormat::kNvfp4:
      return prefill_launch_stages<MoeWeightFormat::kNvfp4, kBm>(p, a, stages, ctx);
    case MoeWeightFormat::kFp8:
      return prefill_launch_stages<MoeWeightFormat::kFp8, kBm>(p, a, stages, ctx);
    case MoeWeightFormat::kBf16:
      return prefill_launch_stages<MoeWeightFormat::kBf16, kBm>(p, a, stages, ctx);
  }
}

void prefill_launch_projection(const DeviceContext& ctx, const MoeGemmArgs& a) {
  const GemmParams p = make_params(a);
  if (a.rows >= 128 * a.w.n_experts) return prefill_launch_format<128>(p, a, ctx.props(), ctx);
  prefill_launch_format<64>(p, a, ctx.props(), ctx);
}

}  // namespace

// Row tiles of 128 halve the W dequantisation per output, but each expert's last tile is partial: while experts
// average fewer than 128 rows, 64-row tiles waste less. Prefill is bound by arithmetic, not by filling the SMs, so
// w2 is simply a second launch.
void moe_gemm_launch_prefill(const DeviceContext& ctx, const MoeGemmArgs& a) {
  prefill_launch_projection(ctx, a);
  if (a.w2.n != 0) prefill_launch_projection(ctx, second_projection(a));
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t moe_gemm_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, moe_prefill_kernel<MoeWeightFormat::kNvfp4, 128, 2>);
}

}  // namespace tern
