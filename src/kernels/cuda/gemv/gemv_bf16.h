// BF16 GEMV for decode: y[m, n] = x[m, k] . W[n, k]^T for 1 <= m <= kGemvMaxRows, with the arguments and semantics
// of gemm_bf16 (gemm_bf16.h): bf16 row-major operands, W in nn.Linear layout, fp32 accumulation, y rounded to bf16
// once. One kernel that streams W near copy speed; for more rows gemm_bf16 (cuBLASLt) is the one to call.
#pragma once

#include "core/error.h"
#include "kernels/cuda/gemm/gemm_bf16.h"
#include "kernels/cuda/gemv/gemv_bf16_launch.h"
#include "kernels/cuda/moe/moe_launch.h"

namespace tern {

// Queues the product on ctx.stream(). Errors name the bad argument: non-positive sizes, m over kGemvMaxRows, a
// dimension over 2^31 - 1, k not a multiple of 8, null or unaligned pointers (x and W 16 bytes, y 2), ldy < n.
// m == 0 is a no-op.
Expected<void> gemv_bf16(const DeviceContext& ctx, const GemmBf16Args& args);

// An RMSNorm of x fused in front of the product (GemvBf16Params in gemv_bf16_launch.h has the arithmetic): a decode
// step's norm then needs no launch of its own and no round trip of its output through memory.
struct GemvNormArgs {
  const uint16_t* weight = nullptr;    // [k] bf16, 16-byte aligned
  const uint16_t* residual = nullptr;  // optional [m, k], added to x first
  float eps = 1e-6f;
  bool zero_centred = false;  // weight applied as (1 + w)
  uint16_t* h_out = nullptr;  // optional [m, k]: bf16(x + residual)
  uint16_t* x_out = nullptr;  // optional [m, k]: the normed rows the product used
};

// As gemv_bf16, plus errors for a null or unaligned norm weight, unaligned residual / outputs, a bad eps, and an
// h_out or x_out that overlaps x or residual (every block reads those while block 0 writes the outputs).
Expected<void> gemv_bf16_rmsnorm(const DeviceContext& ctx, const GemmBf16Args& args, const GemvNormArgs& norm);

// The SiLU-and-mul of a dense MLP fused in front of its down projection: args.x holds args.m rows of [gate | up]
// (the gate|up projection's output), ldx elements apart, args.k is the act width (the intermediate size), and the
// product uses act[i, c] = bf16(silu(gate[i, c]) * up[i, c]) with silu_mul's arithmetic (elementwise.h), so y is
// what silu_mul followed by gemv_bf16 would give, bit for bit, without the launch and the act's round trip. As
// gemv_bf16, plus errors for an ldx under 2k or not a multiple of 8.
Expected<void> gemv_bf16_silu_mul(const DeviceContext& ctx, const GemmBf16Args& args, int64_t ldx);

// gemv_bf16_silu_mul as the MoE block's shared-expert down projection with the block's combine folded into its
// epilogue (GemvMoeCombine in gemv_bf16_launch.h): args.y is what gemv_bf16_silu_mul into combine.shared_out
// followed by moe_combine(combine) would write to combine.y, bit for bit, without the combine's launch and the
// shared output's round trip (combine.shared_out and combine.y are not used; combine comes from
// moe_forward_experts). A null combine.shared_gate adds the shared expert unweighted, as moe_combine does. As
// gemv_bf16_silu_mul, plus errors for a combine whose tokens or hidden are not args.m and args.n, a top_k outside
// [1, kGemvCombineMaxTopK], null or unaligned combine pointers (the gate may be null) and a bad gate stride.
Expected<void> gemv_bf16_silu_mul_moe_combine(const DeviceContext& ctx, const GemmBf16Args& args, int64_t ldx,
                                              const MoeCombineArgs& combine);

}  // namespace tern
