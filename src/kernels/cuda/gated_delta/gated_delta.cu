// Gated DeltaNet kernels; contracts in gated_delta_launch.h.
//
// conv1d: one block per (sequence, channel tile); its threads split the sequence's rows into contiguous runs and
// slide a kernel-wide window in registers, so x is read once per output. The new conv state is written after a
// block barrier, once every thread has read the old one (the state is updated in place).
//
// Recurrent delta rule: one block per (sequence, value head, 32 value columns). The columns of S are independent
// (delta[e] and out[e] only involve column e), so each warp owns 8 columns with 4 lanes per column, each lane
// holding dk/4 rows of its column in registers, and the warps never wait for each other: per token a warp
// normalises q and k into its own shared-memory buffer, reduces S^T k and S^T q with two shuffles, and moves on.
// With the gated norm (GdnGatedNorm) they do wait: per token the block, then the cluster of the head's value slices,
// add the sums of squares before each column is normed.
//
// Speculative verification (GdnSequences::row_slots): each kernel also writes the state after every row of a
// verified sequence to that row's slot; the conv from its old window and the rows, the recurrent kernel after each
// token's update, the chunked kernel in an extra stage from the chunk's start state. That code is in separate
// instances (kVerify), launched only for calls with row_slots, so calls without them run exactly the plain kernels;
// in a call with row_slots, a sequence that is no verification pays a branch.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/ptx.cuh"

#include <algorithm>

#include "kernels/cuda/gated_delta/gated_delta_launch.h"

namespace tern {
namespace {

using cuda_common::bf16_to_f32;
using cuda_common::f32_to_bf16;
using cuda_common::sigmoid_f32;
using cuda_common::silu_f32;
using cuda_common::warp_sum;

// As the CPU path: accurate expf / log1pf (not the fast intrinsics; sigmoid_f32 and silu_f32 too), softplus with
// torch's threshold 20.
__device__ __forceinline__ float softplus_f32(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// A sequence's rows and slot, read from the device metadata. `valid` is false for metadata that would index out
// of bounds (a broken caller): such a sequence is skipped rather than corrupting memory.
struct SeqView {
  int64_t begin, len, slot;
  bool fresh, valid;
};

__device__ __forceinline__ SeqView seq_view(const GdnSequences& q, int64_t s) {
  SeqView v;
  v.begin = q.query_start[s];
  const int64_t end = q.query_start[s + 1];
  v.len = end - v.begin;
  v.slot = q.state_slot[s];
  v.fresh = q.seq_past[s] == 0;
  v.valid = v.begin >= 0 && v.len >= 0 && end <= q.tokens && v.slot >= 0;
  return v;
}

// Sequence s's row slots when it is a verification (GdnSequences::row_slots), else null.
__device__ __forceinline__ const int32_t* verify_slots(const GdnSequences& q, int64_t s) {
  if (q.row_slots == nullptr) return nullptr;
  const int32_t* slots = q.row_slots + s * q.max_rows;
  return slots[0] >= 0 ? slots : nullptr;
}

// ---------------------------------------------------------------------------------------------------------------
// conv1d + SiLU. Block = kConvThreads threads as (token lanes) x (channel tile); lanes = 1 for decode, up to 8 for
// long rows so a prefill has 8 runs in flight per channel. Loads are issued kConvBatch rows at a time so each
// thread keeps several independent loads in flight.

constexpr int kConvThreads = 256;
constexpr int kConvBatch = 8;

struct ConvParams {
  GdnConvArgs a;
  int lanes;    // token runs per channel
  int ch_tile;  // channels per block = kConvThreads / lanes
};

template <int kK, bool kVerify>
__global__ void __launch_bounds__(kConvThreads) gdn_conv1d_kernel(const ConvParams p) {
  ptx::grid_dependency_begin();
  constexpr int kHist = kK - 1;
  const GdnConvArgs& a = p.a;
  const SeqView sq = seq_view(a.seqs, blockIdx.x);
  if (!sq.valid) return;  // uniform over the block, before any barrier
  const int lane = threadIdx.x / p.ch_tile;
  const int64_t c = int64_t{blockIdx.y} * p.ch_tile + threadIdx.x % p.ch_tile;
  const bool active = c < a.channels;
  uint16_t* state = a.conv_state + (sq.slot * a.channels + c) * kHist;
  // Stage 1: the old state (bf16 bits, zeros for a new sequence), kept to the end because the update is in place.
  uint16_t old[kHist];
#pragma unroll
  for (int j = 0; j < kHist; ++j) old[j] = (active && !sq.fresh) ? state[j] : uint16_t{0};
  const uint16_t* x = a.x + sq.begin * a.x_stride + c;
  uint16_t* y = a.y + sq.begin * a.channels + c;
  // Stage 2: this lane's run of rows [t0, t1), the window seeded with the kHist inputs before t0.
  const int64_t run = (sq.len + p.lanes - 1) / p.lanes;
  const int64_t t0 = lane * run, t1 = min(sq.len, t0 + run);
  if (active && t0 < t1) {
    float w[kK], win[kK];
#pragma unroll
    for (int j = 0; j < kK; ++j) w[j] = a.weight[c * kK + j];
#pragma unroll
    for (int j = 0; j < kHist; ++j) {
      const int64_t pos = t0 - kHist + j;
      win[j] = bf16_to_f32(pos >= 0 ? x[pos * a.x_stride] : old[kHist + pos]);
    }
    for (int64_t t = t0; t < t1; t += kConvBatch) {
      float next[kConvBatch];
#pragma unroll
      for (int u = 0; u < kConvBatch; ++u) next[u] = t + u < t1 ? bf16_to_f32(x[(t + u) * a.x_stride]) : 0.0f;
#pragma unroll
      for (int u = 0; u < kConvBatch; ++u) {
        if (t + u >= t1) break;
        win[kHist] = next[u];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < kK; ++j) acc += w[j] * win[j];
        y[(t + u) * a.channels] = f32_to_bf16(silu_f32(acc));
#pragma unroll
        for (int j = 0; j < kHist; ++j) win[j] = win[j + 1];
      }
    }
  }
  // Stage 3: every thread has read the old state; lane 0 writes the last kHist inputs (older ones from the state).
  __syncthreads();
  if (active && lane == 0) {
#pragma unroll
    for (int j = 0; j < kHist; ++j) {
      const int64_t pos = sq.len - kHist + j;
      state[j] = pos >= 0 ? x[pos * a.x_stride] : old[kHist + pos];
    }
  }
  // Stage 4, verifications only: the window after row t (the kHist inputs ending at row t, older ones from old[])
  // into row slot t, for t < min(len, max_rows); the lanes take the rows in turn. The row slots are not the
  // sequence's slot, so stage 3's write cannot have changed what they copy.
  if constexpr (kVerify) {
    const int32_t* row_slots = verify_slots(a.seqs, blockIdx.x);
    if (active && row_slots != nullptr) {
      const int64_t rows = min(sq.len, a.seqs.max_rows);
      for (int64_t t = lane; t < rows; t += p.lanes) {
        const int64_t slot = row_slots[t];
        if (slot < 0) continue;  // a broken caller: skipped rather than written out of bounds
        uint16_t* row_state = a.conv_state + (slot * a.channels + c) * kHist;
#pragma unroll
        for (int j = 0; j < kHist; ++j) {
          const int64_t pos = t + 1 - kHist + j;
          row_state[j] = pos >= 0 ? x[pos * a.x_stride] : old[kHist + pos];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Recurrent delta rule.

constexpr int kSplit = 4;                                   // lanes per value column
constexpr int kColsPerWarp = 32 / kSplit;                   // 8
constexpr int kRecWarps = kGdnValueSlice / kColsPerWarp;    // 4
constexpr int kRecThreads = kRecWarps * 32;                 // 128

// Per-head constants of the gates: g = a_coef * softplus(a + dt_bias), a_coef = -exp(A_log).
struct HeadGates {
  float a_coef, dt_bias;
};

__device__ __forceinline__ HeadGates head_gates(const GdnDeltaRuleArgs& a, int64_t j) {
  return {-expf(a.a_log[j]), a.dt_bias[j]};
}

// The raw bf16 inputs of one token as one lane needs them: kPerLane elements of q and of k (d = lane + 32 u),
// the lane's v element, a and b.
template <int kPerLane>
struct TokenRaw {
  uint16_t q[kPerLane], k[kPerLane];
  uint16_t v, a, b;
};

template <int kPerLane>
__device__ __forceinline__ void token_load(TokenRaw<kPerLane>& r, const GdnDeltaRuleArgs& a, int64_t row,
                                           int64_t q_off, int64_t k_off, int64_t v_off, int64_t j, int lane) {
  const uint16_t* qkv = a.qkv + row * a.qkv_stride;
#pragma unroll
  for (int u = 0; u < kPerLane; ++u) {
    r.q[u] = qkv[q_off + lane + 32 * u];
    r.k[u] = qkv[k_off + lane + 32 * u];
  }
  r.v = qkv[v_off];
  r.a = a.a[row * a.ab_stride + j];
  r.b = a.b[row * a.ab_stride + j];
}

// l2-normalised q (times dk^-0.5) and k of one token into q_out[d], k_out[d], as layers/gated_deltanet.cc:
// x * (1 / sqrt(sum x^2 + 1e-6)), q then scaled. Called by a whole warp.
template <int kDk>
__device__ __forceinline__ void token_normalise(const TokenRaw<kDk / 32>& r, float* q_out, float* k_out, int lane) {
  constexpr int kPerLane = kDk / 32;
  float q[kPerLane], k[kPerLane], sq = 0.0f, sk = 0.0f;
#pragma unroll
  for (int u = 0; u < kPerLane; ++u) {
    q[u] = bf16_to_f32(r.q[u]);
    k[u] = bf16_to_f32(r.k[u]);
    sq += q[u] * q[u];
    sk += k[u] * k[u];
  }
  const float inv_q = 1.0f / sqrtf(warp_sum(sq) + 1e-6f), inv_k = 1.0f / sqrtf(warp_sum(sk) + 1e-6f);
  const float q_scale = 1.0f / sqrtf(static_cast<float>(kDk));
#pragma unroll
  for (int u = 0; u < kPerLane; ++u) {
    q_out[lane + 32 * u] = (q[u] * inv_q) * q_scale;
    k_out[lane + 32 * u] = k[u] * inv_k;
  }
}

// The gated norm of one token's head output o (every lane of a column holds it after the shuffles): the block's
// share of the sum of squares of bf16(o) goes to part[parity], the cluster (the head's value slices) syncs, and
// each block adds every block's share in rank order. Called by all threads of every block of the cluster.
__device__ __forceinline__ float gated_norm_inv(float o_rounded, int r, int warp, int lane, int parity,
                                                float (&warp_part)[2][kRecWarps], float (&part)[2], float dv,
                                                float eps) {
  namespace cg = cooperative_groups;
  float ss = r == 0 ? o_rounded * o_rounded : 0.0f;  // lanes 0..7: the warp's 8 columns once each
  ss = warp_sum(ss);
  if (lane == 0) warp_part[parity][warp] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float p = 0.0f;
#pragma unroll
    for (int w = 0; w < kRecWarps; ++w) p += warp_part[parity][w];
    part[parity] = p;
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  float total = 0.0f;
  for (unsigned rank = 0; rank < cluster.num_blocks(); ++rank) total += *cluster.map_shared_rank(&part[parity], rank);
  return 1.0f / sqrtf(total / dv + eps);
}

template <int kDk, bool kNorm, bool kVerify>
__global__ void __launch_bounds__(kRecThreads) gdn_recurrent_kernel(const GdnDeltaRuleArgs a) {
  ptx::grid_dependency_begin();
  // kNorm: per token parity, each warp's and the block's share of the head's sum of squares. The parities let one
  // cluster sync per token separate a token's writes from the previous token's remote reads.
  __shared__ float warp_part[kNorm ? 2 : 1][kNorm ? kRecWarps : 1];
  __shared__ float part[kNorm ? 2 : 1];
  constexpr int kRows = kDk / kSplit;  // rows of S per lane: d = i * kSplit + r
  constexpr int kPerLane = kDk / 32;
  // [warp][token parity][q | k][d]: double-buffered so one __syncwarp per token separates writes from reads.
  __shared__ float qk_s[kRecWarps][2][2][kDk];
  const SeqView sq = seq_view(a.seqs, blockIdx.x);
  if (!sq.valid) return;  // every block of a cluster has this sequence, so none is left waiting at its syncs
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / kColsPerWarp;
  const int64_t j = blockIdx.y, hv = a.n_value_heads, dv = a.value_dim;
  const int64_t e = int64_t{blockIdx.z} * kGdnValueSlice + warp * kColsPerWarp + lane % kColsPerWarp;
  const int64_t kh = j / (hv / a.n_key_heads);
  const int64_t q_off = kh * kDk, k_off = a.n_key_heads * kDk + kh * kDk, v_off = 2 * a.n_key_heads * kDk + j * dv + e;
  float* st = a.state + (sq.slot * hv + j) * kDk * dv + e;  // S[d][e] = st[d * dv]
  // kVerify: a verification writes S after each of its first row_count tokens to that token's row slot (0: none).
  const int32_t* row_slots = kVerify ? verify_slots(a.seqs, blockIdx.x) : nullptr;
  const int64_t row_count = row_slots == nullptr ? 0 : min(sq.len, a.seqs.max_rows);
  float s[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) s[i] = sq.fresh ? 0.0f : st[(i * kSplit + r) * dv];
  const HeadGates gates = head_gates(a, j);
  TokenRaw<kPerLane> next;
  if (sq.len > 0) token_load(next, a, sq.begin, q_off, k_off, v_off, j, lane);
  for (int64_t t = 0; t < sq.len; ++t) {
    const TokenRaw<kPerLane> cur = next;
    if (t + 1 < sq.len) token_load(next, a, sq.begin + t + 1, q_off, k_off, v_off, j, lane);  // in flight meanwhile
    float(*qk)[kDk] = qk_s[warp][t & 1];
    token_normalise<kDk>(cur, qk[0], qk[1], lane);
    __syncwarp();
    const float decay = expf(gates.a_coef * softplus_f32(bf16_to_f32(cur.a) + gates.dt_bias));
    const float beta = sigmoid_f32(bf16_to_f32(cur.b));
    // S = S * decay; kv = (S^T k)[e], summed over the 4 lanes of the column (lanes r * 8 + col).
    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      s[i] *= decay;
      kv += s[i] * qk[1][i * kSplit + r];
    }
    kv += __shfl_xor_sync(0xFFFFFFFFu, kv, kColsPerWarp);
    kv += __shfl_xor_sync(0xFFFFFFFFu, kv, 2 * kColsPerWarp);
    const float delta = beta * (bf16_to_f32(cur.v) - kv);
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      s[i] += qk[1][i * kSplit + r] * delta;
      o += s[i] * qk[0][i * kSplit + r];
    }
    o += __shfl_xor_sync(0xFFFFFFFFu, o, kColsPerWarp);
    o += __shfl_xor_sync(0xFFFFFFFFu, o, 2 * kColsPerWarp);
    if constexpr (kVerify) {
      if (t < row_count && row_slots[t] >= 0) {  // a negative slot (a broken caller) is skipped
        float* row_st = a.state + (int64_t{row_slots[t]} * hv + j) * kDk * dv + e;
#pragma unroll
        for (int i = 0; i < kRows; ++i) row_st[(i * kSplit + r) * dv] = s[i];
      }
    }
    const int64_t out_at = ((sq.begin + t) * hv + j) * dv + e;
    if constexpr (kNorm) {
      const float ob = bf16_to_f32(f32_to_bf16(o));  // the output as rms_norm would read it
      const float inv = gated_norm_inv(ob, r, warp, lane, static_cast<int>(t & 1), warp_part, part,
                                       static_cast<float>(dv), a.norm.eps);
      if (r == 0) {
        const float z = bf16_to_f32(a.norm.gate[(sq.begin + t) * a.norm.gate_stride + j * dv + e]);
        float y = (ob * inv) * bf16_to_f32(a.norm.weight[e]);
        y *= silu_f32(z);
        a.out[out_at] = f32_to_bf16(y);
      }
    } else {
      if (r == 0) a.out[out_at] = f32_to_bf16(o);
    }
  }
  // With the norm, no block may leave while another still reads its part (the last token's remote reads).
  if constexpr (kNorm) cooperative_groups::this_cluster().sync();
#pragma unroll
  for (int i = 0; i < kRows; ++i) st[(i * kSplit + r) * dv] = s[i];
}

// ---------------------------------------------------------------------------------------------------------------
// Chunked delta rule (the WY form of flash-linear-attention's chunk_gated_delta_rule, worked out for this
// recurrence). Within a chunk of n rows starting from state S0, with gamma_t = sum_{i<=t} g_i:
//   delta_t = beta_t (v_t - e^gamma_t S0^T k_t) - sum_{i<t} beta_t e^(gamma_t - gamma_i) (k_t.k_i) delta_i
//   o_t     = e^gamma_t S0^T q_t + sum_{i<=t} e^(gamma_t - gamma_i) (q_t.k_i) delta_i
//   S_end   = e^gamma_last S0 + sum_i e^(gamma_last - gamma_i) k_i delta_i^T
// The first line is a unit lower-triangular system, solved by forward substitution. Every exponent is <= 0 (g <= 0),
// so nothing overflows. One block per (sequence, value head, 32 value columns) walks the sequence's chunks in
// order with S0's slice in shared memory; all math is fp32 on CUDA cores. Rows past n are zero (k = v = beta = 0,
// g = 0), which makes them inert in every sum. Stages, each ended by a block barrier:
//   1 load and normalise q, k; v slice, g, beta        2 gamma (prefix sum), decay weights
//   3 A = the strictly lower beta e^.. (k.k) and R = beta (v - e^gamma K S0)    4 forward substitution R -> delta
//   5 P = the lower e^.. (q.k)          6 out = e^gamma Q S0 + P delta          7 S = e^gamma_last S0 + K^T W delta
// A verification (GdnSequences::row_slots) adds stage 6b before 7: S_t = e^gamma_t S0 + sum_{i<=t} e^(gamma_t -
// gamma_i) k_i delta_i^T for each of its rows t into the row's slot.

constexpr int kChunkThreads = 256;
constexpr int kChunkWarps = kChunkThreads / 32;
constexpr int kVLd = kGdnValueSlice + 4;  // row stride of the delta buffer (padding spreads banks)

template <int kDk, int kChunk>
struct ChunkLayout {  // offsets in floats into dynamic shared memory; all multiples of 4 for float4 access
  static constexpr int kLd = kDk + 4, kALd = kChunk + 4;
  static constexpr int kQ = 0, kK = kQ + kChunk * kLd, kS = kK + kChunk * kLd, kA = kS + kDk * kGdnValueSlice;
  static constexpr int kV = kA + kChunk * kALd, kGamma = kV + kChunk * kVLd, kBeta = kGamma + kChunk;
  static constexpr int kWeight = kBeta + kChunk, kFloats = kWeight + kChunk;
};

struct ChunkHead {  // what the stages need of the block's (sequence, head, slice)
  int64_t row0;     // first row of the current chunk
  int n;            // its rows
  int64_t q_off, k_off, v_off, j;
  HeadGates gates;
};

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// Stage 1: warp w takes rows w, w + 8, ...
template <int kDk, int kChunk>
__device__ void chunk_load(const GdnDeltaRuleArgs& a, const ChunkHead& h, float* sm) {
  using L = ChunkLayout<kDk, kChunk>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int t = warp; t < kChunk; t += kChunkWarps) {
    float *q = sm + L::kQ + t * L::kLd, *k = sm + L::kK + t * L::kLd, *v = sm + L::kV + t * kVLd;
    if (t >= h.n) {
      for (int d = lane; d < kDk; d += 32) q[d] = k[d] = 0.0f;
      v[lane] = 0.0f;
      if (lane == 0) sm[L::kGamma + t] = sm[L::kBeta + t] = 0.0f;
      continue;
    }
    TokenRaw<kDk / 32> raw;
    token_load(raw, a, h.row0 + t, h.q_off, h.k_off, h.v_off + lane, h.j, lane);
    token_normalise<kDk>(raw, q, k, lane);
    v[lane] = bf16_to_f32(raw.v);
    if (lane == 0) {
      sm[L::kGamma + t] = h.gates.a_coef * softplus_f32(bf16_to_f32(raw.a) + h.gates.dt_bias);
      sm[L::kBeta + t] = sigmoid_f32(bf16_to_f32(raw.b));
    }
  }
}

// Stage 2 (one thread; 64 adds): gamma in place, then the weights e^(gamma_last - gamma_i) of the state update.
template <int kDk, int kChunk>
__device__ void chunk_gamma(const ChunkHead& h, float* sm) {
  using L = ChunkLayout<kDk, kChunk>;
  float* gamma = sm + L::kGamma;
  for (int t = 1; t < kChunk; ++t) gamma[t] += gamma[t - 1];
  const float last = gamma[h.n - 1];
  for (int t = 0; t < kChunk; ++t) sm[L::kWeight + t] = t < h.n ? expf(last - gamma[t]) : 0.0f;
}

// Stages 3 and 5: a[t][i] = mask(t, i) * scale_t * e^(gamma_t - gamma_i) * (x_t . k_i), x = k (kStrict: i < t,
// scale beta) or q (i <= t, scale 1). A 16 x 16 thread grid, each thread a (kChunk/16)^2 tile of rows ty + 16 a,
// columns tx + 16 b.
template <int kDk, int kChunk, bool kStrict>
__device__ void chunk_gram(float* sm) {
  using L = ChunkLayout<kDk, kChunk>;
  constexpr int kT = kChunk / 16;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const float* x = sm + (kStrict ? L::kK : L::kQ);
  const float* k = sm + L::kK;
  float acc[kT][kT] = {};
  for (int d = 0; d < kDk; d += 4) {
    float4 xr[kT], kr[kT];
#pragma unroll
    for (int u = 0; u < kT; ++u) {
      xr[u] = ld4(x + (ty + 16 * u) * L::kLd + d);
      kr[u] = ld4(k + (tx + 16 * u) * L::kLd + d);
    }
#pragma unroll
    for (int u = 0; u < kT; ++u) {
#pragma unroll
      for (int w = 0; w < kT; ++w) {
        acc[u][w] += xr[u].x * kr[w].x + xr[u].y * kr[w].y + xr[u].z * kr[w].z + xr[u].w * kr[w].w;
      }
    }
  }
  const float* gamma = sm + L::kGamma;
#pragma unroll
  for (int u = 0; u < kT; ++u) {
    const int t = ty + 16 * u;
    const float scale = kStrict ? sm[L::kBeta + t] : 1.0f;
#pragma unroll
    for (int w = 0; w < kT; ++w) {
      const int i = tx + 16 * w;
      const bool keep = kStrict ? i < t : i <= t;
      sm[L::kA + t * L::kALd + i] = keep ? scale * expf(gamma[t] - gamma[i]) * acc[u][w] : 0.0f;
    }
  }
}

// (x_t . S0[:, e]) for the thread's rows t = tr + 32 a and columns e = 4 tc .. 4 tc + 3 (stages 3 and 6).
template <int kDk, int kChunk>
__device__ void chunk_times_state(const float* x, const float* sm, float (&acc)[kChunk / 32][4]) {
  using L = ChunkLayout<kDk, kChunk>;
  const int tr = threadIdx.x / 8, tc = threadIdx.x % 8;
  for (int d = 0; d < kDk; d += 4) {
    float4 s[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) s[u] = ld4(sm + L::kS + (d + u) * kGdnValueSlice + 4 * tc);
#pragma unroll
    for (int r = 0; r < kChunk / 32; ++r) {
      const float4 xv = ld4(x + (tr + 32 * r) * L::kLd + d);
      const float xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        acc[r][0] += xs[u] * s[u].x;
        acc[r][1] += xs[u] * s[u].y;
        acc[r][2] += xs[u] * s[u].z;
        acc[r][3] += xs[u] * s[u].w;
      }
    }
  }
}

// Stage 3b: R = beta_t (v_t - e^gamma_t (k_t . S0)), in place over v.
template <int kDk, int kChunk>
__device__ void chunk_residual(float* sm) {
  using L = ChunkLayout<kDk, kChunk>;
  const int tr = threadIdx.x / 8, tc = threadIdx.x % 8;
  float acc[kChunk / 32][4] = {};
  chunk_times_state<kDk, kChunk>(sm + L::kK, sm, acc);
#pragma unroll
  for (int r = 0; r < kChunk / 32; ++r) {
    const int t = tr + 32 * r;
    const float decay = expf(sm[L::kGamma + t]), beta = sm[L::kBeta + t];
    float* v = sm + L::kV + t * kVLd + 4 * tc;
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = beta * (v[c] - decay * acc[r][c]);
  }
}

// Stage 4: delta_t = R_t - sum_{i<t} A[t][i] delta_i, row by row. Warp w owns columns 4w .. 4w + 3; in a warp,
// lane = column * 8 + part, and part sums the i = part (mod 8). Only __syncwarp is needed: a column never leaves
// its warp.
template <int kDk, int kChunk>
__device__ void chunk_substitute(float* sm) {
  using L = ChunkLayout<kDk, kChunk>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, part = lane % 8;
  const int e = warp * 4 + lane / 8;
  float* v = sm + L::kV;
  for (int t = 1; t < kChunk; ++t) {
    const float* arow = sm + L::kA + t * L::kALd;
    float sum = 0.0f;
    for (int i = part; i < t; i += 8) sum += arow[i] * v[i * kVLd + e];
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 4);
    if (part == 0) v[t * kVLd + e] -= sum;
    __syncwarp();
  }
}

// Stage 6: out_t = e^gamma_t (q_t . S0) + sum_{i<=t} P[t][i] delta_i for the chunk's real rows.
template <int kDk, int kChunk>
__device__ void chunk_output(const GdnDeltaRuleArgs& a, const ChunkHead& h, int64_t e0, const float* sm) {
  using L = ChunkLayout<kDk, kChunk>;
  const int tr = threadIdx.x / 8, tc = threadIdx.x % 8;
  float acc[kChunk / 32][4] = {};
  chunk_times_state<kDk, kChunk>(sm + L::kQ, sm, acc);
#pragma unroll
  for (int r = 0; r < kChunk / 32; ++r) {
    const int t = tr + 32 * r;
    const float decay = expf(sm[L::kGamma + t]);
    float o[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) o[c] = decay * acc[r][c];
    for (int i = 0; i <= t; ++i) {
      const float p = sm[L::kA + t * L::kALd + i];
      const float4 dv = ld4(sm + L::kV + i * kVLd + 4 * tc);
      o[0] += p * dv.x;
      o[1] += p * dv.y;
      o[2] += p * dv.z;
      o[3] += p * dv.w;
    }
    if (t >= h.n) continue;
    uint16_t* out = a.out + ((h.row0 + t) * a.n_value_heads + h.j) * a.value_dim + e0 + 4 * tc;
#pragma unroll
    for (int c = 0; c < 4; ++c) out[c] = f32_to_bf16(o[c]);
  }
}

// Stage 7: S[d][e] = e^gamma_last S[d][e] + sum_i k_i[d] w_i delta_i[e], rows d = tr + 32 a, columns 4 tc ...
template <int kDk, int kChunk>
__device__ void chunk_state_update(const ChunkHead& h, float* sm) {
  using L = ChunkLayout<kDk, kChunk>;
  constexpr int kRows = kDk / 32;
  const int tr = threadIdx.x / 8, tc = threadIdx.x % 8;
  float acc[kRows][4] = {};
  for (int i = 0; i < h.n; ++i) {
    const float w = sm[L::kWeight + i];
    const float4 dv = ld4(sm + L::kV + i * kVLd + 4 * tc);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float kw = sm[L::kK + i * L::kLd + tr + 32 * r] * w;
      acc[r][0] += kw * dv.x;
      acc[r][1] += kw * dv.y;
      acc[r][2] += kw * dv.z;
      acc[r][3] += kw * dv.w;
    }
  }
  const float decay = expf(sm[L::kGamma + h.n - 1]);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float* s = sm + L::kS + (tr + 32 * r) * kGdnValueSlice + 4 * tc;
#pragma unroll
    for (int c = 0; c < 4; ++c) s[c] = decay * s[c] + acc[r][c];
  }
}

// Stage 6b, verifications only: S_t = e^gamma_t S0 + sum_{i<=t} e^(gamma_t - gamma_i) k_i delta_i^T for the chunk's
// rows t < rows into slot slots[t], with stage 7's thread layout and expressions (so the row that ends the chunk
// gets stage 7's values). Reads shared memory only, as stage 6 does, so the two need no barrier between them.
template <int kDk, int kChunk>
__device__ void chunk_row_states(const GdnDeltaRuleArgs& a, const int32_t* slots, int rows, int64_t j, int64_t e0,
                                 const float* sm) {
  using L = ChunkLayout<kDk, kChunk>;
  constexpr int kRows = kDk / 32;
  const int tr = threadIdx.x / 8, tc = threadIdx.x % 8;
  const float* gamma = sm + L::kGamma;
  const int64_t dv = a.value_dim;
  for (int t = 0; t < rows; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // a broken caller: skipped rather than written out of bounds
    float acc[kRows][4] = {};
    for (int i = 0; i <= t; ++i) {
      const float w = expf(gamma[t] - gamma[i]);
      const float4 dl = ld4(sm + L::kV + i * kVLd + 4 * tc);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float kw = sm[L::kK + i * L::kLd + tr + 32 * r] * w;
        acc[r][0] += kw * dl.x;
        acc[r][1] += kw * dl.y;
        acc[r][2] += kw * dl.z;
        acc[r][3] += kw * dl.w;
      }
    }
    const float decay = expf(gamma[t]);
    float* out = a.state + (slot * a.n_value_heads + j) * kDk * dv + e0 + 4 * tc;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float* s = sm + L::kS + (tr + 32 * r) * kGdnValueSlice + 4 * tc;
#pragma unroll
      for (int c = 0; c < 4; ++c) out[(tr + 32 * r) * dv + c] = decay * s[c] + acc[r][c];
    }
  }
}

template <int kDk, int kChunk, bool kVerify>
__global__ void __launch_bounds__(kChunkThreads) gdn_chunked_kernel(const GdnDeltaRuleArgs a) {
  ptx::grid_dependency_begin();
  using L = ChunkLayout<kDk, kChunk>;
  extern __shared__ float4 chunk_smem[];
  float* sm = reinterpret_cast<float*>(chunk_smem);
  const SeqView sq = seq_view(a.seqs, blockIdx.x);
  if (!sq.valid) return;
  const int64_t j = blockIdx.y, hv = a.n_value_heads, dv = a.value_dim, e0 = int64_t{blockIdx.z} * kGdnValueSlice;
  const int64_t kh = j / (hv / a.n_key_heads);
  ChunkHead h{.row0 = sq.begin, .n = 0, .q_off = kh * kDk, .k_off = a.n_key_heads * kDk + kh * kDk,
              .v_off = 2 * a.n_key_heads * kDk + j * dv + e0, .j = j, .gates = head_gates(a, j)};
  float* state = a.state + (sq.slot * hv + j) * kDk * dv + e0;
  const int32_t* row_slots = kVerify ? verify_slots(a.seqs, blockIdx.x) : nullptr;
  for (int i = threadIdx.x; i < kDk * kGdnValueSlice; i += kChunkThreads) {
    sm[L::kS + i] = sq.fresh ? 0.0f : state[(i / kGdnValueSlice) * dv + i % kGdnValueSlice];
  }
  for (int64_t c0 = 0; c0 < sq.len; c0 += kChunk) {
    h.row0 = sq.begin + c0;
    h.n = static_cast<int>(min(int64_t{kChunk}, sq.len - c0));
    chunk_load<kDk, kChunk>(a, h, sm);
    __syncthreads();
    if (threadIdx.x == 0) chunk_gamma<kDk, kChunk>(h, sm);
    __syncthreads();
    chunk_gram<kDk, kChunk, true>(sm);
    chunk_residual<kDk, kChunk>(sm);
    __syncthreads();
    chunk_substitute<kDk, kChunk>(sm);
    __syncthreads();
    chunk_gram<kDk, kChunk, false>(sm);
    __syncthreads();
    chunk_output<kDk, kChunk>(a, h, e0, sm);
    if constexpr (kVerify) {
      if (row_slots != nullptr && c0 < a.seqs.max_rows) {
        const int rows = static_cast<int>(min(int64_t{h.n}, a.seqs.max_rows - c0));
        chunk_row_states<kDk, kChunk>(a, row_slots + c0, rows, j, e0, sm);
      }
    }
    __syncthreads();
    chunk_state_update<kDk, kChunk>(h, sm);
    __syncthreads();
  }
  for (int i = threadIdx.x; i < kDk * kGdnValueSlice; i += kChunkThreads) {
    state[(i / kGdnValueSlice) * dv + i % kGdnValueSlice] = sm[L::kS + i];
  }
}

template <int kDk, int kChunk, bool kVerify>
void chunked_launch_instance(const DeviceContext& ctx, const GdnDeltaRuleArgs& args, dim3 grid) {
  const int bytes = static_cast<int>(gdn_chunked_smem_bytes(kDk, kChunk));
  TERN_CUDA_CHECK(cudaFuncSetAttribute(gdn_chunked_kernel<kDk, kChunk, kVerify>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  launch_kernel(ctx, gdn_chunked_kernel<kDk, kChunk, kVerify>, grid, dim3(kChunkThreads), bytes, args);
}

template <int kDk, int kChunk>
void chunked_launch(const DeviceContext& ctx, const GdnDeltaRuleArgs& args, dim3 grid) {
  if (args.seqs.row_slots != nullptr) {
    chunked_launch_instance<kDk, kChunk, true>(ctx, args, grid);
  } else {
    chunked_launch_instance<kDk, kChunk, false>(ctx, args, grid);
  }
}

template <int kChunk>
void chunked_dispatch(const DeviceContext& ctx, const GdnDeltaRuleArgs& args, dim3 grid) {
  switch (args.key_dim) {
    case 32: chunked_launch<32, kChunk>(ctx, args, grid); break;
    case 64: chunked_launch<64, kChunk>(ctx, args, grid); break;
    default: chunked_launch<128, kChunk>(ctx, args, grid); break;
  }
}

template <int kK>
void conv_launch(const DeviceContext& ctx, const ConvParams& p, dim3 grid) {
  if (p.a.seqs.row_slots != nullptr) {
    launch_kernel(ctx, gdn_conv1d_kernel<kK, true>, grid, dim3(kConvThreads), 0, p);
  } else {
    launch_kernel(ctx, gdn_conv1d_kernel<kK, false>, grid, dim3(kConvThreads), 0, p);
  }
}

int conv_lanes(int64_t max_query_len) {
  int lanes = 1;
  while (lanes < 8 && int64_t{lanes} * kConvBatch < max_query_len) lanes *= 2;
  return lanes;
}

}  // namespace

bool gdn_head_dim_supported(int64_t dim) { return dim == 32 || dim == 64 || dim == 128; }

int64_t gdn_chunked_smem_bytes(int64_t key_dim, int64_t chunk) {
  auto bytes = [](auto layout) { return int64_t{decltype(layout)::kFloats} * 4; };
  const bool long_chunk = chunk == 64;
  switch (key_dim) {
    case 32: return long_chunk ? bytes(ChunkLayout<32, 64>{}) : bytes(ChunkLayout<32, 32>{});
    case 64: return long_chunk ? bytes(ChunkLayout<64, 64>{}) : bytes(ChunkLayout<64, 32>{});
    default: return long_chunk ? bytes(ChunkLayout<128, 64>{}) : bytes(ChunkLayout<128, 32>{});
  }
}

int64_t gdn_chunked_chunk_len(const DeviceProps& props, int64_t key_dim) {
  // 64-row chunks halve the sequential chunk steps; they need ~109 KB at dk 128 (H100/H200/B200 have 227 KB per
  // block, an RTX PRO 6000 ~99 KB, which takes 32-row chunks at ~58 KB).
  const auto optin = static_cast<int64_t>(props.shared_mem_per_block_optin);
  if (!gdn_head_dim_supported(key_dim)) return 0;
  if (gdn_chunked_smem_bytes(key_dim, 64) <= optin) return 64;
  if (gdn_chunked_smem_bytes(key_dim, 32) <= optin) return 32;
  return 0;
}

void gdn_conv1d_launch(const DeviceContext& ctx, const GdnConvArgs& args) {
  const int lanes = conv_lanes(args.seqs.max_query_len);
  const ConvParams p{.a = args, .lanes = lanes, .ch_tile = kConvThreads / lanes};
  const dim3 grid(static_cast<unsigned>(args.seqs.n_seqs),
                  static_cast<unsigned>((args.channels + p.ch_tile - 1) / p.ch_tile));
  switch (args.kernel) {
    case 2: conv_launch<2>(ctx, p, grid); break;
    case 3: conv_launch<3>(ctx, p, grid); break;
    case 4: conv_launch<4>(ctx, p, grid); break;
    case 5: conv_launch<5>(ctx, p, grid); break;
    case 6: conv_launch<6>(ctx, p, grid); break;
    case 7: conv_launch<7>(ctx, p, grid); break;
    default: conv_launch<8>(ctx, p, grid); break;
  }
  TERN_CUDA_CHECK_LAUNCH();
}

// With the gated norm: a cluster of a head's value slices (grid z, 1 to 4 blocks), with programmatic launch where
// the context has it on.
template <int kDk, bool kVerify>
void launch_recurrent_norm(const DeviceContext& ctx, const GdnDeltaRuleArgs& args, dim3 grid) {
  cudaLaunchAttribute attrs[2]{};
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = 1;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = grid.z;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kRecThreads);
  config.stream = ctx.stream();
  config.attrs = attrs;
  config.numAttrs = ctx.programmatic_launch() ? 2 : 1;
  (void)cudaLaunchKernelEx(&config, gdn_recurrent_kernel<kDk, true, kVerify>, args);
}

template <int kDk>
void launch_recurrent(const DeviceContext& ctx, const GdnDeltaRuleArgs& args, dim3 grid) {
  const bool norm = args.norm.gate != nullptr, verify = args.seqs.row_slots != nullptr;
  if (norm && verify) {
    launch_recurrent_norm<kDk, true>(ctx, args, grid);
  } else if (norm) {
    launch_recurrent_norm<kDk, false>(ctx, args, grid);
  } else if (verify) {
    launch_kernel(ctx, gdn_recurrent_kernel<kDk, false, true>, grid, dim3(kRecThreads), 0, args);
  } else {
    launch_kernel(ctx, gdn_recurrent_kernel<kDk, false, false>, grid, dim3(kRecThreads), 0, args);
  }
}

void gdn_delta_rule_launch_recurrent(const DeviceContext& ctx, const GdnDeltaRuleArgs& args) {
  const dim3 grid(static_cast<unsigned>(args.seqs.n_seqs), static_cast<unsigned>(args.n_value_heads),
                  static_cast<unsigned>(args.value_dim / kGdnValueSlice));
  switch (args.key_dim) {
    case 32: launch_recurrent<32>(ctx, args, grid); break;
    case 64: launch_recurrent<64>(ctx, args, grid); break;
    default: launch_recurrent<128>(ctx, args, grid); break;
  }
  TERN_CUDA_CHECK_LAUNCH();
}

void gdn_delta_rule_launch_chunked(const DeviceContext& ctx, const GdnDeltaRuleArgs& args) {
  const dim3 grid(static_cast<unsigned>(args.seqs.n_seqs), static_cast<unsigned>(args.n_value_heads),
                  static_cast<unsigned>(args.value_dim / kGdnValueSlice));
  if (gdn_chunked_chunk_len(ctx.props(), args.key_dim) == 64) {
    chunked_dispatch<64>(ctx, args, grid);
  } else {
    chunked_dispatch<32>(ctx, args, grid);
  }
  TERN_CUDA_CHECK_LAUNCH();
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t gated_delta_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, gdn_conv1d_kernel<4, false>);
}

}  // namespace tern
