#include "ops/moe_cuda.h"

#include <algorithm>

#include "kernels/cuda/elementwise/elementwise.h"
#include "kernels/cuda/gemm/gemm_bf16.h"
#include "kernels/cuda/gemv/gemv_bf16.h"
#include "ops/cuda_util.h"

namespace tern {
namespace {

// Intermediate buffers start as 0xFF bytes (NaN activations, -1 indices), so a step that skips work shows.
DeviceBuffer poisoned(size_t bytes, cudaStream_t stream) {
  DeviceBuffer b(std::max<size_t>(bytes, 256));
  TERN_CUDA_CHECK(cudaMemsetAsync(b.data(), 0xFF, b.size_bytes(), stream));
  return b;
}

struct MoeDeviceInputs {
  DeviceBuffer x, router, gate_up, gate_up_scales, gate_up_global, down, down_scales, down_global;
  DeviceBuffer gate_up_row_scales, down_row_scales;  // FP8
  DeviceBuffer shared_gate_up, shared_down, logits, shared_gu_out, shared_act, shared_out, workspace, bias;
  size_t workspace_bytes = 0;
};

MoeDeviceInputs moe_upload(const MoeInputs& in, cudaStream_t s) {
  const auto t = static_cast<size_t>(in.tokens), h = static_cast<size_t>(in.hidden), i = static_cast<size_t>(in.inter);
  MoeDeviceInputs d{.x = cuda_upload(in.x, s), .router = cuda_upload(in.router, s)};
  // NVFP4's packed e2m1 and FP8's e4m3 codes both travel in the *_packed vectors.
  const bool packed = in.nvfp4 || in.fp8;
  d.gate_up = packed ? cuda_upload(in.gate_up_packed, s) : cuda_upload(in.gate_up_bf16, s);
  d.down = packed ? cuda_upload(in.down_packed, s) : cuda_upload(in.down_bf16, s);
  d.gate_up_scales = cuda_upload(in.gate_up_scales, s);
  d.down_scales = cuda_upload(in.down_scales, s);
  d.gate_up_row_scales = cuda_upload(in.gate_up_row_scales, s);
  d.down_row_scales = cuda_upload(in.down_row_scales, s);
  d.gate_up_global = cuda_upload(in.gate_up_global, s);
  d.down_global = cuda_upload(in.down_global, s);
  d.shared_gate_up = cuda_upload(in.shared_gate_up, s);
  d.shared_down = cuda_upload(in.shared_down, s);
  d.bias = cuda_upload(in.correction_bias, s);
  d.logits = poisoned(t * static_cast<size_t>(in.n_experts + 1) * 2, s);
  d.shared_gu_out = poisoned(t * 2 * i * 2, s);
  d.shared_act = poisoned(t * i * 2, s);
  d.shared_out = poisoned(t * h * 2, s);
  d.workspace_bytes = moe_forward_workspace_bytes(in.tokens, in.top_k, in.n_experts, in.inter, in.hidden);
  d.workspace = poisoned(d.workspace_bytes, s);
  return d;
}

// One projection of the experts the inputs hold ([expert_begin, expert_begin + local_experts) of the stacks) as the
// grouped GEMM reads it.
MoeExpertWeights expert_view(const MoeInputs& in, const DeviceBuffer& w, const DeviceBuffer& scales,
                             const DeviceBuffer& global, const DeviceBuffer& row_scales, int64_t n, int64_t k) {
  MoeExpertWeights v{.format = in.nvfp4 ? MoeWeightFormat::kNvfp4 : in.fp8 ? MoeWeightFormat::kFp8
                                                                            : MoeWeightFormat::kBf16,
                     .n_experts = in.held(), .n = n, .k = k};
  const int64_t first = in.expert_begin;
  if (in.fp8) {
    v.packed_expert_stride = n * k;
    v.packed = w.as<uint8_t>() + first * v.packed_expert_stride;
    v.row_scales_expert_stride = n * ((k + 127) / 128);
    v.row_scales = row_scales.as<float>() + first * v.row_scales_expert_stride;
  } else if (in.nvfp4) {
    v.packed_expert_stride = n * k / 2;
    v.packed = w.as<uint8_t>() + first * v.packed_expert_stride;
    v.scales_expert_stride = n * k / 16;
    v.scales = scales.as<uint8_t>() + first * v.scales_expert_stride;
    v.global_scales = global.as<float>() + first;
  } else {
    v.bf16_expert_stride = n * k;
    v.bf16 = w.as<uint16_t>() + first * v.bf16_expert_stride;
  }
  return v;
}

// The model's decode path at one token with a shared expert (CudaOps::run_moe, models/gpu/cuda_ops.cc): the shared
// expert's down projection runs after the experts, with SiLU-and-mul folded in front and the combine folded behind
// it.
bool fold_combine(const MoeInputs& in) {
  return in.shared && in.tokens == 1;
}

// The dense layers around the routed experts: router logits (+ the shared gate column) and the shared expert (its
// down projection only when the combine is not folded into it).
Expected<void> moe_dense_layers(const DeviceContext& ctx, const MoeInputs& in, const MoeDeviceInputs& d) {
  const uint16_t* x = d.x.as<uint16_t>();
  TERN_TRY(gemm_bf16(ctx, {.x = x, .w = d.router.as<uint16_t>(), .y = d.logits.as<uint16_t>(), .m = in.tokens,
                           .n = in.n_experts + 1, .k = in.hidden}));
  if (!in.shared) return {};
  TERN_TRY(gemm_bf16(ctx, {.x = x, .w = d.shared_gate_up.as<uint16_t>(), .y = d.shared_gu_out.as<uint16_t>(),
                           .m = in.tokens, .n = 2 * in.inter, .k = in.hidden}));
  if (fold_combine(in)) return {};
  TERN_TRY(silu_mul(ctx, {.gate_up = d.shared_gu_out.as<uint16_t>(), .y = d.shared_act.as<uint16_t>(),
                          .rows = in.tokens, .inter = in.inter}));
  return gemm_bf16(ctx, {.x = d.shared_act.as<uint16_t>(), .w = d.shared_down.as<uint16_t>(),
                         .y = d.shared_out.as<uint16_t>(), .m = in.tokens, .n = in.hidden, .k = in.inter});
}

std::string cuda_only(const DeviceDescription& d, const SelfTestCase&) {
  if (std::string why = cuda_unsupported_reason(d); !why.empty()) return why;
  return arch_features(d.cc_major, d.cc_minor).mma_bf16 ? "" : "needs bf16 mma.sync (sm_80 or later targets)";
}

}  // namespace

Expected<RunOutput> moe_cuda_run(const DeviceContext& ctx, const MoeInputs& in, const ArgsTweak<MoeForwardArgs>& tweak,
                                 MoeGemmVariant variant) {
  const MoeDeviceInputs d = moe_upload(in, ctx.stream());
  const int64_t e = in.n_experts;
  return cuda_run_timed(ctx, in.tokens, in.hidden, [&](uint16_t* y) -> Expected<void> {
    TERN_TRY(moe_dense_layers(ctx, in, d));
    MoeForwardArgs a{.x = d.x.as<uint16_t>(), .router_logits = d.logits.as<uint16_t>(), .logits_stride = e + 1,
                     .tokens = in.tokens, .hidden = in.hidden, .inter = in.inter, .n_experts = e, .top_k = in.top_k,
                     .expert_begin = in.expert_begin, .renormalize = true, .sigmoid = in.sigmoid,
                     .n_group = in.n_group, .topk_group = in.topk_group,
                     .routed_scaling = in.routed_scaling,
                     .correction_bias = in.correction_bias.empty() ? nullptr : d.bias.as<float>(),
                     .gate_up = expert_view(in, d.gate_up, d.gate_up_scales, d.gate_up_global, d.gate_up_row_scales,
                                            2 * in.inter, in.hidden),
                     .down = expert_view(in, d.down, d.down_scales, d.down_global, d.down_row_scales, in.hidden,
                                         in.inter),
                     .shared_out = in.shared ? d.shared_out.as<uint16_t>() : nullptr,
                     // An unweighted shared expert has no gate; its column of the logits is then never read.
                     .shared_gate = in.shared && in.shared_gate ? d.logits.as<uint16_t>() + e : nullptr,
                     .shared_gate_stride = e + 1,
                     .y = y, .workspace = d.workspace.data(), .workspace_bytes = d.workspace_bytes, .variant = variant};
    if (tweak) tweak(a);
    if (!fold_combine(in) || a.shared_out == nullptr) return moe_forward(ctx, a);
    TERN_ASSIGN_OR_RETURN(const MoeCombineArgs c, moe_forward_experts(ctx, a));
    if (c.tokens == 0) return {};
    return gemv_bf16_silu_mul_moe_combine(ctx,
                                          {.x = d.shared_gu_out.as<uint16_t>(),
                                           .w = d.shared_down.as<uint16_t>(),
                                           .y = c.y,
                                           .m = 1,
                                           .n = in.hidden,
                                           .k = in.inter,
                                           .ldy = in.hidden},
                                          2 * in.inter, c);
  });
}

Expected<void> moe_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context) {
  return registry.add(Implementation{
      .op = "moe",
      .name = "cuda",
      .backend = Backend::kCuda,
      .priority = 10,
      .tolerance = kMoeCudaTolerance,
      .unsupported_reason = cuda_only,
      .run = [context](const OpInputs& b) { return moe_cuda_run(*context, static_cast<const MoeInputs&>(b)); },
  });
}

}  // namespace tern
