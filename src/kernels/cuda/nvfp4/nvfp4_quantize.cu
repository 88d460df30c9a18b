// NVFP4 activation quantizer; the contract is in nvfp4_quantize.h. One thread per 16-element block: two 16-byte loads
// of bf16, one 8-byte store of packed codes and one scale byte. Consecutive threads take consecutive blocks of a
// row, so loads and packed stores are coalesced; tiled scale stores scatter, but they are 1/16 of the traffic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include "kernels/cuda/nvfp4/nvfp4_quantize_launch.h"
#include "kernels/cuda/nvfp4/nvfp4_scale_layout.h"

namespace tern {
namespace {

constexpr int kThreads = 256;
constexpr int kBlock = 16;  // NVFP4 block
constexpr float kE2m1Max = 6.0f;
constexpr float kE4m3Max = 448.0f;

struct QuantizeParams {
  const uint16_t* x;         // [m, k]
  const float* input_scale;  // device scalar
  uint8_t* packed;           // [m, k/2]
  uint8_t* scales;           // row-major [m, k/16] or tiled
  int64_t m, k;
  int64_t rows, cols;  // the scale layout's rows and block columns (padded when tiled)
  bool tiled;
};

// std::clamp's comparisons (a NaN passes through unchanged), which fminf/fmaxf would not reproduce.
__device__ __forceinline__ float clamp_as_std(float v, float lo, float hi) { return v < lo ? lo : (hi < v ? hi : v); }

// core/nvfp4.cc's reciprocal_or_zero; __fdiv_rn is the correctly rounded 1/v whatever the compiler flags.
__device__ __forceinline__ float reciprocal_or_zero(float v) { return v == 0.0f ? 0.0f : __fdiv_rn(1.0f, v); }

__device__ __forceinline__ float e4m3_decode(uint32_t code) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3)));
}

// The 16 bf16 values of one block, widened exactly to fp32 (element 2i is the low half of word i).
__device__ __forceinline__ void load_block(const uint16_t* src, float (&v)[kBlock]) {
  const uint4* p = reinterpret_cast<const uint4*>(src);
  const uint4 lo = __ldg(p), hi = __ldg(p + 1);
  const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = __uint_as_float(words[i] << 16);
    v[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

// core/nvfp4.cc quantize_activation_block, operation for operation: returns the e4m3 scale code and the 16 e2m1
// codes packed two per byte (element 2j in the low nibble of byte j).
__device__ __forceinline__ uint32_t quantize_block(const float (&v)[kBlock], float act_global_scale, uint2& packed) {
  float vmax = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) vmax = fmaxf(vmax, fabsf(v[i]));  // like std::max, skips a NaN element
  float scale = __fmul_rn(act_global_scale, __fmul_rn(vmax, reciprocal_or_zero(kE2m1Max)));
  scale = clamp_as_std(scale, -kE4m3Max, kE4m3Max);
  const uint32_t scale_code = __nv_cvt_float_to_fp8(scale, __NV_SATFINITE, __NV_E4M3);
  const float output_scale =
      reciprocal_or_zero(__fmul_rn(e4m3_decode(scale_code), reciprocal_or_zero(act_global_scale)));
  uint32_t words[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
    const float q = clamp_as_std(__fmul_rn(v[i], output_scale), -kE2m1Max, kE2m1Max);
    const uint32_t code = __nv_cvt_float_to_fp4(q, __NV_E2M1, cudaRoundNearest) & 0xFu;
    words[i / 8] |= code << (4 * (i % 8));
  }
  packed = make_uint2(words[0], words[1]);
  return scale_code;
}

__global__ void __launch_bounds__(kThreads) nvfp4_quantize_kernel(QuantizeParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= p.rows * p.cols) return;
  const int64_t row = i / p.cols, block = i % p.cols;
  const int64_t n_blocks = p.k / kBlock;
  const int64_t scale_at = p.tiled ? nvfp4_tiled_scale_offset(row, block, p.k) : row * n_blocks + block;
  if (row >= p.m || block >= n_blocks) {  // padding of the tiled layout (never taken row-major)
    p.scales[scale_at] = 0;
    return;
  }
  float v[kBlock];
  load_block(p.x + row * p.k + block * kBlock, v);
  const float act_global_scale = __fdiv_rn(1.0f, __ldg(p.input_scale));
  uint2 packed;
  p.scales[scale_at] = static_cast<uint8_t>(quantize_block(v, act_global_scale, packed));
  *reinterpret_cast<uint2*>(p.packed + row * (p.k / 2) + block * (kBlock / 2)) = packed;
}

}  // namespace

void nvfp4_quantize_launch(const DeviceContext& ctx, const Nvfp4QuantizeArgs& a) {
  const bool tiled = a.layout == Nvfp4ScaleLayout::kTiled128x4;
  const QuantizeParams p{.x = a.x,
                         .input_scale = a.input_scale,
                         .packed = a.packed,
                         .scales = a.scales,
                         .m = a.m,
                         .k = a.k,
                         .rows = tiled ? nvfp4_tiled_scale_rows(a.m) : a.m,
                         .cols = tiled ? nvfp4_tiled_scale_cols(a.k) : a.k / kBlock,
                         .tiled = tiled};
  const int64_t n_blocks = (p.rows * p.cols + kThreads - 1) / kThreads;
  nvfp4_quantize_kernel<<<static_cast<unsigned>(n_blocks), kThreads, 0, ctx.stream()>>>(p);
  TERN_CUDA_CHECK_LAUNCH();
}

}  // namespace tern
