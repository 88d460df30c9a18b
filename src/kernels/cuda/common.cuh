// Device helpers shared by the CUDA kernels: bf16 <-> fp32 conversions (one value, a pair, 8 values in 16 bytes),
// the sigmoid and SiLU of the CPU path, RoPE's scaled cos and sin, and the warp sum. The tensor-core and inline-PTX
// helpers (mma_bf16_16816,
// cp.async, ldmatrix) are in ptx.cuh, the NVFP4 ones in nvfp4_device.cuh. Include from .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tern::cuda_common {

// bf16 is the upper half of an fp32: widening is exact.
__device__ __forceinline__ float bf16_to_f32(uint16_t bits) {
  return __uint_as_float(uint32_t{bits} << 16);
}

// Round to nearest even, as core/formats.h float_to_bf16 (NaN stays NaN, overflow goes to infinity).
__device__ __forceinline__ uint16_t f32_to_bf16(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

// lo in bits 15:0 and hi in bits 31:16, each rounded as f32_to_bf16.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return uint32_t{f32_to_bf16(lo)} | (uint32_t{f32_to_bf16(hi)} << 16);
}

// 8 bf16 values (16 bytes, element 2i the low half of word i) widened to fp32: a shift (even element) or a mask
// (odd element).
__device__ __forceinline__ void unpack_bf16x8(const uint4& raw, float (&v)[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(words[i] << 16);
    v[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}
// The same from 16-byte aligned memory, and back (each value rounded as f32_to_bf16), in one 16-byte access. (The
// load goes into a local first: unpacking straight from a reference to memory compiled some kernels differently.)
__device__ __forceinline__ void load_bf16x8(const uint16_t* p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  unpack_bf16x8(raw, v);
}
__device__ __forceinline__ void store_bf16x8(uint16_t* p, const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = pack_bf16x2(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// As the CPU path (layers/): 1 / (1 + exp(-x)) and x / (1 + exp(-x)) with the accurate expf, not __expf, so large
// |x| stay within an ulp.
__device__ __forceinline__ float sigmoid_f32(float x) {
  return 1.0f / (1.0f + expf(-x));
}
__device__ __forceinline__ float silu_f32(float x) {
  return x / (1.0f + expf(-x));
}

// RoPE's cos and sin of `angle` times `factor` (YaRN's attention factor; 1 otherwise), in fp32 as layers/rope.cc
// computes them.
__device__ __forceinline__ void rope_cos_sin(float angle, float factor, float* cos_out, float* sin_out) {
  float s, c;
  sincosf(angle, &s, &c);
  *cos_out = c * factor;
  *sin_out = s * factor;
}

// The sum over the 32 lanes of a full warp (float, double or an integer type), as a butterfly with offsets 16, 8, 4,
// 2, 1: every lane gets the same bits, and the order of the additions is fixed.
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

}  // namespace tern::cuda_common
