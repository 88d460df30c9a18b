// Paged attention decode of the GPU model path: the split-K tensor-core decode kernel, the reduce that merges its
// splits, and the device-dependent choice of stages and split count; contracts in attention_launch.h.
#include <algorithm>
#include <limits>

#include "kernels/cuda/attention/attention_device.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"

namespace tern {
namespace {

constexpr int kMaxGroup = 16;
static_assert(kMaxGroup == kAttentionMaxGroup);

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

// ---------------------------------------------------------------------------------------------------------------
// Decode (split-K flash decoding on tensor cores). Block (query row t and kv head, split), 4 warps; the group's G
// query heads are the 16 rows of the mma tiles (rows past G hold zero queries and are dropped at the end). The keys
// of the split's range are cut into chunks of 16 and warp w takes chunks w, w + 4, w + 8, ..., so a warp's loads and
// its online softmax need no block barrier. Per chunk:
//   K and V rows gathered with cp.async into the warp's own buffer (two stages where the shared memory allows: the
//   next chunk's rows are in flight while this one is computed), zero-filled past the range;
//   S = Q K^T (16 heads x 16 keys, fp32 accumulation of the exact bf16 products), keys past the range masked;
//   running max and sum per head in the log2 domain (scale * log2(e) applied to the fp32 scores);
//   O += P V with P split into a bf16 high part and a bf16 remainder (two mmas), so the probabilities keep about 16
//   significant bits, as close to the fp32 P of the CPU reference as the tolerance needs, where one bf16 P has 8.
// At the end the four warps' (max, sum, O) merge through shared memory in a fixed order (deterministic); one split
// writes `out`, several write partials for the reduce kernel.
// Shared memory: Q [16][hd + 8] bf16, then per warp and stage K [16][hd + 8] and V [16][hd + 8] bf16 (rows padded by
// 16 bytes so ldmatrix's eight row reads fall in distinct banks), then (max, sum) [4 warps][16][2] fp32. The merge
// reuses the K/V buffers as O [4 warps][16][hd + 8] fp32 (exactly one stage's size).

constexpr int kDecodeWarps = kAttentionDecodeWarps;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kDecodeKeys = kAttentionDecodeKeys;
static_assert(kDecodeKeys == 16, "a chunk is one k step of the P V mma and two n tiles of the S mma");
static_assert(kMaxGroup <= 16, "the group's heads are the 16 rows of one mma tile");

struct DecodeParams {
  PagedAttentionArgs a;
  int group;  // query heads per kv head
  int log2_bs;
  int n_splits;      // each query row's keys cut into this many equal ranges
  float scale_log2;  // scale * log2(e)
  float* partial;    // [tokens, n_heads, n_splits, head_dim] when n_splits > 1
  float* ml;         // [tokens, n_heads, n_splits, 2]: running max (log2 domain) and sum
};

size_t decode_smem_bytes(int head_dim, int stages) {
  const size_t row_bytes = static_cast<size_t>(head_dim + 8) * 2;
  const size_t kv_bytes = static_cast<size_t>(stages) * kDecodeWarps * 2 * kDecodeKeys * row_bytes;
  return 16 * row_bytes + kv_bytes + kDecodeWarps * 16 * 2 * sizeof(float);
}

// The sequence of query row t with its first row, row count and length, found from two guesses read together with
// their lengths: one query row per sequence (s = t) or the same count for all (s = t / max_query_len). Row t belongs
// to s exactly when query_start[s] <= t < query_start[s + 1], so a guess that passes is the answer, one round trip
// to memory; the binary search (a chain of dependent loads) runs only when neither does.
struct RowSequence {
  int s, q0, n_q, seq_len;
};

__device__ __forceinline__ RowSequence find_row_sequence(const PagedAttentionArgs& a, int t) {
  const int n_seqs = static_cast<int>(a.n_seqs), max_q = static_cast<int>(a.max_query_len);
  const int32_t* query_start = a.query_start;
  const int g0 = min(t, n_seqs - 1), g1 = min(t / max_q, n_seqs - 1);
  const int a0 = query_start[g0], b0 = query_start[g0 + 1], len0 = a.seq_lens[g0];
  const int a1 = query_start[g1], b1 = query_start[g1 + 1], len1 = a.seq_lens[g1];
  if (a0 <= t && t < b0) return {g0, a0, b0 - a0, len0};
  if (a1 <= t && t < b1) return {g1, a1, b1 - a1, len1};
  const int s = find_sequence(query_start, n_seqs, t);
  return {s, query_start[s], query_start[s + 1] - query_start[s], a.seq_lens[s]};
}

// Queues the cp.async copies of keys [key0, key0 + 16) of the kv head into k_s / v_s ([16][hd + 8] each, v_s right
// after k_s), zero-filled from k_end on. Lane l (and l + 16) looks up the slot of key l; the copies get it by shuffle.
template <int kHeadDim>
__device__ __forceinline__ void decode_load_chunk(const DecodeParams& p, const int32_t* table, int kvh, int key0,
                                                  int k_end, uint16_t* k_s) {
  constexpr int kLd = kHeadDim + 8, kPieces = kHeadDim / 8;
  const PagedKvCache& cache = p.a.cache;
  uint16_t* v_s = k_s + kDecodeKeys * kLd;
  const int lane = threadIdx.x % 32, key = key0 + lane % kDecodeKeys;
  const int slot =
      key < k_end ? __ldg(table + (key >> p.log2_bs)) * (1 << p.log2_bs) + (key & ((1 << p.log2_bs) - 1)) : 0;
#pragma unroll
  for (int it = 0; it < kDecodeKeys * kPieces / 32; ++it) {
    const int i = lane + 32 * it, r = i / kPieces, c = i % kPieces;
    const int slot_r = __shfl_sync(0xFFFFFFFFu, slot, r);
    const bool valid = key0 + r < k_end;
    const int64_t offset = (int64_t{slot_r} * cache.n_kv_heads + kvh) * kHeadDim + c * 8;
    cp_async_16_zfill(k_s + r * kLd + c * 8, cache.k + offset, valid);
    cp_async_16_zfill(v_s + r * kLd + c * 8, cache.v + offset, valid);
  }
}

// S = Q K^T: the 16 query rows against the chunk's 16 keys (two n tiles of 8).
template <int kHeadDim>
__device__ __forceinline__ void decode_scores(const uint16_t* q_s, const uint16_t* k_s, float (&s)[2][4]) {
  constexpr int kLd = kHeadDim + 8;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < kHeadDim; kk += 16) {
    uint32_t a[4], b[4];
    ldmatrix_x4(a, q_s + (lane % 16) * kLd + kk + (lane / 16) * 8);
    ldmatrix_x4(b, k_s + ((lane / 16) * 8 + lane % 8) * kLd + kk + ((lane / 8) % 2) * 8);
    mma_bf16_16816(s[0], a, {b[0], b[1]});
    mma_bf16_16816(s[1], a, {b[2], b[3]});
  }
}

// Range mask and the online softmax update of one chunk. A thread holds rows lane/4 (r = 0) and lane/4 + 8 (r = 1),
// keys 2 * (lane % 4) + {0, 1} of each n tile; a row's four lanes are a quad. l stays a per-thread partial sum.
template <int kHeadDim>
__device__ __forceinline__ void decode_softmax(float (&s)[2][4], float (&o)[kHeadDim / 8][4], float (&m)[2],
                                               float (&l)[2], int key0, int k_end, float scale_log2) {
  const int lane = threadIdx.x % 32;
  float mx[2] = {m[0], m[1]};
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + n * 8 + (lane % 4) * 2 + (e % 2);
      const float v = key < k_end ? s[n][e] * scale_log2 : -INFINITY;
      s[n][e] = v;
      mx[e / 2] = fmaxf(mx[e / 2], v);
    }
  }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xFFFFFFFFu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xFFFFFFFFu, mx[r], 2));
    base[r] = mx[r] == -INFINITY ? 0.0f : mx[r];  // (a chunk always holds a key; kept so -inf never meets -inf)
    const float corr = exp2f(m[r] - base[r]);     // 0 while m is -inf
    m[r] = mx[r];
    l[r] *= corr;
#pragma unroll
    for (int dn = 0; dn < kHeadDim / 8; ++dn) {
      o[dn][2 * r] *= corr;
      o[dn][2 * r + 1] *= corr;
    }
  }
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = exp2f(s[n][e] - base[e / 2]);
      l[e / 2] += s[n][e];
    }
  }
}

// bf16 pairs of (x, y) and of what their rounding left over.
__device__ __forceinline__ void split_bf16x2(float x, float y, uint32_t& hi, uint32_t& lo) {
  const uint16_t hx = f32_to_bf16(x), hy = f32_to_bf16(y);
  hi = uint32_t{hx} | (uint32_t{hy} << 16);
  lo = pack_bf16x2(x - bf16_to_f32(hx), y - bf16_to_f32(hy));
}

// O += P V for the chunk: P's accumulator fragments (keys 0..15) are the A operand of one k step; V through
// ldmatrix.trans.
template <int kHeadDim>
__device__ __forceinline__ void decode_pv(const float (&s)[2][4], const uint16_t* v_s, float (&o)[kHeadDim / 8][4]) {
  constexpr int kLd = kHeadDim + 8;
  const int lane = threadIdx.x % 32;
  uint32_t hi[4], lo[4];
  split_bf16x2(s[0][0], s[0][1], hi[0], lo[0]);
  split_bf16x2(s[0][2], s[0][3], hi[1], lo[1]);
  split_bf16x2(s[1][0], s[1][1], hi[2], lo[2]);
  split_bf16x2(s[1][2], s[1][3], hi[3], lo[3]);
#pragma unroll
  for (int dn = 0; dn < kHeadDim / 8; dn += 2) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, v_s + (((lane / 8) % 2) * 8 + lane % 8) * kLd + dn * 8 + (lane / 16) * 8);
    mma_bf16_16816(o[dn], hi, {b[0], b[1]});
    mma_bf16_16816(o[dn + 1], hi, {b[2], b[3]});
    mma_bf16_16816(o[dn], lo, {b[0], b[1]});
    mma_bf16_16816(o[dn + 1], lo, {b[2], b[3]});
  }
}

// The block's query row and key range.
struct DecodeRange {
  const int32_t* table;  // the sequence's block table row
  int k_begin, k_end;    // the split's keys (empty when k_begin == k_end)
};

__device__ __forceinline__ DecodeRange decode_range(const DecodeParams& p, int t, int split) {
  const PagedAttentionArgs& a = p.a;
  const RowSequence seq = find_row_sequence(a, t);
  const int position = seq.seq_len - seq.n_q + (t - seq.q0);
  const int n_keys = min(position + 1, static_cast<int>(a.max_blocks_per_seq << p.log2_bs));
  const int64_t split_len = max((n_keys + p.n_splits - 1) / p.n_splits, static_cast<int>(kDecodeMinSplitKeys));
  const int64_t begin = min(int64_t{split} * split_len, int64_t{n_keys});
  return {a.block_tables + int64_t{seq.s} * a.max_blocks_per_seq, static_cast<int>(begin),
          static_cast<int>(min(begin + split_len, int64_t{n_keys}))};
}

// The four warps' partial softmaxes merged per (head, dim); one split writes `out`, several their partials.
template <int kHeadDim>
__device__ __forceinline__ void decode_merge_store(const DecodeParams& p, const float* o_s, const float* ml_s,
                                                   int64_t head_row0, int split) {
  constexpr int kLd = kHeadDim + 8;
  const PagedAttentionArgs& a = p.a;
  for (int i = threadIdx.x; i < p.group * kHeadDim; i += kDecodeThreads) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    float big = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) big = fmaxf(big, ml_s[(w * 16 + g) * 2]);
    float o = 0.0f, l = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float m = ml_s[(w * 16 + g) * 2];
      if (m == -INFINITY) continue;  // a warp that saw no keys
      const float weight = exp2f(m - big);
      o += weight * o_s[(w * 16 + g) * kLd + d];
      l += weight * ml_s[(w * 16 + g) * 2 + 1];
    }
    const int64_t row = head_row0 + g;
    if (p.n_splits == 1) {
      float y = l > 0.0f ? o / l : 0.0f;
      if (a.gate != nullptr) y *= sigmoid_f32(bf16_to_f32(a.gate[row * kHeadDim + d]));
      a.out[row * kHeadDim + d] = f32_to_bf16(y);
    } else {
      const int64_t part = row * p.n_splits + split;
      p.partial[part * kHeadDim + d] = o;
      if (d == 0) {
        p.ml[2 * part] = big;
        p.ml[2 * part + 1] = l;
      }
    }
  }
}

template <int kHeadDim, int kStages>
__global__ void __launch_bounds__(kDecodeThreads) paged_decode_kernel(const DecodeParams p) {
  ptx::grid_dependency_begin();
  constexpr int kLd = kHeadDim + 8, kPieces = kHeadDim / 8, kStageElems = 2 * kDecodeKeys * kLd;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* q_s = smem;                                                                 // [16][kLd]
  uint16_t* kv_s = smem + 16 * kLd;                                                     // [warp][stage][K|V][16][kLd]
  float* ml_s = reinterpret_cast<float*>(kv_s + kDecodeWarps * kStages * kStageElems);  // [warp][16][2]
  const PagedAttentionArgs& a = p.a;
  const int n_kv = static_cast<int>(a.cache.n_kv_heads), G = p.group;
  const int t = static_cast<int>(blockIdx.x / n_kv), kvh = static_cast<int>(blockIdx.x % n_kv), split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const DecodeRange range = decode_range(p, t, split);
  const int64_t head_row0 = int64_t{t} * a.n_heads + int64_t{kvh} * G;  // row of the group's first query head
  const int n_chunks = (range.k_end - range.k_begin + kDecodeKeys - 1) / kDecodeKeys;
  const int n_mine = n_chunks > warp ? (n_chunks - warp + kDecodeWarps - 1) / kDecodeWarps : 0;
  uint16_t* my_kv = kv_s + warp * kStages * kStageElems;
  const auto key0_of = [&](int j) { return range.k_begin + (warp + j * kDecodeWarps) * kDecodeKeys; };

  // The warp's first chunk in flight, then the G query rows (zero rows up to 16) into shared memory.
  if (n_mine > 0) decode_load_chunk<kHeadDim>(p, range.table, kvh, key0_of(0), range.k_end, my_kv);
  cp_async_commit();
  for (int i = threadIdx.x; i < 16 * kPieces; i += kDecodeThreads) {
    const int g = i / kPieces, c = i % kPieces;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (g < G) v = __ldg(reinterpret_cast<const uint4*>(a.q + (head_row0 + g) * kHeadDim) + c);
    *reinterpret_cast<uint4*>(q_s + g * kLd + c * 8) = v;
  }
  __syncthreads();

  float o[kPieces][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  for (int j = 0; j < n_mine; ++j) {
    if constexpr (kStages == 2) {  // chunk j + 1 into the other buffer, then wait for chunk j only
      if (j + 1 < n_mine) {
        decode_load_chunk<kHeadDim>(p, range.table, kvh, key0_of(j + 1), range.k_end,
                                    my_kv + ((j + 1) % 2) * kStageElems);
      }
      cp_async_commit();  // always, so one group per step stays the count wait_group<1> relies on
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();  // every lane's copies of chunk j are visible to the warp
    const uint16_t* k_c = my_kv + (j % kStages) * kStageElems;
    float s[2][4];
    decode_scores<kHeadDim>(q_s, k_c, s);
    decode_softmax<kHeadDim>(s, o, m, l, key0_of(j), range.k_end, p.scale_log2);
    decode_pv<kHeadDim>(s, k_c + kDecodeKeys * kLd, o);
    __syncwarp();  // every lane is done reading the buffer before the next copies into it are queued
    if constexpr (kStages == 1) {
      if (j + 1 < n_mine) {
        decode_load_chunk<kHeadDim>(p, range.table, kvh, key0_of(j + 1), range.k_end, my_kv);
        cp_async_commit();
      }
    }
  }
  cp_async_wait<0>();

  // Each warp's rows (heads < G) into shared memory over the K/V buffers, once every warp is done with them.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xFFFFFFFFu, l[r], 1);
    l[r] += __shfl_xor_sync(0xFFFFFFFFu, l[r], 2);
  }
  __syncthreads();
  float* o_s = reinterpret_cast<float*>(kv_s);  // [warp][16][kLd] fp32
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = lane / 4 + 8 * r;
    if (row >= G) continue;
    float* dst = o_s + (warp * 16 + row) * kLd + (lane % 4) * 2;
#pragma unroll
    for (int dn = 0; dn < kPieces; ++dn) {
      *reinterpret_cast<float2*>(dst + dn * 8) = make_float2(o[dn][2 * r], o[dn][2 * r + 1]);
    }
    if (lane % 4 == 0) {
      ml_s[(warp * 16 + row) * 2] = m[r];
      ml_s[(warp * 16 + row) * 2 + 1] = l[r];
    }
  }
  __syncthreads();
  decode_merge_store<kHeadDim>(p, o_s, ml_s, head_row0, split);
}

// Merges the splits of each (token, head) row: a thread owns 4 dims of one row and folds the splits in batches of
// kReduceBatch (their loads all in flight at once) into a running max M, sum and output, each batch rescaled by
// 2^(M_old - M_new); a split that saw no keys has m_s = -inf and weight 0. A decode step of few tokens has few rows,
// so the merge is bound by load latency, not bytes: batching the splits' loads is what keeps it short.
constexpr int kReduceThreads = 128;
constexpr int kReduceBatch = 16;

template <int kHeadDim>
__global__ void __launch_bounds__(kReduceThreads) paged_decode_reduce_kernel(const DecodeParams p) {
  ptx::grid_dependency_begin();
  constexpr int kVecs = kHeadDim / 4, kRowsPerBlock = kReduceThreads / kVecs;
  const int64_t row = int64_t{blockIdx.x} * kRowsPerBlock + threadIdx.x / kVecs;
  if (row >= p.a.tokens * p.a.n_heads) return;
  const int v = threadIdx.x % kVecs, n = p.n_splits;
  const float2* ml = reinterpret_cast<const float2*>(p.ml) + row * n;
  const float4* part = reinterpret_cast<const float4*>(p.partial + row * n * kHeadDim) + v;
  float big = -INFINITY, sum = 0.0f;
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int s0 = 0; s0 < n; s0 += kReduceBatch) {
    float2 m_l[kReduceBatch];
    float4 x[kReduceBatch];
#pragma unroll
    for (int i = 0; i < kReduceBatch; ++i) {
      const bool in = s0 + i < n;
      m_l[i] = in ? ml[s0 + i] : make_float2(-INFINITY, 0.0f);
      x[i] = in ? part[(s0 + i) * kVecs] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float top = big;
#pragma unroll
    for (int i = 0; i < kReduceBatch; ++i) top = fmaxf(top, m_l[i].x);
    if (top == -INFINITY) continue;
    const float r = exp2f(big - top);  // 0 while nothing was folded in (big = -inf)
    sum *= r;
    o = make_float4(o.x * r, o.y * r, o.z * r, o.w * r);
#pragma unroll
    for (int i = 0; i < kReduceBatch; ++i) {
      if (m_l[i].x == -INFINITY) continue;
      const float w = exp2f(m_l[i].x - top);
      sum += w * m_l[i].y;
      o = make_float4(o.x + w * x[i].x, o.y + w * x[i].y, o.z + w * x[i].z, o.w + w * x[i].w);
    }
    big = top;
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  float y[4] = {o.x * inv, o.y * inv, o.z * inv, o.w * inv};
  const int64_t e = row * kHeadDim + 4 * v;
  if (p.a.gate != nullptr) {
    const uint2 g = *reinterpret_cast<const uint2*>(p.a.gate + e);
    y[0] *= sigmoid_f32(bf16_to_f32(static_cast<uint16_t>(g.x & 0xFFFFu)));
    y[1] *= sigmoid_f32(bf16_to_f32(static_cast<uint16_t>(g.x >> 16)));
    y[2] *= sigmoid_f32(bf16_to_f32(static_cast<uint16_t>(g.y & 0xFFFFu)));
    y[3] *= sigmoid_f32(bf16_to_f32(static_cast<uint16_t>(g.y >> 16)));
  }
  *reinterpret_cast<uint2*>(p.a.out + e) = make_uint2(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]));
}

template <int kHeadDim, int kStages>
void decode_launch_tiles(const DeviceContext& ctx, const DecodeParams& p, size_t smem) {
  auto* kernel = paged_decode_kernel<kHeadDim, kStages>;
  TERN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>(p.a.tokens * p.a.cache.n_kv_heads), static_cast<unsigned>(p.n_splits));
  launch_kernel(ctx, kernel, grid, dim3(kDecodeThreads), smem, p);
}

template <int kHeadDim>
void decode_launch_hd(const DeviceContext& ctx, const DecodeParams& p, const AttentionDecodeTiles& tiles) {
  if (tiles.stages == 2) {
    decode_launch_tiles<kHeadDim, 2>(ctx, p, tiles.smem_bytes);
  } else {
    decode_launch_tiles<kHeadDim, 1>(ctx, p, tiles.smem_bytes);
  }
  if (p.n_splits > 1) {
    const int64_t rows = p.a.tokens * p.a.n_heads, rows_per_block = kReduceThreads / (kHeadDim / 4);
    const auto blocks = static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block);
    launch_kernel(ctx, paged_decode_reduce_kernel<kHeadDim>, dim3(blocks), dim3(kReduceThreads), 0, p);
  }
}

// Registers per thread of paged_decode_kernel (the larger of its two stage counts) as ptxas reports them for sm_90a,
// rounded up to 8, for the occupancy the split count plans with: 64, 96, 128 and 170.
constexpr int decode_registers(int head_dim) {
  return head_dim <= 32 ? 64 : head_dim <= 64 ? 96 : head_dim <= 128 ? 128 : 176;
}

constexpr size_t kSmemReservedPerBlock = 1024;  // what the driver keeps per resident block (sm_80 and later)

}  // namespace

void paged_attention_decode_launch(const DeviceContext& ctx, const PagedAttentionArgs& args) {
  const int64_t hd = args.cache.head_dim;
  DecodeParams p{.a = args,
                 .group = static_cast<int>(args.n_heads / args.cache.n_kv_heads),
                 .log2_bs = log2_int(args.cache.block_size),
                 .n_splits = static_cast<int>(attention_decode_splits(ctx.props(), hd, args.tokens, args.n_heads,
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
  const AttentionDecodeTiles tiles = attention_decode_tiles(ctx.props(), hd);
  switch (hd) {
    case 32:
      decode_launch_hd<32>(ctx, p, tiles);
      break;
    case 64:
      decode_launch_hd<64>(ctx, p, tiles);
      break;
    case 128:
      decode_launch_hd<128>(ctx, p, tiles);
      break;
    default:
      decode_launch_hd<256>(ctx, p, tiles);
      break;
  }
  TERN_CUDA_CHECK_LAUNCH();
}

// Two stages per warp where the opt-in shared memory allows it (H200: every head_dim, 145 KiB at 256; RTX PRO 6000:
// up to head_dim 128), one otherwise (the other warps' loads still overlap a warp's math).
AttentionDecodeTiles attention_decode_tiles(const DeviceProps& props, int64_t head_dim) {
  const int hd = static_cast<int>(head_dim);
  for (int stages = 2; stages >= 1; --stages) {
    const size_t bytes = decode_smem_bytes(hd, stages);
    if (bytes > props.shared_mem_per_block_optin) continue;
    const size_t per_sm = props.shared_mem_per_sm > 0 ? props.shared_mem_per_sm : props.shared_mem_per_block_optin;
    int blocks = static_cast<int>(per_sm / (bytes + kSmemReservedPerBlock));
    if (props.regs_per_sm > 0) blocks = std::min(blocks, props.regs_per_sm / (decode_registers(hd) * kDecodeThreads));
    blocks = std::min(blocks, props.max_threads_per_sm > 0 ? props.max_threads_per_sm / kDecodeThreads : 16);
    return {.stages = stages, .smem_bytes = bytes, .blocks_per_sm = std::max(blocks, 1)};
  }
  return {.stages = 0, .smem_bytes = 0, .blocks_per_sm = 0};
}

namespace {

// Decode blocks resident on the whole device at once.
int64_t decode_slots(const DeviceProps& props, int64_t head_dim) {
  return int64_t{std::max(props.num_sms, 1)} * std::max(attention_decode_tiles(props, head_dim).blocks_per_sm, 1);
}

}  // namespace

// About three waves of blocks at most, and at least kDecodeMinSplitKeys keys per range at max_seq_len. It never grows
// with tokens * n_kv_heads and never shrinks with max_seq_len, which paged_attention_workspace_bytes relies on.
int64_t attention_decode_max_splits(const DeviceProps& props, int64_t head_dim, int64_t tokens, int64_t n_kv_heads,
                                    int64_t max_seq_len) {
  const int64_t base = std::max<int64_t>(tokens * n_kv_heads, 1);
  const int64_t fill = (3 * decode_slots(props, head_dim) + base - 1) / base;
  const int64_t most = (max_seq_len + kDecodeMinSplitKeys - 1) / kDecodeMinSplitKeys;
  return std::clamp<int64_t>(std::min(fill, most), 1, 65535);
}

// Cost of n splits in key rows streamed per block slot: waves(n) * (keys per range + a block's fixed cost, taken as
// kDecodeMinSplitKeys keys), plus for n > 1 the partials (2 * group fp32 rows per split, written and read back: the
// bytes of 2 * group key rows of K and V) spread over the slots and the reduce launch. Integer math: the host
// computations of the launcher and of the workspace size agree exactly.
int64_t attention_decode_splits(const DeviceProps& props, int64_t head_dim, int64_t tokens, int64_t n_heads,
                                int64_t n_kv_heads, int64_t max_seq_len) {
  const int64_t slots = decode_slots(props, head_dim), base = std::max<int64_t>(tokens * n_kv_heads, 1);
  const int64_t group = std::max<int64_t>(n_heads / std::max<int64_t>(n_kv_heads, 1), 1);
  const int64_t keys = std::max<int64_t>(max_seq_len, 1);
  const int64_t top = attention_decode_max_splits(props, head_dim, tokens, n_kv_heads, max_seq_len);
  int64_t best = 1, best_cost = std::numeric_limits<int64_t>::max();
  for (int64_t n = 1; n <= top; ++n) {
    const int64_t waves = (base * n + slots - 1) / slots;
    int64_t cost = waves * ((keys + n - 1) / n + kDecodeMinSplitKeys);
    if (n > 1) cost += (base * n * 2 * group + slots - 1) / slots + kDecodeMinSplitKeys;
    if (cost < best_cost) {
      best = n;
      best_cost = cost;
    }
  }
  return best;
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t attention_decode_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, paged_decode_reduce_kernel<128>);
}

}  // namespace tern
