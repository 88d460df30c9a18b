// Paged attention kernels of the GPU model path; contracts in attention_launch.h.
//
// prepare:  one block per token; q/k per-head RMSNorm and RoPE in fp32, one bf16 rounding, k/v into their slot.
// decode:   split-K flash decoding. A block owns (token, kv head, range of keys) and all query heads of that kv head,
//           so each K/V row is read once per group; a reduce kernel merges the ranges' partial softmaxes.
// prefill:  flash attention on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulation) over 64-row query tiles
//           of one head, K/V tiles gathered from the paged cache with cp.async, online softmax in the log2 domain.
#include <cuda_bf16.h>
#include "kernels/cuda/module_attributes.h"

#include <algorithm>

#include "kernels/cuda/attention_launch.h"

namespace tern {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxGroup = 16;
static_assert(kMaxGroup == kAttentionMaxGroup);

__device__ __forceinline__ float bf16_to_f32(uint16_t bits) {
  return __uint_as_float(uint32_t{bits} << 16);
}
__device__ __forceinline__ uint16_t f32_to_bf16(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

__device__ __forceinline__ void unpack_bf16x8(const uint4 raw, float (&v)[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(words[i] << 16);
    v[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

// As layers/attention.cc: 1 / (1 + exp(-x)) with the accurate expf.
__device__ __forceinline__ float sigmoid_f32(float x) {
  return 1.0f / (1.0f + expf(-x));
}

// The cache slot of key j of a sequence whose block table row is `table`.
__device__ __forceinline__ int64_t key_slot(const int32_t* table, int j, int log2_bs) {
  return int64_t{table[j >> log2_bs]} * (int64_t{1} << log2_bs) + (j & ((1 << log2_bs) - 1));
}

// The sequence owning query row t: the largest s with query_start[s] <= t (empty sequences are skipped over).
__device__ __forceinline__ int find_sequence(const int32_t* query_start, int n_seqs, int t) {
  int lo = 0, hi = n_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_start[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

int log2_int(int64_t v) {
  int l = 0;
  while ((int64_t{1} << l) < v) ++l;
  return l;
}

// ---------------------------------------------------------------------------------------------------------------
// attention_prepare. One block per token: sin/cos of its position once into shared memory (sincosf of a large angle
// takes the slow range reduction, so not once per head), then each warp takes whole head rows: q heads, k heads, v
// heads. A lane holds head_dim / 32 values; RoPE's partner dims come through the warp's row in shared memory.

constexpr int kPrepareThreads = 256;

template <int kHeadDim>
__global__ void __launch_bounds__(kPrepareThreads) attention_prepare_kernel(const AttentionPrepareArgs a) {
  constexpr int kPerLane = kHeadDim / 32, kWarps = kPrepareThreads / 32;
  __shared__ float cos_s[kHeadDim / 2], sin_s[kHeadDim / 2];
  __shared__ float row_s[kWarps][kHeadDim];
  const int64_t t = blockIdx.x;
  const int half = static_cast<int>(a.rotary_dim / 2);
  if (half > 0) {
    const float position = static_cast<float>(a.positions[t]);
    for (int i = threadIdx.x; i < half; i += kPrepareThreads) sincosf(position * a.inv_freq[i], &sin_s[i], &cos_s[i]);
  }
  __syncthreads();
  const int64_t slot = a.slot_mapping[t];
  const bool cached = slot >= 0 && slot < a.cache.n_blocks * a.cache.block_size;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n_rows = a.n_heads + 2 * a.n_kv_heads;
  for (int64_t r = warp; r < n_rows; r += kWarps) {
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
      for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
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

// ---------------------------------------------------------------------------------------------------------------
// Decode (split-K flash decoding). Block (token, split, kv head), 128 threads, the group's G query heads together:
//   stage 0: the G query rows into shared memory as fp32, pre-scaled by scale * log2(e) (softmax in base 2);
//   then per chunk of 128 keys of the split's range:
//   stage 1: one key per thread: its K row (16-byte loads) against all G rows (broadcast reads of q) -> scores;
//   stage 2: one warp per head: chunk max, running max and sum, probabilities, rescale factor of the old terms;
//   stage 3: P·V: a thread owns 8 dims of up to 4 heads over a slice of the chunk's keys (consecutive threads take
//            consecutive 16-byte pieces of one V row, so the loads coalesce);
//   stage 4: the slices' sums are added; one split writes `out`, several write partials for the reduce kernel.

constexpr int kDecodeThreads = 128;
constexpr int kDecodeChunk = 128;          // keys scored per pass, one per thread
constexpr int kHeadsPerThread = 4;         // heads one thread accumulates in stage 3
constexpr int kDecodeReduceFloats = 4096;  // slices x G x head_dim <= 1024 * G / ceil(G / 4) <= 4096

struct DecodeParams {
  PagedAttentionArgs a;
  int group;  // query heads per kv head
  int log2_bs;
  int n_splits;      // each query row's keys cut into this many equal ranges
  float scale_log2;  // scale * log2(e)
  float* partial;    // [tokens, n_heads, n_splits, head_dim] when n_splits > 1
  float* ml;         // [tokens, n_heads, n_splits, 2]: running max (log2 domain) and sum
};

template <int kHeadDim>
__device__ __forceinline__ void decode_scores(const DecodeParams& p, const float (*q_s)[kHeadDim],
                                              const uint16_t* k_row, float (&score)[kMaxGroup]) {
#pragma unroll 4
  for (int ch = 0; ch < kHeadDim / 8; ++ch) {
    float k[8];
    unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(k_row) + ch), k);
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= p.group) break;
      const float4 qa = *reinterpret_cast<const float4*>(&q_s[g][ch * 8]);
      const float4 qb = *reinterpret_cast<const float4*>(&q_s[g][ch * 8 + 4]);
      score[g] +=
          qa.x * k[0] + qa.y * k[1] + qa.z * k[2] + qa.w * k[3] + qb.x * k[4] + qb.y * k[5] + qb.z * k[6] + qb.w * k[7];
    }
  }
}

template <int kHeadDim>
__global__ void __launch_bounds__(kDecodeThreads) paged_decode_kernel(const DecodeParams p) {
  constexpr int kChunks = kHeadDim / 8;
  __shared__ __align__(16) float q_s[kMaxGroup][kHeadDim];
  __shared__ float p_s[kMaxGroup][kDecodeChunk];
  __shared__ float red_s[kDecodeReduceFloats];
  __shared__ int64_t slot_s[kDecodeChunk];
  __shared__ float m_s[kMaxGroup], l_s[kMaxGroup], corr_s[kMaxGroup];
  const PagedAttentionArgs& a = p.a;
  const int tid = threadIdx.x, t = blockIdx.x, split = blockIdx.y, kvh = blockIdx.z, G = p.group;
  const int s = find_sequence(a.query_start, static_cast<int>(a.n_seqs), t);
  const int q0 = a.query_start[s], n_q = a.query_start[s + 1] - q0;
  const int position = a.seq_lens[s] - n_q + (t - q0);
  const int n_keys = min(position + 1, static_cast<int>(a.max_blocks_per_seq << p.log2_bs));
  const int split_len = max((n_keys + p.n_splits - 1) / p.n_splits, static_cast<int>(kDecodeMinSplitKeys / 2));
  const int k_begin = split * split_len, k_end = min(n_keys, k_begin + split_len);
  const int32_t* table = a.block_tables + int64_t{s} * a.max_blocks_per_seq;
  const int64_t head_row0 = int64_t{t} * a.n_heads + int64_t{kvh} * G;  // row of the group's first query head

  // Stage 0.
  for (int i = tid; i < G * kHeadDim; i += kDecodeThreads) {
    q_s[i / kHeadDim][i % kHeadDim] = bf16_to_f32(a.q[head_row0 * kHeadDim + i]) * p.scale_log2;
  }
  if (tid < G) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  const int n_units = (G + kHeadsPerThread - 1) / kHeadsPerThread * kChunks;
  const int n_slices = kDecodeThreads / n_units;
  const int slice = tid / n_units, hg = (tid % n_units) / kChunks, c = tid % kChunks;
  const bool pv_active = slice < n_slices;
  float acc[kHeadsPerThread][8] = {};
  __syncthreads();

  for (int c0 = k_begin; c0 < k_end; c0 += kDecodeChunk) {
    const int len = min(kDecodeChunk, k_end - c0);
    {  // Stage 1.
      float score[kMaxGroup] = {};
      if (tid < len) {
        const int64_t slot = key_slot(table, c0 + tid, p.log2_bs);
        slot_s[tid] = slot;
        decode_scores<kHeadDim>(p, q_s, a.cache.k + (slot * a.cache.n_kv_heads + kvh) * kHeadDim, score);
      }
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < G) p_s[g][tid] = tid < len ? score[g] : -INFINITY;
      }
    }
    __syncthreads();
    {  // Stage 2. The chunk holds at least one key, so its max (and the new running max) is finite.
      const int warp = tid / 32, lane = tid % 32;
      for (int g = warp; g < G; g += kDecodeThreads / 32) {
        float v[kDecodeChunk / 32];
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < kDecodeChunk / 32; ++i) mx = fmaxf(mx, v[i] = p_s[g][lane + 32 * i]);
        for (int offset = 16; offset > 0; offset /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, offset));
        const float m_old = m_s[g], m_new = fmaxf(m_old, mx);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < kDecodeChunk / 32; ++i) {
          v[i] = exp2f(v[i] - m_new);
          sum += v[i];
          p_s[g][lane + 32 * i] = v[i];
        }
        for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
        __syncwarp();  // every lane has read m_s[g] before lane 0 replaces it
        if (lane == 0) {
          const float corr = exp2f(m_old - m_new);  // 0 while m_old is -inf
          corr_s[g] = corr;
          l_s[g] = l_s[g] * corr + sum;
          m_s[g] = m_new;
        }
      }
    }
    __syncthreads();
    if (pv_active) {  // Stage 3.
#pragma unroll
      for (int hh = 0; hh < kHeadsPerThread; ++hh) {
        const int g = hg * kHeadsPerThread + hh;
        const float corr = g < G ? corr_s[g] : 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[hh][e] *= corr;
      }
      for (int j = slice; j < len; j += n_slices) {
        float v[8];
        const uint16_t* v_row = a.cache.v + (slot_s[j] * a.cache.n_kv_heads + kvh) * kHeadDim;
        unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(v_row) + c), v);
#pragma unroll
        for (int hh = 0; hh < kHeadsPerThread; ++hh) {
          const int g = hg * kHeadsPerThread + hh;
          if (g >= G) break;
          const float pj = p_s[g][j];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[hh][e] += pj * v[e];
        }
      }
    }
    __syncthreads();  // p_s and slot_s are rewritten by the next chunk
  }

  // Stage 4.
  if (pv_active) {
#pragma unroll
    for (int hh = 0; hh < kHeadsPerThread; ++hh) {
      const int g = hg * kHeadsPerThread + hh;
      if (g >= G) break;
#pragma unroll
      for (int e = 0; e < 8; ++e) red_s[(slice * G + g) * kHeadDim + c * 8 + e] = acc[hh][e];
    }
  }
  __syncthreads();
  for (int i = tid; i < G * kHeadDim; i += kDecodeThreads) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    float o = 0.0f;
    for (int sl = 0; sl < n_slices; ++sl) o += red_s[(sl * G + g) * kHeadDim + d];
    const int64_t row = head_row0 + g;
    if (p.n_splits == 1) {
      const float l = l_s[g];
      float y = l > 0.0f ? o / l : 0.0f;
      if (a.gate != nullptr) y *= sigmoid_f32(bf16_to_f32(a.gate[row * kHeadDim + d]));
      a.out[row * kHeadDim + d] = f32_to_bf16(y);
    } else {
      const int64_t part = row * p.n_splits + split;
      p.partial[part * kHeadDim + d] = o;
      if (d == 0) {
        p.ml[2 * part] = m_s[g];
        p.ml[2 * part + 1] = l_s[g];
      }
    }
  }
}

// Merges the splits of one (token, head) row per warp: weights 2^(m_s - M) with M the largest running max; a split
// that saw no keys has m_s = -inf and weight 0.
constexpr int kReduceWarps = 4;

template <int kHeadDim>
__global__ void __launch_bounds__(kReduceWarps * 32) paged_decode_reduce_kernel(const DecodeParams p) {
  constexpr int kPerLane = kHeadDim / 32;
  const int64_t row = int64_t{blockIdx.x} * kReduceWarps + threadIdx.x / 32;
  if (row >= p.a.tokens * p.a.n_heads) return;
  const int lane = threadIdx.x % 32;
  const float* ml = p.ml + row * p.n_splits * 2;
  const float* partial = p.partial + row * p.n_splits * kHeadDim;
  float big = -INFINITY;
  for (int s = 0; s < p.n_splits; ++s) big = fmaxf(big, ml[2 * s]);
  float sum = 0.0f, o[kPerLane] = {};
  for (int s = 0; s < p.n_splits; ++s) {
    const float m = ml[2 * s];
    if (m == -INFINITY) continue;
    const float w = exp2f(m - big);
    sum += w * ml[2 * s + 1];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) o[i] += w * partial[s * kHeadDim + lane + 32 * i];
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t e = row * kHeadDim + lane + 32 * i;
    float y = sum > 0.0f ? o[i] / sum : 0.0f;
    if (p.a.gate != nullptr) y *= sigmoid_f32(bf16_to_f32(p.a.gate[e]));
    p.a.out[e] = f32_to_bf16(y);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Prefill (flash attention on tensor cores). Block (query tile, head, sequence), 4 warps; warp w owns query rows
// 16w..16w+15 of the tile. The Q tile stays in shared memory; K/V tiles of kKvTile keys are gathered from the cache
// slot by slot with cp.async (zero-filled past the last key the tile needs). Per K/V tile:
//   S = Q K^T (ldmatrix of Q rows and K rows: K stored [key][dim] is exactly the mma's col-major B);
//   causal mask, running row max and rescale in the log2 domain, P = 2^(S - max) in registers;
//   O += P V, P's accumulator fragments reused as the A operand (bf16), V through ldmatrix.trans.
// Rows are padded by 16 bytes so ldmatrix's eight 16-byte row reads fall in distinct banks.

constexpr int kPrefillWarps = 4;
constexpr int kPrefillThreads = kPrefillWarps * 32;

struct PrefillParams {
  PagedAttentionArgs a;
  int group;
  int log2_bs;
  float scale_log2;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16_zfill(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return uint32_t{f32_to_bf16(lo)} | (uint32_t{f32_to_bf16(hi)} << 16);
}

// Where the tile of a block sits in its sequence.
struct PrefillTile {
  int q0;      // first query row of the sequence
  int row0;    // first row of the tile within the sequence
  int n_q;     // the sequence's query rows
  int pos0;    // position of the tile's row 0
  int n_keys;  // keys the tile's last valid row attends
  int64_t table_row;
};

// Gathers keys [key0, key0 + kKvTile) of the kv head into k_s / v_s ([kKvTile][kLd] each), zero past n_keys.
template <int kHeadDim, int kKvTile>
__device__ __forceinline__ void prefill_load_kv(const PrefillParams& p, const PrefillTile& tile, int kvh, int key0,
                                                uint16_t* k_s, uint16_t* v_s) {
  constexpr int kLd = kHeadDim + 8, kChunks = kHeadDim / 8;
  const PagedKvCache& cache = p.a.cache;
  const int32_t* table = p.a.block_tables + tile.table_row;
  for (int i = threadIdx.x; i < kKvTile * kChunks; i += kPrefillThreads) {
    const int r = i / kChunks, c = i % kChunks, key = key0 + r;
    const bool valid = key < tile.n_keys;
    const int64_t offset = valid ? (key_slot(table, key, p.log2_bs) * cache.n_kv_heads + kvh) * kHeadDim + c * 8 : 0;
    cp_async_16_zfill(k_s + r * kLd + c * 8, cache.k + offset, valid);
    cp_async_16_zfill(v_s + r * kLd + c * 8, cache.v + offset, valid);
  }
}

// S = Q K^T for the warp's 16 rows and the tile's keys.
template <int kHeadDim, int kKvTile>
__device__ __forceinline__ void prefill_scores(const uint16_t* q_s, const uint16_t* k_s, float (&s)[kKvTile / 8][4]) {
  constexpr int kLd = kHeadDim + 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < kKvTile / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < kHeadDim; kk += 16) {
    uint32_t a[4];
    ldmatrix_x4(a, q_s + (warp * 16 + lane % 16) * kLd + kk + (lane / 16) * 8);
#pragma unroll
    for (int n = 0; n < kKvTile / 8; n += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, k_s + (n * 8 + (lane / 16) * 8 + lane % 8) * kLd + kk + ((lane / 8) % 2) * 8);
      mma_bf16_16816(s[n], a, b[0], b[1]);
      mma_bf16_16816(s[n + 1], a, b[2], b[3]);
    }
  }
}

// O += P V with P the probabilities in s (accumulator layout of keys 16k..16k+15 = the A fragment of step k).
template <int kHeadDim, int kKvTile>
__device__ __forceinline__ void prefill_pv(const float (&s)[kKvTile / 8][4], const uint16_t* v_s,
                                           float (&o)[kHeadDim / 8][4]) {
  constexpr int kLd = kHeadDim + 8;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < kKvTile; kk += 16) {
    const int n = kk / 8;
    const uint32_t a[4] = {pack_bf16x2(s[n][0], s[n][1]), pack_bf16x2(s[n][2], s[n][3]),
                           pack_bf16x2(s[n + 1][0], s[n + 1][1]), pack_bf16x2(s[n + 1][2], s[n + 1][3])};
#pragma unroll
    for (int dn = 0; dn < kHeadDim / 8; dn += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_s + (kk + ((lane / 8) % 2) * 8 + lane % 8) * kLd + dn * 8 + (lane / 16) * 8);
      mma_bf16_16816(o[dn], a, b[0], b[1]);
      mma_bf16_16816(o[dn + 1], a, b[2], b[3]);
    }
  }
}

// Causal mask and the online softmax update of one K/V tile. A thread holds rows lane/4 (r = 0) and lane/4 + 8
// (r = 1) of its warp's 16, columns 2 * (lane % 4) + {0, 1} of each 8-key group; a row's four lanes are a quad.
template <int kHeadDim, int kKvTile>
__device__ __forceinline__ void prefill_softmax(float (&s)[kKvTile / 8][4], float (&o)[kHeadDim / 8][4], float (&m)[2],
                                                float (&l)[2], const int (&qpos)[2], int key0, float scale_log2) {
  const int lane = threadIdx.x % 32;
  float mx[2] = {m[0], m[1]};
#pragma unroll
  for (int n = 0; n < kKvTile / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + n * 8 + (lane % 4) * 2 + (e % 2);
      const float v = key <= qpos[e / 2] ? s[n][e] * scale_log2 : -INFINITY;
      s[n][e] = v;
      mx[e / 2] = fmaxf(mx[e / 2], v);
    }
  }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xFFFFFFFFu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xFFFFFFFFu, mx[r], 2));
    base[r] = mx[r] == -INFINITY ? 0.0f : mx[r];  // a row with no key yet keeps p = 0 instead of NaN
    const float corr = exp2f(m[r] - base[r]);
    m[r] = mx[r];
    l[r] *= corr;
#pragma unroll
    for (int dn = 0; dn < kHeadDim / 8; ++dn) {
      o[dn][2 * r] *= corr;
      o[dn][2 * r + 1] *= corr;
    }
  }
#pragma unroll
  for (int n = 0; n < kKvTile / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = exp2f(s[n][e] - base[e / 2]);
      l[e / 2] += s[n][e];
    }
  }
}

template <int kHeadDim, int kKvTile, int kStages>
__global__ void __launch_bounds__(kPrefillThreads) paged_prefill_kernel(const PrefillParams p) {
  constexpr int kLd = kHeadDim + 8, kRows = 16 * kPrefillWarps, kChunks = kHeadDim / 8;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* q_s = smem;                 // [kRows][kLd]
  uint16_t* kv_s = smem + kRows * kLd;  // per stage: K [kKvTile][kLd], then V [kKvTile][kLd]
  const PagedAttentionArgs& a = p.a;
  const int h = blockIdx.y, seq = blockIdx.z, kvh = h / p.group;
  PrefillTile tile;
  tile.q0 = a.query_start[seq];
  tile.n_q = a.query_start[seq + 1] - tile.q0;
  tile.row0 = (gridDim.x - 1 - blockIdx.x) * kRows;  // the latest (longest) tiles start first
  if (tile.row0 >= tile.n_q) return;
  const int past = a.seq_lens[seq] - tile.n_q;
  tile.pos0 = past + tile.row0;
  tile.n_keys = min(past + min(tile.row0 + kRows, tile.n_q), static_cast<int>(a.max_blocks_per_seq << p.log2_bs));
  tile.table_row = int64_t{seq} * a.max_blocks_per_seq;
  const int n_tiles = (tile.n_keys + kKvTile - 1) / kKvTile;

  // Q tile and the first K/V tile in one cp.async group.
  for (int i = threadIdx.x; i < kRows * kChunks; i += kPrefillThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = tile.row0 + r < tile.n_q;
    const int64_t offset = valid ? ((int64_t{tile.q0} + tile.row0 + r) * a.n_heads + h) * kHeadDim + c * 8 : 0;
    cp_async_16_zfill(q_s + r * kLd + c * 8, a.q + offset, valid);
  }
  prefill_load_kv<kHeadDim, kKvTile>(p, tile, kvh, 0, kv_s, kv_s + kKvTile * kLd);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int qpos[2] = {tile.pos0 + warp * 16 + lane / 4, tile.pos0 + warp * 16 + lane / 4 + 8};
  float o[kHeadDim / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  for (int j = 0; j < n_tiles; ++j) {
    if constexpr (kStages == 2) {  // prefetch tile j + 1 into the other stage, then wait for tile j only
      if (j + 1 < n_tiles) {
        uint16_t* next = kv_s + ((j + 1) % 2) * 2 * kKvTile * kLd;
        prefill_load_kv<kHeadDim, kKvTile>(p, tile, kvh, (j + 1) * kKvTile, next, next + kKvTile * kLd);
      }
      cp_async_commit();  // always, so the group count per step stays uniform
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint16_t* k_s = kv_s + (j % kStages) * 2 * kKvTile * kLd;
    float s[kKvTile / 8][4];
    prefill_scores<kHeadDim, kKvTile>(q_s, k_s, s);
    prefill_softmax<kHeadDim, kKvTile>(s, o, m, l, qpos, j * kKvTile, p.scale_log2);
    prefill_pv<kHeadDim, kKvTile>(s, k_s + kKvTile * kLd, o);
    __syncthreads();  // the stage just read is overwritten by the next load
    if constexpr (kStages == 1) {
      if (j + 1 < n_tiles) {
        prefill_load_kv<kHeadDim, kKvTile>(p, tile, kvh, (j + 1) * kKvTile, kv_s, kv_s + kKvTile * kLd);
        cp_async_commit();
      }
    }
  }
  cp_async_wait<0>();

  // Row sums over the quad, normalise, gate, store bf16 pairs.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xFFFFFFFFu, l[r], 1);
    l[r] += __shfl_xor_sync(0xFFFFFFFFu, l[r], 2);
    const int row = tile.row0 + warp * 16 + lane / 4 + 8 * r;
    if (row >= tile.n_q) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const int64_t base = ((int64_t{tile.q0} + row) * a.n_heads + h) * kHeadDim + (lane % 4) * 2;
#pragma unroll
    for (int dn = 0; dn < kHeadDim / 8; ++dn) {
      float y0 = o[dn][2 * r] * inv, y1 = o[dn][2 * r + 1] * inv;
      if (a.gate != nullptr) {
        y0 *= sigmoid_f32(bf16_to_f32(a.gate[base + dn * 8]));
        y1 *= sigmoid_f32(bf16_to_f32(a.gate[base + dn * 8 + 1]));
      }
      *reinterpret_cast<uint32_t*>(a.out + base + dn * 8) = pack_bf16x2(y0, y1);
    }
  }
}

// K/V tile keys: 64 keep S at 32 fp32 registers next to O's head_dim / 2 up to head_dim 128; head_dim 256 holds
// 128 registers of O, so its tiles shrink to 32 keys to stay under 255 registers without spills.
constexpr int prefill_kv_tile(int head_dim) {
  return head_dim <= 128 ? 64 : 32;
}

size_t prefill_smem_bytes(int head_dim, int stages) {
  const size_t row_bytes = static_cast<size_t>(head_dim + 8) * 2;
  return (16 * kPrefillWarps + static_cast<size_t>(stages) * 2 * prefill_kv_tile(head_dim)) * row_bytes;
}

template <int kHeadDim, int kStages>
void prefill_launch_tiles(const DeviceContext& ctx, const PrefillParams& p, size_t smem) {
  constexpr int kKvTile = prefill_kv_tile(kHeadDim);
  auto* kernel = paged_prefill_kernel<kHeadDim, kKvTile, kStages>;
  TERN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t rows = 16 * kPrefillWarps;
  const dim3 grid(static_cast<unsigned>((p.a.max_query_len + rows - 1) / rows), static_cast<unsigned>(p.a.n_heads),
                  static_cast<unsigned>(p.a.n_seqs));
  kernel<<<grid, kPrefillThreads, smem, ctx.stream()>>>(p);
}

template <int kHeadDim>
void prefill_launch_hd(const DeviceContext& ctx, const PrefillParams& p, const AttentionPrefillTiles& tiles) {
  if (tiles.stages == 2) {
    prefill_launch_tiles<kHeadDim, 2>(ctx, p, tiles.smem_bytes);
  } else {
    prefill_launch_tiles<kHeadDim, 1>(ctx, p, tiles.smem_bytes);
  }
}

template <int kHeadDim>
void prepare_launch_hd(const DeviceContext& ctx, const AttentionPrepareArgs& a) {
  attention_prepare_kernel<kHeadDim><<<static_cast<unsigned>(a.tokens), kPrepareThreads, 0, ctx.stream()>>>(a);
}

template <int kHeadDim>
void decode_launch_hd(const DeviceContext& ctx, const DecodeParams& p) {
  const dim3 grid(static_cast<unsigned>(p.a.tokens), static_cast<unsigned>(p.n_splits),
                  static_cast<unsigned>(p.a.cache.n_kv_heads));
  paged_decode_kernel<kHeadDim><<<grid, kDecodeThreads, 0, ctx.stream()>>>(p);
  if (p.n_splits > 1) {
    const int64_t rows = p.a.tokens * p.a.n_heads;
    const auto blocks = static_cast<unsigned>((rows + kReduceWarps - 1) / kReduceWarps);
    paged_decode_reduce_kernel<kHeadDim><<<blocks, kReduceWarps * 32, 0, ctx.stream()>>>(p);
  }
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

void paged_attention_decode_launch(const DeviceContext& ctx, const PagedAttentionArgs& args) {
  DecodeParams p{.a = args,
                 .group = static_cast<int>(args.n_heads / args.cache.n_kv_heads),
                 .log2_bs = log2_int(args.cache.block_size),
                 .n_splits = static_cast<int>(attention_decode_splits(ctx.props().num_sms, args.tokens,
                                                                      args.cache.n_kv_heads, args.max_seq_len)),
                 .scale_log2 = args.scale * kLog2e,
                 .partial = nullptr,
                 .ml = nullptr};
  if (p.n_splits > 1) {
    const size_t rows = static_cast<size_t>(args.tokens * args.n_heads * p.n_splits);
    p.partial = static_cast<float*>(args.workspace);
    p.ml = reinterpret_cast<float*>(static_cast<char*>(args.workspace) +
                                    (rows * static_cast<size_t>(args.cache.head_dim) * 4 + 255) / 256 * 256);
  }
  switch (args.cache.head_dim) {
    case 32:
      decode_launch_hd<32>(ctx, p);
      break;
    case 64:
      decode_launch_hd<64>(ctx, p);
      break;
    case 128:
      decode_launch_hd<128>(ctx, p);
      break;
    default:
      decode_launch_hd<256>(ctx, p);
      break;
  }
  TERN_CUDA_CHECK_LAUNCH();
}

// Two stages (loads of the next K/V tile under the current tile's math) where the opt-in shared memory allows it
// (H200: 227 KiB for every head_dim; RTX PRO 6000: 99 KiB, exactly two stages at head_dim 256), one otherwise.
AttentionPrefillTiles attention_prefill_tiles(const DeviceProps& props, int64_t head_dim) {
  const int hd = static_cast<int>(head_dim);
  for (int stages = 2; stages >= 1; --stages) {
    const size_t bytes = prefill_smem_bytes(hd, stages);
    if (bytes <= props.shared_mem_per_block_optin) {
      return {.kv_tile = prefill_kv_tile(hd), .stages = stages, .smem_bytes = bytes};
    }
  }
  return {.kv_tile = prefill_kv_tile(hd), .stages = 0, .smem_bytes = 0};
}

void paged_attention_prefill_launch(const DeviceContext& ctx, const PagedAttentionArgs& args) {
  const PrefillParams p{.a = args,
                        .group = static_cast<int>(args.n_heads / args.cache.n_kv_heads),
                        .log2_bs = log2_int(args.cache.block_size),
                        .scale_log2 = args.scale * kLog2e};
  const AttentionPrefillTiles tiles = attention_prefill_tiles(ctx.props(), args.cache.head_dim);
  switch (args.cache.head_dim) {
    case 32:
      prefill_launch_hd<32>(ctx, p, tiles);
      break;
    case 64:
      prefill_launch_hd<64>(ctx, p, tiles);
      break;
    case 128:
      prefill_launch_hd<128>(ctx, p, tiles);
      break;
    default:
      prefill_launch_hd<256>(ctx, p, tiles);
      break;
  }
  TERN_CUDA_CHECK_LAUNCH();
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t attention_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, paged_decode_reduce_kernel<128>);
}

}  // namespace tern
