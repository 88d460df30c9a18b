// Multi-head latent attention in the weight-absorbed form: the pre-attention step (latent norm, RoPE, cache write)
// and the attention over the paged latent cache; contracts in mla_launch.h.
#include <algorithm>

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
// mla_attention. Block (query row, group of kMlaHeadsPerBlock heads, key range), one warp per head: every head of a
// token reads the same latent keys (one KV "head", MQA-like), so the block loads each tile of kMlaKeysPerTile latent
// rows into shared memory once for all its heads, with cp.async two tiles deep (the next tile lands while this one is
// scored). Scoring: lane j takes key j of the tile and walks its row 16 bytes at a time against the warp's query
// (fp32, pre-scaled); rows are row_words apart, 4 x an odd count of 4-byte words, so the 8 lanes of each 16-byte
// phase read 8 different bank quads. Then an online softmax per warp, and the output: lane l accumulates the value
// pairs l, l + 32, ... of c (the latent's first kv_lora_rank values) over the tile's keys. With several key ranges
// (split-K) each block leaves (m, l, o) in the workspace and mla_combine_kernel merges them.

constexpr int kAttnThreads = kMlaHeadsPerBlock * 32;
constexpr int kMaxOutPairsPerLane = static_cast<int>(kMlaMaxLoraRank / 64);
constexpr int kCombineThreads = 128;

__host__ __device__ constexpr int64_t key_row_words(int64_t width) {
  const int64_t quads = (width / 2 + 3) / 4;
  return 4 * (quads % 2 == 1 ? quads : quads + 1);
}

struct AttnParams {
  MlaAttentionArgs a;
  int splits;
  int tiles_per_split;
};

__global__ void __launch_bounds__(kAttnThreads) mla_attention_kernel(const AttnParams p) {
  ptx::grid_dependency_begin();
  const MlaAttentionArgs& a = p.a;
  extern __shared__ __align__(16) uint32_t smem[];
  const int width = static_cast<int>(a.cache.kv_lora_rank + a.cache.rope_dim);
  const int row_words = static_cast<int>(key_row_words(width)), chunks = width / 8;
  const int lora_pairs = static_cast<int>(a.cache.kv_lora_rank / 2);
  uint32_t* keys_s = smem;                                                             // [2][tile][row_words]
  float* q_s = reinterpret_cast<float*>(smem + 2 * kMlaKeysPerTile * row_words);      // [heads][width]
  int64_t* slot_s = reinterpret_cast<int64_t*>(q_s + kMlaHeadsPerBlock * width);       // [2][tile]
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
  const int64_t n_tiles = (n_keys + kMlaKeysPerTile - 1) / kMlaKeysPerTile;
  const int64_t tile_begin = int64_t{blockIdx.z} * p.tiles_per_split;
  const int64_t tile_end = min(n_tiles, tile_begin + p.tiles_per_split);

  for (int i = tid; i < kMlaHeadsPerBlock * width; i += kAttnThreads) {
    const int64_t hh = head0 + i / width;
    q_s[i] = hh < a.n_heads ? bf16_to_f32(a.q_latent[(t * a.n_heads + hh) * width + i % width]) * a.scale : 0.0f;
  }
  // The physical slots of tile `tile`'s keys into slot_s[buf] (threads 0..31), and their rows into keys_s[buf].
  auto slots = [&](int64_t tile, int buf) {
    if (tid < kMlaKeysPerTile) {
      const int64_t j = tile * kMlaKeysPerTile + tid;
      int64_t pos = -1;
      if (j < n_keys) pos = causal ? j : a.selected[t * a.topk + j];
      if (pos > position) pos = -1;  // never a future key, whatever a selection says
      slot_s[buf * kMlaKeysPerTile + tid] = pos >= 0 ? int64_t{table[pos / bs]} * bs + (pos & (bs - 1)) : -1;
    }
  };
  auto load = [&](int buf) {
    for (int i = tid; i < kMlaKeysPerTile * chunks; i += kAttnThreads) {
      const int r = i / chunks, c = i % chunks;
      const int64_t slot = slot_s[buf * kMlaKeysPerTile + r];
      ptx::cp_async_16_zfill(keys_s + (buf * kMlaKeysPerTile + r) * row_words + 4 * c,
                             a.cache.data + (slot >= 0 ? slot : 0) * width + 8 * c, slot >= 0);
    }
    ptx::cp_async_commit();
  };
  if (tile_begin < tile_end) {
    slots(tile_begin, 0);
    __syncthreads();
    load(0);
  }

  float m = -INFINITY, l = 0.0f;
  float o[2 * kMaxOutPairsPerLane];
#pragma unroll
  for (int i = 0; i < 2 * kMaxOutPairsPerLane; ++i) o[i] = 0.0f;

  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int buf = static_cast<int>((tile - tile_begin) & 1), next = buf ^ 1;
    const bool more = tile + 1 < tile_end;
    __syncthreads();  // every warp is done with tile - 1: its buffer and slots are free
    if (more) slots(tile + 1, next);
    __syncthreads();
    if (more) {
      load(next);
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    __syncthreads();  // this tile's rows, from every thread's copies
    if (!active) continue;
    const int64_t* tile_slots = slot_s + buf * kMlaKeysPerTile;
    float score = -INFINITY;
    if (tile_slots[lane] >= 0) {
      const uint4* row = reinterpret_cast<const uint4*>(keys_s + (buf * kMlaKeysPerTile + lane) * row_words);
      const float4* qh = reinterpret_cast<const float4*>(q_s + warp * width);
      float acc = 0.0f;
      for (int c = 0; c < chunks; ++c) {
        const uint4 w = row[c];
        const float4 q0 = qh[2 * c], q1 = qh[2 * c + 1];
        acc += __uint_as_float(w.x << 16) * q0.x + __uint_as_float(w.x & 0xFFFF0000u) * q0.y;
        acc += __uint_as_float(w.y << 16) * q0.z + __uint_as_float(w.y & 0xFFFF0000u) * q0.w;
        acc += __uint_as_float(w.z << 16) * q1.x + __uint_as_float(w.z & 0xFFFF0000u) * q1.y;
        acc += __uint_as_float(w.w << 16) * q1.z + __uint_as_float(w.w & 0xFFFF0000u) * q1.w;
      }
      score = acc;
    }
    const float m_new = fmaxf(m, warp_max(score));
    if (m_new == -INFINITY) continue;  // every key so far masked (warp-uniform)
    const float prob = score == -INFINITY ? 0.0f : expf(score - m_new);
    const float correction = m == -INFINITY ? 0.0f : expf(m - m_new);
    l = l * correction + warp_sum(prob);
#pragma unroll
    for (int i = 0; i < 2 * kMaxOutPairsPerLane; ++i) o[i] *= correction;
    for (int r = 0; r < kMlaKeysPerTile; ++r) {
      const float pr = __shfl_sync(0xFFFFFFFFu, prob, r);
      if (pr == 0.0f) continue;  // warp-uniform
      const uint32_t* row = keys_s + (buf * kMlaKeysPerTile + r) * row_words;
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
  const int64_t lora = a.cache.kv_lora_rank;
  if (p.splits == 1) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    uint32_t* out = reinterpret_cast<uint32_t*>(a.out_latent + (t * a.n_heads + h) * lora);
#pragma unroll
    for (int i = 0; i < kMaxOutPairsPerLane; ++i) {
      const int c = lane + 32 * i;
      if (c < lora_pairs) out[c] = cuda_common::pack_bf16x2(o[2 * i] * inv, o[2 * i + 1] * inv);
    }
    return;
  }
  // Partials: (m, l) pairs [rows, heads, splits, 2], then outputs [rows, heads, splits, lora] (unnormalised).
  const int64_t part = (t * a.n_heads + h) * p.splits + blockIdx.z, parts = a.tokens * a.n_heads * p.splits;
  float* ml = static_cast<float*>(a.workspace);
  float* out = ml + 2 * parts + part * lora;
  if (lane == 0) {
    ml[2 * part] = m;
    ml[2 * part + 1] = l;
  }
#pragma unroll
  for (int i = 0; i < kMaxOutPairsPerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < lora_pairs) {
      out[2 * c] = o[2 * i];
      out[2 * c + 1] = o[2 * i + 1];
    }
  }
}

// One block per (row, head): the splits' partials merged, o = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
__global__ void __launch_bounds__(kCombineThreads) mla_combine_kernel(const AttnParams p) {
  ptx::grid_dependency_begin();
  const MlaAttentionArgs& a = p.a;
  const int64_t row = blockIdx.x, lora = a.cache.kv_lora_rank, parts = a.tokens * a.n_heads * p.splits;
  const float* ml = static_cast<const float*>(a.workspace) + 2 * row * p.splits;
  float big = -INFINITY;
  for (int s = 0; s < p.splits; ++s) big = fmaxf(big, ml[2 * s]);
  float total = 0.0f;
  for (int s = 0; s < p.splits; ++s) total += ml[2 * s] == -INFINITY ? 0.0f : expf(ml[2 * s] - big) * ml[2 * s + 1];
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  const float* outs = static_cast<const float*>(a.workspace) + 2 * parts + row * p.splits * lora;
  for (int64_t d = threadIdx.x; d < lora; d += kCombineThreads) {
    float sum = 0.0f;
    for (int s = 0; s < p.splits; ++s) {
      if (ml[2 * s] != -INFINITY) sum += expf(ml[2 * s] - big) * outs[s * lora + d];
    }
    a.out_latent[row * lora + d] = f32_to_bf16(sum * inv);
  }
}

}  // namespace

size_t mla_attention_smem_bytes(int64_t width) {
  return static_cast<size_t>(2 * kMlaKeysPerTile * key_row_words(width) * 4 + kMlaHeadsPerBlock * width * 4 +
                             2 * kMlaKeysPerTile * 8);
}

int64_t mla_attention_splits(const DeviceProps& props, int64_t tokens, int64_t n_heads, int64_t max_keys) {
  const int64_t blocks = tokens * ((n_heads + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock);
  const int64_t sms = std::max(props.num_sms, 1);
  if (blocks >= sms) return 1;
  const int64_t by_keys = std::max<int64_t>(1, max_keys / kMlaMinKeysPerSplit);
  return std::max<int64_t>(1, std::min((2 * sms + blocks - 1) / blocks, by_keys));
}

size_t mla_attention_workspace_bytes(const DeviceProps& props, int64_t kv_lora_rank) {
  // rows x groups x splits < 3 x num_sms blocks, kMlaHeadsPerBlock heads each.
  const auto parts = static_cast<size_t>(3 * std::max(props.num_sms, 1) * kMlaHeadsPerBlock);
  return parts * static_cast<size_t>(kv_lora_rank + 2) * 4;
}

void mla_prepare_launch(const DeviceContext& ctx, const MlaPrepareArgs& args) {
  launch_kernel(ctx, mla_prepare_kernel, dim3(static_cast<unsigned>(args.tokens)), dim3(kPrepareThreads), 0, args);
  TERN_CUDA_CHECK_LAUNCH();
}

void mla_attention_launch(const DeviceContext& ctx, const MlaAttentionArgs& args) {
  const size_t smem = mla_attention_smem_bytes(args.cache.width());
  const int64_t max_keys = args.selected != nullptr ? args.topk : args.max_seq_len;
  const int64_t splits = mla_attention_splits(ctx.props(), args.tokens, args.n_heads, max_keys);
  const int64_t tiles = (max_keys + kMlaKeysPerTile - 1) / kMlaKeysPerTile;
  const AttnParams p{.a = args,
                     .splits = static_cast<int>(splits),
                     .tiles_per_split = static_cast<int>(std::max<int64_t>(1, (tiles + splits - 1) / splits))};
  TERN_CUDA_CHECK(
      cudaFuncSetAttribute(mla_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>(args.tokens),
                  static_cast<unsigned>((args.n_heads + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock),
                  static_cast<unsigned>(splits));
  launch_kernel(ctx, mla_attention_kernel, grid, dim3(kAttnThreads), smem, p);
  TERN_CUDA_CHECK_LAUNCH();
  if (splits > 1) {
    launch_kernel(ctx, mla_combine_kernel, dim3(static_cast<unsigned>(args.tokens * args.n_heads)),
                  dim3(kCombineThreads), 0, p);
    TERN_CUDA_CHECK_LAUNCH();
  }
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t mla_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, mla_attention_kernel);
}

}  // namespace tern
