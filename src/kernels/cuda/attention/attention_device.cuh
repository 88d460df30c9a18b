// What the paged attention kernels share (attention_prepare.cu, attention_decode.cu, attention_prefill.cu): the
// device helpers they use and the tensor-core and cp.async wrappers. Internal to those files.
//
// prepare:  one block per token; q/k per-head RMSNorm and RoPE in fp32, one bf16 rounding, k/v into their slot.
// decode:   split-K flash decoding on tensor cores. A block owns (token, kv head, range of keys) and all query heads
//           of that kv head, so each K/V row is read once per group; its warps stream their own chunks of keys
//           through cp.async buffers without block barriers; a reduce kernel merges the ranges' partial softmaxes.
// prefill:  flash attention on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulation) over 64-row query tiles
//           of one head, K/V tiles gathered from the paged cache with cp.async, online softmax in the log2 domain.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/attention/attention_launch.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ptx.cuh"

namespace tern {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

using cuda_common::bf16_to_f32;
using cuda_common::f32_to_bf16;
using cuda_common::pack_bf16x2;
using cuda_common::sigmoid_f32;  // as layers/attention.cc
using cuda_common::warp_sum;

inline int log2_int(int64_t v) {
  int l = 0;
  while ((int64_t{1} << l) < v) ++l;
  return l;
}

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core and cp.async helpers (decode and prefill).

using ptx::cp_async_16_zfill;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::mma_bf16_16816;
using ptx::smem_addr;

}  // namespace
}  // namespace tern
