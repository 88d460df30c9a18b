// The batch kernel of the dense weight-only GEMMs (NVFP4 W4A16 in gemm_nvfp4_w4a16.cu, block-wise FP8 W8A16 in
// gemm_fp8_w8a16.cu), for 17..64 activation rows: the weight is read once for all of them. The decode kernels
// re-read the weight per 16 rows and the dequantized cuBLASLt path writes and reads it again as bf16, both 2-4x
// slower than cuBLASLt on a bf16 weight there (docs/perf/gemm.md §batch). Include from those two .cu files only.
//
// Scheme. A block of kBatchWarps warps owns batch_rows() consecutive weight rows (16 per warp) and a contiguous
// range of K steps (its split); every warp walks the same steps. Per step the block stages the x of all
// kTokenTiles * 8 token rows for the step's k into shared memory with cp.async (double-buffered), and each warp
// dequantizes its weight step in registers into mma A fragments as the decode schemes lay them out
// (nvfp4_device.cuh: 128-k steps, e2m1 * e4m3 bf16 products, exact; fp8_device.cuh: 64-k steps, here each value
// e4m3 * scale rounded to bf16 as the prefill and dequantized paths have it), then runs one mma per (m16 weight
// tile, token tile, k16). x fragments come from shared memory, shared by the block's warps; each warp keeps
// kBatchWeightDepth weight steps in flight.
//
// Split K: when the row blocks alone leave SMs idle, grid.y splits the steps (at most 8), and the splits of a row
// block form one thread-block cluster. Each block writes its fp32 partial sums to the context's workspace, the
// cluster meets at a barrier, and then each block adds the partials of its share of the row block's columns in split
// order and stores them, so the bits do not depend on timing. (One block reducing a whole row block was the first
// version: its serial tail grew with m and cost more than the mmas, docs/perf/gemm.md §batch.)
#pragma once

#include <algorithm>
#include <cstdint>

#include <cooperative_groups.h>

#include "kernels/cuda/fp8/fp8_device.cuh"
#include "kernels/cuda/gemm/dequant_prefill.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/nvfp4/nvfp4_device.cuh"
#include "kernels/cuda/ptx.cuh"

namespace tern::weight_batch {

using dequant_prefill::ColumnScales;
using dequant_prefill::Format;
using namespace nvfp4_device;

constexpr int kBatchWarps = 8;
// Warp tiles of 16 rows (one m16 tile): 32-row tiles issue fewer instructions per weight but leave half the warps,
// and measured slower past 32 activation rows and for FP8 (docs/perf/gemm.md §batch).
constexpr int kBatchMTiles = 1;
constexpr int kBatchWeightDepth = 3;  // weight steps in flight per warp
constexpr int kBatchThreads = kBatchWarps * 32;
// Weight rows of a block: a warp holds kMTiles m16 tiles (16 rows each).
__host__ __device__ constexpr int batch_rows(int m_tiles) { return kBatchWarps * 16 * m_tiles; }

// The prefill kernel's operands (x, the weight in its format, y, the output scales: NVFP4 weight_scale_2 times
// 2^kDecodeShift per part, FP8 1), and the split-K state the launcher fills in.
struct BatchParams : dequant_prefill::PrefillParams {
  float* partials;      // [splits, n, 8 * token tiles] fp32 when splits > 1: the context's weight workspace
  int steps_per_split;
};

// k per step and 16-byte x units per lane per step (NVFP4: 32 k of each token; FP8: 16).
template <Format kFormat>
__host__ __device__ constexpr int batch_step_k() {
  return kFormat == Format::kNvfp4 ? kDecodeStepK : fp8_device::kFp8DecodeStepK;
}
template <Format kFormat>
__host__ __device__ constexpr int lane_units() {
  return batch_step_k<kFormat>() / 32;
}

// The x tile of one step: token r's 16-byte unit u (k = 8u of the step) at unit r * R + u + u / G, G = lane_units:
// the units lane (g, t) reads at once (t G + j, token g) fall in eight distinct 16-byte bank groups for the eight
// lanes of a quarter warp (R = 20 or 12, both 4 mod 8), so the loads are conflict-free.
template <Format kFormat>
__host__ __device__ constexpr int x_row_units() {
  return batch_step_k<kFormat>() / 8 + batch_step_k<kFormat>() / 8 / lane_units<kFormat>();
}
template <Format kFormat>
__device__ __forceinline__ int x_unit(int row, int u) {
  return row * x_row_units<kFormat>() + u + u / lane_units<kFormat>();
}
template <Format kFormat, int kTokenTiles>
__host__ __device__ constexpr int x_tile_units() {
  return kTokenTiles * 8 * x_row_units<kFormat>();
}

// Stages step `step`'s x (token rows 0 .. 8 kTokenTiles - 1, zeros past m or k) into xs with cp.async.
template <Format kFormat, int kTokenTiles>
__device__ __forceinline__ void stage_x(const BatchParams& p, int step, uint4* xs) {
  constexpr int kUnits = batch_step_k<kFormat>() / 8, kPieces = kTokenTiles * 8 * kUnits;
#pragma unroll
  for (int i = threadIdx.x; i < kPieces; i += kBatchThreads) {
    const int r = i / kUnits, u = i % kUnits;
    const int kk = step * batch_step_k<kFormat>() + 8 * u;
    const bool valid = r < p.m && kk < p.k;  // k is a multiple of 16: a unit is all in or all out
    const uint16_t* src = valid ? p.x + static_cast<int64_t>(r) * p.k + kk : p.x;
    ptx::cp_async_16_zfill(xs + x_unit<kFormat>(r, u), src, valid);
  }
}

// A warp's weight registers for one step: rows g + 8h, h < 2 kMTiles.
template <int kMTiles>
struct Fp8BatchW {
  uint4 w[2 * kMTiles];  // the lane's 16 codes of each row
  float s[2 * kMTiles];  // their scales for the step's 128-column block
};
template <Format kFormat, int kMTiles>
struct BatchW {
  using type = DecodeW<kMTiles>;  // 32 codes of each row and their block scales
};
template <int kMTiles>
struct BatchW<Format::kFp8, kMTiles> {
  using type = Fp8BatchW<kMTiles>;
};

template <Format kFormat, int kMTiles>
__device__ __forceinline__ void load_w(const BatchParams& p, int n0, int step,
                                       typename BatchW<kFormat, kMTiles>::type& w) {
  if constexpr (kFormat == Format::kNvfp4) {
    decode_load_w<kMTiles, true>(p.packed, p.scales, p.n, p.k, n0, step, w);
  } else {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int k0 = step * fp8_device::kFp8DecodeStepK + t * 16;
    const bool step_in = step * fp8_device::kFp8DecodeStepK < p.k;
    const int64_t scale_cols = fp8_device::fp8_scale_cols(p.k);
#pragma unroll
    for (int h = 0; h < 2 * kMTiles; ++h) {
      const int row = n0 + g + 8 * h;
      w.w[h] = row < p.n && k0 < p.k ? ptx::ld_stream_16(p.packed + static_cast<int64_t>(row) * p.k + k0)
                                     : make_uint4(0, 0, 0, 0);
      // Every lane takes the step's scale (fp8_decode_load says why).
      w.s[h] =
          row < p.n && step_in
              ? __ldg(p.row_scales + row * scale_cols + step * fp8_device::kFp8DecodeStepK / fp8_device::kFp8ScaleBlock)
              : 0.0f;
    }
  }
}

// acc[tt][mt] += the step's product of weight rows 16 mt .. 16 mt + 15 of the warp and token tile tt. The mmas are
// issued with the token tiles innermost, so consecutive ones never share an accumulator (mma.sync is asm volatile:
// the compiler keeps this order, and an mma on the accumulator of the one before waits for its result).
template <int kMTiles, int kTokenTiles>
__device__ __forceinline__ void nvfp4_step(const DecodeW<kMTiles>& w, const uint4* xs,
                                           float (&acc)[kTokenTiles][kMTiles][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    uint32_t sc[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) decode_scales(w.s[mt] >> (16 * b), sc[mt]);
#pragma unroll
    for (int j = 2 * b; j < 2 * b + 2; ++j) {
      uint32_t a[kMTiles][2][4];  // [m16 tile][half][A register]
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        uint32_t lo[4], hi[4];
        decode_e2m1_pairs(uint4_word(w.q[2 * mt], j), lo);
        decode_e2m1_pairs(uint4_word(w.q[2 * mt + 1], j), hi);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          lo[i] = bf16x2_mul(lo[i], sc[mt][0]);
          hi[i] = bf16x2_mul(hi[i], sc[mt][1]);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          a[mt][half][0] = lo[2 * half];
          a[mt][half][1] = hi[2 * half];
          a[mt][half][2] = lo[2 * half + 1];
          a[mt][half][3] = hi[2 * half + 1];
        }
      }
      uint32_t xb[kTokenTiles][4];
#pragma unroll
      for (int tt = 0; tt < kTokenTiles; ++tt)
        decode_x_pairs(xs[x_unit<Format::kNvfp4>(8 * tt + g, 4 * t + j)], xb[tt]);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int tt = 0; tt < kTokenTiles; ++tt) {
            const uint32_t bx[2] = {xb[tt][2 * half], xb[tt][2 * half + 1]};
            ptx::mma_bf16_16816(acc[tt][mt], a[mt][half], bx);
          }
        }
      }
    }
  }
}

// FP8: each weight value is e4m3 * its row's scale rounded to bf16 once (fp8_dequant16: the dequantized weight of
// transformers and of the other multi-row paths), so the mmas add straight into acc.
template <int kMTiles, int kTokenTiles>
__device__ __forceinline__ void fp8_step(const Fp8BatchW<kMTiles>& w, const uint4* xs,
                                         float (&acc)[kTokenTiles][kMTiles][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  uint32_t v[2 * kMTiles][8];  // rows g + 8h as bf16 pairs
#pragma unroll
  for (int h = 0; h < 2 * kMTiles; ++h) fp8_device::fp8_dequant16(w.w[h], w.s[h], v[h]);
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // k slots 4q .. 4q + 3 of the lane's 16: x words 2q, 2q + 1 of its two units
    uint32_t b[kTokenTiles][2];
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) {
      const uint2 xq = reinterpret_cast<const uint2*>(xs + x_unit<Format::kFp8>(8 * tt + g, 2 * t + q / 2))[q % 2];
      b[tt][0] = xq.x;
      b[tt][1] = xq.y;
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const uint32_t a[4] = {v[2 * mt][2 * q], v[2 * mt + 1][2 * q], v[2 * mt][2 * q + 1], v[2 * mt + 1][2 * q + 1]};
#pragma unroll
      for (int tt = 0; tt < kTokenTiles; ++tt) ptx::mma_bf16_16816(acc[tt][mt], a, b[tt]);
    }
  }
}

// Resident blocks per SM the launch bounds ask for: two (16 warps) where a lane fits 128 registers, which
// NVFP4 with 32-row warp tiles and eight token tiles, or FP8's 32 rows held as 32 bf16 pairs, do not.
template <Format kFormat>
__host__ __device__ constexpr int batch_min_blocks(int m_tiles, int token_tiles) {
  return m_tiles == 1 || (kFormat == Format::kNvfp4 && token_tiles <= 4) ? 2 : 1;
}

template <Format kFormat, int kMTiles, int kTokenTiles>
__global__ void __launch_bounds__(kBatchThreads, batch_min_blocks<kFormat>(kMTiles, kTokenTiles))
    batch_kernel(const BatchParams p) {
  constexpr int kRows = batch_rows(kMTiles);
  __shared__ uint4 xs[2][x_tile_units<kFormat, kTokenTiles>()];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int block_n0 = blockIdx.x * kRows, n0 = block_n0 + warp * 16 * kMTiles;
  const int n_steps = (p.k + batch_step_k<kFormat>() - 1) / batch_step_k<kFormat>();
  const int first = blockIdx.y * p.steps_per_split;
  const int last = min(first + p.steps_per_split, n_steps);
  using W = typename BatchW<kFormat, kMTiles>::type;
  float acc[kTokenTiles][kMTiles][4] = {};
  // The weight steps stream through a ring of kBatchWeightDepth register sets, each refilled as soon as its step is
  // computed; the first ones leave before the programmatic-launch wait (no kernel writes weights).
  ptx::grid_dependents_launch();
  W ring[kBatchWeightDepth];
#pragma unroll
  for (int i = 0; i < kBatchWeightDepth; ++i) {
    if (first + i < last) load_w<kFormat, kMTiles>(p, n0, first + i, ring[i]);
  }
  ptx::grid_dependency_wait();
  stage_x<kFormat, kTokenTiles>(p, first, xs[0]);
  ptx::cp_async_commit();
  for (int base = first; base < last; base += kBatchWeightDepth) {
#pragma unroll
    for (int i = 0; i < kBatchWeightDepth; ++i) {
      const int step = base + i;
      if (step >= last) break;
      const int buf = (step - first) % 2;
      if (step + 1 < last) {
        stage_x<kFormat, kTokenTiles>(p, step + 1, xs[buf ^ 1]);
        ptx::cp_async_commit();
        ptx::cp_async_wait<1>();
      } else {
        ptx::cp_async_wait<0>();
      }
      __syncthreads();  // step's x is in xs[buf] for every warp
      if constexpr (kFormat == Format::kNvfp4) {
        nvfp4_step<kMTiles, kTokenTiles>(ring[i], xs[buf], acc);
      } else {
        fp8_step<kMTiles, kTokenTiles>(ring[i], xs[buf], acc);
      }
      if (step + kBatchWeightDepth < last) load_w<kFormat, kMTiles>(p, n0, step + kBatchWeightDepth, ring[i]);
      __syncthreads();  // every warp is done with xs[buf] before step + 2 is staged there
    }
  }
  ptx::cp_async_wait<0>();  // a split without steps still staged one
  // Fragment element e of lane (g, t), m16 tile mt, token tile tt: weight row n0 + 16 mt + g + 8 (e / 2), token
  // 8 tt + 2 t + e % 2.
  auto each = [&](auto&& f) {
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + 16 * mt + g + 8 * (e / 2), token = 8 * tt + 2 * t + e % 2;
          if (col < p.n && token < p.m) f(token, col, acc[tt][mt][e]);
        }
      }
    }
  };
  if (gridDim.y == 1) {
    each([&](int token, int col, float v) { p.y[token * p.ldy + col] = f32_to_bf16(v * p.out_scale.at(col)); });
    return;
  }
  // Partials as [split][col][token], token tiles padded: lane (g, t) holds tokens 2t, 2t + 1 of a column as a pair.
  constexpr int kTokens = 8 * kTokenTiles;
  float* mine = p.partials + static_cast<int64_t>(blockIdx.y) * p.n * kTokens;
#pragma unroll
  for (int tt = 0; tt < kTokenTiles; ++tt) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = n0 + 16 * mt + g + 8 * h;
        if (col < p.n) {
          *reinterpret_cast<float2*>(mine + static_cast<int64_t>(col) * kTokens + 8 * tt + 2 * t) =
              make_float2(acc[tt][mt][2 * h], acc[tt][mt][2 * h + 1]);
        }
      }
    }
  }
  // The cluster barrier's arrive has release and its wait acquire semantics at cluster scope, so every block of the
  // cluster sees the others' partials after it (no separate fence).
  cooperative_groups::this_cluster().sync();
  const int share = (kRows + gridDim.y - 1) / gridDim.y;
  const int c0 = block_n0 + blockIdx.y * share, c1 = min(min(c0 + share, block_n0 + kRows), p.n);
  const int64_t split_stride = static_cast<int64_t>(p.n) * kTokens;
  for (int i = threadIdx.x; i < (c1 - c0) * p.m; i += kBatchThreads) {
    const int col = c0 + i / p.m, token = i % p.m;
    const float* src = p.partials + static_cast<int64_t>(col) * kTokens + token;
    float sum = 0.0f;
    for (int s = 0; s < static_cast<int>(gridDim.y); ++s) sum += __ldcg(src + s * split_stride);
    p.y[token * p.ldy + col] = f32_to_bf16(sum * p.out_scale.at(col));
  }
}

// Row blocks, and the split of K that makes the grid about one wave of resident blocks (each split about two steps
// or more, so a block's weight loads overlap its mmas; at most a portable cluster); the partials must fit
// `partial_floats`.
struct BatchShape {
  int m_tiles, row_blocks, splits, steps_per_split;
};

constexpr int kBatchMaxSplits = 8;

template <Format kFormat>
inline BatchShape batch_choose_shape(int num_sms, int64_t n, int64_t k, int64_t partial_floats, int m_tiles,
                                     int token_tiles) {
  const int row_blocks = static_cast<int>((n + batch_rows(m_tiles) - 1) / batch_rows(m_tiles));
  const int steps = static_cast<int>((k + batch_step_k<kFormat>() - 1) / batch_step_k<kFormat>());
  const int wave = num_sms * batch_min_blocks<kFormat>(m_tiles, token_tiles);
  const int want = std::max(1, std::min({(wave + row_blocks - 1) / row_blocks, steps / 2, kBatchMaxSplits}));
  int splits = 1;  // a power of two (cluster shapes); a last split may get no steps and add zeros
  while (2 * splits <= want && 2 * splits * n * 8 * token_tiles <= partial_floats) splits *= 2;
  return BatchShape{m_tiles, row_blocks, splits, (steps + splits - 1) / splits};
}

// launch_kernel's launch (programmatic when the context says so), the splits of a row block as one cluster.
template <Format kFormat, int kMTiles, int kTokenTiles>
void launch_tiles(const dequant_prefill::PrefillParams& p, const BatchShape& shape, const DeviceContext& ctx) {
  const BatchParams q{p, reinterpret_cast<float*>(ctx.weight_workspace()), shape.steps_per_split};
  launch_kernel_clustered(ctx, batch_kernel<kFormat, kMTiles, kTokenTiles>,
                          dim3(static_cast<unsigned>(shape.row_blocks), static_cast<unsigned>(shape.splits)),
                          dim3(kBatchThreads), 0, dim3(1, static_cast<unsigned>(shape.splits), 1), q);
  TERN_CUDA_CHECK_LAUNCH();
}

// Launches for p.m in 1 .. 64 (four token tiles up to 32 rows, eight above); the partials go to the context's
// weight_workspace.
template <Format kFormat>
void launch(const dequant_prefill::PrefillParams& p, const DeviceContext& ctx) {
  const int token_tiles = p.m <= 32 ? 4 : 8;
  const BatchShape shape = batch_choose_shape<kFormat>(ctx.props().num_sms, p.n, p.k,
                                                       ctx.weight_workspace_bytes() / sizeof(float), kBatchMTiles,
                                                       token_tiles);
  if (token_tiles == 4) return launch_tiles<kFormat, kBatchMTiles, 4>(p, shape, ctx);
  launch_tiles<kFormat, kBatchMTiles, 8>(p, shape, ctx);
}

}  // namespace tern::weight_batch
