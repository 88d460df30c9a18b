// SiLU-and-mul of a [gate | up] pair with silu_mul's arithmetic (elementwise.cu): silu(g) = g / (1 + expf(-g)) in
// fp32, times up, one round to nearest even bf16 of the product. Kernels that fold the activation into their input
// (the MoE expert GEMM, the BF16 GEMV) compute it with these, silu_mul's expression (the same silu_f32 of
// common.cuh), so the compiler makes the same operations of it and their act is bit-identical to what silu_mul
// would have written.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace tern {

__device__ __forceinline__ float silu_mul_f32(float g, float u) {
  return cuda_common::silu_f32(g) * u;
}

// Two bf16 of act from the matching words of gate and up (element 0 in the low half).
__device__ __forceinline__ uint32_t silu_mul_bf16x2(uint32_t gate, uint32_t up) {
  const float lo = silu_mul_f32(__uint_as_float(gate << 16), __uint_as_float(up << 16));
  const float hi = silu_mul_f32(__uint_as_float(gate & 0xFFFF0000u), __uint_as_float(up & 0xFFFF0000u));
  return cuda_common::pack_bf16x2(lo, hi);
}

}  // namespace tern
