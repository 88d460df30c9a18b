// Block-wise FP8 W8A16 GEMM kernels; see gemm_fp8_w8a16.h for the contract, fp8_device.cuh for the schemes and
// docs/perf/gemm.md for measurements.
#include "kernels/cuda/gemm/gemm_fp8_w8a16_launch.h"

#include "kernels/cuda/fp8/fp8_device.cuh"
#include "kernels/cuda/gemm/dequant_prefill.cuh"
#include "kernels/cuda/gemm/weight_batch.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/nvfp4/nvfp4_device.cuh"
#include "kernels/cuda/ptx.cuh"

namespace tern {

using namespace fp8_device;
using nvfp4_device::decode_block_tiles;
using nvfp4_device::decode_block_warps;
using nvfp4_device::decode_red_floats;
using nvfp4_device::decode_reduce_store;
using nvfp4_device::decode_token_offsets;
using nvfp4_device::f32_to_bf16;

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Decode kernel (M <= 16): fp8_device.cuh's decode scheme. Block b holds tiles b * kTiles .. of 16 weight rows,
// kSplitK warps per tile splitting K (nvfp4_device.cuh's block layout and fixed-order split-K reduction).

struct DecodeParams {
  const uint16_t* x;        // [m, k]
  const uint8_t* codes;     // [n, k]
  const float* row_scales;  // [n, ceil(k / 128)]
  uint16_t* y;              // [m, ldy], columns [0, n) written
  int m, n, k;
  int64_t ldy;
};

// 16 resident warps per SM: a lane holds fp8_decode_unroll steps of loads (128 bytes of weight with one token
// tile), which fits 128 registers.
constexpr int kDecodeWarpsPerSm = 16;

__host__ __device__ constexpr int decode_min_blocks(int split_k) {
  return kDecodeWarpsPerSm > decode_block_warps(split_k) ? kDecodeWarpsPerSm / decode_block_warps(split_k) : 1;
}

template <int kSplitK, int kTokenTiles>
__global__ void __launch_bounds__(decode_block_warps(kSplitK) * 32, decode_min_blocks(kSplitK))
    fp8_decode_kernel(const DecodeParams p) {
  ptx::grid_dependency_begin();
  constexpr int kTiles = decode_block_tiles(kSplitK);
  __shared__ __align__(16) float red[decode_red_floats<kSplitK, 1, kTokenTiles>()];
  const int warp = threadIdx.x / 32;
  const int n0 = (blockIdx.x * kTiles + warp / kSplitK) * 16;
  float acc[kTokenTiles][1][4] = {};
  if (n0 < p.n) {  // warp-uniform; a tile past n still takes part in the reduction's barriers
    int64_t xoff[kTokenTiles];
    decode_token_offsets<kTokenTiles>(p.m, p.k, xoff);
    fp8_decode_k_loop<kTokenTiles, false>(p.codes, p.row_scales, p.n, p.k, n0, warp % kSplitK, kSplitK, p.x, xoff, acc);
  }
  decode_reduce_store<kSplitK, 1, kTokenTiles>(acc, red, [&](int tile, int row, int token, float sum) {
    const int col = (blockIdx.x * kTiles + tile) * 16 + row;
    if (col < p.n && token < p.m) p.y[static_cast<int64_t>(token) * p.ldy + col] = f32_to_bf16(sum);
  });
}

template <int kSplitK, int kTokenTiles>
void decode_launch_kernel(const DecodeParams& p, const DeviceContext& ctx) {
  constexpr int kTileRows = 16 * decode_block_tiles(kSplitK);
  const dim3 grid(static_cast<unsigned>((p.n + kTileRows - 1) / kTileRows));
  launch_kernel(ctx, fp8_decode_kernel<kSplitK, kTokenTiles>, grid, dim3(decode_block_warps(kSplitK) * 32), 0, p);
  TERN_CUDA_CHECK_LAUNCH();
}

template <int kTokenTiles>
void decode_launch_split(const DecodeParams& p, int split_k, const DeviceContext& ctx) {
  switch (split_k) {
    case 1:
      return decode_launch_kernel<1, kTokenTiles>(p, ctx);
    case 2:
      return decode_launch_kernel<2, kTokenTiles>(p, ctx);
    case 4:
      return decode_launch_kernel<4, kTokenTiles>(p, ctx);
    case 8:
      return decode_launch_kernel<8, kTokenTiles>(p, ctx);
    default:
      return decode_launch_kernel<16, kTokenTiles>(p, ctx);
  }
}

// K splits in two while the warps still fit the resident slots once: more warps, each with fewer steps, have more
// of the read in flight at once; past one wave they would only queue. No more warps than 64-k steps.
int decode_split_k(int num_sms, int64_t n, int64_t k) {
  const int64_t target = static_cast<int64_t>(kDecodeWarpsPerSm) * num_sms;
  const int64_t tiles = (n + 15) / 16, steps = (k + kFp8DecodeStepK - 1) / kFp8DecodeStepK;
  int split = 1;
  while (split < 16 && 2 * split <= steps && tiles * 2 * split <= target) split *= 2;
  return split;
}

}  // namespace

void fp8_w8a16_launch_decode(const DeviceContext& ctx, const GemmFp8W8a16Args& a) {
  const DecodeParams p{.x = a.x,
                       .codes = a.w.codes,
                       .row_scales = a.w.row_scales,
                       .y = a.y,
                       .m = static_cast<int>(a.m),
                       .n = static_cast<int>(a.w.n),
                       .k = static_cast<int>(a.w.k),
                       .ldy = a.ldy > 0 ? a.ldy : a.w.n};
  const int split = decode_split_k(ctx.props().num_sms, a.w.n, a.w.k);
  if (a.m <= 8) return decode_launch_split<1>(p, split, ctx);
  decode_launch_split<2>(p, split, ctx);
}

namespace {

// The operands as the prefill and batch kernels take them.
dequant_prefill::PrefillParams operands(const GemmFp8W8a16Args& a) {
  return dequant_prefill::PrefillParams{.x = a.x,
                                        .packed = a.w.codes,
                                        .scales = nullptr,
                                        .row_scales = a.w.row_scales,
                                        .y = a.y,
                                        .out_scale = dequant_prefill::unit_column_scales(),
                                        .m = static_cast<int>(a.m),
                                        .n = static_cast<int>(a.w.n),
                                        .k = static_cast<int>(a.w.k),
                                        .ldy = a.ldy > 0 ? a.ldy : a.w.n};
}

}  // namespace

void fp8_w8a16_launch_batch(const DeviceContext& ctx, const GemmFp8W8a16Args& a) {
  weight_batch::launch<dequant_prefill::Format::kFp8>(operands(a), ctx);
}

void fp8_w8a16_launch_prefill(const DeviceContext& ctx, const GemmFp8W8a16Args& a) {
  dequant_prefill::launch<dequant_prefill::Format::kFp8>(operands(a), ctx);
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t gemm_fp8_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, fp8_decode_kernel<4, 1>);
}

}  // namespace tern
