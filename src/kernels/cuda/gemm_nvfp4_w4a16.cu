// NVFP4 W4A16 GEMM kernels; see gemm_nvfp4_w4a16.h for the contract and docs/perf/gemm.md for measurements.
//
// Both kernels use mma.sync.m16n8k16 (bf16 in, fp32 accumulate). The weight factor fed to the tensor cores is
// e2m1 · e4m3 block scale, which is exact in bf16 (at most 2 + 4 significant bits, magnitudes 2^-10 .. 2688), so
// every product is exact and the only roundings are the fp32 accumulation and the final bf16 store.
#include <cuda_bf16.h>
#include <cuda_fp8.h>


#include "kernels/cuda/gemm_nvfp4_w4a16_launch.h"

namespace tern {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Shared device helpers

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
  return __byte_perm(a, b, selector);
}

// e4m3 block scale times 2^exp2, as a bf16 pair (both halves equal). Exact: e4m3 has 4 significant bits.
__device__ __forceinline__ uint32_t e4m3_scale_bf16x2(uint32_t code, float multiplier) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code & 0xFF), __NV_E4M3);
  const float value = __half2float(__half(h)) * multiplier;
  const uint32_t bits = __bfloat16_as_ushort(__float2bfloat16_rn(value));
  return bits | (bits << 16);
}

__device__ __forceinline__ uint16_t float_to_bf16_bits(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }

// ---------------------------------------------------------------------------------------------------------------
// Decode kernel (M <= 16): a bandwidth problem. Each block owns 16 weight rows; its warps split K. A lane (g, t) =
// (lane / 4, lane % 4) loads 16 bytes (32 consecutive k) of rows g and g + 8 per 128-k step, which is the mma A
// fragment's row pair. The mma only sums over its 16 k slots, so which k each slot holds is free as long as x
// uses the same assignment: the weight nibbles go to bf16 by shifting bits in place (no lookups), pairing
// elements (e3,e7), (e2,e6), (e1,e5), (e0,e4) of each 8-nibble word, and x is permuted to match with byte_perm
// once per step. The bf16 pattern with the e2m1 exponent/mantissa in bits [8:6] equals e2m1 · 2^-126 (e2m1's
// subnormal 0.5 becomes a bf16 subnormal), so the block scale is applied as e4m3 · 2^(126 - kDecodeShift) and
// the fp32 sum is multiplied by global_scale · 2^kDecodeShift; the shift keeps the scale within bf16's range.

constexpr int kDecodeShift = 10;
constexpr int kDecodeRows = 16;      // rows of W per block (mma M)
constexpr int kDecodeStepK = 128;    // k per warp step: 4 lanes x 32
constexpr int kDecodeUnroll = 2;     // steps whose loads are issued before any is used

struct DecodeParams {
  const uint16_t* x;       // [m, k]
  const uint8_t* packed;   // [n, k/2]
  const uint8_t* scales;   // [n, k/16]
  uint16_t* y;             // [m, ldy], columns [0, n) written
  float out_scale;         // global_scale * 2^kDecodeShift
  int m, n, k;
  int64_t ldy;
};

template <int kTokenTiles>
struct DecodeChunk {
  uint4 w[2];                 // rows g and g+8, 32 e2m1 codes each
  uint32_t scales;            // bytes: row g blk 0, row g blk 1, row g+8 blk 0, row g+8 blk 1
  uint4 x[kTokenTiles][4];    // x[token][32 k] for token tile tt's token g
};

// e2m1 nibbles (3 - i) and (7 - i) of q as a bf16 pair equal to e2m1 · 2^-126.
__device__ __forceinline__ uint32_t decode_e2m1_pair(uint32_t q, int i) {
  const uint32_t qs = q << (4 * i);
  return (qs & 0x80008000u) | ((qs & 0x70007000u) >> 6);
}

// The x pair matching decode_e2m1_pair(q, i) for the 8 bf16 values in v (v.x holds elements 0, 1).
__device__ __forceinline__ uint32_t decode_x_pair(const uint4& v, int i) {
  switch (i) {
    case 0: return byte_perm(v.y, v.w, 0x7632);  // (x3, x7)
    case 1: return byte_perm(v.y, v.w, 0x5410);  // (x2, x6)
    case 2: return byte_perm(v.x, v.z, 0x7632);  // (x1, x5)
    default: return byte_perm(v.x, v.z, 0x5410);  // (x0, x4)
  }
}

template <int kTokenTiles, bool kVec16>
__device__ __forceinline__ void decode_load_chunk(const DecodeParams& p, int n0, int step, DecodeChunk<kTokenTiles>& c) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int k0 = step * kDecodeStepK + t * 32;
  const int valid = min(32, p.k - k0);  // 32, 16 or <= 0 (k is a multiple of 16)
  c.scales = 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = n0 + g + 8 * r;
    c.w[r] = make_uint4(0, 0, 0, 0);
    if (row >= p.n || valid <= 0) continue;
    const uint8_t* wp = p.packed + static_cast<int64_t>(row) * (p.k / 2) + k0 / 2;
    const uint8_t* sp = p.scales + static_cast<int64_t>(row) * (p.k / 16) + k0 / 16;
    if constexpr (kVec16) {
      c.w[r] = __ldcs(reinterpret_cast<const uint4*>(wp));
      c.scales |= static_cast<uint32_t>(__ldcs(reinterpret_cast<const unsigned short*>(sp))) << (16 * r);
    } else {
      const uint2 lo = __ldcs(reinterpret_cast<const uint2*>(wp));
      c.w[r].x = lo.x;
      c.w[r].y = lo.y;
      c.scales |= static_cast<uint32_t>(__ldcs(sp)) << (16 * r);
      if (valid == 32) {
        const uint2 hi = __ldcs(reinterpret_cast<const uint2*>(wp + 8));
        c.w[r].z = hi.x;
        c.w[r].w = hi.y;
        c.scales |= static_cast<uint32_t>(__ldcs(sp + 1)) << (16 * r + 8);
      }
    }
  }
#pragma unroll
  for (int tt = 0; tt < kTokenTiles; ++tt) {
    const int token = tt * 8 + g;
    const uint4* xp = reinterpret_cast<const uint4*>(p.x + static_cast<int64_t>(token) * p.k + k0);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // 16-byte piece j holds k0 + 8j .. k0 + 8j + 7; valid is a multiple of 16, so pieces are whole.
      const bool ok = token < p.m && 8 * j < valid;
      c.x[tt][j] = ok ? __ldg(xp + j) : make_uint4(0, 0, 0, 0);
    }
  }
}

template <int kTokenTiles>
__device__ __forceinline__ void decode_mma_chunk(const DecodeChunk<kTokenTiles>& c, float (&acc)[kTokenTiles][4]) {
  constexpr float kScaleMul = 0x1p116f;  // 2^(126 - kDecodeShift)
  static_assert(126 - kDecodeShift == 116);
  uint32_t sc[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) sc[i] = e4m3_scale_bf16x2(c.scales >> (8 * i), kScaleMul);
  const uint32_t q0[4] = {c.w[0].x, c.w[0].y, c.w[0].z, c.w[0].w};
  const uint32_t q1[4] = {c.w[1].x, c.w[1].y, c.w[1].z, c.w[1].w};
  // sc index: row g block b -> b, row g+8 block b -> 2 + b; both rows' block bytes sit in scales as 0,1 | 2,3.
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // word j of each row: chunk elements 8j .. 8j+7, block j / 2
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t a[4];
      a[0] = bf16x2_mul(decode_e2m1_pair(q0[j], 2 * h), sc[j / 2]);
      a[1] = bf16x2_mul(decode_e2m1_pair(q1[j], 2 * h), sc[2 + j / 2]);
      a[2] = bf16x2_mul(decode_e2m1_pair(q0[j], 2 * h + 1), sc[j / 2]);
      a[3] = bf16x2_mul(decode_e2m1_pair(q1[j], 2 * h + 1), sc[2 + j / 2]);
#pragma unroll
      for (int tt = 0; tt < kTokenTiles; ++tt) {
        const uint32_t b[2] = {decode_x_pair(c.x[tt][j], 2 * h), decode_x_pair(c.x[tt][j], 2 * h + 1)};
        mma_bf16_16816(acc[tt], a, b);
      }
    }
  }
}

// Sums the warps' partial fragments through shared memory and writes y. Fragment element e of lane (g, t) in
// token tile tt is row g + 8 * (e / 2), token tt * 8 + 2t + e % 2.
template <int kWarps, int kTokenTiles>
__device__ __forceinline__ void decode_reduce_store(const DecodeParams& p, int n0, const float (&acc)[kTokenTiles][4],
                                                    float* red) {
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
    const int tt = idx / 128, l = (idx / 4) % 32, e = idx % 4;
    const int row = n0 + l / 4 + 8 * (e / 2);
    const int token = tt * 8 + 2 * (l % 4) + e % 2;
    if (row < p.n && token < p.m) p.y[static_cast<int64_t>(token) * p.ldy + row] = float_to_bf16_bits(sum * p.out_scale);
  }
}

// Register cap of 128 (min blocks) keeps 16 warps resident per SM, enough 16-byte loads in flight for HBM.
template <int kWarps, int kTokenTiles, bool kVec16>
__global__ void __launch_bounds__(kWarps * 32, 16 / kWarps) nvfp4_decode_kernel(DecodeParams p) {
  __shared__ __align__(16) float red[kWarps * kTokenTiles * 128];
  const int warp = threadIdx.x / 32;
  const int n0 = blockIdx.x * kDecodeRows;
  const int n_steps = (p.k + kDecodeStepK - 1) / kDecodeStepK;
  float acc[kTokenTiles][4] = {};
  for (int s = warp; s < n_steps; s += kWarps * kDecodeUnroll) {
    DecodeChunk<kTokenTiles> chunks[kDecodeUnroll];
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const int step = s + u * kWarps;
      if (step < n_steps) {
        decode_load_chunk<kTokenTiles, kVec16>(p, n0, step, chunks[u]);
      } else {
        chunks[u] = {};  // all-zero weights: contributes nothing
      }
    }
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) decode_mma_chunk<kTokenTiles>(chunks[u], acc);
  }
  decode_reduce_store<kWarps, kTokenTiles>(p, n0, acc, red);
}

// ---------------------------------------------------------------------------------------------------------------
// Prefill kernel (M large): arithmetic-bound. A block computes a kBm x 128 tile of y over K in 32-k steps. x tiles
// stream into shared memory with cp.async (kStages deep); W's packed bytes for step s + 2 are loaded into
// registers while step s computes, then dequantized (a 256-entry byte -> bf16-pair table, times the block scale)
// into one of two bf16 W tiles. 8 warps as 2 (M) x 4 (N), each a (kBm / 2) x 32 tile of m16n8k16 mmas fed by
// ldmatrix. Rows are padded by 16 bytes so ldmatrix's eight 16-byte rows fall in distinct banks.

constexpr int kPrefillBn = 128;
constexpr int kPrefillBk = 32;
constexpr int kPrefillThreads = 256;
constexpr int kPrefillRowPad = 8;  // bf16 elements
constexpr int kPrefillLd = kPrefillBk + kPrefillRowPad;

struct PrefillParams {
  const uint16_t* x;
  const uint8_t* packed;
  const uint8_t* scales;
  uint16_t* y;      // [m, ldy]
  float out_scale;  // global_scale
  int m, n, k;
  int64_t ldy;
};

constexpr size_t prefill_smem_bytes(int bm, int stages) {
  return sizeof(uint16_t) * kPrefillLd * (static_cast<size_t>(stages) * bm + 2 * kPrefillBn) + 256 * sizeof(uint32_t);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16_zfill(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// Thread tid owns W row tid / 2, k half tid % 2 (one 16-element NVFP4 block) of each 32-k step.
struct PrefillWRegs {
  uint2 packed;
  uint32_t scale;
};

__device__ __forceinline__ PrefillWRegs prefill_load_w(const PrefillParams& p, int n0, int kstep) {
  const int row = n0 + threadIdx.x / 2;
  const int kb = kstep * kPrefillBk + (threadIdx.x % 2) * 16;
  PrefillWRegs r{make_uint2(0, 0), 0};
  if (row < p.n && kb < p.k) {  // k is a multiple of 16: a block is all in or all out
    r.packed = __ldcs(reinterpret_cast<const uint2*>(p.packed + static_cast<int64_t>(row) * (p.k / 2) + kb / 2));
    r.scale = __ldcs(p.scales + static_cast<int64_t>(row) * (p.k / 16) + kb / 16);
  }
  return r;
}

__device__ __forceinline__ void prefill_store_w(const PrefillWRegs& r, const uint32_t* lut, uint16_t* ws) {
  const uint32_t sc = e4m3_scale_bf16x2(r.scale, 1.0f);
  const uint32_t b[2] = {r.packed.x, r.packed.y};
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = bf16x2_mul(lut[(b[i / 4] >> (8 * (i % 4))) & 0xFF], sc);
  uint4* dst = reinterpret_cast<uint4*>(ws + (threadIdx.x / 2) * kPrefillLd + (threadIdx.x % 2) * 16);
  dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
  dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

template <int kBm>
__device__ __forceinline__ void prefill_load_x_async(const PrefillParams& p, int m0, int kstep, uint16_t* xs) {
  constexpr int kPieces = kBm * kPrefillBk / 8;  // 16-byte pieces
#pragma unroll
  for (int i = threadIdx.x; i < kPieces; i += kPrefillThreads) {
    const int r = i / (kPrefillBk / 8), c = i % (kPrefillBk / 8);
    const int row = m0 + r, kk = kstep * kPrefillBk + c * 8;
    const bool valid = row < p.m && kk < p.k;
    const uint16_t* src = valid ? p.x + static_cast<int64_t>(row) * p.k + kk : p.x;
    cp_async_16_zfill(xs + r * kPrefillLd + c * 8, src, valid);
  }
}

template <int kBm>
__device__ __forceinline__ void prefill_mma_step(const uint16_t* xs, const uint16_t* ws, float (&acc)[kBm / 32][4][4]) {
  constexpr int kMt = kBm / 32;  // m16 tiles per warp
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp / 4) * (kBm / 2), wn = (warp % 4) * 32;
#pragma unroll
  for (int kk = 0; kk < kPrefillBk; kk += 16) {
    uint32_t a[kMt][4], b[4][2];
#pragma unroll
    for (int mi = 0; mi < kMt; ++mi) {
      ldmatrix_x4(a[mi], xs + (wm + mi * 16 + lane % 16) * kPrefillLd + kk + (lane / 16) * 8);
    }
#pragma unroll
    for (int nj = 0; nj < 4; nj += 2) {
      uint32_t r[4];
      ldmatrix_x4(r, ws + (wn + nj * 8 + (lane / 16) * 8 + lane % 8) * kPrefillLd + kk + ((lane / 8) % 2) * 8);
      b[nj][0] = r[0];
      b[nj][1] = r[1];
      b[nj + 1][0] = r[2];
      b[nj + 1][1] = r[3];
    }
#pragma unroll
    for (int mi = 0; mi < kMt; ++mi) {
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) mma_bf16_16816(acc[mi][ni], a[mi], b[ni]);
    }
  }
}

template <int kBm>
__device__ __forceinline__ void prefill_store_y(const PrefillParams& p, int m0, int n0,
                                                const float (&acc)[kBm / 32][4][4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const bool pairs = p.n % 2 == 0 && p.ldy % 2 == 0;  // then (col, col + 1) is a 4-byte aligned bf16 pair
#pragma unroll
  for (int mi = 0; mi < kBm / 32; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + (warp / 4) * (kBm / 2) + mi * 16 + g + 8 * h;
        const int col = n0 + (warp % 4) * 32 + ni * 8 + 2 * t;
        if (row >= p.m || col >= p.n) continue;
        uint16_t* dst = p.y + static_cast<int64_t>(row) * p.ldy + col;
        const uint16_t v0 = float_to_bf16_bits(acc[mi][ni][2 * h] * p.out_scale);
        const uint16_t v1 = float_to_bf16_bits(acc[mi][ni][2 * h + 1] * p.out_scale);
        if (pairs) {
          *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(v0) | (static_cast<uint32_t>(v1) << 16);
        } else {
          dst[0] = v0;
          if (col + 1 < p.n) dst[1] = v1;
        }
      }
    }
  }
}

// e2m1 bf16 patterns of magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
// Packed four to a 64-bit word so the table stays in registers.
__device__ __forceinline__ uint32_t e2m1_bf16_bits(uint32_t code) {
  constexpr uint64_t kLow = 0x3FC03F803F000000ull, kHigh = 0x40C0408040404000ull;  // magnitudes 0..3, 4..7
  const uint64_t table = (code & 4) ? kHigh : kLow;
  return static_cast<uint32_t>((table >> (16 * (code & 3))) & 0xFFFF) | ((code & 8) << 12);
}

template <int kBm, int kStages>
__global__ void __launch_bounds__(kPrefillThreads) nvfp4_prefill_kernel(PrefillParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem);             // [kStages][kBm][kPrefillLd]
  uint16_t* ws = xs + kStages * kBm * kPrefillLd;                // [2][kPrefillBn][kPrefillLd]
  uint32_t* lut = reinterpret_cast<uint32_t*>(ws + 2 * kPrefillBn * kPrefillLd);  // [256]
  const int n0 = blockIdx.x * kPrefillBn, m0 = blockIdx.y * kBm;
  const int n_ksteps = (p.k + kPrefillBk - 1) / kPrefillBk;

  lut[threadIdx.x] = e2m1_bf16_bits(threadIdx.x & 0xF) | (e2m1_bf16_bits(threadIdx.x >> 4) << 16);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_ksteps) prefill_load_x_async<kBm>(p, m0, s, xs + s * kBm * kPrefillLd);
    cp_async_commit();  // always, so the group count per step stays uniform
  }
  PrefillWRegs w = prefill_load_w(p, n0, 0);
  __syncthreads();  // lut
  prefill_store_w(w, lut, ws);
  if (n_ksteps > 1) w = prefill_load_w(p, n0, 1);

  float acc[kBm / 32][4][4] = {};
  for (int ks = 0; ks < n_ksteps; ++ks) {
    cp_async_wait<kStages - 2>();
    // Step ks's x and W tiles are complete and every warp has finished step ks - 1, whose buffers we refill.
    __syncthreads();
    const int next = ks + kStages - 1;
    if (next < n_ksteps) prefill_load_x_async<kBm>(p, m0, next, xs + (next % kStages) * kBm * kPrefillLd);
    cp_async_commit();
    prefill_mma_step<kBm>(xs + (ks % kStages) * kBm * kPrefillLd, ws + (ks % 2) * kPrefillBn * kPrefillLd, acc);
    if (ks + 1 < n_ksteps) {
      prefill_store_w(w, lut, ws + ((ks + 1) % 2) * kPrefillBn * kPrefillLd);
      if (ks + 2 < n_ksteps) w = prefill_load_w(p, n0, ks + 2);
    }
  }
  cp_async_wait<0>();
  prefill_store_y<kBm>(p, m0, n0, acc);
}

// ---------------------------------------------------------------------------------------------------------------
// Host side: validation, tile choice, launch.

bool is_aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// Warps per decode block. A block owns only 16 rows, so small-n weights give few blocks; we aim for at least 16
// resident warps per SM (each lane keeps kDecodeUnroll x 32 bytes of weight in flight, ~32 KiB per SM, which is
// what Little's law asks of HBM3e at ~1 us latency) by splitting K over more warps when blocks are scarce, but
// not more warps than there are 128-k steps.
int decode_choose_warps(const DeviceProps& props, int64_t n, int64_t k) {
  const int64_t blocks = (n + kDecodeRows - 1) / kDecodeRows;
  const int64_t steps = (k + kDecodeStepK - 1) / kDecodeStepK;
  int warps = 16;
  if (blocks >= 2LL * props.num_sms) warps = 8;
  if (blocks >= 4LL * props.num_sms) warps = 4;
  while (warps > 4 && warps > steps) warps /= 2;
  return warps;
}

template <int kWarps, int kTokenTiles>
void decode_launch_vec(const DecodeParams& p, bool vec16, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.n + kDecodeRows - 1) / kDecodeRows));
  if (vec16) {
    nvfp4_decode_kernel<kWarps, kTokenTiles, true><<<grid, kWarps * 32, 0, stream>>>(p);
  } else {
    nvfp4_decode_kernel<kWarps, kTokenTiles, false><<<grid, kWarps * 32, 0, stream>>>(p);
  }
  TERN_CUDA_CHECK_LAUNCH();
}

template <int kTokenTiles>
void decode_launch_tiles(const DecodeParams& p, int warps, bool vec16, cudaStream_t stream) {
  switch (warps) {
    case 4: return decode_launch_vec<4, kTokenTiles>(p, vec16, stream);
    case 8: return decode_launch_vec<8, kTokenTiles>(p, vec16, stream);
    default: return decode_launch_vec<16, kTokenTiles>(p, vec16, stream);
  }
}

}  // namespace

void nvfp4_w4a16_launch_decode(const DeviceContext& ctx, const GemmNvfp4W4a16Args& a) {
  const DecodeParams p{.x = a.x,
                       .packed = a.w.packed,
                       .scales = a.w.scales,
                       .y = a.y,
                       .out_scale = a.w.global_scale * static_cast<float>(1 << kDecodeShift),
                       .m = static_cast<int>(a.m),
                       .n = static_cast<int>(a.w.n),
                       .k = static_cast<int>(a.w.k),
                       .ldy = a.ldy > 0 ? a.ldy : a.w.n};
  // 16-byte weight loads need 16-byte aligned rows (k % 32) and base; the paired scale load needs 2-byte rows.
  const bool vec16 = a.w.k % 32 == 0 && is_aligned(a.w.packed, 16) && is_aligned(a.w.scales, 2);
  const int warps = decode_choose_warps(ctx.props(), a.w.n, a.w.k);
  if (a.m <= 8) {
    decode_launch_tiles<1>(p, warps, vec16, ctx.stream());
  } else {
    decode_launch_tiles<2>(p, warps, vec16, ctx.stream());
  }
}

namespace {

template <int kBm, int kStages>
void prefill_launch_tiles(const PrefillParams& p, cudaStream_t stream) {
  constexpr size_t kSmem = prefill_smem_bytes(kBm, kStages);
  TERN_CUDA_CHECK(cudaFuncSetAttribute(nvfp4_prefill_kernel<kBm, kStages>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  const dim3 grid(static_cast<unsigned>((p.n + kPrefillBn - 1) / kPrefillBn),
                  static_cast<unsigned>((p.m + kBm - 1) / kBm));
  nvfp4_prefill_kernel<kBm, kStages><<<grid, kPrefillThreads, kSmem, stream>>>(p);
  TERN_CUDA_CHECK_LAUNCH();
}

// Tile choice. kBm = 128 halves the W dequantization per output and reuses each x tile over more columns, but
// when 128-row tiles would leave SMs idle (fewer tiles than SMs) 64-row tiles double the block count. Stages:
// as many x buffers (up to 4) as fit twice in one SM's shared memory, so two blocks overlap one another's
// barriers, and at least within the per-block opt-in limit.
}  // namespace

void nvfp4_w4a16_launch_prefill(const DeviceContext& ctx, const GemmNvfp4W4a16Args& a) {
  const DeviceProps& props = ctx.props();
  const PrefillParams p{.x = a.x,
                        .packed = a.w.packed,
                        .scales = a.w.scales,
                        .y = a.y,
                        .out_scale = a.w.global_scale,
                        .m = static_cast<int>(a.m),
                        .n = static_cast<int>(a.w.n),
                        .k = static_cast<int>(a.w.k),
                       .ldy = a.ldy > 0 ? a.ldy : a.w.n};
  const int64_t n_tiles = (a.w.n + kPrefillBn - 1) / kPrefillBn;
  const bool big = ((a.m + 127) / 128) * n_tiles >= props.num_sms;
  const int bm = big ? 128 : 64;
  auto fits = [&](int stages) {
    const size_t bytes = prefill_smem_bytes(bm, stages);
    return bytes <= props.shared_mem_per_block_optin && 2 * bytes <= props.shared_mem_per_sm;
  };
  const int stages = fits(4) ? 4 : fits(3) ? 3 : 2;
  if (bm == 128) {
    if (stages == 4) return prefill_launch_tiles<128, 4>(p, ctx.stream());
    if (stages == 3) return prefill_launch_tiles<128, 3>(p, ctx.stream());
    return prefill_launch_tiles<128, 2>(p, ctx.stream());
  }
  if (stages == 4) return prefill_launch_tiles<64, 4>(p, ctx.stream());
  if (stages == 3) return prefill_launch_tiles<64, 3>(p, ctx.stream());
  return prefill_launch_tiles<64, 2>(p, ctx.stream());
}

}  // namespace tern
