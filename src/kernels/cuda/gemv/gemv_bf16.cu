// BF16 GEMV for decode; contract in gemv_bf16_launch.h.
//
// With at most 8 rows of x, the product is bound by reading W once (2 bytes per weight, x and y are noise), so the
// kernel is a streaming read of W at copy speed and nothing else: no split-K second pass, no shared-memory staging.
// A group of T threads (gemv_bf16_group_threads) owns 4 consecutive rows of W (output columns) and splits k
// between its threads in 16-byte chunks, lane-contiguous so each warp load covers 512 contiguous bytes of a row.
// A thread keeps an fp32 accumulator per (row of x, column) in registers, so m is a template parameter; the group's
// partial sums meet through warp shuffles and, when T > 32, shared memory, and y is rounded to bf16 once.
// A prologue (a template parameter, so the plain kernel carries none of it) may turn x into the rows the product
// uses as each chunk is read: an RMSNorm, or the SiLU-and-mul of [gate | up] rows. An epilogue may fold the MoE
// block's combine into the shared expert's down projection (GemvMoeCombine).
#include <cuda_bf16.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemv/gemv_bf16_launch.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/moe/moe_launch.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/silu_mul.cuh"

namespace tern {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 4;  // output columns (rows of W) per group of threads
constexpr int kVec = 8;   // bf16 values per 16-byte chunk

// What the kernel makes of x before the product (GemvBf16Params: norm_weight, silu_ldx).
enum class Prologue { kNone, kRmsNorm, kSiluMul };

// W is read once (ptx::ld_stream_16): L1 stays with x, which every block reads; the 256 bytes L2 fetches are the
// neighbouring lanes' reads of the same step.
__device__ __forceinline__ uint4 ld_weight_16(const uint16_t* p) {
  return ptx::ld_stream_16(p);
}

using cuda_common::bf16_to_f32;
using cuda_common::f32_to_bf16;
using cuda_common::pack_bf16x2;  // round to nearest even, as rms_norm
using cuda_common::sigmoid_f32;
using cuda_common::unpack_bf16x8;
using cuda_common::warp_sum;

// Row i's 8 values of chunk c as the product uses them: x itself; with kRmsNorm its RMSNorm (h = x + residual,
// then scale and weight, one bf16 rounding), where `write` (block 0, group 0, which covers every chunk once) stores
// h and x'; with kSiluMul the act of row i's gate and up, silu_mul's bits. Every group recomputes the act of the
// chunks it reads (there is no staging), which adds arithmetic per weight but no memory traffic.
template <int kRows, Prologue kPrologue>
__device__ __forceinline__ void x_chunk(const GemvBf16Params& p, int i, int64_t c, const float (&inv)[kRows],
                                        bool write, float (&xf)[kVec]) {
  if constexpr (kPrologue == Prologue::kSiluMul) {
    const uint4* gate = reinterpret_cast<const uint4*>(p.x + i * p.silu_ldx + c * kVec);
    const uint4 g = __ldg(gate), u = __ldg(gate + p.k / kVec);
    unpack_bf16x8(make_uint4(silu_mul_bf16x2(g.x, u.x), silu_mul_bf16x2(g.y, u.y), silu_mul_bf16x2(g.z, u.z),
                             silu_mul_bf16x2(g.w, u.w)),
                  xf);
    return;
  }
  const int64_t at = i * p.k + c * kVec;
  unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(p.x + at)), xf);
  if constexpr (kPrologue == Prologue::kRmsNorm) {
    if (p.residual != nullptr) {
      float r[kVec];
      unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(p.residual + at)), r);
#pragma unroll
      for (int e = 0; e < kVec; ++e) xf[e] += r[e];
    }
    float w[kVec];
    unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(p.norm_weight + c * kVec)), w);
    const float offset = p.norm_zero_centred ? 1.0f : 0.0f;
    uint32_t h_bits[4], y_bits[4];
#pragma unroll
    for (int e = 0; e < kVec; e += 2) {
      h_bits[e / 2] = pack_bf16x2(xf[e], xf[e + 1]);
      const float y0 = (xf[e] * inv[i]) * (offset + w[e]), y1 = (xf[e + 1] * inv[i]) * (offset + w[e + 1]);
      y_bits[e / 2] = pack_bf16x2(y0, y1);
      xf[e] = __uint_as_float(y_bits[e / 2] << 16);
      xf[e + 1] = __uint_as_float(y_bits[e / 2] & 0xFFFF0000u);
    }
    if (write && p.h_out != nullptr) {
      *reinterpret_cast<uint4*>(p.h_out + at) = make_uint4(h_bits[0], h_bits[1], h_bits[2], h_bits[3]);
    }
    if (write && p.x_out != nullptr) {
      *reinterpret_cast<uint4*>(p.x_out + at) = make_uint4(y_bits[0], y_bits[1], y_bits[2], y_bits[3]);
    }
  }
}

// acc[i][r] += x[i, chunk] . w_r[chunk] for one 8-element chunk c.
template <int kRows, Prologue kPrologue>
__device__ __forceinline__ void fma_chunk(float (&acc)[kRows][kCols], const uint4 (&w)[kCols], const GemvBf16Params& p,
                                          int64_t c, const float (&inv)[kRows], bool write) {
  float wf[kCols][kVec];
#pragma unroll
  for (int r = 0; r < kCols; ++r) unpack_bf16x8(w[r], wf[r]);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    float xf[kVec];
    x_chunk<kRows, kPrologue>(p, i, c, inv, write, xf);
#pragma unroll
    for (int r = 0; r < kCols; ++r) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[i][r] = fmaf(xf[e], wf[r][e], acc[i][r]);
    }
  }
}

// With kRmsNorm, every group first sums the squares of its rows' h over the whole k (each group covers k once with
// its threads), so each group has its own copy of the norm's scale; the fp32 sum runs in another order than
// rms_norm's, so a rounded x' can differ from rms_norm's in its last bit.
template <int kRows>
__device__ __forceinline__ void norm_scales(const GemvBf16Params& p, int group, int group_threads, int j,
                                            float (&inv)[kRows]) {
  __shared__ float ss_part[kWarps][kRows];
  const int n_chunks = static_cast<int>(p.k / kVec);
  float ss[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) ss[i] = 0.0f;
  for (int c = j; c < n_chunks; c += group_threads) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int64_t at = i * p.k + int64_t{c} * kVec;
      float h[kVec];
      unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(p.x + at)), h);
      if (p.residual != nullptr) {
        float r[kVec];
        unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(p.residual + at)), r);
#pragma unroll
        for (int e = 0; e < kVec; ++e) h[e] += r[e];
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) ss[i] += h[e] * h[e];
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    float v = ss[i];
    v = warp_sum(v);
    if (lane == 0) ss_part[warp][i] = v;
  }
  __syncthreads();
  const int warps_per_group = group_threads / 32;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    float total = 0.0f;
    for (int w = 0; w < warps_per_group; ++w) total += ss_part[group * warps_per_group + w][i];
    inv[i] = 1.0f / sqrtf(total / static_cast<float>(p.k) + p.norm_eps);
  }
}

// The routed part of the combine for output (row i, column col): the token's pairs in ascending expert order
// (order[i][s]: the pair j of the s-th smallest id), weighted, summed in fp32 as moe_combine does.
template <int kRows>
__device__ __forceinline__ float combine_routed(const GemvMoeCombine& c, int64_t n,
                                                const int (&order)[kRows][kGemvCombineMaxTopK], int i, int64_t col) {
  float acc = 0.0f;
  for (int s = 0; s < c.top_k && order[i][s] >= 0; ++s) {  // -1: past this rank's experts' pairs
    const int pair = i * c.top_k + order[i][s];
    const float v = bf16_to_f32(c.expert_out[int64_t{c.pair_row[pair]} * n + col]);
    acc = fmaf(v, c.topk_weights[pair], acc);
  }
  return acc;
}

// One block: kThreads / group_threads groups, each owning kCols consecutive output columns. kCombine: the MoE
// combine epilogue (cb); the kernels below pass their parameters in.
template <int kRows, Prologue kPrologue, bool kCombine>
__device__ __forceinline__ void gemv_bf16_block(const GemvBf16Params& p, const GemvMoeCombine& cb,
                                                const int group_threads) {
  ptx::grid_dependents_launch();  // the wait comes after the first weight loads (below)
  __shared__ float partial[kWarps][kRows * kCols];
  __shared__ int order[kCombine ? kRows : 1][kGemvCombineMaxTopK];
  const int t = static_cast<int>(threadIdx.x);
  const int groups = kThreads / group_threads;
  const int group = t / group_threads, j = t % group_threads;
  const int64_t col0 = (int64_t{blockIdx.x} * groups + group) * kCols;

  // Stage 1: stream the group's rows of W. Columns past n (the last block) re-read row n - 1, so every load is in
  // bounds without a branch; their sums are never written. Two chunks per step keep 2 x kCols loads in flight.
  const uint16_t* wrow[kCols];
#pragma unroll
  for (int r = 0; r < kCols; ++r) wrow[r] = p.w + (col0 + r < p.n ? col0 + r : p.n - 1) * p.k;
  float acc[kRows][kCols];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
#pragma unroll
    for (int r = 0; r < kCols; ++r) acc[i][r] = 0.0f;
  }
  const int n_chunks = static_cast<int>(p.k / kVec);
  // W does not change while a model runs, so the first step's weight loads leave before the programmatic-launch
  // wait and overlap the previous kernel's tail; x, the residual and y are touched only after it. The first step is
  // the loop's first iteration peeled, so the sums are the same. The RMSNorm prologue keeps the wait first: the fused
  // norm kernel is opt-in (gemm_cuda.cc), and early loads would make its self-test time mislead further (they would
  // overlap each block's norm pass in the one-wave lead case only; see docs/perf/gpu.md §fused-rms-norm-gemv).
  int c = j;
  const bool first_step = c + group_threads < n_chunks;
  uint4 first0[kCols], first1[kCols];
  if constexpr (kPrologue == Prologue::kRmsNorm) ptx::grid_dependency_wait();
  if (first_step) {
#pragma unroll
    for (int r = 0; r < kCols; ++r) first0[r] = ld_weight_16(wrow[r] + int64_t{c} * kVec);
#pragma unroll
    for (int r = 0; r < kCols; ++r) first1[r] = ld_weight_16(wrow[r] + int64_t{c + group_threads} * kVec);
  }
  if constexpr (kPrologue != Prologue::kRmsNorm) ptx::grid_dependency_wait();
  float inv[kRows];
  if constexpr (kPrologue == Prologue::kRmsNorm) norm_scales<kRows>(p, group, group_threads, j, inv);
  const bool write = kPrologue == Prologue::kRmsNorm && blockIdx.x == 0 && group == 0;
  if (first_step) {
    fma_chunk<kRows, kPrologue>(acc, first0, p, c, inv, write);
    fma_chunk<kRows, kPrologue>(acc, first1, p, c + group_threads, inv, write);
    c += 2 * group_threads;
  }
  for (; c + group_threads < n_chunks; c += 2 * group_threads) {
    uint4 w0[kCols], w1[kCols];
#pragma unroll
    for (int r = 0; r < kCols; ++r) w0[r] = ld_weight_16(wrow[r] + int64_t{c} * kVec);
#pragma unroll
    for (int r = 0; r < kCols; ++r) w1[r] = ld_weight_16(wrow[r] + int64_t{c + group_threads} * kVec);
    fma_chunk<kRows, kPrologue>(acc, w0, p, c, inv, write);
    fma_chunk<kRows, kPrologue>(acc, w1, p, c + group_threads, inv, write);
  }
  if (c < n_chunks) {  // an odd number of chunks left for this thread
    uint4 w0[kCols];
#pragma unroll
    for (int r = 0; r < kCols; ++r) w0[r] = ld_weight_16(wrow[r] + int64_t{c} * kVec);
    fma_chunk<kRows, kPrologue>(acc, w0, p, c, inv, write);
  }

  // With the combine: thread t < m * top_k ranks pair t among its token's pairs by expert id (ties by j, as
  // moe_combine), for stage 3's summation order; stage 2's barrier publishes it.
  if constexpr (kCombine) {
    if (t < kRows * cb.top_k) {
      const int k = cb.top_k, i = t / k, j = t % k;
      const int32_t* ids = cb.topk_ids + i * k;
      const int id = moe_combine_key(ids[j], cb.expert_begin, cb.expert_end);
      int rank = 0;
      for (int q = 0; q < k; ++q) {
        const int other = moe_combine_key(ids[q], cb.expert_begin, cb.expert_end);
        rank += other < id || (other == id && q < j);
      }
      order[i][rank] = id == INT_MAX ? -1 : j;
    }
  }

  // Stage 2: each warp's sum of every accumulator (a group is whole warps: group_threads is a multiple of 32).
  const int warp = t / 32, lane = t % 32;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
#pragma unroll
    for (int r = 0; r < kCols; ++r) {
      float v = acc[i][r];
      v = warp_sum(v);
      if (lane == 0) partial[warp][i * kCols + r] = v;
    }
  }
  __syncthreads();

  // Stage 3: one thread per (group, row of x, column) adds its group's warps in a fixed order and writes bf16
  // (round to nearest even). groups * kRows * kCols <= 8 * 8 * 4 = kThreads.
  if (t < groups * kRows * kCols) {
    const int g = t / (kRows * kCols), idx = t % (kRows * kCols);
    const int warps_per_group = group_threads / 32;
    float sum = 0.0f;
    for (int w = 0; w < warps_per_group; ++w) sum += partial[g * warps_per_group + w][idx];
    const int64_t col = (int64_t{blockIdx.x} * groups + g) * kCols + idx % kCols;
    if constexpr (kCombine) {
      if (col < p.n) {
        const int i = idx / kCols;
        const float shared = __bfloat162float(__float2bfloat16_rn(sum));  // the product as it would be stored
        // moe_combine's form; 1 for an ungated shared expert (fmaf(1, s, acc) is the plain sum), as moe_combine
        const float sig = cb.gate != nullptr ? sigmoid_f32(bf16_to_f32(cb.gate[i * cb.gate_stride])) : 1.0f;
        sum = fmaf(sig, shared, combine_routed<kRows>(cb, p.n, order, i, col));
      }
    }
    if (col < p.n) p.y[(idx / kCols) * p.ldy + col] = f32_to_bf16(sum);
  }
}

template <int kRows, Prologue kPrologue>
__global__ void __launch_bounds__(kThreads) gemv_bf16_kernel(const GemvBf16Params p, const int group_threads) {
  gemv_bf16_block<kRows, kPrologue, false>(p, GemvMoeCombine{}, group_threads);
}

template <int kRows>
__global__ void __launch_bounds__(kThreads)
    gemv_bf16_combine_kernel(const GemvBf16Params p, const GemvMoeCombine cb, const int group_threads) {
  gemv_bf16_block<kRows, Prologue::kSiluMul, true>(p, cb, group_threads);
}

template <int kRows>
void launch_rows(const GemvBf16Params& p, const GemvMoeCombine* cb, int group_threads, const DeviceContext& ctx) {
  const int64_t cols_per_block = int64_t{kThreads / group_threads} * kCols;
  const auto grid = static_cast<unsigned>((p.n + cols_per_block - 1) / cols_per_block);
  if (p.norm_weight != nullptr) {
    launch_kernel(ctx, gemv_bf16_kernel<kRows, Prologue::kRmsNorm>, dim3(grid), dim3(kThreads), 0, p, group_threads);
  } else if (p.silu_ldx > 0 && cb != nullptr) {
    launch_kernel(ctx, gemv_bf16_combine_kernel<kRows>, dim3(grid), dim3(kThreads), 0, p, *cb, group_threads);
  } else if (p.silu_ldx > 0) {
    launch_kernel(ctx, gemv_bf16_kernel<kRows, Prologue::kSiluMul>, dim3(grid), dim3(kThreads), 0, p, group_threads);
  } else {
    launch_kernel(ctx, gemv_bf16_kernel<kRows, Prologue::kNone>, dim3(grid), dim3(kThreads), 0, p, group_threads);
  }
  TERN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void gemv_bf16_launch(const DeviceContext& ctx, const GemvBf16Params& p, const GemvMoeCombine* combine) {
  using Launch = void (*)(const GemvBf16Params&, const GemvMoeCombine*, int, const DeviceContext&);
  static constexpr Launch kByRows[kGemvMaxRows] = {launch_rows<1>, launch_rows<2>, launch_rows<3>, launch_rows<4>,
                                                   launch_rows<5>, launch_rows<6>, launch_rows<7>, launch_rows<8>};
  static_assert(kGemvMaxRows * kWarps * kCols <= kThreads, "stage 3 needs a thread per output of a block");
  if (p.m < 1 || p.m > kGemvMaxRows) return;  // gemv_bf16() rejects these first
  const int threads =
      p.group_threads > 0 ? p.group_threads : gemv_bf16_group_threads(p.m, p.n, p.k, ctx.props().num_sms);
  kByRows[p.m - 1](p, combine, threads, ctx);
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t gemv_bf16_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, gemv_bf16_kernel<kGemvMaxRows, Prologue::kNone>);
}

}  // namespace tern
