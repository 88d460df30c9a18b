// Quantized weights dequantized to bf16 rows in global memory (weight_dequant_launch.h): one thread per 16 values,
// with the same per-value arithmetic as the prefill kernels' shared-memory tiles (fp8_device.cuh, nvfp4_device.cuh).
#include "kernels/cuda/gemm/weight_dequant_launch.h"

#include <algorithm>

#include "kernels/cuda/fp8/fp8_device.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/nvfp4/nvfp4_device.cuh"
#include "kernels/cuda/ptx.cuh"

namespace tern {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void store16(uint16_t* out, const uint32_t (&v)[8]) {
  uint4* dst = reinterpret_cast<uint4*>(out);
  dst[0] = make_uint4(v[0], v[1], v[2], v[3]);
  dst[1] = make_uint4(v[4], v[5], v[6], v[7]);
}

__global__ void __launch_bounds__(kThreads) fp8_dequant_kernel(const uint8_t* codes, const float* row_scales,
                                                               int64_t groups, int k, uint16_t* out) {
  ptx::grid_dependency_begin();
  const int64_t scale_cols = fp8_device::fp8_scale_cols(k);
  for (int64_t g = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t e = g * 16, row = e / k;
    const int col = static_cast<int>(e - row * k);
    const uint4 q = __ldcs(reinterpret_cast<const uint4*>(codes + e));
    uint32_t v[8];
    fp8_device::fp8_dequant16(q, __ldg(row_scales + row * scale_cols + col / fp8_device::kFp8ScaleBlock), v);
    store16(out + e, v);
  }
}

__global__ void __launch_bounds__(kThreads) nvfp4_dequant_kernel(const uint8_t* packed, const uint8_t* scales,
                                                                 int64_t groups, uint16_t* out) {
  ptx::grid_dependency_begin();
  for (int64_t g = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * kThreads) {
    const uint2 q = __ldcs(reinterpret_cast<const uint2*>(packed + g * 8));
    const uint32_t sc = nvfp4_device::e4m3_scale_bf16x2(__ldcs(scales + g), 1.0f);
    const uint32_t bytes[2] = {q.x, q.y};
    uint32_t v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = nvfp4_device::bf16x2_mul(nvfp4_device::e2m1_byte_to_bf16x2((bytes[i / 4] >> (8 * (i % 4))) & 0xFF), sc);
    }
    store16(out + g * 16, v);
  }
}

// Enough blocks to fill the device a few times over; each thread walks the rest with a grid stride.
unsigned grid_for(const DeviceContext& ctx, int64_t groups) {
  const int64_t wanted = (groups + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{8} * ctx.props().num_sms)));
}

}  // namespace

void fp8_dequant_rows_launch(const DeviceContext& ctx, const uint8_t* codes, const float* row_scales, int64_t rows,
                             int64_t k, uint16_t* out) {
  const int64_t groups = rows * k / 16;
  launch_kernel(ctx, fp8_dequant_kernel, dim3(grid_for(ctx, groups)), dim3(kThreads), 0, codes, row_scales, groups,
                static_cast<int>(k), out);
}

void nvfp4_dequant_rows_launch(const DeviceContext& ctx, const uint8_t* packed, const uint8_t* scales, int64_t rows,
                               int64_t k, uint16_t* out) {
  const int64_t groups = rows * k / 16;
  launch_kernel(ctx, nvfp4_dequant_kernel, dim3(grid_for(ctx, groups)), dim3(kThreads), 0, packed, scales, groups,
                out);
}

}  // namespace tern
