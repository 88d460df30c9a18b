// Elementwise kernels of the GPU model path; contracts in elementwise_launch.h. All are memory-bound: the vectorised
// ones move 16 bytes (8 bf16) per access and do their math in fp32, rounding to bf16 once per output.
#include <cuda_bf16.h>
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/ptx.cuh"

#include <algorithm>

#include "kernels/cuda/elementwise/elementwise_launch.h"

namespace tern {
namespace {

constexpr int kVec = 8;  // bf16 values per 16-byte access (load_bf16x8, store_bf16x8)

using cuda_common::bf16_to_f32;
using cuda_common::f32_to_bf16;
using cuda_common::load_bf16x8;
using cuda_common::silu_f32;  // as layers/norms.h
using cuda_common::store_bf16x8;

// Grid for the grid-stride kernels: enough blocks to fill every SM several times, no more than the work needs.
int grid_for(const DeviceContext& ctx, int64_t items, int threads) {
  const int64_t needed = (items + threads - 1) / threads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, int64_t{ctx.props().num_sms} * 16)));
}

// ---------------------------------------------------------------------------------------------------------------
// RMSNorm. A group of G threads (8 <= G <= 256, a power of two) owns a row and keeps its values in registers
// between the sum of squares and the scaling, so x (and residual) are read once. Small G lets per-head norms
// (head_dim 64..256) put many rows in a block instead of leaving most of a warp idle.

constexpr int kNormThreads = 256;

struct NormParams {
  RmsNormArgs a;
  int group;     // threads per row
  int n_chunks;  // dim / 8
};

template <int kChunks, bool kResidual, bool kGated>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(const NormParams p) {
  ptx::grid_dependency_begin();
  __shared__ float warp_sums[kNormThreads / 32];
  const int g = threadIdx.x % p.group;
  const int64_t row = int64_t{blockIdx.x} * (kNormThreads / p.group) + threadIdx.x / p.group;
  const bool active = row < p.a.rows;
  const int64_t base = row * p.a.dim, x_base = p.a.x_stride == 0 ? base : row * p.a.x_stride;
  const int64_t y_base = p.a.y_stride == 0 ? base : row * p.a.y_stride;
  const int64_t gate_base =
      p.a.gate_stride == 0 ? base : (row / p.a.gate_heads) * p.a.gate_stride + (row % p.a.gate_heads) * p.a.dim;
  float h[kChunks][kVec], w[kChunks][kVec], z[kGated ? kChunks : 1][kVec];
  float sum = 0.0f;
  // Stage 1: load (and add the residual), sum of squares of the fp32 values. The weight and gate are loaded here
  // too, so their latency overlaps the row's instead of following the reduction (a decode step's norm is a few
  // rows, bound by that chain of latencies).
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int chunk = g + c * p.group;
    if (!active || chunk >= p.n_chunks) continue;
    load_bf16x8(p.a.weight + chunk * kVec, w[c]);
    if constexpr (kGated) load_bf16x8(p.a.gate + gate_base + chunk * kVec, z[c]);
    load_bf16x8(p.a.x + x_base + chunk * kVec, h[c]);
    if constexpr (kResidual) {
      float r[kVec];
      load_bf16x8(p.a.residual + base + chunk * kVec, r);
#pragma unroll
      for (int i = 0; i < kVec; ++i) h[c][i] += r[i];
      store_bf16x8(p.a.h_out + base + chunk * kVec, h[c]);
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum += h[c][i] * h[c][i];
  }
  // Stage 2: reduce over the group (lanes of a group are contiguous, so xor offsets below G stay inside it).
  for (int offset = min(p.group, 32) / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
  if (p.group > 32) {
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    const int first = (threadIdx.x / p.group) * (p.group / 32);
    sum = 0.0f;
    for (int w = 0; w < p.group / 32; ++w) sum += warp_sums[first + w];
  }
  if (!active) return;
  const float inv = 1.0f / sqrtf(sum / static_cast<float>(p.a.dim) + p.a.eps);
  const float offset = p.a.zero_centred ? 1.0f : 0.0f;
  // Stage 3: scale, weight, gate, store.
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int chunk = g + c * p.group;
    if (chunk >= p.n_chunks) continue;
    float y[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) y[i] = (h[c][i] * inv) * (offset + w[c][i]);
    if constexpr (kGated) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) y[i] *= silu_f32(z[c][i]);
    }
    store_bf16x8(p.a.y + y_base + chunk * kVec, y);
  }
}

template <int kChunks>
void rms_norm_dispatch(const DeviceContext& ctx, const NormParams& p, int grid) {
  const bool residual = p.a.residual != nullptr, gated = p.a.gate != nullptr;
  if (residual && gated) {
    launch_kernel(ctx, rms_norm_kernel<kChunks, true, true>, dim3(grid), dim3(kNormThreads), 0, p);
  } else if (residual) {
    launch_kernel(ctx, rms_norm_kernel<kChunks, true, false>, dim3(grid), dim3(kNormThreads), 0, p);
  } else if (gated) {
    launch_kernel(ctx, rms_norm_kernel<kChunks, false, true>, dim3(grid), dim3(kNormThreads), 0, p);
  } else {
    launch_kernel(ctx, rms_norm_kernel<kChunks, false, false>, dim3(grid), dim3(kNormThreads), 0, p);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// RoPE. Block (token, slice of that token's pair slots); a head has head_dim / 2 slots: slot j < rotary_dim / 2
// rotates pair j, the rest copy the pass-through dims two at a time. cos/sin of the token are computed once per
// block into shared memory (sincosf of a large angle takes the slow range reduction, so not once per head).

constexpr int kRopeThreads = 256;

template <bool kInterleaved>
__global__ void __launch_bounds__(kRopeThreads) rope_kernel(const RopeArgs a) {
  ptx::grid_dependency_begin();
  __shared__ float cos_s[kRopeMaxRotaryDim / 2], sin_s[kRopeMaxRotaryDim / 2];
  const int64_t t = blockIdx.x;
  const int half = static_cast<int>(a.rotary_dim / 2);
  const float position = static_cast<float>(a.positions[t]);
  for (int i = threadIdx.x; i < half; i += kRopeThreads) {
    cuda_common::rope_cos_sin(position * a.inv_freq[i], a.attention_factor, &cos_s[i], &sin_s[i]);
  }
  __syncthreads();
  const int64_t slots_per_head = a.head_dim / 2;
  const int64_t slot = int64_t{blockIdx.y} * kRopeThreads + threadIdx.x;
  if (slot >= a.n_heads * slots_per_head) return;
  const int64_t head = slot / slots_per_head;
  const int j = static_cast<int>(slot % slots_per_head);
  const uint16_t* x = a.x + (t * a.n_heads + head) * a.head_dim;
  uint16_t* y = a.y + (t * a.n_heads + head) * a.head_dim;
  int lo, hi;  // the pair's two dims
  if (j >= half) {
    lo = static_cast<int>(a.rotary_dim) + 2 * (j - half);
    hi = lo + 1;
    if (x != y) {
      y[lo] = x[lo];
      y[hi] = x[hi];
    }
    return;
  }
  lo = kInterleaved ? 2 * j : j;
  hi = kInterleaved ? 2 * j + 1 : j + half;
  const float u = bf16_to_f32(x[lo]), v = bf16_to_f32(x[hi]);
  const float c = cos_s[j], s = sin_s[j];
  y[lo] = f32_to_bf16(u * c - v * s);
  y[hi] = f32_to_bf16(v * c + u * s);
}

// ---------------------------------------------------------------------------------------------------------------
// Row-wise streaming kernels: grid-stride over 8-value chunks.

constexpr int kStreamThreads = 256;

__global__ void __launch_bounds__(kStreamThreads) silu_mul_kernel(const SiluMulArgs a) {
  ptx::grid_dependency_begin();
  const int64_t chunks_per_row = a.inter / kVec;
  for (int64_t idx = int64_t{blockIdx.x} * kStreamThreads + threadIdx.x; idx < a.rows * chunks_per_row;
       idx += int64_t{gridDim.x} * kStreamThreads) {
    const int64_t r = idx / chunks_per_row, c = idx % chunks_per_row;
    float g[kVec], u[kVec];
    load_bf16x8(a.gate_up + r * a.gate_up_stride + c * kVec, g);
    load_bf16x8(a.gate_up + r * a.gate_up_stride + a.inter + c * kVec, u);
#pragma unroll
    for (int i = 0; i < kVec; ++i) g[i] = silu_f32(g[i]) * u[i];
    store_bf16x8(a.y + r * a.inter + c * kVec, g);
  }
}

__global__ void __launch_bounds__(kStreamThreads) embedding_kernel(const EmbeddingArgs a) {
  ptx::grid_dependency_begin();
  const int64_t chunks_per_row = a.hidden / kVec;
  for (int64_t idx = int64_t{blockIdx.x} * kStreamThreads + threadIdx.x; idx < a.tokens * chunks_per_row;
       idx += int64_t{gridDim.x} * kStreamThreads) {
    const int64_t t = idx / chunks_per_row, c = idx % chunks_per_row;
    const int32_t id = a.ids[t];
    uint4 v = make_uint4(0, 0, 0, 0);
    if (id >= 0 && id < a.vocab) {
      const int64_t row = id - a.table_begin;
      if (row >= 0 && row < (a.table_rows < 0 ? a.vocab : a.table_rows)) {
        v = *reinterpret_cast<const uint4*>(a.table + row * a.hidden + c * kVec);
      }
    } else if (c == 0) {
      atomicMin(a.bad, (static_cast<unsigned long long>(t) << 32) | static_cast<uint32_t>(id));
    }
    *reinterpret_cast<uint4*>(a.y + t * a.hidden + c * kVec) = v;
  }
}

__global__ void __launch_bounds__(kStreamThreads) residual_add_kernel(const ResidualAddArgs a) {
  ptx::grid_dependency_begin();
  for (int64_t idx = int64_t{blockIdx.x} * kStreamThreads + threadIdx.x; idx < a.n / kVec;
       idx += int64_t{gridDim.x} * kStreamThreads) {
    float x[kVec], r[kVec];
    load_bf16x8(a.a + idx * kVec, x);
    load_bf16x8(a.b + idx * kVec, r);
#pragma unroll
    for (int i = 0; i < kVec; ++i) x[i] += r[i];
    store_bf16x8(a.y + idx * kVec, x);
  }
}

}  // namespace

void rms_norm_launch(const DeviceContext& ctx, const RmsNormArgs& args) {
  const int n_chunks = static_cast<int>(args.dim / kVec);
  // Two chunks (16 values) per thread where the row allows it: enough loads in flight per thread, and up to
  // dim 4096 with a 256-thread group. Longer rows take up to 8 chunks per thread.
  int group = 8;
  while (group < kNormThreads && group * 2 < n_chunks) group *= 2;
  NormParams p{.a = args, .group = group, .n_chunks = n_chunks};
  const int64_t rows_per_block = kNormThreads / group;
  const int grid = static_cast<int>((args.rows + rows_per_block - 1) / rows_per_block);
  if (n_chunks <= 2 * group) {
    rms_norm_dispatch<2>(ctx, p, grid);
  } else {
    rms_norm_dispatch<8>(ctx, p, grid);
  }
  TERN_CUDA_CHECK_LAUNCH();
}

void rope_launch(const DeviceContext& ctx, const RopeArgs& args) {
  const int64_t slots = args.n_heads * (args.head_dim / 2);
  // Tokens on x (up to 2^31 - 1), the token's slices on y.
  const dim3 grid(static_cast<unsigned>(args.tokens), static_cast<unsigned>((slots + kRopeThreads - 1) / kRopeThreads));
  if (args.interleaved) {
    launch_kernel(ctx, rope_kernel<true>, grid, dim3(kRopeThreads), 0, args);
  } else {
    launch_kernel(ctx, rope_kernel<false>, grid, dim3(kRopeThreads), 0, args);
  }
  TERN_CUDA_CHECK_LAUNCH();
}

void silu_mul_launch(const DeviceContext& ctx, const SiluMulArgs& args) {
  SiluMulArgs a = args;
  if (a.gate_up_stride == 0) a.gate_up_stride = 2 * a.inter;
  launch_kernel(ctx, silu_mul_kernel, dim3(grid_for(ctx, a.rows * a.inter / kVec, kStreamThreads)),
                dim3(kStreamThreads), 0, a);
  TERN_CUDA_CHECK_LAUNCH();
}

void embedding_launch(const DeviceContext& ctx, const EmbeddingArgs& args) {
  TERN_CUDA_CHECK(cudaMemsetAsync(args.bad, 0xFF, sizeof(unsigned long long), ctx.stream()));
  launch_kernel(ctx, embedding_kernel, dim3(grid_for(ctx, args.tokens * args.hidden / kVec, kStreamThreads)),
                dim3(kStreamThreads), 0, args);
  TERN_CUDA_CHECK_LAUNCH();
}

void residual_add_launch(const DeviceContext& ctx, const ResidualAddArgs& args) {
  launch_kernel(ctx, residual_add_kernel, dim3(grid_for(ctx, args.n / kVec, kStreamThreads)), dim3(kStreamThreads), 0,
                args);
  TERN_CUDA_CHECK_LAUNCH();
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t elementwise_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, silu_mul_kernel);
}

}  // namespace tern
