// Multi-head latent attention in the weight-absorbed form: the pre-attention step (latent norm, RoPE, cache write)
// and the attention over the paged latent cache; contracts in mla_launch.h.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mla/mla_launch.h"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/ptx.cuh"

namespace tern {
namespace {

using cuda_common::bf16_to_f32;
using cuda_common::f32_to_bf16;
using cuda_common::warp_sum;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  return v;
}

// The two values of a RoPE pair slot j < rope_dim / 2: interleaved (2j, 2j + 1) or NeoX halves (j, j + rope_dim/2).
__device__ __forceinline__ void rope_pair(int j, int half, bool interleaved, int& lo, int& hi) {
  lo = interleaved ? 2 * j : j;
  hi = interleaved ? 2 * j + 1 : j + half;
}

// ---------------------------------------------------------------------------------------------------------------
// mla_prepare. One block per token: sin/cos of its position once into shared memory, the latent's sum of squares
// reduced over the block, then the normed c, the roped k_pe and every head's roped q_pe written.

constexpr int kPrepareThreads = 256;

__global__ void __launch_bounds__(kPrepareThreads) mla_prepare_kernel(const MlaPrepareArgs a) {
  ptx::grid_dependency_begin();
  __shared__ float cos_s[kMlaMaxRopeDim / 2], sin_s[kMlaMaxRopeDim / 2];
  __shared__ float warp_sums[kPrepareThreads / 32];
  const int64_t t = blockIdx.x;
  const int lora = static_cast<int>(a.cache.kv_lora_rank), rope = static_cast<int>(a.cache.rope_dim);
  const int half = rope / 2, width = lora + rope, tid = threadIdx.x;
  const float position = static_cast<float>(a.positions[t]);
  for (int i = tid; i < half; i += kPrepareThreads) sincosf(position * a.inv_freq[i], &sin_s[i], &cos_s[i]);
  const uint16_t* kv = a.kv_a + t * a.kv_a_stride;
  float sum = 0.0f;
  for (int i = tid; i < lora; i += kPrepareThreads) {
    const float v = bf16_to_f32(kv[i]);
    sum += v * v;
  }
  sum = warp_sum(sum);
  if (tid % 32 == 0) warp_sums[tid / 32] = sum;
  __syncthreads();  // also publishes cos_s / sin_s
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kPrepareThreads / 32; ++w) total += warp_sums[w];
  const float inv = 1.0f / sqrtf(total / static_cast<float>(lora) + a.eps);
  const float offset = a.zero_centred ? 1.0f : 0.0f;
  const int64_t slot = a.slot_mapping[t];
  if (slot >= 0 && slot < a.cache.n_blocks * a.cache.block_size) {
    uint16_t* dst = a.cache.data + slot * width;
    for (int i = tid; i < lora; i += kPrepareThreads) {
      dst[i] = f32_to_bf16(bf16_to_f32(kv[i]) * inv * (offset + bf16_to_f32(a.kv_norm_weight[i])));
    }
    for (int j = tid; j < half; j += kPrepareThreads) {
      int lo, hi;
      rope_pair(j, half, a.interleaved, lo, hi);
      const float x0 = bf16_to_f32(kv[lora + lo]), x1 = bf16_to_f32(kv[lora + hi]);
      dst[lora + lo] = f32_to_bf16(x0 * cos_s[j] - x1 * sin_s[j]);
      dst[lora + hi] = f32_to_bf16(x1 * cos_s[j] + x0 * sin_s[j]);
    }
  }
  const int64_t q_head = a.nope_dim + rope;
  for (int64_t idx = tid; idx < a.n_heads * half; idx += kPrepareThreads) {
    const int64_t h = idx / half;
    const int j = static_cast<int>(idx % half);
    int lo, hi;
    rope_pair(j, half, a.interleaved, lo, hi);
    const uint16_t* src = a.q + t * a.q_stride + h * q_head + a.nope_dim;
    uint16_t* dst = a.q_latent + (t * a.n_heads + h) * width + lora;
    const float x0 = bf16_to_f32(src[lo]), x1 = bf16_to_f32(src[hi]);
    dst[lo] = f32_to_bf16(x0 * cos_s[j] - x1 * sin_s[j]);
    dst[hi] = f32_to_bf16(x1 * cos_s[j] + x0 * sin_s[j]);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// mla_attention. Block (query row, group of kMlaHeadsPerBlock heads), one warp per head: every head of a token reads
// the same latent keys (one KV "head", MQA-like), so the block loads a tile of kMlaKeysPerTile latent rows into
// shared memory once for all its heads. Scoring: lane j takes key j of the tile and walks its row against the
// warp's query (fp32, pre-scaled) in shared memory; the rows are padded to an odd count of 4-byte words so the 32
// lanes read 32 different banks. Then an online softmax per warp, and the output: lane l accumulates the value pairs
// l, l + 32, ... of c (the latent's first kv_lora_rank values) over the tile's keys.

constexpr int kAttnThreads = kMlaHeadsPerBlock * 32;
constexpr int kMaxOutPairsPerLane = static_cast<int>(kMlaMaxLoraRank / 64);

__host__ __device__ constexpr int64_t key_row_words(int64_t width) { return (width / 2) | 1; }

__global__ void __launch_bounds__(kAttnThreads) mla_attention_kernel(const MlaAttentionArgs a) {
  ptx::grid_dependency_begin();
  extern __shared__ uint32_t smem[];
  const int width = static_cast<int>(a.cache.kv_lora_rank + a.cache.rope_dim), words = width / 2;
  const int row_words = static_cast<int>(key_row_words(width));
  const int lora_pairs = static_cast<int>(a.cache.kv_lora_rank / 2);
  uint32_t* keys_s = smem;                                                       // [tile][row_words]
  float* q_s = reinterpret_cast<float*>(smem + kMlaKeysPerTile * row_words);     // [heads][width]
  int64_t* slot_s = reinterpret_cast<int64_t*>(q_s + kMlaHeadsPerBlock * width);  // [tile]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t t = blockIdx.x, head0 = int64_t{blockIdx.y} * kMlaHeadsPerBlock, h = head0 + warp;
  const bool active = h < a.n_heads;

  // The row's sequence (the last s with query_start[s] <= t) and position.
  int lo = 0, hi = static_cast<int>(a.n_seqs) - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.query_start[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int s = lo;
  const int64_t n_q = a.query_start[s + 1] - a.query_start[s];
  const int64_t position = a.seq_lens[s] - n_q + (t - a.query_start[s]);
  const bool causal = a.selected == nullptr;
  const int64_t n_keys = causal ? position + 1 : a.topk;
  const int64_t bs = a.cache.block_size;
  const int32_t* table = a.block_tables + int64_t{s} * a.max_blocks_per_seq;

  for (int i = tid; i < kMlaHeadsPerBlock * width; i += kAttnThreads) {
    const int64_t hh = head0 + i / width;
    q_s[i] = hh < a.n_heads ? bf16_to_f32(a.q_latent[(t * a.n_heads + hh) * width + i % width]) * a.scale : 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  float o[2 * kMaxOutPairsPerLane];
#pragma unroll
  for (int i = 0; i < 2 * kMaxOutPairsPerLane; ++i) o[i] = 0.0f;

  for (int64_t tile = 0; tile < n_keys; tile += kMlaKeysPerTile) {
    __syncthreads();  // the previous tile is consumed (and, the first time, q_s is written)
    if (tid < kMlaKeysPerTile) {
      const int64_t j = tile + tid;
      int64_t p = -1;
      if (j < n_keys) p = causal ? j : a.selected[t * a.topk + j];
      if (p > position) p = -1;  // never a future key, whatever a selection says
      slot_s[tid] = p >= 0 ? int64_t{table[p / bs]} * bs + (p & (bs - 1)) : -1;
    }
    __syncthreads();
    for (int i = tid; i < kMlaKeysPerTile * words; i += kAttnThreads) {
      const int r = i / words, c = i % words;
      const int64_t slot = slot_s[r];
      keys_s[r * row_words + c] =
          slot >= 0 ? reinterpret_cast<const uint32_t*>(a.cache.data + slot * width)[c] : 0u;
    }
    __syncthreads();
    if (!active) continue;
    float score = -INFINITY;
    if (slot_s[lane] >= 0) {
      const uint32_t* row = keys_s + lane * row_words;
      const float* qh = q_s + warp * width;
      float acc = 0.0f;
      for (int c = 0; c < words; ++c) {
        const uint32_t w = row[c];
        acc += __uint_as_float(w << 16) * qh[2 * c] + __uint_as_float(w & 0xFFFF0000u) * qh[2 * c + 1];
      }
      score = acc;
    }
    const float m_new = fmaxf(m, warp_max(score));
    if (m_new == -INFINITY) continue;  // every key so far masked (warp-uniform)
    const float p = score == -INFINITY ? 0.0f : expf(score - m_new);
    const float correction = m == -INFINITY ? 0.0f : expf(m - m_new);
    l = l * correction + warp_sum(p);
#pragma unroll
    for (int i = 0; i < 2 * kMaxOutPairsPerLane; ++i) o[i] *= correction;
    for (int r = 0; r < kMlaKeysPerTile; ++r) {
      const float pr = __shfl_sync(0xFFFFFFFFu, p, r);
      if (pr == 0.0f) continue;  // warp-uniform
      const uint32_t* row = keys_s + r * row_words;
#pragma unroll
      for (int i = 0; i < kMaxOutPairsPerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < lora_pairs) {
          const uint32_t w = row[c];
          o[2 * i] += pr * __uint_as_float(w << 16);
          o[2 * i + 1] += pr * __uint_as_float(w & 0xFFFF0000u);
        }
      }
    }
    m = m_new;
  }
  if (!active) return;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  uint32_t* out = reinterpret_cast<uint32_t*>(a.out_latent + (t * a.n_heads + h) * a.cache.kv_lora_rank);
#pragma unroll
  for (int i = 0; i < kMaxOutPairsPerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < lora_pairs) out[c] = cuda_common::pack_bf16x2(o[2 * i] * inv, o[2 * i + 1] * inv);
  }
}

}  // namespace

size_t mla_attention_smem_bytes(int64_t width) {
  return static_cast<size_t>(kMlaKeysPerTile * key_row_words(width) * 4 + kMlaHeadsPerBlock * width * 4 +
                             kMlaKeysPerTile * 8);
}

void mla_prepare_launch(const DeviceContext& ctx, const MlaPrepareArgs& args) {
  launch_kernel(ctx, mla_prepare_kernel, dim3(static_cast<unsigned>(args.tokens)), dim3(kPrepareThreads), 0, args);
  TERN_CUDA_CHECK_LAUNCH();
}

void mla_attention_launch(const DeviceContext& ctx, const MlaAttentionArgs& args) {
  const size_t smem = mla_attention_smem_bytes(args.cache.width());
  TERN_CUDA_CHECK(
      cudaFuncSetAttribute(mla_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>(args.tokens),
                  static_cast<unsigned>((args.n_heads + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock));
  launch_kernel(ctx, mla_attention_kernel, grid, dim3(kAttnThreads), smem, args);
  TERN_CUDA_CHECK_LAUNCH();
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t mla_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, mla_attention_kernel);
}

}  // namespace tern
