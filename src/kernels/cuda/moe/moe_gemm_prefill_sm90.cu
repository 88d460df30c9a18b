// The prefill variant of the grouped expert GEMM on Hopper (sm_90a): the same contract and row tiles as
// moe_gemm_prefill.cu (moe_launch.h, moe_gemm_device.cuh), with the products on wgmma instead of mma.sync. Two
// kernels: the first below (every format; the weight dequantized into a shared-memory tile), and for NVFP4 with
// k % 128 == 0 the second, with the weight in registers (moe_prefill_rs_kernel, docs/perf/gpu.md §moe-prefill-rs).
//
// A block of two warpgroups computes a kBm x kBn tile of one expert's rows (kBn weight rows, 256 as launched) over K
// in 64-k steps. Every stage of a kStages-deep ring holds the step's x tile (kBm gathered rows, by cp.async) and W
// tile (bf16 by cp.async; NVFP4 and FP8 loaded into registers one step early and dequantized into the tile, NVFP4
// as exact bf16 factors, FP8 as e4m3 * row scale rounded once to bf16), both in the 128-byte-swizzled K-major layout
// wgmma reads from shared memory (wgmma.cuh). Per step each
// warpgroup issues its four k16 wgmmas asynchronously, then refills the stage kWgLag steps behind while they run,
// and waits for the previous step's group before the next barrier, so loads, dequantization and tensor-core work
// overlap. Warpgroup tiles: kBm = 128: warpgroup w takes rows 64 w .. 64 w + 63 and all kBn columns (m64n256);
// kBm = 64: all 64 rows and columns kBn / 2 * w onwards (m64n128). Every warpgroup issues its products, also one
// whose rows all lie past its expert's last row (copies of the tile's first row, never stored): skipping them puts the
// wgmmas under a branch, and ptxas then serializes them (docs/perf/gpu.md §moe-prefill-wgmma).
//
// Why a stage is refilled two steps behind: after the barrier of step s every warpgroup has waited for its step
// s - 2 group (wait_group<1> at the end of step s - 1), so the stage of step s - 2 is free while step s - 1 may still
// be in the tensor cores. Requires k % 64 == 0 (the launcher falls back to the mma.sync kernel otherwise).
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/wgmma.cuh"

#include "kernels/cuda/fp8/fp8_device.cuh"
#include "kernels/cuda/moe/moe_gemm_device.cuh"
#include "kernels/cuda/moe/moe_launch.h"
#include "kernels/cuda/nvfp4/nvfp4_device.cuh"

namespace tern {

using namespace nvfp4_device;

namespace {

constexpr int kWgBk = 64;        // k per step: one 128-byte swizzled row of bf16
constexpr int kWgThreads = 256;  // two warpgroups

template <int kBm, int kBn>
__host__ __device__ constexpr uint32_t wg_stage_bytes() {
  return static_cast<uint32_t>((kBm + kBn) * kWgBk * 2);
}
// The ring, 1024 bytes of alignment slack, the tile's x row addresses (wg_x_rows).
template <int kBm, int kBn, int kStages>
constexpr size_t wg_smem_bytes() {
  return static_cast<size_t>(kStages) * wg_stage_bytes<kBm, kBn>() + 1024 + kBm * sizeof(const void*);
}

#if TERN_WGMMA_AVAILABLE  // the device helpers exist only where the kernel has a body
// A stage is refilled this many steps after its products were issued. 1 (wait for every product each step, one
// more step loaded ahead) measured the same within 2% (docs/perf/gpu.md §moe-prefill-wgmma).
constexpr int kWgLag = 2;

// The tile's x rows, kBm of them, a 64-k step at a time into a stage's 128-byte-swizzled tile by cp.async: thread t
// copies 16-byte chunk t % 8 of rows t / 8 + 32 i (rows 32 apart share the swizzle, so their chunks lie 4096 bytes
// apart in the tile). The rows' source addresses are looked up once in a table in shared memory (wg_x_rows), and rows
// past the expert's end copy the tile's first row: their products are never stored, so every copy is unconditional
// and a step costs a table load and an add per chunk.
struct WgXCopy {
  const unsigned char* const* rows;  // the thread's first row in the table
  uint32_t dst;                      // its first chunk's offset in a tile
  int src;                           // its chunk's byte offset in a row
};

// Fills `table` with the source addresses of the tile's kBm rows (the caller syncs before the first copy).
template <int kBm>
__device__ __forceinline__ WgXCopy wg_x_rows(const GemmParams& p, const TileWork& tw, const unsigned char** table) {
  for (int i = threadIdx.x; i < kBm; i += kWgThreads) {
    const int r = tw.row0 + i < tw.row_end ? tw.row0 + i : tw.row0;
    table[i] = reinterpret_cast<const unsigned char*>(p.x + x_row_offset(p, r));
  }
  return {table + threadIdx.x / 8, wgmma::sw128_offset(threadIdx.x / 8, threadIdx.x % 8),
          static_cast<int>(threadIdx.x % 8) * 16};
}

// Step `kstep`'s x into the tile at shared address `tile`.
template <int kBm>
__device__ __forceinline__ void wg_load_x(const WgXCopy& c, uint32_t tile, int kstep) {
  const int src = kstep * kWgBk * 2 + c.src;
#pragma unroll
  for (int i = 0; i < kBm * 8 / kWgThreads; ++i) ptx::cp_async_16(tile + c.dst + 4096 * i, c.rows[32 * i] + src);
}

// bf16 W rows n0 .. n0 + kBn - 1 of step `kstep` into a stage's W tile at shared address `tile` (rows past n copy row
// n - 1: their columns of y are never stored).
template <int kBn>
__device__ __forceinline__ void wg_load_w_bf16(const uint16_t* w, int n, int k, int n0, int kstep, uint32_t tile) {
  const int r = threadIdx.x / 8, c = threadIdx.x % 8;
  const uint32_t dst = tile + wgmma::sw128_offset(r, c);
  const uint16_t* src = w + kstep * kWgBk + c * 8;
#pragma unroll
  for (int i = 0; i < kBn * 8 / kWgThreads; ++i) {
    ptx::cp_async_16(dst + 4096 * i, src + static_cast<int64_t>(min(n0 + r + 32 * i, n - 1)) * k);
  }
}

// Thread t's share of an NVFP4 step: for each i < kBn / 128, 32 codes (16 bytes) of W row 128 i + t / 2, k half
// t % 2, and their two block scales.
template <int kBn>
struct WgFp4Regs {
  uint4 packed[kBn / 128];
  uint32_t scales[kBn / 128];  // bits 7:0 the first 16 codes' scale, 15:8 the second's
};

template <int kBn>
__device__ __forceinline__ WgFp4Regs<kBn> wg_load_w_fp4(const uint8_t* packed, const uint8_t* scales, int n, int k,
                                                        int n0, int kstep) {
  WgFp4Regs<kBn> r;
  const int kb = kstep * kWgBk + (threadIdx.x % 2) * 32;
#pragma unroll
  for (int i = 0; i < kBn / 128; ++i) {
    const int row = n0 + 128 * i + threadIdx.x / 2;
    r.packed[i] = make_uint4(0, 0, 0, 0);
    r.scales[i] = 0;
    if (row < n) {
      r.packed[i] = ld_weight_16(packed + static_cast<int64_t>(row) * (k / 2) + kb / 2);
      r.scales[i] = ld_scale_2(scales + static_cast<int64_t>(row) * (k / 16) + kb / 16);
    }
  }
  return r;
}

// The 32 codes as bf16 e2m1 · e4m3 · 2^-kDecodeShift (exact) into chunks 4 (t % 2) .. + 3 of row t / 2: each 8-code
// word through decode_e2m1_pairs (pairs (i, i + 4), each e2m1 · 2^-126), put back in k order, times the scale.
template <int kBn>
__device__ __forceinline__ void wg_store_w_fp4(const WgFp4Regs<kBn>& r, unsigned char* ws) {
  const int half = threadIdx.x % 2;
#pragma unroll
  for (int u = 0; u < kBn / 128; ++u) {
    const int row = 128 * u + threadIdx.x / 2;
    uint32_t sc[2];
    decode_scales(r.scales[u], sc);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t p[4];
      decode_e2m1_pairs(uint4_word(r.packed[u], i), p);
      const uint32_t s = sc[i / 2];
      const uint4 chunk = make_uint4(bf16x2_mul(byte_perm(p[0], p[1], 0x5410), s),
                                     bf16x2_mul(byte_perm(p[2], p[3], 0x5410), s),
                                     bf16x2_mul(byte_perm(p[0], p[1], 0x7632), s),
                                     bf16x2_mul(byte_perm(p[2], p[3], 0x7632), s));
      *reinterpret_cast<uint4*>(ws + wgmma::sw128_offset(row, half * 4 + i)) = chunk;
    }
  }
}

// Thread t's share of an FP8 step: for each i < kBn / 128, 32 codes (two 16-byte loads) of W row 128 i + t / 2, k
// half t % 2, and the row's scale for the step (a 64-k step lies inside one 128-column block).
template <int kBn>
struct WgFp8Regs {
  uint4 codes[kBn / 128][2];
  float scale[kBn / 128];
};

template <int kBn>
__device__ __forceinline__ WgFp8Regs<kBn> wg_load_w_fp8(const uint8_t* codes, const float* row_scales, int n, int k,
                                                        int n0, int kstep) {
  WgFp8Regs<kBn> r;
  const int kb = kstep * kWgBk + (threadIdx.x % 2) * 32;
  const int64_t scale_cols = fp8_device::fp8_scale_cols(k);
#pragma unroll
  for (int i = 0; i < kBn / 128; ++i) {
    const int row = n0 + 128 * i + threadIdx.x / 2;
    r.codes[i][0] = r.codes[i][1] = make_uint4(0, 0, 0, 0);
    r.scale[i] = 0.0f;
    if (row < n) {
      const uint4* src = reinterpret_cast<const uint4*>(codes + static_cast<int64_t>(row) * k + kb);
      r.codes[i][0] = __ldcs(src);
      r.codes[i][1] = __ldcs(src + 1);
      r.scale[i] = __ldg(row_scales + row * scale_cols + kb / fp8_device::kFp8ScaleBlock);
    }
  }
  return r;
}

// The 32 values (fp8_dequant16) into chunks 4 (t % 2) .. + 3 of row t / 2.
template <int kBn>
__device__ __forceinline__ void wg_store_w_fp8(const WgFp8Regs<kBn>& r, unsigned char* ws) {
  const int half = threadIdx.x % 2;
#pragma unroll
  for (int u = 0; u < kBn / 128; ++u) {
    const int row = 128 * u + threadIdx.x / 2;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint32_t v[8];
      fp8_device::fp8_dequant16(r.codes[u][j], r.scale[u], v);
      *reinterpret_cast<uint4*>(ws + wgmma::sw128_offset(row, half * 4 + 2 * j)) = make_uint4(v[0], v[1], v[2], v[3]);
      *reinterpret_cast<uint4*>(ws + wgmma::sw128_offset(row, half * 4 + 2 * j + 1)) =
          make_uint4(v[4], v[5], v[6], v[7]);
    }
  }
}

// The W registers a format carries one step ahead (bf16 has none: cp.async).
template <MoeWeightFormat kFormat, int kBn>
struct WgWRegs {
  struct None {};
  using type = std::conditional_t<kFormat == MoeWeightFormat::kNvfp4, WgFp4Regs<kBn>,
                                  std::conditional_t<kFormat == MoeWeightFormat::kFp8, WgFp8Regs<kBn>, None>>;
};

#endif  // TERN_WGMMA_AVAILABLE

template <MoeWeightFormat kFormat, int kBm, int kBn, int kStages>
__global__ void __launch_bounds__(kWgThreads) moe_prefill_wgmma_kernel(const GemmParams p) {
#if TERN_WGMMA_AVAILABLE
  static_assert(kStages > kWgLag, "stages for the steps in flight");
  constexpr int kLead = kStages - kWgLag;  // steps loaded ahead
  static_assert((kBm == 64 || kBm == 128) && kBn % 128 == 0);
  constexpr int kN = kBm == 128 ? kBn : kBn / 2;  // the warpgroup's columns
  constexpr int kAcc = kN / 2;                     // fp32 accumulators per thread
  ptx::grid_dependency_begin();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw_addr = ptx::smem_addr(smem_raw);
  unsigned char* ring = smem_raw + ((1024 - raw_addr % 1024) % 1024);
  const unsigned char** xrows = reinterpret_cast<const unsigned char**>(ring + kStages * wg_stage_bytes<kBm, kBn>());
  const TileWork tw = find_row_tile(p.offsets, p.n_experts, blockIdx.y, kBm);
  if (tw.expert < 0) return;  // every warp found the same: the whole block leaves
  const int e = tw.expert, n0 = blockIdx.x * kBn, n_ksteps = p.k / kWgBk;
  constexpr bool kIsNvfp4 = kFormat == MoeWeightFormat::kNvfp4, kIsFp8 = kFormat == MoeWeightFormat::kFp8;
  const float out_scale = kIsNvfp4 ? p.global_scales[e] * static_cast<float>(1u << kDecodeShift) : 1.0f;
  const uint8_t* packed = kIsNvfp4 || kIsFp8 ? p.packed + e * p.packed_stride : nullptr;  // NVFP4 codes or FP8
  const uint8_t* scales = kIsNvfp4 ? p.scales + e * p.scales_stride : nullptr;
  const float* row_scales = kIsFp8 ? p.row_scales + e * p.row_scales_stride : nullptr;
  const uint16_t* wbf = kIsNvfp4 || kIsFp8 ? nullptr : p.wbf + e * p.wbf_stride;

  const WgXCopy xcopy = wg_x_rows<kBm>(p, tw, xrows);
  __syncthreads();
  auto x_tile = [&](int stage) { return ring + stage * wg_stage_bytes<kBm, kBn>(); };
  auto w_tile = [&](int stage) { return ring + stage * wg_stage_bytes<kBm, kBn>() + kBm * kWgBk * 2; };
  // Step s's tiles into its stage: x (and bf16 W) by cp.async in one commit group; NVFP4 and FP8 W from the
  // registers.
  typename WgWRegs<kFormat, kBn>::type wr{};
  auto fill = [&](int s) {
    if (s < n_ksteps) {
      wg_load_x<kBm>(xcopy, ptx::smem_addr(x_tile(s % kStages)), s);
      if constexpr (kIsNvfp4) {
        wg_store_w_fp4(wr, w_tile(s % kStages));
        if (s + 1 < n_ksteps) wr = wg_load_w_fp4<kBn>(packed, scales, p.n, p.k, n0, s + 1);
      } else if constexpr (kIsFp8) {
        wg_store_w_fp8(wr, w_tile(s % kStages));
        if (s + 1 < n_ksteps) wr = wg_load_w_fp8<kBn>(packed, row_scales, p.n, p.k, n0, s + 1);
      } else {
        wg_load_w_bf16<kBn>(wbf, p.n, p.k, n0, s, ptx::smem_addr(w_tile(s % kStages)));
      }
    }
    cp_async_commit();  // always, so the group count per step stays uniform
  };
  if constexpr (kIsNvfp4) wr = wg_load_w_fp4<kBn>(packed, scales, p.n, p.k, n0, 0);
  if constexpr (kIsFp8) wr = wg_load_w_fp8<kBn>(packed, row_scales, p.n, p.k, n0, 0);
#pragma unroll
  for (int s = 0; s < kLead; ++s) fill(s);

  const int wg = threadIdx.x / 128;
  const uint32_t a_off = kBm == 128 ? wg * 64 * 128 : 0;       // the warpgroup's x rows
  const uint32_t b_off = kBm == 128 ? 0 : wg * kN * 128;       // the warpgroup's W rows
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
  for (int ks = 0; ks < n_ksteps; ++ks) {
    cp_async_wait<kLead - 1>();  // this thread's copies of step ks have landed
    wgmma::fence_proxy_async_shared();
    __syncthreads();  // ... and everyone's; every warpgroup is done with step ks - 2
    const uint32_t xa = ptx::smem_addr(x_tile(ks % kStages)) + a_off;
    const uint32_t wa = ptx::smem_addr(w_tile(ks % kStages)) + b_off;
    wgmma::fence();
#pragma unroll
    for (int j = 0; j < kWgBk / 16; ++j) {
      wgmma::mma_m64k16<kN>(acc, wgmma::sw128_desc(xa + 32 * j), wgmma::sw128_desc(wa + 32 * j), 1);
    }
    wgmma::commit_group();
    fill(ks + kLead);
    wgmma::wait_group<kWgLag - 1>();
    wgmma::fence_operands(acc);
  }
  wgmma::wait_group<0>();
  wgmma::fence_operands(acc);
  cp_async_wait<0>();

  // y: accumulator 4 j + 2 h + c of thread (warp v of the warpgroup, lane l) is row 16 v + l / 4 + 8 h, column
  // 8 j + 2 (l % 4) + c of the warpgroup's tile.
  const int v = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int row_base = tw.row0 + (kBm == 128 ? wg * 64 : 0) + 16 * v + lane / 4;
  const int col_base = n0 + (kBm == 128 ? 0 : wg * kN) + 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + 8 * h, col = col_base + 8 * j;
      if (row >= tw.row_end || col >= p.n) continue;
      store_y_pair(p, row, col, f32_to_bf16(acc[4 * j + 2 * h] * out_scale),
                   f32_to_bf16(acc[4 * j + 2 * h + 1] * out_scale));
    }
  }
#endif  // TERN_WGMMA_AVAILABLE
}

// ---- NVFP4 with the weight in registers (RS wgmma) ----
//
// The products transposed: y^T = W x^T, so the weight is wgmma's A operand, dequantized from its codes straight into
// the A fragment registers (no bf16 tile in shared memory, which the kernel above writes and both warpgroups then
// read), and the expert's gathered x rows are B, N = kRsTokens of them. A block of two warpgroups takes 128 weight
// rows (64 each: the wgmma M) of one expert against one tile of its rows, in 64-k steps through a kStages ring of
// {x tile (cp.async, the 128-byte-swizzled K-major layout), the 128 rows' 32 bytes of codes and 4 block scales
// (cp.async)}; 84 KB at 128 tokens and 4 stages, so two blocks share an SM. Per step each thread reads its rows'
// codes (rows g and g + 8 of its warp's 16: bytes t, t + 4, ... of each 32-byte row, the k pairs its A fragment
// slots hold), turns each byte into the bf16 pair e2m1 · 2^-126 (as decode_e2m1_pairs does) times the block scale
// e4m3 · 2^116, and issues four m64nNk16 wgmmas; the next step's fragments are built (into a second buffer) while
// they run. Outputs equal the kernel above's (the same exact factors, summed in fp32). Requires k % 128 == 0 (steps
// in pairs, one per fragment buffer).
constexpr int kRsRows = 128;  // weight rows per block

template <int kTokens>
__host__ __device__ constexpr uint32_t rs_x_bytes() {
  return static_cast<uint32_t>(kTokens * kWgBk * 2);
}
constexpr uint32_t kRsCodeBytes = kRsRows * kWgBk / 2;    // 32 bytes a row
constexpr uint32_t kRsScaleBytes = kRsRows * kWgBk / 16;  // 4 a row
// The output tile staged for its stores: kTokens rows of 128 bf16, padded so the fragment writes do not collide.
constexpr int kRsOutStride = kRsRows + 8;
// x tiles (1024-aligned), code tiles, scale tiles, 1024 bytes of alignment slack, the x row addresses.
template <int kTokens, int kStages>
constexpr size_t rs_smem_bytes() {
  return static_cast<size_t>(kStages) * (rs_x_bytes<kTokens>() + kRsCodeBytes + kRsScaleBytes) + 1024 +
         kTokens * sizeof(const void*);
}

#if TERN_WGMMA_AVAILABLE
// The four code bytes of q (each the codes of k and k + 1: low nibble, high nibble) as bf16 pairs (e2m1 of the low
// nibble, e2m1 of the high) · 2^-126, in byte order. The nibbles of byte b go to bits 3:0 and 19:16 with one permute
// of the low and the high nibbles (bytes 1 and 3 from selector nibbles with bit 3 set: the sign of a byte whose bit 7
// is clear, so zero), then decode_e2m1_pairs' multiply and mask.
__device__ __forceinline__ void rs_code_pairs(uint32_t q, uint32_t (&pair)[4]) {
  const uint32_t lo = q & 0x0F0F0F0Fu, hi = (q >> 4) & 0x0F0F0F0Fu;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    uint32_t spread;
    asm("prmt.b32 %0, %1, %2, %3;\n"
        : "=r"(spread)
        : "r"(lo), "r"(hi), "r"(b | (8 | b) << 4 | (4 + b) << 8 | (8 | b) << 12));
    pair[b] = (spread * 0x1040u) & 0x81C081C0u;
  }
}

// The A fragments of one step for rows r0 (g) and r0 + 8 of the thread's warp tile, k16 slice j in a[j]: codes of
// row r at bytes 8 j + t (k 16 j + 2 t, + 1) and 8 j + t + 4 (k 16 j + 2 t + 8, + 9) of its 32. `codes` and
// `scales` point at row r0's codes and scales in the stage.
__device__ __forceinline__ void rs_build_a(const unsigned char* codes, const unsigned char* scales, uint32_t sel,
                                           uint32_t (&a)[4][4]) {
  const uint4 p0 = *reinterpret_cast<const uint4*>(codes);
  const uint4 p1 = *reinterpret_cast<const uint4*>(codes + 16);
  const uint4 q0 = *reinterpret_cast<const uint4*>(codes + 8 * 32);
  const uint4 q1 = *reinterpret_cast<const uint4*>(codes + 8 * 32 + 16);
  const uint32_t s0 = *reinterpret_cast<const uint32_t*>(scales);
  const uint32_t s1 = *reinterpret_cast<const uint32_t*>(scales + 8 * 4);
  const uint32_t w0[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
  const uint32_t w1[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    // Byte t of words 2 j and 2 j + 1 of each row (sel = t | (t + 4) << 4), as [row r0: k 2t.., k 2t+8..; row r0 + 8:
    // the same].
    const uint32_t q =
        byte_perm(byte_perm(w0[2 * j], w0[2 * j + 1], sel), byte_perm(w1[2 * j], w1[2 * j + 1], sel), 0x5410);
    uint32_t sc[2];  // rows r0 and r0 + 8, block j
    decode_scales(byte_perm(s0, s1, static_cast<uint32_t>(j) | static_cast<uint32_t>(j + 4) << 4), sc);
    uint32_t pair[4];
    rs_code_pairs(q, pair);
    a[j][0] = bf16x2_mul(pair[0], sc[0]);
    a[j][1] = bf16x2_mul(pair[2], sc[1]);
    a[j][2] = bf16x2_mul(pair[1], sc[0]);
    a[j][3] = bf16x2_mul(pair[3], sc[1]);
  }
}

__device__ __forceinline__ void rs_fence_a(uint32_t (&a)[4][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) wgmma::fence_operands(a[j]);
}
#endif  // TERN_WGMMA_AVAILABLE

template <int kTokens, int kStages, int kMinBlocks>
__global__ void __launch_bounds__(kWgThreads, kMinBlocks) moe_prefill_rs_kernel(const GemmParams p) {
#if TERN_WGMMA_AVAILABLE
  static_assert(kStages >= 3, "a step in flight, its successor being read, one loading");
  constexpr int kLead = kStages - 1;  // steps loaded ahead
  constexpr int kAcc = kTokens / 2;
  ptx::grid_dependency_begin();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw_addr = ptx::smem_addr(smem_raw);
  unsigned char* ring = smem_raw + ((1024 - raw_addr % 1024) % 1024);
  // x tiles, code tiles, scale tiles, then the tile's x row addresses.
  constexpr uint32_t kCodeRing = kStages * rs_x_bytes<kTokens>(), kScaleRing = kCodeRing + kStages * kRsCodeBytes;
  const unsigned char** xrows = reinterpret_cast<const unsigned char**>(ring + kScaleRing + kStages * kRsScaleBytes);
  const TileWork tw = find_row_tile(p.offsets, p.n_experts, blockIdx.y, kTokens);
  if (tw.expert < 0) return;  // every warp found the same: the whole block leaves
  const int e = tw.expert, n0 = blockIdx.x * kRsRows, n_ksteps = p.k / kWgBk;
  const float out_scale = p.global_scales[e] * static_cast<float>(1u << kDecodeShift);
  const WgXCopy xcopy = wg_x_rows<kTokens>(p, tw, xrows);
  __syncthreads();
  // The thread's share of the weight in every fill (rows past n copy row n - 1, whose products are never stored):
  // half threadIdx.x % 2 of row threadIdx.x / 2's 32 code bytes, and (threads below 128) row threadIdx.x's 4 scales.
  const uint8_t* code_src = p.packed + e * p.packed_stride +
                            static_cast<int64_t>(min(n0 + static_cast<int>(threadIdx.x) / 2, p.n - 1)) * (p.k / 2) +
                            (threadIdx.x % 2) * 16;
  const uint8_t* scale_src =
      p.scales + e * p.scales_stride +
      static_cast<int64_t>(min(n0 + static_cast<int>(threadIdx.x) % kRsRows, p.n - 1)) * (p.k / 16);
  const uint32_t ring_addr = ptx::smem_addr(ring);
  auto x_tile = [&](int s) { return ring_addr + (s % kStages) * rs_x_bytes<kTokens>(); };
  auto code_tile = [&](int s) { return ring_addr + kCodeRing + (s % kStages) * kRsCodeBytes; };
  auto scale_tile = [&](int s) { return ring_addr + kScaleRing + (s % kStages) * kRsScaleBytes; };
  // Step s into its stage: x rows, the 128 rows' 32 bytes of codes (two 16-byte copies a row) and their 4 scales.
  auto fill = [&](int s) {
    if (s < n_ksteps) {
      wg_load_x<kTokens>(xcopy, x_tile(s), s);
      ptx::cp_async_16(code_tile(s) + threadIdx.x * 16, code_src + s * 32);
      if (threadIdx.x < kRsRows) ptx::cp_async_4(scale_tile(s) + threadIdx.x * 4, scale_src + s * 4);
    }
    cp_async_commit();  // always, so the group count per step stays uniform
  };
#pragma unroll
  for (int s = 0; s < kLead; ++s) fill(s);

  const int wg = threadIdx.x / 128, v = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int r0 = 64 * wg + 16 * v + lane / 4;  // the thread's first weight row in the block's 128
  const uint32_t sel = static_cast<uint32_t>(lane % 4) | static_cast<uint32_t>(lane % 4 + 4) << 4;
  const unsigned char* const codes_r0 = ring + kCodeRing + r0 * 32;
  const unsigned char* const scales_r0 = ring + kScaleRing + r0 * 4;
  auto build = [&](int s, uint32_t(&a)[4][4]) {
    rs_build_a(codes_r0 + (s % kStages) * kRsCodeBytes, scales_r0 + (s % kStages) * kRsScaleBytes, sel, a);
  };
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
  // Iteration s: issue step s's wgmmas (fragments a[s % 2], x in stage s), then while they run, refill the stage of
  // step s - 1 and build step s + 1's fragments into the other buffer, then wait for step s's products. Every wgmma
  // is retired before the next is issued: ptxas serializes wgmmas when registers that one in flight shares a
  // pipeline stage with are defined meanwhile (C7515), so the overlap is the dequantization under the products.
  uint32_t a0[4][4], a1[4][4];
  cp_async_wait<kLead - 1>();  // step 0 has landed
  wgmma::fence_proxy_async_shared();
  __syncthreads();
  build(0, a0);
  auto iteration = [&](int s, uint32_t(&a)[4][4], uint32_t(&next)[4][4]) {
    const uint32_t xa = x_tile(s);
    wgmma::fence();
#pragma unroll
    for (int j = 0; j < kWgBk / 16; ++j) {
      wgmma::mma_rs_m64k16<kTokens>(acc, a[j], wgmma::sw128_desc(xa + 32 * j), 1);
    }
    wgmma::commit_group();
    cp_async_wait<kLead - 2>();  // step s + 1 has landed
    wgmma::fence_proxy_async_shared();
    __syncthreads();  // ... for everyone, and everyone retired step s - 1: its stage is free
    fill(s + kLead);
    if (s + 1 < n_ksteps) build(s + 1, next);
    wgmma::wait_group<0>();
    wgmma::fence_operands(acc);
    rs_fence_a(a);
  };
  for (int s = 0; s < n_ksteps; s += 2) {  // n_ksteps is even
    iteration(s, a0, a1);
    iteration(s + 1, a1, a0);
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is free: every thread's copies landed and every wgmma retired

  // Accumulator 4 j + 2 h + c: weight row r0 + 8 h, token 8 j + 2 (lane % 4) + c of the tile. Staged as
  // [token][weight row] bf16, then stored a pair of columns a thread, a warp along one token's row.
  uint16_t* out = reinterpret_cast<uint16_t*>(ring);
#pragma unroll
  for (int j = 0; j < kTokens / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        out[(8 * j + 2 * (lane % 4) + c) * kRsOutStride + r0 + 8 * h] = f32_to_bf16(acc[4 * j + 2 * h + c] * out_scale);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTokens * kRsRows / 2; i += kWgThreads) {
    const int r = i / (kRsRows / 2), col = 2 * (i % (kRsRows / 2));
    if (tw.row0 + r >= tw.row_end || n0 + col >= p.n) continue;
    store_y_pair(p, tw.row0 + r, n0 + col, out[r * kRsOutStride + col], out[r * kRsOutStride + col + 1]);
  }
#endif  // TERN_WGMMA_AVAILABLE
}

template <int kTokens, int kStages, int kMinBlocks>
void rs_launch(const GemmParams& p, int64_t rows, int64_t n_experts, const DeviceContext& ctx) {
  static_assert(kStages * rs_x_bytes<kTokens>() >= kTokens * kRsOutStride * 2, "the output tile fits the x ring");
  constexpr size_t kSmem = rs_smem_bytes<kTokens, kStages>();
  auto* kernel = moe_prefill_rs_kernel<kTokens, kStages, kMinBlocks>;
  TERN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  const dim3 grid(static_cast<unsigned>((p.n + kRsRows - 1) / kRsRows),
                  static_cast<unsigned>((rows + kTokens - 1) / kTokens + n_experts));
  launch_kernel(ctx, kernel, grid, dim3(kWgThreads), kSmem, p);
  TERN_CUDA_CHECK_LAUNCH();
}

// The shapes moe_bench --rs-shapes times: {tokens per tile, stages, blocks an SM the registers are sized for}; the
// launcher takes one of the two. (128 tokens at 6 stages and 1 block an SM, 64 at 8 stages, and the next step's
// fragments built between the step's wgmmas were slower: docs/perf/gpu.md §moe-prefill-rs.)
constexpr int kRsShapes[][3] = {{128, 4, 2}, {64, 4, 2}};

void rs_launch_shape(const GemmParams& p, int64_t rows, int64_t n_experts, const DeviceContext& ctx, int shape) {
  constexpr auto& t = kRsShapes;
  switch (shape) {
    case 1: return rs_launch<t[1][0], t[1][1], t[1][2]>(p, rows, n_experts, ctx);
    default: return rs_launch<t[0][0], t[0][1], t[0][2]>(p, rows, n_experts, ctx);
  }
}

// shape < 0: the launcher's choice; 128-token tiles once experts average 64 rows, as the kernel above chooses.
void rs_launch_projection(const DeviceContext& ctx, const MoeGemmArgs& a, int shape) {
  const GemmParams p = make_params(a);
  if (shape < 0) shape = a.rows >= 64 * a.w.n_experts ? 0 : 1;
  rs_launch_shape(p, a.rows, a.w.n_experts, ctx, shape);
}

template <MoeWeightFormat kFormat, int kBm, int kBn, int kStages>
void wg_launch(const GemmParams& p, int64_t rows, int64_t n_experts, const DeviceContext& ctx) {
  constexpr size_t kSmem = wg_smem_bytes<kBm, kBn, kStages>();
  TERN_CUDA_CHECK(cudaFuncSetAttribute(moe_prefill_wgmma_kernel<kFormat, kBm, kBn, kStages>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  // Column tiles vary fastest, so the blocks that run together share their x rows.
  const dim3 grid(static_cast<unsigned>((p.n + kBn - 1) / kBn),
                  static_cast<unsigned>((rows + kBm - 1) / kBm + n_experts));
  launch_kernel(ctx, moe_prefill_wgmma_kernel<kFormat, kBm, kBn, kStages>, grid, dim3(kWgThreads), kSmem, p);
  TERN_CUDA_CHECK_LAUNCH();
}

template <MoeWeightFormat kFormat>
void wg_launch_tiles(const GemmParams& p, const MoeGemmArgs& a, const DeviceContext& ctx) {
  // 128-row tiles once experts average 64 rows: the dequantized weight serves twice the rows (docs/perf/gpu.md
  // §moe-prefill-wgmma).
  if (a.rows >= 64 * a.w.n_experts) return wg_launch<kFormat, 128, 256, 4>(p, a.rows, a.w.n_experts, ctx);
  wg_launch<kFormat, 64, 256, 4>(p, a.rows, a.w.n_experts, ctx);
}

void wg_launch_projection(const DeviceContext& ctx, const MoeGemmArgs& a) {
  const GemmParams p = make_params(a);
  switch (a.w.format) {
    case MoeWeightFormat::kNvfp4: return wg_launch_tiles<MoeWeightFormat::kNvfp4>(p, a, ctx);
    case MoeWeightFormat::kFp8: return wg_launch_tiles<MoeWeightFormat::kFp8>(p, a, ctx);
    default: return wg_launch_tiles<MoeWeightFormat::kBf16>(p, a, ctx);
  }
}

}  // namespace

bool moe_gemm_prefill_sm90_fits(const DeviceContext& ctx, const MoeGemmArgs& a) {
#if TERN_BUILD_HAS_SM90A
  const auto fits = [](const MoeExpertWeights& w) { return w.n == 0 || w.k % kWgBk == 0; };
  return ctx.props().cc_major == 9 && ctx.props().cc_minor == 0 && fits(a.w) && fits(a.w2) && a.ldx % 8 == 0 &&
         reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
         wg_smem_bytes<128, 256, 4>() <= ctx.props().shared_mem_per_block_optin;
#else
  (void)ctx;
  (void)a;
  return false;  // no sm_90a machine code in this build: the kernel's body would be empty
#endif
}

bool moe_gemm_prefill_rs_fits(const DeviceContext& ctx, const MoeGemmArgs& a) {
  const auto fits = [](const MoeExpertWeights& w) {
    return w.n == 0 || (w.format == MoeWeightFormat::kNvfp4 && w.k % (2 * kWgBk) == 0);
  };
  // Its largest shape needs less shared memory than the kernel above, whose fit the first check includes.
  static_assert(rs_smem_bytes<128, 4>() <= wg_smem_bytes<128, 256, 4>());
  return moe_gemm_prefill_sm90_fits(ctx, a) && fits(a.w) && fits(a.w2);
}

void moe_gemm_launch_prefill_rs(const DeviceContext& ctx, const MoeGemmArgs& a, int shape) {
  rs_launch_projection(ctx, a, shape);
  if (a.w2.n != 0) rs_launch_projection(ctx, second_projection(a), shape);
}

std::vector<std::string> moe_gemm_prefill_rs_shapes() {
  std::vector<std::string> out;
  for (const auto& sh : kRsShapes) {
    out.push_back(std::to_string(sh[0]) + " tokens, " + std::to_string(sh[1]) + " stages, " + std::to_string(sh[2]) +
                  " blocks/SM");
  }
  return out;
}

void moe_gemm_launch_prefill_sm90(const DeviceContext& ctx, const MoeGemmArgs& a) {
  wg_launch_projection(ctx, a);
  if (a.w2.n != 0) wg_launch_projection(ctx, second_projection(a));
}

// What the driver loaded of this module for the current device (module_attributes.h). Its kernels have a body only
// in sm_90a machine code.
cudaError_t moe_gemm_prefill_sm90_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, moe_prefill_wgmma_kernel<MoeWeightFormat::kNvfp4, 128, 256, 4>);
}

}  // namespace tern
