// Deliberately racy rms_norm kernels; contracts in fault_kernels_test.h. One block of kThreads per row.
#include "ops/fault_kernels_test.h"

#include <cuda_bf16.h>

#include "kernels/cuda/common.cuh"

namespace tern {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCountRounds = 4;  // increments of every counter per thread of the counting grid

using cuda_common::bf16_to_f32;
using cuda_common::f32_to_bf16;
using cuda_common::warp_sum;

// y = w * (x * scale) over one row, rounded to bf16 once.
__device__ void write_row(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t dim, float scale) {
  for (int64_t i = threadIdx.x; i < dim; i += kThreads)
    y[i] = f32_to_bf16(bf16_to_f32(w[i]) * (bf16_to_f32(x[i]) * scale));
}

__global__ void __launch_bounds__(kThreads)
    rms_norm_lost_updates_kernel(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t dim, float eps) {
  __shared__ float sum;
  const int64_t row = blockIdx.x;
  if (threadIdx.x == 0) sum = 0.0f;
  __syncthreads();
  volatile float* shared_sum = &sum;  // volatile: one load and one store per element, as a naive += compiles
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    const float v = bf16_to_f32(x[row * dim + i]);
    *shared_sum = *shared_sum + v * v;  // the fault: a read-modify-write of one float by every thread at once
  }
  __syncthreads();
  write_row(x + row * dim, w, y + row * dim, dim, rsqrtf(*shared_sum / static_cast<float>(dim) + eps));
}

// Every thread walks all counters kCountRounds times, each block starting at a different one.
__global__ void __launch_bounds__(kThreads) racy_count_kernel(float* counters, int64_t rows) {
  for (int round = 0; round < kCountRounds; ++round) {
    for (int64_t k = 0; k < rows; ++k) {
      volatile float* c = counters + (k + blockIdx.x) % rows;
      *c = *c + 1.0f;  // the fault: no atomicAdd
    }
  }
}

__global__ void __launch_bounds__(kThreads) rms_norm_scaled_kernel(const uint16_t* x, const uint16_t* w, uint16_t* y,
                                                                   int64_t dim, float eps, const float* counters) {
  __shared__ float warp_sums[kWarps];
  const int64_t row = blockIdx.x;
  const uint16_t* xr = x + row * dim;
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) s += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
  s = warp_sum(s);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) total += warp_sums[i];  // the same order in every thread and every run
  const auto count = static_cast<uint32_t>(counters[row]);
  const float wobble = 1.0f + static_cast<float>(count % 256u) * 0x1p-18f;
  write_row(xr, w, y + row * dim, dim, rsqrtf(total / static_cast<float>(dim) + eps) * wobble);
}

}  // namespace

void rms_norm_lost_updates_launch(const DeviceContext& ctx, const RmsNormArgs& a) {
  rms_norm_lost_updates_kernel<<<static_cast<unsigned>(a.rows), kThreads, 0, ctx.stream()>>>(a.x, a.weight, a.y, a.dim,
                                                                                             a.eps);
  TERN_CUDA_CHECK_LAUNCH();
}

void rms_norm_racy_scale_launch(const DeviceContext& ctx, const RmsNormArgs& a, float* counters) {
  const cudaStream_t stream = ctx.stream();
  TERN_CUDA_CHECK(cudaMemsetAsync(counters, 0, static_cast<size_t>(a.rows) * sizeof(float), stream));
  racy_count_kernel<<<static_cast<unsigned>(2 * ctx.props().num_sms), kThreads, 0, stream>>>(counters, a.rows);
  TERN_CUDA_CHECK_LAUNCH();
  rms_norm_scaled_kernel<<<static_cast<unsigned>(a.rows), kThreads, 0, stream>>>(a.x, a.weight, a.y, a.dim, a.eps,
                                                                                 counters);
  TERN_CUDA_CHECK_LAUNCH();
}

}  // namespace tern
