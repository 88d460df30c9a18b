// Checked launchers of the sparse Mixture-of-Experts kernels (argument structs, semantics and the whole pipeline in
// moe_launch.h). Each validates shapes, pointers and alignment and queues its kernel on ctx.stream() without
// waiting for it; errors name the kernel and the bad argument. tokens == 0 is a no-op, except that moe_align
// still writes the (all-zero) offsets.
//
// Alignment: the grouped GEMM reads x and bf16 weights 16 bytes at a time (x 16-byte aligned, ldx a multiple of 8;
// bf16 weights 16-byte aligned with an expert stride that is a multiple of 8), NVFP4 packed weights 8 bytes at a
// time (8-byte aligned, expert stride a multiple of 8), FP8 codes 16 bytes at a time (16-byte aligned, expert stride
// a multiple of 16; row_scales 4-byte aligned); y must be 4-byte aligned with ldy >= n. The combine moves 8
// bf16 at a time: hidden a multiple of 8, expert_out, shared_out and y 16-byte aligned.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/moe/moe_launch.h"

namespace tern {

size_t moe_align_workspace_bytes(int64_t tokens, int64_t top_k, int64_t n_experts);

Expected<void> moe_route(const DeviceContext& ctx, const MoeRouteArgs& args);
Expected<void> moe_align(const DeviceContext& ctx, const MoeAlignArgs& args);
// moe_route then moe_align, in one launch up to 8 tokens (beyond, as the two launches: faster there); align must
// sort the ids route writes (same topk_ids, tokens, top_k and n_experts) and tokens * top_k <=
// kMoeRouteAlignMaxPairs. tokens == 0 writes the all-zero offsets, as moe_align.
Expected<void> moe_route_align(const DeviceContext& ctx, const MoeRouteArgs& route, const MoeAlignArgs& align);
Expected<void> moe_gemm(const DeviceContext& ctx, const MoeGemmArgs& args, MoeGemmVariant variant = MoeGemmVariant::kAuto);
Expected<void> moe_combine(const DeviceContext& ctx, const MoeCombineArgs& args);

// The routed part of one MoE block from the router logits on: route, align, the fused gate/up grouped GEMM,
// silu_mul, the down grouped GEMM and the combine (moe_launch.h's pipeline). At decode (kDecode, or kAuto with at
// most kMoeDecodeMaxTokens tokens) route and align are one launch (moe_route_align; at one token no launch: the
// gate/up launch routes the token itself, MoeGemmArgs::route), a separate up stack joins the gate's launch
// (MoeGemmArgs::w2) and the down GEMM applies silu_mul to its input itself (MoeGemmArgs::x_silu_mul); past
// kMoeDecodePassRows tokens the align writes the decode pass list both GEMMs take (MoeGemmArgs::decode_passes).
// The fused steps give the same bits as the separate ones, except that gate and up in one grid may split K
// differently (a different fp32 summation order). Sigmoid routing (DeepSeek-V3 / GLM-5; MoeRouteArgs::sigmoid) is
// never routed inside the gate/up launch: at one token it takes moe_route_align's launch. The router GEMM and the
// shared expert are dense layers the caller runs first; their outputs come in as router_logits and shared_out /
// shared_gate (the shared expert gate may be an extra column of the router's output, hence its stride; without a
// gate the shared expert is added unweighted, as DeepSeek-V3 and GLM-5 add theirs).
struct MoeForwardArgs {
  const uint16_t* x = nullptr;              // [tokens, hidden] bf16
  const uint16_t* router_logits = nullptr;  // [tokens, logits_stride] bf16
  const float* router_logits_f32 = nullptr; // or fp32 (sigmoid routing only: DeepSeek-V3 / GLM-5's fp32 router)
  int64_t logits_stride = 0;
  int64_t tokens = 0, hidden = 0, inter = 0, n_experts = 0, top_k = 0;
  // Expert parallelism: the weights hold experts [expert_begin, expert_begin + gate_up.n_experts) of the router's
  // n_experts, and only the pairs routed to them are computed and combined (y holds this rank's part of the block's
  // sum; the shared expert, when given, is added here too). All of them: 0 with n_experts in the weights.
  int64_t expert_begin = 0;
  bool renormalize = true;
  // The routing: softmax, or with sigmoid DeepSeek-V3 / GLM-5's (MoeRouteArgs, whose fields these are).
  bool sigmoid = false;
  int64_t n_group = 1, topk_group = 1;
  float routed_scaling = 1.0f;
  const float* correction_bias = nullptr;  // [n_experts] fp32; null: none
  MoeExpertWeights gate_up;  // n = 2 * inter (gate rows first, then up; NVFP4: one global scale per expert), k = hidden
  MoeExpertWeights up;       // optional (n = 0: gate_up is fused): then gate_up holds the gate (n = inter) and this the
                             // up projection, for NVFP4 checkpoints whose gate and up have their own global scales
  MoeExpertWeights down;     // n = hidden, k = inter
  const uint16_t* shared_out = nullptr;   // optional [tokens, hidden] bf16
  const uint16_t* shared_gate = nullptr;  // optional [tokens] at shared_gate_stride, only with shared_out; null:
  int64_t shared_gate_stride = 1;         // shared_out is added unweighted
  uint16_t* y = nullptr;  // [tokens, hidden] bf16
  void* workspace = nullptr;  // moe_forward_workspace_bytes(); holds the routing and the intermediate activations
  size_t workspace_bytes = 0;
  MoeGemmVariant variant = MoeGemmVariant::kAuto;
};

size_t moe_forward_workspace_bytes(int64_t tokens, int64_t top_k, int64_t n_experts, int64_t inter, int64_t hidden);
Expected<void> moe_forward(const DeviceContext& ctx, const MoeForwardArgs& args);
// moe_forward up to the combine, which it returns unlaunched (its inputs in the workspace, args' shared expert and
// y), for a caller that folds it into another launch (gemv_bf16_silu_mul_moe_combine). tokens == 0 launches
// nothing and returns a combine of no tokens.
Expected<MoeCombineArgs> moe_forward_experts(const DeviceContext& ctx, const MoeForwardArgs& args);

}  // namespace tern
