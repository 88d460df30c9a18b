// attention_prepare: the fused pre-attention step of the GPU model path (q/k per-head RMSNorm and RoPE in fp32, one
// bf16 rounding, k/v into their cache slot); contract in attention_launch.h.
#include "kernels/cuda/attention/attention_device.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"

namespace tern {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// attention_prepare. Block (token, group of kPrepareWarps head rows): sin/cos of the token's position once into
// shared memory (sincosf of a large angle takes the slow range reduction, so not once per head), then each warp takes
// one head row (q heads, then k heads, then v heads). A lane holds head_dim / 32 values; RoPE's partner dims come
// through the warp's row in shared memory. One row per warp keeps a decode step's few tokens spread over many SMs:
// a block walking all of a token's rows serially was bound by its chain of load latencies.

constexpr int kPrepareWarps = 4;
constexpr int kPrepareThreads = kPrepareWarps * 32;

template <int kHeadDim>
__global__ void __launch_bounds__(kPrepareThreads) attention_prepare_kernel(const AttentionPrepareArgs a) {
  ptx::grid_dependency_begin();
  constexpr int kPerLane = kHeadDim / 32, kWarps = kPrepareWarps;
  __shared__ float cos_s[kHeadDim / 2], sin_s[kHeadDim / 2];
  __shared__ float row_s[kWarps][kHeadDim];
  const int64_t t = blockIdx.x;
  const int half = static_cast<int>(a.rotary_dim / 2);
  if (half > 0) {
    const float position = static_cast<float>(a.positions[t]);
    for (int i = threadIdx.x; i < half; i += kPrepareThreads) {
      cuda_common::rope_cos_sin(position * a.inv_freq[i], a.attention_factor, &cos_s[i], &sin_s[i]);
    }
  }
  __syncthreads();
  const int64_t slot = a.slot_mapping[t];
  const bool cached = slot >= 0 && slot < a.cache.n_blocks * a.cache.block_size;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n_rows = a.n_heads + 2 * a.n_kv_heads;
  for (int64_t r = int64_t{blockIdx.y} * kWarps + warp; r < n_rows; r += int64_t{gridDim.y} * kWarps) {
    if (r >= a.n_heads + a.n_kv_heads) {  // a v head: copied as it is
      if (!cached) continue;
      const int64_t kvh = r - a.n_heads - a.n_kv_heads;
      const uint16_t* src = a.v + t * a.kv_stride + kvh * kHeadDim;
      uint16_t* dst = a.cache.v + (slot * a.n_kv_heads + kvh) * kHeadDim;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) dst[lane + 32 * i] = src[lane + 32 * i];
      continue;
    }
    const bool is_q = r < a.n_heads;
    if (!is_q && !cached) continue;
    const uint16_t* src = is_q ? a.q_proj + t * a.q_proj_stride + r * (a.gated ? 2 : 1) * kHeadDim
                               : a.k + t * a.kv_stride + (r - a.n_heads) * kHeadDim;
    uint16_t* dst = is_q ? a.q_out + (t * a.n_heads + r) * kHeadDim
                         : a.cache.k + (slot * a.n_kv_heads + (r - a.n_heads)) * kHeadDim;
    const uint16_t* weight = is_q ? a.q_norm_weight : a.k_norm_weight;
    if (is_q && a.gated) {
      uint16_t* gate = a.gate_out + (t * a.n_heads + r) * kHeadDim;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) gate[lane + 32 * i] = src[kHeadDim + lane + 32 * i];
    }
    float x[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] = bf16_to_f32(src[lane + 32 * i]);
    if (weight != nullptr) {  // RMSNorm as layers/norms.cc: (x * rsqrt(mean(x^2) + eps)) * (offset + w)
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) sum += x[i] * x[i];
      sum = warp_sum(sum);
      const float inv = 1.0f / sqrtf(sum / static_cast<float>(kHeadDim) + a.eps);
      const float offset = a.zero_centred ? 1.0f : 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) x[i] = (x[i] * inv) * (offset + bf16_to_f32(weight[lane + 32 * i]));
    }
    if (half > 0) {  // NeoX: dim i < half pairs with i + half, as layers/rope.cc
      __syncwarp();  // the previous row's partner reads are done
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) row_s[warp][lane + 32 * i] = x[i];
      __syncwarp();
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < half) {
          x[i] = x[i] * cos_s[d] - row_s[warp][d + half] * sin_s[d];
        } else if (d < 2 * half) {
          x[i] = x[i] * cos_s[d - half] + row_s[warp][d - half] * sin_s[d - half];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) dst[lane + 32 * i] = f32_to_bf16(x[i]);
  }
}

template <int kHeadDim>
void prepare_launch_hd(const DeviceContext& ctx, const AttentionPrepareArgs& a) {
  const int64_t n_rows = a.n_heads + 2 * a.n_kv_heads;
  const dim3 grid(static_cast<unsigned>(a.tokens), static_cast<unsigned>((n_rows + kPrepareWarps - 1) / kPrepareWarps));
  launch_kernel(ctx, attention_prepare_kernel<kHeadDim>, grid, dim3(kPrepareThreads), 0, a);
}

}  // namespace

void attention_prepare_launch(const DeviceContext& ctx, const AttentionPrepareArgs& args) {
  switch (args.head_dim) {
    case 32:
      prepare_launch_hd<32>(ctx, args);
      break;
    case 64:
      prepare_launch_hd<64>(ctx, args);
      break;
    case 128:
      prepare_launch_hd<128>(ctx, args);
      break;
    default:
      prepare_launch_hd<256>(ctx, args);
      break;
  }
  TERN_CUDA_CHECK_LAUNCH();
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t attention_prepare_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, attention_prepare_kernel<128>);
}

}  // namespace tern
