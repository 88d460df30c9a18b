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
// conv1d + SiLU. Block = kConvThreads threads as (token lanes) x (channel tile); each thread takes kV adjacent
// channels (8, with 16-byte loads and stores, where the channels and strides allow; else 1). lanes = 1 for decode,
// more for long rows so a prefill has several runs in flight per channel. Loads are issued a batch of rows at a time
// so each thread keeps several independent loads in flight.

constexpr int kConvThreads = 256;
constexpr int kConvBatch = 8;

struct ConvParams {
  GdnConvArgs a;
  int lanes;    // token runs per channel
  int ch_tile;  // threads per token lane = kConvThreads / lanes
};

// kV consecutive bf16 at p, as raw bits: one 16-byte access at kV = 8 (conv_vector_width checked the alignment).
template <int kV>
struct Bf16s {
  uint32_t w[(kV + 1) / 2];
  __device__ __forceinline__ float operator[](int v) const {
    return bf16_to_f32(static_cast<uint16_t>(v % 2 == 0 ? w[v / 2] & 0xFFFFu : w[v / 2] >> 16));
  }
};
template <int kV>
__device__ __forceinline__ Bf16s<kV> load_bf16s(const uint16_t* p) {
  Bf16s<kV> r;
  if constexpr (kV == 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    r.w[0] = u.x;
    r.w[1] = u.y;
    r.w[2] = u.z;
    r.w[3] = u.w;
  } else {
    static_assert(kV == 1);
    r.w[0] = p[0];
  }
  return r;
}
template <int kN>
__device__ __forceinline__ void copy_u16s(uint16_t* dst, const uint16_t* src) {
  if constexpr (kN % 8 == 0) {
#pragma unroll
    for (int i = 0; i < kN / 8; ++i) reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) dst[i] = src[i];
  }
}

// Two blocks an SM where the registers allow (kV = 8 with Qwen3.5's kernel of 4 fits 128 registers).
template <int kK, int kV, bool kVerify>
__global__ void __launch_bounds__(kConvThreads, kV == 8 && kK <= 4 ? 2 : 1) gdn_conv1d_kernel(const ConvParams p) {
  ptx::grid_dependency_begin();
  constexpr int kHist = kK - 1, kBatch = kV == 8 ? kConvBatch / 2 : kConvBatch;
  const GdnConvArgs& a = p.a;
  const SeqView sq = seq_view(a.seqs, blockIdx.x);
  if (!sq.valid) return;  // uniform over the block, before any barrier
  const int lane = threadIdx.x / p.ch_tile;
  const int64_t c = (int64_t{blockIdx.y} * p.ch_tile + threadIdx.x % p.ch_tile) * kV;
  const bool active = c < a.channels;  // channels % kV == 0
  // The state is [slot][channel][kHist]: channel c + v's entry j at state[v * kHist + j].
  uint16_t* state = a.conv_state + (sq.slot * a.channels + c) * kHist;
  // Stage 1: the old state (bf16 bits, zeros for a new sequence), kept to the end because the update is in place.
  uint16_t old[kV * kHist];
  if (active && !sq.fresh) {
    copy_u16s<kV * kHist>(old, state);
  } else {
#pragma unroll
    for (int i = 0; i < kV * kHist; ++i) old[i] = 0;
  }
  const uint16_t* x = a.x + sq.begin * a.x_stride + c;
  uint16_t* y = a.y + sq.begin * a.channels + c;
  // Stage 2: this lane's run of rows [t0, t1), the window seeded with the kHist inputs before t0.
  const int64_t run = (sq.len + p.lanes - 1) / p.lanes;
  const int64_t t0 = lane * run, t1 = min(sq.len, t0 + run);
  if (active && t0 < t1) {
    float w[kV][kK], win[kV][kK];
#pragma unroll
    for (int v = 0; v < kV; ++v) {
#pragma unroll
      for (int j = 0; j < kK; ++j) w[v][j] = a.weight[(c + v) * kK + j];
    }
#pragma unroll
    for (int j = 0; j < kHist; ++j) {
      const int64_t pos = t0 - kHist + j;
      if (pos >= 0) {
        const Bf16s<kV> in = load_bf16s<kV>(x + pos * a.x_stride);
#pragma unroll
        for (int v = 0; v < kV; ++v) win[v][j] = in[v];
      } else {
#pragma unroll
        for (int v = 0; v < kV; ++v) win[v][j] = bf16_to_f32(old[v * kHist + kHist + pos]);
      }
    }
    for (int64_t t = t0; t < t1; t += kBatch) {
      Bf16s<kV> next[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) next[u] = t + u < t1 ? load_bf16s<kV>(x + (t + u) * a.x_stride) : Bf16s<kV>{};
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (t + u >= t1) break;
        uint16_t out[kV];
#pragma unroll
        for (int v = 0; v < kV; ++v) {
          win[v][kHist] = next[u][v];
          float acc = 0.0f;
#pragma unroll
          for (int j = 0; j < kK; ++j) acc += w[v][j] * win[v][j];
          out[v] = f32_to_bf16(silu_f32(acc));
#pragma unroll
          for (int j = 0; j < kHist; ++j) win[v][j] = win[v][j + 1];
        }
        copy_u16s<kV>(y + (t + u) * a.channels, out);
      }
    }
  }
  // The window of kHist inputs ending at row `end` (exclusive), older ones from old[], into dst.
  auto window = [&](uint16_t* dst, int64_t end) {
#pragma unroll
    for (int j = 0; j < kHist; ++j) {
      const int64_t pos = end - kHist + j;
#pragma unroll
      for (int v = 0; v < kV; ++v) dst[v * kHist + j] = pos >= 0 ? x[pos * a.x_stride + v] : old[v * kHist + kHist + pos];
    }
  };
  // Stage 3: every thread has read the old state; lane 0 writes the last kHist inputs.
  __syncthreads();
  if (active && lane == 0) window(state, sq.len);
  // Stage 4, verifications only: the window after row t into row slot t, for t < min(len, max_rows); the lanes take
  // the rows in turn. The row slots are not the sequence's slot, so stage 3's write cannot have changed what they
  // copy.
  if constexpr (kVerify) {
    const int32_t* row_slots = verify_slots(a.seqs, blockIdx.x);
    if (active && row_slots != nullptr) {
      const int64_t rows = min(sq.len, a.seqs.max_rows);
      for (int64_t t = lane; t < rows; t += p.lanes) {
        const int64_t slot = row_slots[t];
        if (slot < 0) continue;  // a broken caller: skipped rather than written out of bounds
        window(a.conv_state + (slot * a.channels + c) * kHist, t + 1);
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
// memory: delta, the outputs, S. The prepare kernel's math is fp32 on CUDA cores, the walk's products 3xTF32 on the
// tensor cores (about fp32's accuracy). Rows past n are zero (q = k = v = beta = 0, g = 0):
// inert in every sum, and never written.
// A verification (GdnSequences::row_slots) also writes S_t = e^gamma_t S0 + sum_{i<=t} e^(gamma_t - gamma_i) k_i
// delta_i^T for each of its rows t into the row's slot.

constexpr int kChunkThreads = 256;  // the prepare kernel's block
constexpr int kChunkWarps = kChunkThreads / 32;
// The walk kernel's block: eight warps (their roles at gdn_chunk_walk_kernel).
constexpr int kWalkThreads = 256;
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

// 3xTF32 operand fragments of m16n8k8 from shared memory (ptx::tf32_split). A at p = &A[row0][k0], row-major with
// row stride kLd; B at p = &B[k0][col0], B[k][n] row-major with row stride kLd.
struct Tf32Frag4 {
  uint32_t big[4], small[4];
};
struct Tf32Frag2 {
  uint32_t big[2], small[2];
};
__device__ __forceinline__ Tf32Frag4 tf32_frag(float x0, float x1, float x2, float x3) {
  Tf32Frag4 f;
  ptx::tf32_split(x0, f.big[0], f.small[0]);
  ptx::tf32_split(x1, f.big[1], f.small[1]);
  ptx::tf32_split(x2, f.big[2], f.small[2]);
  ptx::tf32_split(x3, f.big[3], f.small[3]);
  return f;
}
template <int kLd>
__device__ __forceinline__ Tf32Frag4 tf32_frag_a(const float* p, int g, int t4) {
  return tf32_frag(p[g * kLd + t4], p[(g + 8) * kLd + t4], p[g * kLd + t4 + 4], p[(g + 8) * kLd + t4 + 4]);
}
// B = C^T for C row-major at p = &C[col0][k0] (row stride kLd): b[k][n] = C[n][k].
template <int kLd>
__device__ __forceinline__ Tf32Frag2 tf32_frag_bt(const float* p, int g, int t4) {
  Tf32Frag2 f;
  ptx::tf32_split(p[g * kLd + t4], f.big[0], f.small[0]);
  ptx::tf32_split(p[g * kLd + t4 + 4], f.big[1], f.small[1]);
  return f;
}
template <int kLd>
__device__ __forceinline__ Tf32Frag2 tf32_frag_b(const float* p, int g, int t4) {
  Tf32Frag2 f;
  ptx::tf32_split(p[t4 * kLd + g], f.big[0], f.small[0]);
  ptx::tf32_split(p[(t4 + 4) * kLd + g], f.big[1], f.small[1]);
  return f;
}
// c += a b in 3xTF32, the small terms first.
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const Tf32Frag4& a, const Tf32Frag2& b) {
  ptx::mma_tf32_1688(c, a.small, b.big);
  ptx::mma_tf32_1688(c, a.big, b.small);
  ptx::mma_tf32_1688(c, a.big, b.big);
}

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
  // T: the inverses of (I + A)'s diagonal 16 x 16 blocks; N: -T_r A[r][< r] (stage 4). Both row strides = 20 (mod
  // 32), which spreads an A fragment's loads over 32 banks.
  static constexpr int kTLd = 20, kNLd = kChunk - 16 + 4;
  static constexpr int kR0 = 0, kR1 = kR0 + kChunk * kR0Ld, kA = kR1 + kChunk * kLd, kGamma = kA + kChunk * kALd;
  static constexpr int kBeta = kGamma + kChunk, kKScale = kBeta + kChunk, kT = kKScale + kChunk;
  static constexpr int kN = kT + kChunk * kTLd, kFloats = kN + kChunk * kNLd;
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

  // Stage 2: both Gram matrices (q k^T and k k^T) in 3xTF32 on the tensor cores; warp w takes 16 rows and
  // kGramTiles tiles of 8 columns (tiles wholly above the diagonal are zero). P goes to the workspace, A to shared
  // memory.
  {
    constexpr int kWarpsPerM = kChunkWarps / (kChunk / 16), kGramTiles = kChunk / 8 / kWarpsPerM;
    const int g = lane / 4, t4 = lane % 4, m = warp / kWarpsPerM, nt0 = warp % kWarpsPerM * kGramTiles;
    float acc_q[kGramTiles][4] = {}, acc_k[kGramTiles][4] = {};
#pragma unroll 4
    for (int d = 0; d < kDk; d += 8) {
      const Tf32Frag4 fq = tf32_frag_a<L::kR0Ld>(q_s + 16 * m * L::kR0Ld + d, g, t4);
      const Tf32Frag4 fk = tf32_frag_a<L::kLd>(k_s + 16 * m * L::kLd + d, g, t4);
#pragma unroll
      for (int nn = 0; nn < kGramTiles; ++nn) {
        if (8 * (nt0 + nn) > 16 * m + 15) continue;
        const Tf32Frag2 fb = tf32_frag_bt<L::kLd>(k_s + 8 * (nt0 + nn) * L::kLd + d, g, t4);
        mma_3xtf32(acc_q[nn], fq, fb);
        mma_3xtf32(acc_k[nn], fk, fb);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = 16 * m + g + 8 * h;
      float* p_row = ws.p + ((row0 + t) * hv + j) * ws.p_ld;
#pragma unroll
      for (int nn = 0; nn < kGramTiles; ++nn) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int i = 8 * (nt0 + nn) + 2 * t4 + c;
          const float decay = i <= t ? expf(gamma[t] - gamma[i]) : 0.0f;  // <= 1
          a_s[t * L::kALd + i] = i < t ? beta[t] * decay * acc_k[nn][2 * h + c] : 0.0f;
          if (t < n) p_row[i] = decay * acc_q[nn][2 * h + c];
        }
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

  // Stage 4: X = [W | U] solves (I + A) X = B = [diag(beta e^gamma) K | diag(beta) V], 16 rows at a time on the
  // tensor cores (3xTF32): with T_r = (I + A_rr)^-1 (A's diagonal blocks, by substitution) and N_r = -T_r A[r][< r],
  // block row r of X is T_r B_r + N_r X[< r]. A warp owns 8-column tiles of X and overwrites B's columns with X's in
  // place (k's in R1, v's in R0), so its block rows need no barrier between them.
  constexpr int kBlocks = kChunk / 16;
  float *kscale = sm + L::kKScale, *tinv = sm + L::kT, *nneg = sm + L::kN;
  const int g = lane / 4, t4 = lane % 4;
  if (threadIdx.x < kChunk) kscale[threadIdx.x] = beta[threadIdx.x] * expf(gamma[threadIdx.x]);
  if (threadIdx.x < 16 * kBlocks) {  // thread (r, c): column c of T_r
    const int r = threadIdx.x / 16, c = threadIdx.x % 16;
    const float* arr = a_s + 16 * r * L::kALd + 16 * r;
    float y[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float v = i == c ? 1.0f : 0.0f;
#pragma unroll
      for (int m = 0; m < i; ++m) v -= arr[i * L::kALd + m] * y[m];
      y[i] = i < c ? 0.0f : v;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) tinv[(16 * r + i) * L::kTLd + c] = y[i];
  }
  __syncthreads();
  {  // N_r, an 8-column tile (r, nt) per job, jobs dealt to the warps in turn
    int job = 0;
    for (int r = 1; r < kBlocks; ++r) {
      for (int nt = 0; nt < 2 * r; ++nt, ++job) {
        if (job % kChunkWarps != warp) continue;
        float acc[4] = {};
#pragma unroll
        for (int k0 = 0; k0 < 16; k0 += 8) {
          mma_3xtf32(acc, tf32_frag_a<L::kTLd>(tinv + 16 * r * L::kTLd + k0, g, t4),
                     tf32_frag_b<L::kALd>(a_s + (16 * r + k0) * L::kALd + 8 * nt, g, t4));
        }
        float* o = nneg + (16 * r + g) * L::kNLd + 8 * nt + 2 * t4;
        o[0] = -acc[0];
        o[1] = -acc[1];
        o[8 * L::kNLd] = -acc[2];
        o[8 * L::kNLd + 1] = -acc[3];
      }
    }
  }
  __syncthreads();
  const int n_tiles = static_cast<int>((kDk + dv) / 8);  // kDk and dv are multiples of 8: no tile straddles k | v
  for (int nt = warp; nt < n_tiles; nt += kChunkWarps) {
    const int col = 8 * nt;
    const bool is_k = col < kDk;
    float* xb = is_k ? k_s + col : q_s + (col - kDk);
    const int ld = is_k ? L::kLd : L::kR0Ld;
    const float* row_scale = is_k ? kscale : beta;
    float* dst = is_k ? ws.w + j * kDk + col : ws.u + j * dv + (col - kDk);
    const int64_t row_stride = is_k ? hv * kDk : hv * dv;
    for (int r = 0; r < kBlocks; ++r) {
      float acc[4] = {};
#pragma unroll
      for (int k0 = 0; k0 < 16; k0 += 8) {
        const int ta = 16 * r + k0 + t4, tb = ta + 4;
        Tf32Frag2 fb;
        ptx::tf32_split(xb[ta * ld + g] * row_scale[ta], fb.big[0], fb.small[0]);
        ptx::tf32_split(xb[tb * ld + g] * row_scale[tb], fb.big[1], fb.small[1]);
        mma_3xtf32(acc, tf32_frag_a<L::kTLd>(tinv + 16 * r * L::kTLd + k0, g, t4), fb);
      }
      for (int k0 = 0; k0 < 16 * r; k0 += 8) {
        Tf32Frag2 fb;
        ptx::tf32_split(xb[(k0 + t4) * ld + g], fb.big[0], fb.small[0]);
        ptx::tf32_split(xb[(k0 + t4 + 4) * ld + g], fb.big[1], fb.small[1]);
        mma_3xtf32(acc, tf32_frag_a<L::kNLd>(nneg + 16 * r * L::kNLd + k0, g, t4), fb);
      }
      __syncwarp();  // the block row's B values are read (the mma waited for every lane's)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = 16 * r + g + 8 * h;
        xb[t * ld + 2 * t4] = acc[2 * h];
        xb[t * ld + 2 * t4 + 1] = acc[2 * h + 1];
        if (t < n) {
          float* out = dst + (row0 + t) * row_stride + 2 * t4;
          out[0] = acc[2 * h];
          out[1] = acc[2 * h + 1];
        }
      }
      __syncwarp();  // X's block row visible to the warp's lanes for the next block rows
    }
  }
  if (threadIdx.x < n) ws.gamma[(row0 + threadIdx.x) * hv + j] = gamma[threadIdx.x];
}

// Shared memory of the walk kernel, in floats. The products run on the tensor cores (TF32 m16n8k8), and each row
// stride is chosen so that a warp's fragment loads hit 32 distinct banks: rows read along the row as an A operand
// (q, W, P) are 4 (mod 32) floats apart, rows read down a column (k as the transposed A; delta and S as B) 8.
template <int kDk, int kChunk>
struct WalkLayout {
  static constexpr int kRowLd = kDk + 4, kKLd = kDk + 8, kALd = kChunk + 4, kSLd = kGdnValueSlice + 8;
  static constexpr int kDLd = kSLd;
  static constexpr int kS = 0, kQ = kS + kDk * kSLd, kK = kQ + kChunk * kRowLd, kW = kK + kChunk * kKLd;
  static constexpr int kD = kW + kChunk * kRowLd, kP = kD + kChunk * kDLd, kGamma = kP + kChunk * kALd;
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
  walk_copy_rows<kChunk, kDk>(sm + L::kQ, L::kRowLd, row0, n,
                              [&](int64_t row) { return ws.qk + (row * hk + kh) * 2 * kDk; });
  walk_copy_rows<kChunk, kDk>(sm + L::kW, L::kRowLd, row0, n, [&](int64_t row) { return ws.w + (row * hv + j) * kDk; });
  ptx::cp_async_commit();
}

template <int kDk, int kChunk>
__device__ void walk_load_u(const ChunkWorkspace& ws, const GdnDeltaRuleArgs& a, int64_t row0, int n, int64_t j,
                            int64_t e0, float* sm) {
  using L = WalkLayout<kDk, kChunk>;
  const int64_t hv = a.n_value_heads;
  walk_copy_rows<kChunk, kGdnValueSlice>(sm + L::kD, L::kDLd, row0, n,
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
  walk_copy_rows<kChunk, kDk>(sm + L::kK, L::kKLd, row0, n,
                              [&](int64_t row) { return ws.qk + (row * hk + kh) * 2 * kDk + kDk; });
  walk_copy_rows<kChunk, kChunk>(sm + L::kP, L::kALd, row0, n,
                                 [&](int64_t row) { return ws.p + (row * hv + j) * ws.p_ld; });
  ptx::cp_async_commit();
}

// S_t = e^gamma_t S0 + sum_{i<=t} e^(gamma_t - gamma_i) k_i delta_i^T for the verified rows t < rows into slot
// slots[t] (fp32 on CUDA cores: a verification has a few rows), thread (tr, tc) rows d = tr + 32 r and columns
// 4 tc ... Reads S0 from shared memory, so it runs before S's update is stored there.
template <int kDk, int kChunk>
__device__ void walk_row_states(const GdnDeltaRuleArgs& a, const int32_t* slots, int rows, int64_t j, int64_t e0,
                                const float* sm) {
  using L = WalkLayout<kDk, kChunk>;
  constexpr int kRowStep = kWalkThreads / 8;
  constexpr int kRows = (kDk + kRowStep - 1) / kRowStep;
  const int tr = threadIdx.x / 8, tc = threadIdx.x % 8;
  const float* gamma = sm + L::kGamma;
  const int64_t dv = a.value_dim;
  for (int t = 0; t < rows; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // a broken caller: skipped rather than written out of bounds
    float acc[kRows][4] = {};
    for (int i = 0; i <= t; ++i) {
      const float w = expf(gamma[t] - gamma[i]);
      const float4 dl = ld4(sm + L::kD + i * L::kDLd + 4 * tc);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int d = tr + kRowStep * r;
        const float kw = d < kDk ? sm[L::kK + i * L::kKLd + d] * w : 0.0f;
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
      const int d = tr + kRowStep * r;
      if (d >= kDk) continue;
      const float* s = sm + L::kS + d * L::kSLd + 4 * tc;
#pragma unroll
      for (int c = 0; c < 4; ++c) out[d * dv + c] = decay * s[c] + acc[r][c];
    }
  }
}

// The walk: one block per (sequence, value head, 32 value columns), the sequence's chunks in order. Eight warps;
// lane (g, t4) = (lane / 4, lane % 4) holds an m16n8 accumulator's rows g, g + 8 and columns 2 t4, 2 t4 + 1.
//   phase 1: warps 0-3 W S0 (delta = U - W S0, stored in place of U), warps 4-7 Q S0 (kept in registers), each
//            warp a 16-row tile of the chunk by 32 columns (64-row chunks) or 16 (32-row chunks);
//   phase 2: warps 4-7 the outputs e^gamma_t (Q S0) + P delta (P's blocks up to the diagonal); every warp its part
//            of S (S0 scaled by e^gamma_last, plus (e^(gamma_last - gamma_i) k_i)^T delta), which it holds in
//            registers from chunk to chunk and stores for the next chunk's phase 1.
// Products in 3xTF32 (about fp32's accuracy: the same tolerances as the fp32 CUDA-core form this replaced).
template <int kDk, int kChunk, bool kVerify>
__global__ void __launch_bounds__(kWalkThreads) gdn_chunk_walk_kernel(const GdnDeltaRuleArgs a) {
  static_assert(kWalkThreads == 256 && kGdnValueSlice == 32 && (kChunk == 32 || kChunk == 64));
  ptx::grid_dependency_begin();
  using L = WalkLayout<kDk, kChunk>;
  constexpr int kMTiles = kChunk / 16, kNSplit = 4 / kMTiles, kNTiles1 = 4 / kNSplit;  // phases 1 and 2
  constexpr int kSNTiles = kDk / 32, kSWarpsPerM = 4 / kSNTiles;                        // S: 16 rows, kSNTiles x 8
  extern __shared__ float4 chunk_smem[];
  float* sm = reinterpret_cast<float*>(chunk_smem);
  const SeqView sq = seq_view(a.seqs, blockIdx.x);
  if (!sq.valid) return;
  const int64_t j = blockIdx.y, hv = a.n_value_heads, dv = a.value_dim, e0 = int64_t{blockIdx.z} * kGdnValueSlice;
  const int64_t kh = j / (hv / a.n_key_heads);
  const ChunkWorkspace ws = chunk_workspace(a, kChunk);
  float* state = a.state + (sq.slot * hv + j) * kDk * dv + e0;
  const int32_t* row_slots = kVerify ? verify_slots(a.seqs, blockIdx.x) : nullptr;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const bool q_warp = warp >= 4;
  const int m1 = (warp % 4) / kNSplit, n1 = (warp % 4) % kNSplit * kNTiles1;
  const int ms = warp / kSWarpsPerM, ns = warp % kSWarpsPerM * kSNTiles;
  for (int i = threadIdx.x; i < kDk * kGdnValueSlice; i += kWalkThreads) {
    const int d = i / kGdnValueSlice, e = i % kGdnValueSlice;
    sm[L::kS + d * L::kSLd + e] = sq.fresh ? 0.0f : state[d * dv + e];
  }
  auto chunk_rows = [&](int64_t c0) { return static_cast<int>(min(int64_t{kChunk}, sq.len - c0)); };
  if (sq.len > 0) walk_load_qw<kDk, kChunk>(ws, a, sq.begin, chunk_rows(0), j, kh, sm);
  __syncthreads();
  float s_acc[kSNTiles][4];
#pragma unroll
  for (int nn = 0; nn < kSNTiles; ++nn) {
    const float* p = sm + L::kS + (16 * ms + g) * L::kSLd + 8 * (ns + nn) + 2 * t4;
    s_acc[nn][0] = p[0];
    s_acc[nn][1] = p[1];
    s_acc[nn][2] = p[8 * L::kSLd];
    s_acc[nn][3] = p[8 * L::kSLd + 1];
  }
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
    // Phase 1. Rows past n are zero in q, W and U, so delta's are too.
    float acc[kNTiles1][4] = {};
    {
      const float* arow = sm + (q_warp ? L::kQ : L::kW) + 16 * m1 * L::kRowLd;
#pragma unroll 4
      for (int k0 = 0; k0 < kDk; k0 += 8) {
        const Tf32Frag4 fa = tf32_frag_a<L::kRowLd>(arow + k0, g, t4);
#pragma unroll
        for (int nn = 0; nn < kNTiles1; ++nn) {
          mma_3xtf32(acc[nn], fa, tf32_frag_b<L::kSLd>(sm + L::kS + k0 * L::kSLd + 8 * (n1 + nn), g, t4));
        }
      }
      if (!q_warp) {
#pragma unroll
        for (int nn = 0; nn < kNTiles1; ++nn) {
          float* d = sm + L::kD + (16 * m1 + g) * L::kDLd + 8 * (n1 + nn) + 2 * t4;
          d[0] -= acc[nn][0];
          d[1] -= acc[nn][1];
          d[8 * L::kDLd] -= acc[nn][2];
          d[8 * L::kDLd + 1] -= acc[nn][3];
        }
      }
    }
    ptx::cp_async_wait<0>();
    __syncthreads();  // delta complete, k and P in, q, W and S0 read: the next chunk's q and W may come in now
    if (c0 + kChunk < sq.len) {
      walk_load_qw<kDk, kChunk>(ws, a, row0 + kChunk, chunk_rows(c0 + kChunk), j, kh, sm);
    }
    // Phase 2: the outputs.
    if (q_warp) {
      const int t_lo = 16 * m1 + g, t_hi = t_lo + 8;
      const float d_lo = expf(gamma[t_lo]), d_hi = expf(gamma[t_hi]);
#pragma unroll
      for (int nn = 0; nn < kNTiles1; ++nn) {
        acc[nn][0] *= d_lo;
        acc[nn][1] *= d_lo;
        acc[nn][2] *= d_hi;
        acc[nn][3] *= d_hi;
      }
      for (int k0 = 0; k0 < 16 * (m1 + 1); k0 += 8) {
        const Tf32Frag4 fa = tf32_frag_a<L::kALd>(sm + L::kP + 16 * m1 * L::kALd + k0, g, t4);
#pragma unroll
        for (int nn = 0; nn < kNTiles1; ++nn) {
          mma_3xtf32(acc[nn], fa, tf32_frag_b<L::kDLd>(sm + L::kD + k0 * L::kDLd + 8 * (n1 + nn), g, t4));
        }
      }
#pragma unroll
      for (int nn = 0; nn < kNTiles1; ++nn) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int t = t_lo + 8 * h;
          if (t >= n) continue;
          uint16_t* out = a.out + ((row0 + t) * hv + j) * dv + e0 + 8 * (n1 + nn) + 2 * t4;
          const uint32_t pair = uint32_t{f32_to_bf16(acc[nn][2 * h])} | uint32_t{f32_to_bf16(acc[nn][2 * h + 1])} << 16;
          *reinterpret_cast<uint32_t*>(out) = pair;
        }
      }
    }
    // Phase 2: S = e^gamma_last S0 + (e^(gamma_last - gamma_i) k_i)^T delta, in registers. Rows past n have zero
    // k and delta and weight.
    {
      const float decay = expf(gamma[n - 1]);
#pragma unroll
      for (int nn = 0; nn < kSNTiles; ++nn) {
#pragma unroll
        for (int c = 0; c < 4; ++c) s_acc[nn][c] *= decay;
      }
      for (int k0 = 0; k0 < n; k0 += 8) {
        const float w0 = sm[L::kWeight + k0 + t4], w1 = sm[L::kWeight + k0 + t4 + 4];
        const float* kp = sm + L::kK + (k0 + t4) * L::kKLd + 16 * ms + g;
        const Tf32Frag4 fa = tf32_frag(kp[0] * w0, kp[8] * w0, kp[4 * L::kKLd] * w1, kp[4 * L::kKLd + 8] * w1);
#pragma unroll
        for (int nn = 0; nn < kSNTiles; ++nn) {
          mma_3xtf32(s_acc[nn], fa, tf32_frag_b<L::kDLd>(sm + L::kD + k0 * L::kDLd + 8 * (ns + nn), g, t4));
        }
      }
    }
    if constexpr (kVerify) {
      if (row_slots != nullptr && c0 < a.seqs.max_rows) {
        const int rows = static_cast<int>(min(int64_t{n}, a.seqs.max_rows - c0));
        walk_row_states<kDk, kChunk>(a, row_slots + c0, rows, j, e0, sm);
      }
      __syncthreads();  // S0 read by every thread before it is overwritten
    }
#pragma unroll
    for (int nn = 0; nn < kSNTiles; ++nn) {
      float* p = sm + L::kS + (16 * ms + g) * L::kSLd + 8 * (ns + nn) + 2 * t4;
      p[0] = s_acc[nn][0];
      p[1] = s_acc[nn][1];
      p[8 * L::kSLd] = s_acc[nn][2];
      p[8 * L::kSLd + 1] = s_acc[nn][3];
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < kDk * kGdnValueSlice; i += kWalkThreads) {
    const int d = i / kGdnValueSlice, e = i % kGdnValueSlice;
    state[d * dv + e] = sm[L::kS + d * L::kSLd + e];
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

template <int kK, int kV>
void conv_launch(const DeviceContext& ctx, const ConvParams& p, dim3 grid) {
  if (p.a.seqs.row_slots != nullptr) {
    launch_kernel(ctx, gdn_conv1d_kernel<kK, kV, true>, grid, dim3(kConvThreads), 0, p);
  } else {
    launch_kernel(ctx, gdn_conv1d_kernel<kK, kV, false>, grid, dim3(kConvThreads), 0, p);
  }
}

template <int kK>
void conv_launch(const DeviceContext& ctx, const ConvParams& p, dim3 grid, int vector) {
  if (vector == 8) {
    conv_launch<kK, 8>(ctx, p, grid);
  } else {
    conv_launch<kK, 1>(ctx, p, grid);
  }
}

// 8 channels a thread for long runs of rows (a prefill of at least kConvVectorMinRows), where every access of 8
// stays 16-byte aligned; else 1. At decode and short runs the grid of one channel a thread keeps more loads in
// flight: docs/perf/gpu.md §conv-vector.
constexpr int64_t kConvVectorMinRows = 1024;

int conv_vector_width(const GdnConvArgs& a) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool ok = a.channels % 8 == 0 && a.x_stride % 8 == 0 && aligned(a.x) && aligned(a.y) && aligned(a.conv_state);
  return ok && a.seqs.max_query_len >= kConvVectorMinRows ? 8 : 1;
}

// Token runs per channel: enough that a long prefill has work for every SM (up to 8 at one channel a thread, whose
// grid has 8x the blocks; up to 32 at 8), one for decode.
int conv_lanes(int64_t max_query_len, int vector) {
  const int max_lanes = vector == 8 ? 32 : 8;
  int lanes = 1;
  while (lanes < max_lanes && int64_t{lanes} * kConvBatch < max_query_len) lanes *= 2;
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
  const int vector = conv_vector_width(args), lanes = conv_lanes(args.seqs.max_query_len, vector);
  const ConvParams p{.a = args, .lanes = lanes, .ch_tile = kConvThreads / lanes};
  const int64_t block_channels = int64_t{p.ch_tile} * vector;
  const dim3 grid(static_cast<unsigned>(args.seqs.n_seqs),
                  static_cast<unsigned>((args.channels + block_channels - 1) / block_channels));
  switch (args.kernel) {
    case 2: conv_launch<2>(ctx, p, grid, vector); break;
    case 3: conv_launch<3>(ctx, p, grid, vector); break;
    case 4: conv_launch<4>(ctx, p, grid, vector); break;
    case 5: conv_launch<5>(ctx, p, grid, vector); break;
    case 6: conv_launch<6>(ctx, p, grid, vector); break;
    case 7: conv_launch<7>(ctx, p, grid, vector); break;
    default: conv_launch<8>(ctx, p, grid, vector); break;
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
  return cudaFuncGetAttributes(out, gdn_conv1d_kernel<4, 1, false>);
}

}  // namespace tern
