// Device code shared by the dense NVFP4 W4A16 GEMM (gemm_nvfp4_w4a16.cu) and the grouped MoE GEMM (moe_gemm.cu):
// the bf16 mma.sync with its operand loads, and the two ways an NVFP4 weight (ModelOpt layout, shared
// model-specs.md section 1) reaches the tensor cores:
//   decode:  16-byte loads of the packed weight dequantized straight into mma A fragments in registers;
//   prefill: a 128 x 32 weight tile dequantized to bf16 in shared memory, then ldmatrix + mma.
// The weight factor fed to the tensor cores is e2m1 · e4m3 block scale, which is exact in bf16 (at most 2 + 4
// significant bits, magnitudes 2^-10 .. 2688), so every product is exact and the only roundings are the fp32
// accumulation and the final bf16 store. Include from .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace tern::nvfp4_device {

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core and conversion helpers

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

// ---------------------------------------------------------------------------------------------------------------
// Decode scheme (few activation rows: a bandwidth problem). A block owns 16 weight rows; its warps split K. A lane
// (g, t) = (lane / 4, lane % 4) loads 16 bytes (32 consecutive k) of rows g and g + 8 per 128-k step, which is the
// mma A fragment's row pair. The mma only sums over its 16 k slots, so which k each slot holds is free as long as
// x uses the same assignment: the weight nibbles go to bf16 by shifting bits in place (no lookups), pairing
// elements (e3,e7), (e2,e6), (e1,e5), (e0,e4) of each 8-nibble word, and x is permuted to match with byte_perm
// once per step. The bf16 pattern with the e2m1 exponent/mantissa in bits [8:6] equals e2m1 · 2^-126 (e2m1's
// subnormal 0.5 becomes a bf16 subnormal), so the block scale is applied as e4m3 · 2^(126 - kDecodeShift) and
// the fp32 sum is multiplied by global_scale · 2^kDecodeShift; the shift keeps the scale within bf16's range.

constexpr int kDecodeShift = 10;
constexpr int kDecodeRows = 16;      // rows of W per block (mma M)
constexpr int kDecodeStepK = 128;    // k per warp step: 4 lanes x 32

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

// The weight half of a decode chunk: rows n0 + g and n0 + g + 8 of an [n, k] NVFP4 weight at k0 = step * 128 +
// t * 32 (zeros past n or k). kVec16: one 16-byte load per row (k % 32 == 0, 16-byte aligned rows), else two 8-byte
// loads (a row may end after the first 16 codes).
template <int kTokenTiles, bool kVec16>
__device__ __forceinline__ void decode_load_w(const uint8_t* packed, const uint8_t* scales, int n, int k, int n0,
                                              int step, DecodeChunk<kTokenTiles>& c) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int k0 = step * kDecodeStepK + t * 32;
  const int valid = min(32, k - k0);  // 32, 16 or <= 0 (k is a multiple of 16)
  c.scales = 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = n0 + g + 8 * r;
    c.w[r] = make_uint4(0, 0, 0, 0);
    if (row >= n || valid <= 0) continue;
    const uint8_t* wp = packed + static_cast<int64_t>(row) * (k / 2) + k0 / 2;
    const uint8_t* sp = scales + static_cast<int64_t>(row) * (k / 16) + k0 / 16;
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

// ---------------------------------------------------------------------------------------------------------------
// Prefill scheme (many activation rows: arithmetic-bound). A block computes a kBm x 128 tile over K in 32-k steps.
// W's packed bytes for a step are loaded into registers ahead of use, then dequantized (a 256-entry byte -> bf16-pair
// table, times the block scale) into a bf16 W tile in shared memory. 8 warps as 2 (M) x 4 (N), each a (kBm / 2) x 32
// tile of m16n8k16 mmas fed by ldmatrix. Rows are padded by 16 bytes so ldmatrix's eight 16-byte rows fall in
// distinct banks.

constexpr int kPrefillBn = 128;
constexpr int kPrefillBk = 32;
constexpr int kPrefillThreads = 256;
constexpr int kPrefillRowPad = 8;  // bf16 elements
constexpr int kPrefillLd = kPrefillBk + kPrefillRowPad;

// Thread tid owns W row tid / 2, k half tid % 2 (one 16-element NVFP4 block) of each 32-k step.
struct PrefillWRegs {
  uint2 packed;
  uint32_t scale;
};

// The thread's share of step kstep of an [n, k] NVFP4 weight, rows from n0 (zeros past n or k).
__device__ __forceinline__ PrefillWRegs prefill_load_w(const uint8_t* packed, const uint8_t* scales, int n, int k,
                                                       int n0, int kstep) {
  const int row = n0 + threadIdx.x / 2;
  const int kb = kstep * kPrefillBk + (threadIdx.x % 2) * 16;
  PrefillWRegs r{make_uint2(0, 0), 0};
  if (row < n && kb < k) {  // k is a multiple of 16: a block is all in or all out
    r.packed = __ldcs(reinterpret_cast<const uint2*>(packed + static_cast<int64_t>(row) * (k / 2) + kb / 2));
    r.scale = __ldcs(scales + static_cast<int64_t>(row) * (k / 16) + kb / 16);
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

// One 32-k step of the block's kBm x 128 tile: xs [kBm][kPrefillLd] and ws [128][kPrefillLd] bf16 in shared memory.
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

// e2m1 bf16 patterns of magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
// Packed four to a 64-bit word so the table stays in registers.
__device__ __forceinline__ uint32_t e2m1_bf16_bits(uint32_t code) {
  constexpr uint64_t kLow = 0x3FC03F803F000000ull, kHigh = 0x40C0408040404000ull;  // magnitudes 0..3, 4..7
  const uint64_t table = (code & 4) ? kHigh : kLow;
  return static_cast<uint32_t>((table >> (16 * (code & 3))) & 0xFFFF) | ((code & 8) << 12);
}

// The byte -> bf16-pair table prefill_store_w reads: entry b holds e2m1(b & 0xF) low, e2m1(b >> 4) high.
__device__ __forceinline__ uint32_t e2m1_byte_to_bf16x2(uint32_t byte) {
  return e2m1_bf16_bits(byte & 0xF) | (e2m1_bf16_bits(byte >> 4) << 16);
}

}  // namespace tern::nvfp4_device
