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
// Chunked delta rule: the WY form of flash-linear-attention's chunk_gated_delta_rule, worked out for this
// recurrence. Within a chunk of n rows that starts from state S0, with gamma_t = sum_{i<=t} g_i:
//   A[t][i] = beta_t e^(gamma_t - gamma_i) (k_t . k_i) for i < t                  (strictly lower triangular)
//   (I + A) [W | U] = [diag(beta e^gamma) K | diag(beta) V]                       (forward substitution)
//   delta = U - W S0                                  (= beta_t (v_t - e^gamma_t S0^T k_t) - sum_{i<t} A[t][i] delta_i)
//   P[t][i] = e^(gamma_t - gamma_i) (q_t . k_i) for i <= t
//   o_t = e^gamma_t (q_t . S0) + sum_{i<=t} P[t][i] delta_i
//   S_end = e^gamma_last S0 + sum_i e^(gamma_last - gamma_i) k_i delta_i^T
// Every exponent is <= 0 (g <= 0), so nothing overflows. All but the last three lines are independent of S0, so two
// kernels: the prepare kernel (one block per (sequence, chunk, value head), every chunk at once) computes the
// normalised q and k, W, U, P and gamma into the workspace (GdnDeltaRuleArgs::workspace); the walk kernel (one block
// per (sequence, value head, 32 value columns)) takes the sequence's chunks in order with S's slice in shared
// memory: delta, the outputs, S. All math is fp32 on CUDA cores. Rows past n are zero (q = k = v = beta = 0, g = 0):
// inert in every sum, and never written.
// A verification (GdnSequences::row_slots) also writes S_t = e^gamma_t S0 + sum_{i<=t} e^(gamma_t - gamma_i) k_i
// delta_i^T for each of its rows t into the row's slot.

constexpr int kChunkThreads = 256;  // the prepare kernel's block
constexpr int kChunkWarps = kChunkThreads / 32;
// The walk kernel's block: thread (tr, tc) = (tid / 8, tid % 8) takes rows tr, tr + kWalkRowStep, ... and value
// columns 4 tc .. 4 tc + 3. (512 threads, twice the warps for the one block an SM gets at one sequence, measured
// 8% slower: docs/perf/gpu.md "Gated DeltaNet prefill in two kernels".)
constexpr int kWalkThreads = 256;
constexpr int kWalkRowStep = kWalkThreads / 8;
constexpr int kVLd = kGdnValueSlice + 4;  // row stride of the delta buffer (padding spreads banks)
constexpr int kMaxValueDim = 128;         // gdn_head_dim_supported

// The workspace, indexed by token row (a chunk's rows are its sequence's rows): per key head the normalised q (times
// dk^-0.5) and k; per value head W, U, P's row and gamma. Sections in this order, each a multiple of 4 floats but
// the last.
struct ChunkWorkspace {
  float *qk, *w, *u, *p, *gamma;
  int64_t p_ld;  // floats per P row: the chunk length
};

// The sections' offsets in floats, and the floats of all of them (end): the one definition of the layout, for the
// kernels' pointers and gdn_chunked_workspace_bytes.
struct ChunkWorkspaceOffsets {
  int64_t qk, w, u, p, gamma, end;
};

__host__ __device__ inline ChunkWorkspaceOffsets chunk_workspace_offsets(int64_t tokens, int64_t hk, int64_t hv,
                                                                         int64_t dk, int64_t dv, int64_t chunk) {
  ChunkWorkspaceOffsets o;
  o.qk = 0;
  o.w = o.qk + tokens * hk * 2 * dk;
  o.u = o.w + tokens * hv * dk;
  o.p = o.u + tokens * hv * dv;
  o.gamma = o.p + tokens * hv * chunk;
  o.end = o.gamma + tokens * hv;
  return o;
}

__device__ __forceinline__ ChunkWorkspace chunk_workspace(const GdnDeltaRuleArgs& a, int64_t chunk) {
  const ChunkWorkspaceOffsets o =
      chunk_workspace_offsets(a.seqs.tokens, a.n_key_heads, a.n_value_heads, a.key_dim, a.value_dim, chunk);
  float* base = a.workspace;
  return {.qk = base + o.qk, .w = base + o.w, .u = base + o.u, .p = base + o.p, .gamma = base + o.gamma,
          .p_ld = chunk};
}

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// Inclusive prefix sum of x[0, n) in place by one warp (n <= 64).
__device__ __forceinline__ void warp_prefix_sum(float* x, int n) {
  const int lane = threadIdx.x % 32;
  float carry = 0.0f;
  for (int base = 0; base < n; base += 32) {
    float v = base + lane < n ? x[base + lane] : 0.0f;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const float other = __shfl_up_sync(0xFFFFFFFFu, v, d);
      if (lane >= d) v += other;
    }
    if (base + lane < n) x[base + lane] = carry + v;
    carry += __shfl_sync(0xFFFFFFFFu, v, 31);
  }
}

// Shared memory of the prepare kernel, in floats: R0 holds q, later v; R1 k, later nothing (the substitution's
// columns live in registers).
template <int kDk, int kChunk>
struct PrepareLayout {
  static constexpr int kR0Ld = (kDk > kMaxValueDim ? kDk : kMaxValueDim) + 4, kLd = kDk + 4, kALd = kChunk + 4;
  static constexpr int kR0 = 0, kR1 = kR0 + kChunk * kR0Ld, kA = kR1 + kChunk * kLd, kGamma = kA + kChunk * kALd;
  static constexpr int kBeta = kGamma + kChunk, kFloats = kBeta + kChunk;
};

template <int kDk, int kChunk>
__global__ void __launch_bounds__(kChunkThreads) gdn_chunk_prepare_kernel(const GdnDeltaRuleArgs a) {
  ptx::grid_dependency_begin();
  using L = PrepareLayout<kDk, kChunk>;
  constexpr int kVPerLane = kMaxValueDim / 32;
  extern __shared__ float4 chunk_smem[];
  float* sm = reinterpret_cast<float*>(chunk_smem);
  const SeqView sq = seq_view(a.seqs, blockIdx.x);
  const int64_t c0 = int64_t{blockIdx.y} * kChunk;
  if (!sq.valid || c0 >= sq.len) return;
  const int n = static_cast<int>(min(int64_t{kChunk}, sq.len - c0));
  const int64_t j = blockIdx.z, hv = a.n_value_heads, hk = a.n_key_heads, dv = a.value_dim;
  const int64_t group = hv / hk, kh = j / group, row0 = sq.begin + c0;
  const ChunkWorkspace ws = chunk_workspace(a, kChunk);
  const HeadGates gates = head_gates(a, j);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float *q_s = sm + L::kR0, *k_s = sm + L::kR1, *a_s = sm + L::kA, *gamma = sm + L::kGamma, *beta = sm + L::kBeta;
  const int64_t v_off = 2 * hk * kDk + j * dv;

  // Stage 1 (warp w: rows w, w + 8, ...): q and k normalised, g and beta; the first value head of a key head writes
  // q and k out for the walk. The lane's v values wait in registers until R0 is free.
  float v_regs[kChunk / kChunkWarps][kVPerLane];
#pragma unroll
  for (int r = 0; r < kChunk / kChunkWarps; ++r) {
    const int t = warp + r * kChunkWarps;
    float *q = q_s + t * L::kR0Ld, *k = k_s + t * L::kLd;
    if (t >= n) {
      for (int d = lane; d < kDk; d += 32) q[d] = k[d] = 0.0f;
#pragma unroll
      for (int u = 0; u < kVPerLane; ++u) v_regs[r][u] = 0.0f;
      if (lane == 0) gamma[t] = beta[t] = 0.0f;
      continue;
    }
    const int64_t row = row0 + t;
    TokenRaw<kDk / 32> raw;
    token_load(raw, a, row, kh * kDk, hk * kDk + kh * kDk, v_off + lane, j, lane);
#pragma unroll
    for (int u = 0; u < kVPerLane; ++u) {
      v_regs[r][u] = lane + 32 * u < dv ? bf16_to_f32(a.qkv[row * a.qkv_stride + v_off + lane + 32 * u]) : 0.0f;
    }
    token_normalise<kDk>(raw, q, k, lane);  // each lane writes (and below reads) its own d = lane + 32 u
    if (j % group == 0) {
      float* out = ws.qk + (row * hk + kh) * 2 * kDk;
      for (int d = lane; d < kDk; d += 32) {
        out[d] = q[d];
        out[kDk + d] = k[d];
      }
    }
    if (lane == 0) {
      gamma[t] = gates.a_coef * softplus_f32(bf16_to_f32(raw.a) + gates.dt_bias);
      beta[t] = sigmoid_f32(bf16_to_f32(raw.b));
    }
  }
  __syncthreads();
  if (warp == 0) warp_prefix_sum(gamma, kChunk);
  __syncthreads();

  // Stage 2: both Gram matrices in one pass over d; a 16 x 16 thread grid, each thread rows ty + 16 u and columns
  // tx + 16 w. P goes to the workspace, A to shared memory.
  {
    constexpr int kT = kChunk / 16;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    float acc_q[kT][kT] = {}, acc_k[kT][kT] = {};
    for (int d = 0; d < kDk; d += 4) {
      float4 qr[kT], kr[kT], kc[kT];
#pragma unroll
      for (int u = 0; u < kT; ++u) {
        qr[u] = ld4(q_s + (ty + 16 * u) * L::kR0Ld + d);
        kr[u] = ld4(k_s + (ty + 16 * u) * L::kLd + d);
        kc[u] = ld4(k_s + (tx + 16 * u) * L::kLd + d);
      }
#pragma unroll
      for (int u = 0; u < kT; ++u) {
#pragma unroll
        for (int w = 0; w < kT; ++w) {
          acc_q[u][w] += qr[u].x * kc[w].x + qr[u].y * kc[w].y + qr[u].z * kc[w].z + qr[u].w * kc[w].w;
          acc_k[u][w] += kr[u].x * kc[w].x + kr[u].y * kc[w].y + kr[u].z * kc[w].z + kr[u].w * kc[w].w;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kT; ++u) {
      const int t = ty + 16 * u;
      float* p_row = ws.p + ((row0 + t) * hv + j) * ws.p_ld;
#pragma unroll
      for (int w = 0; w < kT; ++w) {
        const int i = tx + 16 * w;
        const float decay = expf(gamma[t] - gamma[i]);  // only used where i <= t, so <= 1
        a_s[t * L::kALd + i] = i < t ? beta[t] * decay * acc_k[u][w] : 0.0f;
        if (t < n) p_row[i] = i <= t ? decay * acc_q[u][w] : 0.0f;
      }
    }
  }
  __syncthreads();  // q is read, A is complete

  // Stage 3: v into R0 (where q was).
#pragma unroll
  for (int r = 0; r < kChunk / kChunkWarps; ++r) {
    const int t = warp + r * kChunkWarps;
#pragma unroll
    for (int u = 0; u < kVPerLane; ++u) q_s[t * L::kR0Ld + lane + 32 * u] = v_regs[r][u];
  }
  __syncthreads();

  // Stage 4: thread c owns column c of [diag(beta e^gamma) K | diag(beta) V] in registers and solves (I + A) X = it
  // by forward substitution; then W and U to the workspace, and gamma.
  const int col = threadIdx.x;
  if (col < kDk + dv) {
    const bool is_k = col < kDk;
    float x[kChunk];
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      x[t] = is_k ? k_s[t * L::kLd + col] * (beta[t] * expf(gamma[t])) : q_s[t * L::kR0Ld + col - kDk] * beta[t];
    }
#pragma unroll
    for (int t = 1; t < kChunk; ++t) {
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < t; ++i) s += a_s[t * L::kALd + i] * x[i];
      x[t] -= s;
    }
    float* dst = is_k ? ws.w + j * kDk + col : ws.u + j * dv + col - kDk;
    const int64_t row_stride = is_k ? hv * kDk : hv * dv;
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      if (t < n) dst[(row0 + t) * row_stride] = x[t];
    }
  }
  if (threadIdx.x < n) ws.gamma[(row0 + threadIdx.x) * hv + j] = gamma[threadIdx.x];
}

// Shared memory of the walk kernel, in floats.
template <int kDk, int kChunk>
struct WalkLayout {
  static constexpr int kLd = kDk + 4, kALd = kChunk + 4;
  static constexpr int kS = 0, kQ = kS + kDk * kGdnValueSlice, kK = kQ + kChunk * kLd, kW = kK + kChunk * kLd;
  static constexpr int kD = kW + kChunk * kLd, kP = kD + kChunk * kVLd, kGamma = kP + kChunk * kALd;
  static constexpr int kWeight = kGamma + kChunk, kFloats = kWeight + kChunk;
};

// A chunk's rows from the workspace into shared memory by cp.async (zeros past n), in the three groups the walk
// overlaps with its phases: q and W (phase 1 only: loaded for the next chunk during phase 2), U's slice into the
// delta buffer (phase 1 updates it in place), k and P (phase 2 only: loaded during phase 1). gamma (4-byte entries
// strided by Hv) by plain loads.

// Chunk rows t < kChunk of kWidth floats from src(row) (row: the token row of chunk row t) to dst, dst_ld floats
// apart.
template <int kChunk, int kWidth, class Src>
__device__ __forceinline__ void walk_copy_rows(float* dst, int dst_ld, int64_t row0, int n, Src src) {
  constexpr int kVecs = kWidth / 4;
  for (int i = threadIdx.x; i < kChunk * kVecs; i += kWalkThreads) {
    const int t = i / kVecs, c = (i % kVecs) * 4;
    const bool in = t < n;
    ptx::cp_async_16_zfill(dst + t * dst_ld + c, src(in ? row0 + t : row0) + c, in);
  }
}

template <int kDk, int kChunk>
__device__ void walk_load_qw(const ChunkWorkspace& ws, const GdnDeltaRuleArgs& a, int64_t row0, int n, int64_t j,
                             int64_t kh, float* sm) {
  using L = WalkLayout<kDk, kChunk>;
  const int64_t hv = a.n_value_heads, hk = a.n_key_heads;
  walk_copy_rows<kChunk, kDk>(sm + L::kQ, L::kLd, row0, n,
                              [&](int64_t row) { return ws.qk + (row * hk + kh) * 2 * kDk; });
  walk_copy_rows<kChunk, kDk>(sm + L::kW, L::kLd, row0, n, [&](int64_t row) { return ws.w + (row * hv + j) * kDk; });
  ptx::cp_async_commit();
}

template <int kDk, int kChunk>
__device__ void walk_load_u(const ChunkWorkspace& ws, const GdnDeltaRuleArgs& a, int64_t row0, int n, int64_t j,
                            int64_t e0, float* sm) {
  using L = WalkLayout<kDk, kChunk>;
  const int64_t hv = a.n_value_heads;
  walk_copy_rows<kChunk, kGdnValueSlice>(sm + L::kD, kVLd, row0, n,
                                         [&](int64_t row) { return ws.u + (row * hv + j) * a.value_dim + e0; });
  ptx::cp_async_commit();
  if (threadIdx.x < kChunk) {
    sm[L::kGamma + threadIdx.x] = threadIdx.x < n ? ws.gamma[(row0 + threadIdx.x) * hv + j] : 0.0f;
  }
}

template <int kDk, int kChunk>
__device__ void walk_load_kp(const ChunkWorkspace& ws, const GdnDeltaRuleArgs& a, int64_t row0, int n, int64_t j,
                             int64_t kh, float* sm) {
  using L = WalkLayout<kDk, kChunk>;
  const int64_t hv = a.n_value_heads, hk = a.n_key_heads;
  walk_copy_rows<kChunk, kDk>(sm + L::kK, L::kLd, row0, n,
                              [&](int64_t row) { return ws.qk + (row * hk + kh) * 2 * kDk + kDk; });
  walk_copy_rows<kChunk, kChunk>(sm + L::kP, L::kALd, row0, n,
                                 [&](int64_t row) { return ws.p + (row * hv + j) * ws.p_ld; });
  ptx::cp_async_commit();
}

// S_t = e^gamma_t S0 + sum_{i<=t} e^(gamma_t - gamma_i) k_i delta_i^T for the verified rows t < rows into slot
// slots[t], rows d = tr + kWalkRowStep r and columns 4 tc of the thread (the S update's layout, so the row that ends
// the chunk gets the S update's values). Reads S before the same thread updates it.
template <int kDk, int kChunk>
__device__ void walk_row_states(const GdnDeltaRuleArgs& a, const int32_t* slots, int rows, int64_t j, int64_t e0,
                                const float* sm) {
  using L = WalkLayout<kDk, kChunk>;
  constexpr int kRows = (kDk + kWalkRowStep - 1) / kWalkRowStep;
  const int tr = threadIdx.x / 8, tc = threadIdx.x % 8;
  const float* gamma = sm + L::kGamma;
  const int64_t dv = a.value_dim;
  for (int t = 0; t < rows; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // a broken caller: skipped rather than written out of bounds
    float acc[kRows][4] = {};
    for (int i = 0; i <= t; ++i) {
      const float w = expf(gamma[t] - gamma[i]);
      const float4 dl = ld4(sm + L::kD + i * kVLd + 4 * tc);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int d = tr + kWalkRowStep * r;
        const float kw = d < kDk ? sm[L::kK + i * L::kLd + d] * w : 0.0f;
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
      const int d = tr + kWalkRowStep * r;
      if (d >= kDk) continue;
      const float* s = sm + L::kS + d * kGdnValueSlice + 4 * tc;
#pragma unroll
      for (int c = 0; c < 4; ++c) out[d * dv + c] = decay * s[c] + acc[r][c];
    }
  }
}

template <int kDk, int kChunk, bool kVerify>
__global__ void __launch_bounds__(kWalkThreads) gdn_chunk_walk_kernel(const GdnDeltaRuleArgs a) {
  ptx::grid_dependency_begin();
  using L = WalkLayout<kDk, kChunk>;
  constexpr int kRowsT = (kChunk + kWalkRowStep - 1) / kWalkRowStep;
  constexpr int kRowsD = (kDk + kWalkRowStep - 1) / kWalkRowStep;
  extern __shared__ float4 chunk_smem[];
  float* sm = reinterpret_cast<float*>(chunk_smem);
  const SeqView sq = seq_view(a.seqs, blockIdx.x);
  if (!sq.valid) return;
  const int64_t j = blockIdx.y, hv = a.n_value_heads, dv = a.value_dim, e0 = int64_t{blockIdx.z} * kGdnValueSlice;
  const int64_t kh = j / (hv / a.n_key_heads);
  const ChunkWorkspace ws = chunk_workspace(a, kChunk);
  float* state = a.state + (sq.slot * hv + j) * kDk * dv + e0;
  const int32_t* row_slots = kVerify ? verify_slots(a.seqs, blockIdx.x) : nullptr;
  const int tr = threadIdx.x / 8, tc = threadIdx.x % 8;
  for (int i = threadIdx.x; i < kDk * kGdnValueSlice; i += kWalkThreads) {
    sm[L::kS + i] = sq.fresh ? 0.0f : state[(i / kGdnValueSlice) * dv + i % kGdnValueSlice];
  }
  auto chunk_rows = [&](int64_t c0) { return static_cast<int>(min(int64_t{kChunk}, sq.len - c0)); };
  if (sq.len > 0) walk_load_qw<kDk, kChunk>(ws, a, sq.begin, chunk_rows(0), j, kh, sm);
  for (int64_t c0 = 0; c0 < sq.len; c0 += kChunk) {
    const int64_t row0 = sq.begin + c0;
    const int n = chunk_rows(c0);
    walk_load_u<kDk, kChunk>(ws, a, row0, n, j, e0, sm);
    walk_load_kp<kDk, kChunk>(ws, a, row0, n, j, kh, sm);
    ptx::cp_async_wait<1>();  // q, W and U are in; k and P may still be on their way
    __syncthreads();
    const float* gamma = sm + L::kGamma;
    if (threadIdx.x < kChunk) {
      sm[L::kWeight + threadIdx.x] = threadIdx.x < n ? expf(gamma[n - 1] - gamma[threadIdx.x]) : 0.0f;
    }
    // Phase 1: W S0 and Q S0 for rows t = tr + kWalkRowStep r, columns 4 tc ..; delta = U - W S0 in place. (Rows
    // past the chunk, t >= kChunk, exist only where the block has more row groups than the chunk rows.)
    float qs[kRowsT][4] = {};
    {
      float ws0[kRowsT][4] = {};
      for (int d = 0; d < kDk; d += 4) {
        float4 s[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) s[u] = ld4(sm + L::kS + (d + u) * kGdnValueSlice + 4 * tc);
#pragma unroll
        for (int r = 0; r < kRowsT; ++r) {
          const int t = min(tr + kWalkRowStep * r, kChunk - 1);  // past the chunk: row kChunk - 1, dropped
          const float4 wv = ld4(sm + L::kW + t * L::kLd + d);
          const float4 qv = ld4(sm + L::kQ + t * L::kLd + d);
          const float wx[4] = {wv.x, wv.y, wv.z, wv.w}, qx[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            ws0[r][0] += wx[u] * s[u].x;
            ws0[r][1] += wx[u] * s[u].y;
            ws0[r][2] += wx[u] * s[u].z;
            ws0[r][3] += wx[u] * s[u].w;
            qs[r][0] += qx[u] * s[u].x;
            qs[r][1] += qx[u] * s[u].y;
            qs[r][2] += qx[u] * s[u].z;
            qs[r][3] += qx[u] * s[u].w;
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kRowsT; ++r) {
        if (tr + kWalkRowStep * r >= kChunk) continue;
        float* dl = sm + L::kD + (tr + kWalkRowStep * r) * kVLd + 4 * tc;
        const float4 uv = ld4(dl);
        st4(dl, make_float4(uv.x - ws0[r][0], uv.y - ws0[r][1], uv.z - ws0[r][2], uv.w - ws0[r][3]));
      }
    }
    ptx::cp_async_wait<0>();
    __syncthreads();  // delta complete, k and P in, q and W read: the next chunk's q and W may come in now
    if (c0 + kChunk < sq.len) {
      walk_load_qw<kDk, kChunk>(ws, a, row0 + kChunk, chunk_rows(c0 + kChunk), j, kh, sm);
    }
    // Phase 2: the outputs, the verified rows' states, then S (each thread updates only the S entries it read).
#pragma unroll
    for (int r = 0; r < kRowsT; ++r) {
      const int t = tr + kWalkRowStep * r;
      if (t >= kChunk) continue;
      const float decay = expf(gamma[t]);
      float o[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) o[c] = decay * qs[r][c];
      for (int i = 0; i <= t; ++i) {
        const float p = sm[L::kP + t * L::kALd + i];
        const float4 dl = ld4(sm + L::kD + i * kVLd + 4 * tc);
        o[0] += p * dl.x;
        o[1] += p * dl.y;
        o[2] += p * dl.z;
        o[3] += p * dl.w;
      }
      if (t >= n) continue;
      uint16_t* out = a.out + ((row0 + t) * hv + j) * dv + e0 + 4 * tc;
#pragma unroll
      for (int c = 0; c < 4; ++c) out[c] = f32_to_bf16(o[c]);
    }
    if constexpr (kVerify) {
      if (row_slots != nullptr && c0 < a.seqs.max_rows) {
        const int rows = static_cast<int>(min(int64_t{n}, a.seqs.max_rows - c0));
        walk_row_states<kDk, kChunk>(a, row_slots + c0, rows, j, e0, sm);
      }
    }
    {
      float acc[kRowsD][4] = {};
      for (int i = 0; i < n; ++i) {
        const float w = sm[L::kWeight + i];
        const float4 dl = ld4(sm + L::kD + i * kVLd + 4 * tc);
#pragma unroll
        for (int r = 0; r < kRowsD; ++r) {
          const int d = min(tr + kWalkRowStep * r, kDk - 1);  // past dk: row dk - 1, dropped
          const float kw = sm[L::kK + i * L::kLd + d] * w;
          acc[r][0] += kw * dl.x;
          acc[r][1] += kw * dl.y;
          acc[r][2] += kw * dl.z;
          acc[r][3] += kw * dl.w;
        }
      }
      const float decay = expf(gamma[n - 1]);
#pragma unroll
      for (int r = 0; r < kRowsD; ++r) {
        if (tr + kWalkRowStep * r >= kDk) continue;
        float* s = sm + L::kS + (tr + kWalkRowStep * r) * kGdnValueSlice + 4 * tc;
        const float4 sv = ld4(s);
        st4(s, make_float4(decay * sv.x + acc[r][0], decay * sv.y + acc[r][1], decay * sv.z + acc[r][2],
                           decay * sv.w + acc[r][3]));
      }
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < kDk * kGdnValueSlice; i += kWalkThreads) {
    state[(i / kGdnValueSlice) * dv + i % kGdnValueSlice] = sm[L::kS + i];
  }
}

template <int kDk, int kChunk>
void chunked_launch(const DeviceContext& ctx, const GdnDeltaRuleArgs& args) {
  const int prepare_bytes = static_cast<int>(PrepareLayout<kDk, kChunk>::kFloats * sizeof(float));
  const int walk_bytes = static_cast<int>(WalkLayout<kDk, kChunk>::kFloats * sizeof(float));
  const dim3 prepare_grid(static_cast<unsigned>(args.seqs.n_seqs),
                          static_cast<unsigned>((args.seqs.max_query_len + kChunk - 1) / kChunk),
                          static_cast<unsigned>(args.n_value_heads));
  const dim3 walk_grid(static_cast<unsigned>(args.seqs.n_seqs), static_cast<unsigned>(args.n_value_heads),
                       static_cast<unsigned>(args.value_dim / kGdnValueSlice));
  TERN_CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_prepare_kernel<kDk, kChunk>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, prepare_bytes));
  if (prepare_grid.y > 0) {
    launch_kernel(ctx, gdn_chunk_prepare_kernel<kDk, kChunk>, prepare_grid, dim3(kChunkThreads), prepare_bytes, args);
  }
  auto launch_walk = [&](auto kernel) {
    TERN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, walk_bytes));
    launch_kernel(ctx, kernel, walk_grid, dim3(kWalkThreads), walk_bytes, args);
  };
  if (args.seqs.row_slots != nullptr) {
    launch_walk(gdn_chunk_walk_kernel<kDk, kChunk, true>);
  } else {
    launch_walk(gdn_chunk_walk_kernel<kDk, kChunk, false>);
  }
}

template <int kChunk>
void chunked_dispatch(const DeviceContext& ctx, const GdnDeltaRuleArgs& args) {
  switch (args.key_dim) {
    case 32: chunked_launch<32, kChunk>(ctx, args); break;
    case 64: chunked_launch<64, kChunk>(ctx, args); break;
    default: chunked_launch<128, kChunk>(ctx, args); break;
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
  auto bytes = [](auto prepare, auto walk) {
    return int64_t{std::max(decltype(prepare)::kFloats, decltype(walk)::kFloats)} * 4;
  };
  const bool long_chunk = chunk == 64;
  switch (key_dim) {
    case 32:
      return long_chunk ? bytes(PrepareLayout<32, 64>{}, WalkLayout<32, 64>{})
                        : bytes(PrepareLayout<32, 32>{}, WalkLayout<32, 32>{});
    case 64:
      return long_chunk ? bytes(PrepareLayout<64, 64>{}, WalkLayout<64, 64>{})
                        : bytes(PrepareLayout<64, 32>{}, WalkLayout<64, 32>{});
    default:
      return long_chunk ? bytes(PrepareLayout<128, 64>{}, WalkLayout<128, 64>{})
                        : bytes(PrepareLayout<128, 32>{}, WalkLayout<128, 32>{});
  }
}

int64_t gdn_chunked_workspace_bytes(int64_t tokens, int64_t n_key_heads, int64_t n_value_heads, int64_t key_dim,
                                    int64_t value_dim) {
  // Sized for 64-row chunks, the longer of the two (P's rows).
  const ChunkWorkspaceOffsets o = chunk_workspace_offsets(tokens, n_key_heads, n_value_heads, key_dim, value_dim, 64);
  return o.end * static_cast<int64_t>(sizeof(float));
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
  if (gdn_chunked_chunk_len(ctx.props(), args.key_dim) == 64) {
    chunked_dispatch<64>(ctx, args);
  } else {
    chunked_dispatch<32>(ctx, args);
  }
  TERN_CUDA_CHECK_LAUNCH();
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t gated_delta_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, gdn_conv1d_kernel<4, false>);
}

}  // namespace tern
