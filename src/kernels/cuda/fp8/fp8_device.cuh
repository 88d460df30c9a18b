// Device code shared by the dense FP8 W8A16 GEMM (gemm/gemm_fp8_w8a16.cu) and the grouped MoE GEMM (moe_gemm_*.cu):
// how a block-wise FP8 weight (DeepSeek-V3 / GLM-5-FP8 / Qwen3-FP8 layout, docs/model-specs.md §1.7) reaches the
// bf16 tensor cores. On the device the weight is its e4m3 codes [n, k] (row-major, k a multiple of 16) and one fp32
// scale per row and 128-column block, [n, ceil(k / 128)] (the checkpoint's weight_scale_inv of the row's 128-row
// block, repeated per row as the CPU matrix holds it, so any slice or stack of rows keeps its scales):
//   decode:  16-byte loads of the codes converted exactly to bf16 in registers, the mma sums of a 64-k step (inside
//            one 128-column block) scaled in fp32 per row and added to the accumulators. Products are exact; the
//            roundings are the fp32 sums and the final bf16 store.
//   prefill: a weight tile dequantized to bf16 in shared memory, each value e4m3 * scale computed in fp32 and rounded
//            to bf16 once (transformers' dequantized weight), then the NVFP4 prefill scheme's ldmatrix + mma.
// An e4m3 NaN code (0x7F, 0xFF; no checkpoint holds one) decodes as 480 here, not NaN. Include from .cu files only.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/nvfp4/nvfp4_device.cuh"
#include "kernels/cuda/ptx.cuh"

namespace tern::fp8_device {

using nvfp4_device::bf16x2_mul;
using nvfp4_device::kPrefillBk;
using nvfp4_device::kPrefillLd;
using nvfp4_device::uint4_word;
using ptx::mma_bf16_16816;

constexpr int kFp8ScaleBlock = 128;   // columns per weight_scale_inv block
constexpr int kFp8DecodeStepK = 64;   // k per warp step of the decode scheme: 4 lanes x 16

__host__ __device__ constexpr int64_t fp8_scale_cols(int64_t k) { return (k + kFp8ScaleBlock - 1) / kFp8ScaleBlock; }

// Two e4m3 codes of `word`, picked by a byte_perm selector that puts them in the high bytes of the two halves, as a
// bf16 pair of their values times 2^-120: the sign to bit 15, exponent and mantissa to bits 10:4 of each half, so
// the e4m3 exponent field becomes the low four bits of bf16's (bias 7 in 127) and e4m3 subnormals bf16 subnormals.
__device__ __forceinline__ uint32_t e4m3x2_bf16x2_tiny(uint32_t word, uint32_t selector) {
  const uint32_t t = __byte_perm(word, 0, selector);
  return (t & 0x80008000u) | ((t >> 4) & 0x07F007F0u);
}

// 16 consecutive e4m3 codes as their exact bf16 values: out[i] holds codes 2i (low half) and 2i + 1.
__device__ __forceinline__ void e4m3x16_to_bf16(const uint4& q, uint32_t (&out)[8]) {
  constexpr uint32_t kTwoPow120 = 0x7B807B80u;  // bf16 pair (2^120, 2^120): a power of two, so the product is exact
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t word = uint4_word(q, j);
    out[2 * j] = bf16x2_mul(e4m3x2_bf16x2_tiny(word, 0x1404), kTwoPow120);      // bytes 0, 1
    out[2 * j + 1] = bf16x2_mul(e4m3x2_bf16x2_tiny(word, 0x3424), kTwoPow120);  // bytes 2, 3
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Decode scheme (few activation rows). A warp owns 16 weight rows and a share of K in 64-k steps. Lane (g, t) =
// (lane / 4, lane % 4) loads the 16 codes k0 .. k0 + 15 (k0 = 64 step + 16 t) of rows g and g + 8 with their two
// scales, and x for the same 16 k of token g of each token tile. mma q of the step takes bf16 pairs 2q and 2q + 1 of
// the rows as the A slots (2t, 2t+1) and (2t+8, 2t+9) and x's pairs 2q, 2q + 1 as B: the mma sums over its 16 k slots
// in any assignment that A and B share. The step's sums (rows g, g + 8 in accumulator elements 0-1, 2-3) are scaled
// by their rows' scales in fp32 and added to acc.

template <int kTokenTiles>
struct Fp8DecodeChunk {
  uint4 w[2];               // rows g and g + 8: 16 codes each
  float s[2];               // their scales for the step's 128-column block
  uint4 x[kTokenTiles][2];  // token g of each token tile: the same 16 k as bf16
};

// Step `step` of rows n0 + g, n0 + g + 8 of an [n, k] weight (zeros past n or k) and of the x rows at x + xoff[tt]
// (xoff < 0: no token). x is global memory, read-only for the kernel's life, or with kXShared rows staged in shared
// memory.
template <int kTokenTiles, bool kXShared>
__device__ __forceinline__ void fp8_decode_load(const uint8_t* codes, const float* scales, int n, int k, int n0,
                                                int step, const uint16_t* x, const int64_t (&xoff)[kTokenTiles],
                                                Fp8DecodeChunk<kTokenTiles>& c) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int k0 = step * kFp8DecodeStepK + t * 16;  // k is a multiple of 16: the 16 codes are all in or all out
  const int64_t scale_cols = fp8_scale_cols(k);
  const bool step_in = step * kFp8DecodeStepK < k;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = n0 + g + 8 * r;
    const bool ok = row < n && k0 < k;
    c.w[r] = ok ? ptx::ld_stream_16(codes + static_cast<int64_t>(row) * k + k0) : make_uint4(0, 0, 0, 0);
    // Every lane takes the step's scale, even one whose 16 codes lie past k: the mma adds the four lanes' k into
    // each accumulator element, so a zero scale there would drop the other lanes' part of a short last step.
    c.s[r] = row < n && step_in ? __ldg(scales + row * scale_cols + step * kFp8DecodeStepK / kFp8ScaleBlock) : 0.0f;
  }
#pragma unroll
  for (int tt = 0; tt < kTokenTiles; ++tt) {
    const bool ok = xoff[tt] >= 0 && k0 < k;
    const uint4* src = reinterpret_cast<const uint4*>(x + xoff[tt] + k0);
    c.x[tt][0] = ok ? (kXShared ? src[0] : __ldg(src)) : make_uint4(0, 0, 0, 0);
    c.x[tt][1] = ok ? (kXShared ? src[1] : __ldg(src + 1)) : make_uint4(0, 0, 0, 0);
  }
}

template <int kTokenTiles>
__device__ __forceinline__ void fp8_decode_mma(const Fp8DecodeChunk<kTokenTiles>& c,
                                               float (&acc)[kTokenTiles][1][4]) {
  uint32_t w0[8], w1[8];  // rows g and g + 8 as bf16 pairs
  e4m3x16_to_bf16(c.w[0], w0);
  e4m3x16_to_bf16(c.w[1], w1);
  float part[kTokenTiles][4] = {};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t a[4] = {w0[2 * q], w1[2 * q], w0[2 * q + 1], w1[2 * q + 1]};
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) {
      const uint32_t b[2] = {uint4_word(c.x[tt][q / 2], (2 * q) % 4), uint4_word(c.x[tt][q / 2], (2 * q) % 4 + 1)};
      mma_bf16_16816(part[tt], a, b);
    }
  }
#pragma unroll
  for (int tt = 0; tt < kTokenTiles; ++tt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[tt][0][e] = fmaf(c.s[e / 2], part[tt][e], acc[tt][0][e]);
  }
}

// Steps whose loads are issued before any is used: 128 bytes of weight per lane in flight with one token tile.
__host__ __device__ constexpr int fp8_decode_unroll(int token_tiles) { return token_tiles == 1 ? 4 : 2; }

// A warp's share of its 16-row tile: steps first, first + stride, ... below ceil(k / 64), fp8_decode_unroll at a time.
template <int kTokenTiles, bool kXShared>
__device__ __forceinline__ void fp8_decode_k_loop(const uint8_t* codes, const float* scales, int n, int k, int n0,
                                                  int first, int stride, const uint16_t* x,
                                                  const int64_t (&xoff)[kTokenTiles],
                                                  float (&acc)[kTokenTiles][1][4]) {
  constexpr int kUnroll = fp8_decode_unroll(kTokenTiles);
  const int n_steps = (k + kFp8DecodeStepK - 1) / kFp8DecodeStepK;
  for (int s = first; s < n_steps; s += stride * kUnroll) {
    Fp8DecodeChunk<kTokenTiles> c[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      fp8_decode_load<kTokenTiles, kXShared>(codes, scales, n, k, n0, s + u * stride, x, xoff, c[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) fp8_decode_mma<kTokenTiles>(c[u], acc);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Prefill scheme: thread tid owns weight row tid / 2, k half tid % 2 (16 codes) of each 32-k step of a 128-row tile
// (nvfp4_device.cuh's prefill layout, kPrefillThreads = 256).

struct Fp8PrefillWRegs {
  uint4 codes;
  float scale;
};

__device__ __forceinline__ Fp8PrefillWRegs fp8_prefill_load_w(const uint8_t* codes, const float* scales, int n, int k,
                                                              int n0, int kstep) {
  const int row = n0 + threadIdx.x / 2;
  const int kb = kstep * kPrefillBk + (threadIdx.x % 2) * 16;
  Fp8PrefillWRegs r{make_uint4(0, 0, 0, 0), 0.0f};
  if (row < n && kb < k) {  // k is a multiple of 16: the 16 codes are all in or all out
    r.codes = __ldcs(reinterpret_cast<const uint4*>(codes + static_cast<int64_t>(row) * k + kb));
    r.scale = __ldg(scales + row * fp8_scale_cols(k) + kb / kFp8ScaleBlock);
  }
  return r;
}

// 16 consecutive codes' values e4m3 * scale, each computed in fp32 and rounded to bf16 once, as bf16 pairs:
// transformers' dequantized weight, and what every FP8 path that computes with a bf16 weight uses.
__device__ __forceinline__ void fp8_dequant16(const uint4& codes, float scale, uint32_t (&out)[8]) {
  uint32_t v[8];
  e4m3x16_to_bf16(codes, v);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float lo = __uint_as_float(v[i] << 16) * scale, hi = __uint_as_float(v[i] & 0xFFFF0000u) * scale;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out[i]) : "f"(hi), "f"(lo));
  }
}

// The thread's 16 values (fp8_dequant16) into the bf16 W tile ws [128][kPrefillLd].
__device__ __forceinline__ void fp8_prefill_store_w(const Fp8PrefillWRegs& r, uint16_t* ws) {
  uint32_t out[8];
  fp8_dequant16(r.codes, r.scale, out);
  uint4* dst = reinterpret_cast<uint4*>(ws + (threadIdx.x / 2) * kPrefillLd + (threadIdx.x % 2) * 16);
  dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
  dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

}  // namespace tern::fp8_device
