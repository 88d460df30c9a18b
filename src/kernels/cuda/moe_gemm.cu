// The grouped expert GEMM of the MoE block (contract in moe_launch.h): every expert's rows times that expert's
// weight, bf16 or NVFP4, in one launch, with no host synchronisation. Both variants size their grid for the worst
// case and each block looks its work up in expert_offsets:
//   decode:  grid (16-row weight tiles, active-expert slots). Slot s takes the s-th expert that has rows; slots
//            past the active count exit at once. The weight streams once per 16 of the expert's rows with 16-byte
//            loads straight into mma fragments (nvfp4_device.cuh's decode scheme; bf16 the same way, unconverted).
//   prefill: grid (row tiles, 128-column weight tiles). The worst case needs ceil(rows / BM) + n_experts row tiles
//            (every expert's last tile may be partial); tile i belongs to the expert whose tile range holds i.
//            x rows are gathered through sorted_pairs by cp.async, W tiles go to shared memory as bf16 (NVFP4
//            dequantised as in the dense prefill kernel), mma.sync m16n8k16 with fp32 accumulation.
// NVFP4 semantics are W4A16 (model-specs.md 1.5): exact bf16 weight factors, weight_scale_2 applied to the fp32 sum.
#include <algorithm>
#include "kernels/cuda/module_attributes.h"
#include <type_traits>

#include "kernels/cuda/moe_launch.h"
#include "kernels/cuda/nvfp4_device.cuh"

namespace tern {

using namespace nvfp4_device;

namespace {

constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr bool kNvfp4 = true;

struct GemmParams {
  const uint16_t* x;
  int64_t ldx;
  const int32_t* sorted_pairs;
  int top_k;
  bool gather;
  const int32_t* offsets;  // [n_experts + 1]
  int n_experts, n, k;
  const uint16_t* wbf;     // bf16 [n_experts][n][k] at wbf_stride elements
  int64_t wbf_stride;
  const uint8_t* packed;   // NVFP4 [n_experts][n][k/2] at packed_stride bytes
  int64_t packed_stride;
  const uint8_t* scales;   // NVFP4 [n_experts][n][k/16] at scales_stride bytes
  int64_t scales_stride;
  const float* global_scales;
  uint16_t* y;
  int64_t ldy;
  bool y_pairs;  // (col, col + 1) of y may be stored as one 4-byte word
};

// The element offset of permuted row r's activations in x.
__device__ __forceinline__ int64_t x_row_offset(const GemmParams& p, int r) {
  const int src = p.gather ? p.sorted_pairs[r] / p.top_k : r;
  return static_cast<int64_t>(src) * p.ldx;
}

// The s-th expert (in index order) that has rows, or -1; the whole warp calls it and gets the same answer.
__device__ int find_active_expert(const int32_t* off, int n_experts, int s) {
  const int lane = threadIdx.x % 32;
  for (int base = 0; base < n_experts; base += 32) {
    const int e = base + lane;
    const bool active = e < n_experts && off[e + 1] > off[e];
    const unsigned mask = __ballot_sync(kFullMask, active);
    const int count = __popc(mask);
    if (s < count) {
      const unsigned hit = __ballot_sync(kFullMask, active && __popc(mask & ((1u << lane) - 1u)) == s);
      return base + __ffs(hit) - 1;
    }
    s -= count;
  }
  return -1;
}

struct TileWork {
  int expert;   // -1: no tile with this index
  int row0;     // first permuted row of the tile
  int row_end;  // the expert's end row
};

// Row tile `tile` when expert e owns ceil(rows_e / bm) consecutive tiles, in expert order. Whole warp.
__device__ TileWork find_row_tile(const int32_t* off, int n_experts, int tile, int bm) {
  const int lane = threadIdx.x % 32;
  int first = 0;  // tiles of the experts before this group of 32
  for (int base = 0; base < n_experts; base += 32) {
    const int e = base + lane;
    const int lo = e < n_experts ? off[e] : 0, hi = e < n_experts ? off[e + 1] : 0;
    const int tiles = hi > lo ? (hi - lo + bm - 1) / bm : 0;
    int incl = tiles;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int other = __shfl_up_sync(kFullMask, incl, d);
      if (lane >= d) incl += other;
    }
    const int total = __shfl_sync(kFullMask, incl, 31);
    if (tile < first + total) {
      const bool mine = tile >= first + incl - tiles && tile < first + incl;
      const int owner = __ffs(__ballot_sync(kFullMask, mine)) - 1;
      const int local = tile - first - __shfl_sync(kFullMask, incl - tiles, owner);
      return {base + owner, __shfl_sync(kFullMask, lo, owner) + local * bm, __shfl_sync(kFullMask, hi, owner)};
    }
    first += total;
  }
  return {-1, 0, 0};
}

// ---------------------------------------------------------------------------------------------------------------
// Decode. A block owns 16 weight rows (mma M) of one expert and takes the expert's rows 8 * kTokenTiles at a time
// (mma N); its warps split K. NVFP4 uses the dense decode scheme unchanged. For bf16, lane (g, t) loads 16
// consecutive k (32 bytes) of weight rows g and g + 8 per 64-k warp step; mma q of the step feeds words 2q, 2q+1
// of the row pair as the A slots (2t, 2t+1) and (2t+8, 2t+9), and x's words 2q, 2q+1 at the same k as B, which is
// all the mma needs (it sums over its 16 k slots in any assignment).

constexpr int kDecodeUnroll = 2;   // steps whose loads are issued before any is used
constexpr int kBf16DecodeStepK = 64;

template <int kTokenTiles>
struct Bf16DecodeChunk {
  uint4 w[2][2];              // rows g and g+8: 16 bf16 each
  uint4 x[kTokenTiles][2];    // token g of each tile: the same 16 k
};

__device__ __forceinline__ uint32_t word_of(const uint4 (&v)[2], int m) {  // bf16 pair m of 16 values
  const uint4& h = v[m / 4];
  switch (m % 4) {
    case 0: return h.x;
    case 1: return h.y;
    case 2: return h.z;
    default: return h.w;
  }
}

template <int kTokenTiles>
__device__ __forceinline__ void bf16_decode_load(const GemmParams& p, const uint16_t* w, int n0, int step,
                                                 const int64_t (&xoff)[kTokenTiles], Bf16DecodeChunk<kTokenTiles>& c) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int k0 = step * kBf16DecodeStepK + t * 16;  // k is a multiple of 16: the 16 values are all in or all out
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = n0 + g + 8 * r;
    const bool ok = row < p.n && k0 < p.k;
    const uint4* src = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(row) * p.k + k0);
    c.w[r][0] = ok ? __ldcs(src) : make_uint4(0, 0, 0, 0);
    c.w[r][1] = ok ? __ldcs(src + 1) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int tt = 0; tt < kTokenTiles; ++tt) {
    const bool ok = xoff[tt] >= 0 && k0 < p.k;
    const uint4* src = reinterpret_cast<const uint4*>(p.x + xoff[tt] + k0);
    c.x[tt][0] = ok ? __ldg(src) : make_uint4(0, 0, 0, 0);
    c.x[tt][1] = ok ? __ldg(src + 1) : make_uint4(0, 0, 0, 0);
  }
}

template <int kTokenTiles>
__device__ __forceinline__ void bf16_decode_mma(const Bf16DecodeChunk<kTokenTiles>& c, float (&acc)[kTokenTiles][4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t a[4] = {word_of(c.w[0], 2 * q), word_of(c.w[1], 2 * q), word_of(c.w[0], 2 * q + 1),
                           word_of(c.w[1], 2 * q + 1)};
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) {
      const uint32_t b[2] = {word_of(c.x[tt], 2 * q), word_of(c.x[tt], 2 * q + 1)};
      mma_bf16_16816(acc[tt], a, b);
    }
  }
}

// The NVFP4 chunk: the dense kernel's weight load, x gathered from the tile's rows.
template <int kTokenTiles, bool kVec16>
__device__ __forceinline__ void nvfp4_decode_load(const GemmParams& p, const uint8_t* packed, const uint8_t* scales,
                                                  int n0, int step, const int64_t (&xoff)[kTokenTiles],
                                                  DecodeChunk<kTokenTiles>& c) {
  decode_load_w<kTokenTiles, kVec16>(packed, scales, p.n, p.k, n0, step, c);
  const int t = threadIdx.x % 4;
  const int k0 = step * kDecodeStepK + t * 32;
  const int valid = min(32, p.k - k0);  // 32, 16 or <= 0
#pragma unroll
  for (int tt = 0; tt < kTokenTiles; ++tt) {
    const uint4* src = reinterpret_cast<const uint4*>(p.x + xoff[tt] + k0);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool ok = xoff[tt] >= 0 && 8 * j < valid;  // 16-byte piece j: k0 + 8j .. k0 + 8j + 7
      c.x[tt][j] = ok ? __ldg(src + j) : make_uint4(0, 0, 0, 0);
    }
  }
}

// The K loop of one pass: this warp's steps warp, warp + kWarps, ..., kDecodeUnroll at a time.
template <bool kIsNvfp4, int kWarps, int kTokenTiles, bool kVec16>
__device__ __forceinline__ void decode_k_loop(const GemmParams& p, int e, int n0, const int64_t (&xoff)[kTokenTiles],
                                              float (&acc)[kTokenTiles][4]) {
  const int warp = threadIdx.x / 32;
  if constexpr (kIsNvfp4) {
    const uint8_t* packed = p.packed + e * p.packed_stride;
    const uint8_t* scales = p.scales + e * p.scales_stride;
    const int n_steps = (p.k + kDecodeStepK - 1) / kDecodeStepK;
    for (int s = warp; s < n_steps; s += kWarps * kDecodeUnroll) {
      DecodeChunk<kTokenTiles> chunks[kDecodeUnroll];
#pragma unroll
      for (int u = 0; u < kDecodeUnroll; ++u) {
        const int step = s + u * kWarps;
        if (step < n_steps) {
          nvfp4_decode_load<kTokenTiles, kVec16>(p, packed, scales, n0, step, xoff, chunks[u]);
        } else {
          chunks[u] = {};  // all-zero weights: contributes nothing
        }
      }
#pragma unroll
      for (int u = 0; u < kDecodeUnroll; ++u) decode_mma_chunk<kTokenTiles>(chunks[u], acc);
    }
  } else {
    const uint16_t* w = p.wbf + e * p.wbf_stride;
    const int n_steps = (p.k + kBf16DecodeStepK - 1) / kBf16DecodeStepK;
    for (int s = warp; s < n_steps; s += kWarps * kDecodeUnroll) {
      Bf16DecodeChunk<kTokenTiles> chunks[kDecodeUnroll];
#pragma unroll
      for (int u = 0; u < kDecodeUnroll; ++u) bf16_decode_load<kTokenTiles>(p, w, n0, s + u * kWarps, xoff, chunks[u]);
#pragma unroll
      for (int u = 0; u < kDecodeUnroll; ++u) bf16_decode_mma<kTokenTiles>(chunks[u], acc);
    }
  }
}

// Sums the warps' fragments through shared memory and writes y. Fragment element i of lane (g, t) in token tile tt
// is weight row g + 8 * (i / 2), tile row tt * 8 + 2t + i % 2.
template <int kWarps, int kTokenTiles>
__device__ __forceinline__ void decode_reduce_store(const GemmParams& p, int n0, int r0, int row_end, float out_scale,
                                                    const float (&acc)[kTokenTiles][4], float* red) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int tt = 0; tt < kTokenTiles; ++tt) {
    *reinterpret_cast<float4*>(&red[((warp * kTokenTiles + tt) * 32 + lane) * 4]) =
        make_float4(acc[tt][0], acc[tt][1], acc[tt][2], acc[tt][3]);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kTokenTiles * 128; idx += kWarps * 32) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[w * kTokenTiles * 128 + idx];
    const int tt = idx / 128, l = (idx / 4) % 32, i = idx % 4;
    const int col = n0 + l / 4 + 8 * (i / 2);
    const int row = r0 + tt * 8 + 2 * (l % 4) + i % 2;
    if (col < p.n && row < row_end) p.y[static_cast<int64_t>(row) * p.ldy + col] = float_to_bf16_bits(sum * out_scale);
  }
  __syncthreads();  // red is rewritten by the next pass
}

template <bool kIsNvfp4, int kWarps, int kTokenTiles, bool kVec16>
__global__ void __launch_bounds__(kWarps * 32, 16 / kWarps) moe_decode_kernel(const GemmParams p) {
  __shared__ __align__(16) float red[kWarps * kTokenTiles * 128];
  const int e = find_active_expert(p.offsets, p.n_experts, blockIdx.y);
  if (e < 0) return;  // every warp found the same: the whole block leaves
  const int row_begin = p.offsets[e], row_end = p.offsets[e + 1];
  const int n0 = blockIdx.x * kDecodeRows;
  const float out_scale = kIsNvfp4 ? p.global_scales[e] * static_cast<float>(1 << kDecodeShift) : 1.0f;
  const int g = (threadIdx.x % 32) / 4;
  for (int r0 = row_begin; r0 < row_end; r0 += 8 * kTokenTiles) {
    int64_t xoff[kTokenTiles];  // -1: past the expert's rows
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) {
      const int r = r0 + tt * 8 + g;
      xoff[tt] = r < row_end ? x_row_offset(p, r) : -1;
    }
    float acc[kTokenTiles][4] = {};
    decode_k_loop<kIsNvfp4, kWarps, kTokenTiles, kVec16>(p, e, n0, xoff, acc);
    decode_reduce_store<kWarps, kTokenTiles>(p, n0, r0, row_end, out_scale, acc, red);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Prefill. The dense prefill kernel's pipeline over one expert's row tile: x stages by cp.async (kStages deep) from
// the gathered rows, W for step s + 2 in registers while step s computes, W tiles double-buffered as bf16.

struct Bf16WRegs {
  uint4 v[2];  // thread tid: W row tid / 2, k half tid % 2 (16 values) of a 32-k step
};

__device__ __forceinline__ Bf16WRegs bf16_prefill_load_w(const uint16_t* w, int n, int k, int n0, int kstep) {
  const int row = n0 + threadIdx.x / 2;
  const int kb = kstep * kPrefillBk + (threadIdx.x % 2) * 16;
  Bf16WRegs r{{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)}};
  if (row < n && kb < k) {
    const uint4* src = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(row) * k + kb);
    r.v[0] = __ldcs(src);
    r.v[1] = __ldcs(src + 1);
  }
  return r;
}

__device__ __forceinline__ void bf16_prefill_store_w(const Bf16WRegs& r, uint16_t* ws) {
  uint4* dst = reinterpret_cast<uint4*>(ws + (threadIdx.x / 2) * kPrefillLd + (threadIdx.x % 2) * 16);
  dst[0] = r.v[0];
  dst[1] = r.v[1];
}

template <int kBm>
constexpr size_t prefill_smem_bytes(int stages) {
  return sizeof(uint16_t) * kPrefillLd * (static_cast<size_t>(stages) * kBm + 2 * kPrefillBn) +
         256 * sizeof(uint32_t) + kBm * sizeof(int64_t);
}

// x tile rows from their gathered offsets (xoff[r] < 0: past the expert's rows, zero-filled).
template <int kBm>
__device__ __forceinline__ void prefill_load_x(const GemmParams& p, const int64_t* xoff, int kstep, uint16_t* xs) {
  constexpr int kPieces = kBm * kPrefillBk / 8;  // 16-byte pieces
#pragma unroll
  for (int i = threadIdx.x; i < kPieces; i += kPrefillThreads) {
    const int r = i / (kPrefillBk / 8), c = i % (kPrefillBk / 8);
    const int kk = kstep * kPrefillBk + c * 8;
    const bool valid = xoff[r] >= 0 && kk < p.k;
    cp_async_16_zfill(xs + r * kPrefillLd + c * 8, valid ? p.x + xoff[r] + kk : p.x, valid);
  }
}

template <int kBm>
__device__ __forceinline__ void prefill_store_y(const GemmParams& p, const TileWork& tw, int n0, float out_scale,
                                                const float (&acc)[kBm / 32][4][4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mi = 0; mi < kBm / 32; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = tw.row0 + (warp / 4) * (kBm / 2) + mi * 16 + g + 8 * h;
        const int col = n0 + (warp % 4) * 32 + ni * 8 + 2 * t;
        if (row >= tw.row_end || col >= p.n) continue;
        uint16_t* dst = p.y + static_cast<int64_t>(row) * p.ldy + col;
        const uint16_t v0 = float_to_bf16_bits(acc[mi][ni][2 * h] * out_scale);
        const uint16_t v1 = float_to_bf16_bits(acc[mi][ni][2 * h + 1] * out_scale);
        if (p.y_pairs) {
          *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(v0) | (static_cast<uint32_t>(v1) << 16);
        } else {
          dst[0] = v0;
          if (col + 1 < p.n) dst[1] = v1;
        }
      }
    }
  }
}

template <bool kIsNvfp4, int kBm, int kStages>
__global__ void __launch_bounds__(kPrefillThreads) moe_prefill_kernel(const GemmParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem);                              // [kStages][kBm][kPrefillLd]
  uint16_t* ws = xs + kStages * kBm * kPrefillLd;                                 // [2][kPrefillBn][kPrefillLd]
  uint32_t* lut = reinterpret_cast<uint32_t*>(ws + 2 * kPrefillBn * kPrefillLd);  // [256]
  int64_t* xoff = reinterpret_cast<int64_t*>(lut + 256);                          // [kBm]
  const TileWork tw = find_row_tile(p.offsets, p.n_experts, blockIdx.x, kBm);
  if (tw.expert < 0) return;  // every warp found the same: the whole block leaves
  const int e = tw.expert, n0 = blockIdx.y * kPrefillBn;
  const int n_ksteps = (p.k + kPrefillBk - 1) / kPrefillBk;
  const float out_scale = kIsNvfp4 ? p.global_scales[e] : 1.0f;

  // Stage 1: gathered row offsets and the e2m1 table; then the pipeline's first x stages and W tiles.
  for (int i = threadIdx.x; i < kBm; i += kPrefillThreads) {
    xoff[i] = tw.row0 + i < tw.row_end ? x_row_offset(p, tw.row0 + i) : -1;
  }
  if constexpr (kIsNvfp4) lut[threadIdx.x] = e2m1_byte_to_bf16x2(threadIdx.x);
  __syncthreads();
  using WRegs = std::conditional_t<kIsNvfp4, PrefillWRegs, Bf16WRegs>;
  auto load_w = [&](int kstep) -> WRegs {
    if constexpr (kIsNvfp4) {
      return prefill_load_w(p.packed + e * p.packed_stride, p.scales + e * p.scales_stride, p.n, p.k, n0, kstep);
    } else {
      return bf16_prefill_load_w(p.wbf + e * p.wbf_stride, p.n, p.k, n0, kstep);
    }
  };
  auto store_w = [&](const WRegs& r, int buffer) {
    if constexpr (kIsNvfp4) {
      prefill_store_w(r, lut, ws + buffer * kPrefillBn * kPrefillLd);
    } else {
      bf16_prefill_store_w(r, ws + buffer * kPrefillBn * kPrefillLd);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_ksteps) prefill_load_x<kBm>(p, xoff, s, xs + s * kBm * kPrefillLd);
    cp_async_commit();  // always, so the group count per step stays uniform
  }
  WRegs w = load_w(0);
  store_w(w, 0);
  if (n_ksteps > 1) w = load_w(1);

  // Stage 2: the K loop.
  float acc[kBm / 32][4][4] = {};
  for (int ks = 0; ks < n_ksteps; ++ks) {
    cp_async_wait<kStages - 2>();
    // Step ks's x and W tiles are complete and every warp has finished step ks - 1, whose buffers we refill.
    __syncthreads();
    const int next = ks + kStages - 1;
    if (next < n_ksteps) prefill_load_x<kBm>(p, xoff, next, xs + (next % kStages) * kBm * kPrefillLd);
    cp_async_commit();
    prefill_mma_step<kBm>(xs + (ks % kStages) * kBm * kPrefillLd, ws + (ks % 2) * kPrefillBn * kPrefillLd, acc);
    if (ks + 1 < n_ksteps) {
      store_w(w, (ks + 1) % 2);
      if (ks + 2 < n_ksteps) w = load_w(ks + 2);
    }
  }
  cp_async_wait<0>();

  // Stage 3: y.
  prefill_store_y<kBm>(p, tw, n0, out_scale, acc);
}

// ---------------------------------------------------------------------------------------------------------------
// Host side: parameters, tile choices, launches.

bool is_aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

GemmParams make_params(const MoeGemmArgs& a) {
  const MoeExpertWeights& w = a.w;
  return GemmParams{.x = a.x,
                    .ldx = a.ldx,
                    .sorted_pairs = a.sorted_pairs,
                    .top_k = static_cast<int>(a.top_k),
                    .gather = a.gather,
                    .offsets = a.expert_offsets,
                    .n_experts = static_cast<int>(w.n_experts),
                    .n = static_cast<int>(w.n),
                    .k = static_cast<int>(w.k),
                    .wbf = w.bf16,
                    .wbf_stride = w.bf16_expert_stride,
                    .packed = w.packed,
                    .packed_stride = w.packed_expert_stride,
                    .scales = w.scales,
                    .scales_stride = w.scales_expert_stride,
                    .global_scales = w.global_scales,
                    .y = a.y,
                    .ldy = a.ldy,
                    .y_pairs = w.n % 2 == 0 && a.ldy % 2 == 0 && is_aligned(a.y, 4)};
}

// Warps per decode block, as the dense decode kernel chooses them: at least ~16 resident warps per SM for enough
// loads in flight, splitting K over more warps when blocks are scarce, never more warps than K steps. The active
// experts are unknown on the host; min(n_experts, rows) bounds them.
int decode_choose_warps(const DeviceProps& props, const MoeGemmArgs& a, int step_k) {
  const int64_t slots = std::min(a.w.n_experts, a.rows);
  const int64_t blocks = (a.w.n + kDecodeRows - 1) / kDecodeRows * slots;
  const int64_t steps = (a.w.k + step_k - 1) / step_k;
  int warps = 16;
  if (blocks >= 2LL * props.num_sms) warps = 8;
  if (blocks >= 4LL * props.num_sms) warps = 4;
  while (warps > 4 && warps > steps) warps /= 2;
  return warps;
}

template <bool kIsNvfp4, int kTokenTiles, bool kVec16>
void decode_launch(const GemmParams& p, int warps, dim3 grid, cudaStream_t stream) {
  switch (warps) {
    case 4: moe_decode_kernel<kIsNvfp4, 4, kTokenTiles, kVec16><<<grid, 4 * 32, 0, stream>>>(p); break;
    case 8: moe_decode_kernel<kIsNvfp4, 8, kTokenTiles, kVec16><<<grid, 8 * 32, 0, stream>>>(p); break;
    default: moe_decode_kernel<kIsNvfp4, 16, kTokenTiles, kVec16><<<grid, 16 * 32, 0, stream>>>(p); break;
  }
  TERN_CUDA_CHECK_LAUNCH();
}

template <int kTokenTiles>
void decode_launch_format(const GemmParams& p, const MoeGemmArgs& a, int warps, dim3 grid, cudaStream_t stream) {
  if (a.w.format == MoeWeightFormat::kBf16) return decode_launch<!kNvfp4, kTokenTiles, false>(p, warps, grid, stream);
  // 16-byte weight loads need 16-byte aligned rows (k % 32) in every expert; the paired scale load 2-byte ones.
  const bool vec16 = a.w.k % 32 == 0 && is_aligned(a.w.packed, 16) && a.w.packed_expert_stride % 16 == 0 &&
                     is_aligned(a.w.scales, 2) && a.w.scales_expert_stride % 2 == 0;
  if (vec16) return decode_launch<kNvfp4, kTokenTiles, true>(p, warps, grid, stream);
  decode_launch<kNvfp4, kTokenTiles, false>(p, warps, grid, stream);
}

template <bool kIsNvfp4, int kBm, int kStages>
void prefill_launch_tiles(const GemmParams& p, int64_t rows, int64_t n_experts, cudaStream_t stream) {
  constexpr size_t kSmem = prefill_smem_bytes<kBm>(kStages);
  TERN_CUDA_CHECK(cudaFuncSetAttribute(moe_prefill_kernel<kIsNvfp4, kBm, kStages>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  const dim3 grid(static_cast<unsigned>((rows + kBm - 1) / kBm + n_experts),
                  static_cast<unsigned>((p.n + kPrefillBn - 1) / kPrefillBn));
  moe_prefill_kernel<kIsNvfp4, kBm, kStages><<<grid, kPrefillThreads, kSmem, stream>>>(p);
  TERN_CUDA_CHECK_LAUNCH();
}

template <bool kIsNvfp4, int kBm>
void prefill_launch_stages(const GemmParams& p, const MoeGemmArgs& a, int stages, cudaStream_t stream) {
  if (stages == 4) return prefill_launch_tiles<kIsNvfp4, kBm, 4>(p, a.rows, a.w.n_experts, stream);
  if (stages == 3) return prefill_launch_tiles<kIsNvfp4, kBm, 3>(p, a.rows, a.w.n_experts, stream);
  prefill_launch_tiles<kIsNvfp4, kBm, 2>(p, a.rows, a.w.n_experts, stream);
}

template <int kBm>
void prefill_launch_format(const GemmParams& p, const MoeGemmArgs& a, const DeviceProps& props, cudaStream_t stream) {
  // As many x stages (up to 4) as fit twice in one SM's shared memory, so two blocks overlap each other's
  // barriers, and at least within the per-block opt-in limit.
  auto fits = [&](int stages) {
    const size_t bytes = prefill_smem_bytes<kBm>(stages);
    return bytes <= props.shared_mem_per_block_optin && 2 * bytes <= props.shared_mem_per_sm;
  };
  const int stages = fits(4) ? 4 : fits(3) ? 3 : 2;
  if (a.w.format == MoeWeightFormat::kNvfp4) return prefill_launch_stages<kNvfp4, kBm>(p, a, stages, stream);
  prefill_launch_stages<!kNvfp4, kBm>(p, a, stages, stream);
}

}  // namespace

void moe_gemm_launch_decode(const DeviceContext& ctx, const MoeGemmArgs& a) {
  const GemmParams p = make_params(a);
  const bool nvfp4 = a.w.format == MoeWeightFormat::kNvfp4;
  const int warps = decode_choose_warps(ctx.props(), a, nvfp4 ? kDecodeStepK : kBf16DecodeStepK);
  const dim3 grid(static_cast<unsigned>((a.w.n + kDecodeRows - 1) / kDecodeRows),
                  static_cast<unsigned>(std::min(a.w.n_experts, a.rows)));
  // One 8-row tile per pass covers every expert while tokens <= 8 (a token picks an expert once).
  if (a.rows <= 8 * a.top_k) return decode_launch_format<1>(p, a, warps, grid, ctx.stream());
  decode_launch_format<2>(p, a, warps, grid, ctx.stream());
}

// Row tiles of 128 halve the W dequantisation per output, but each expert's last tile is partial: while experts
// average fewer than 128 rows, 64-row tiles waste less.
void moe_gemm_launch_prefill(const DeviceContext& ctx, const MoeGemmArgs& a) {
  const GemmParams p = make_params(a);
  if (a.rows >= 128 * a.w.n_experts) return prefill_launch_format<128>(p, a, ctx.props(), ctx.stream());
  prefill_launch_format<64>(p, a, ctx.props(), ctx.stream());
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t moe_gemm_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, moe_prefill_kernel<true, 128, 2>);
}

}  // namespace tern
