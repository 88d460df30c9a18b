#include "ops/gemm_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <utility>

#include "core/formats.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/elementwise/elementwise.h"
#include "kernels/cuda/gemm/gemm_bf16.h"
#include "kernels/cuda/gemm/gemm_fp8_w8a16.h"
#include "kernels/cuda/gemm/gemm_nvfp4_w4a16.h"
#include "kernels/cuda/gemv/gemv_bf16.h"
#include "ops/cuda_util.h"
#include "ops/gemm_op.h"

namespace tern {
namespace {

// bf16 output: rounding is half an ulp of each element (2^-9 relative); the accumulation order of tensor cores
// adds a little. 2^-8 of the largest output bounds both and still rejects a wrong scale of 1%.
//
// rms_norm_gemv, against an fp64 reference with x' unrounded: h and x' are rounded to bf16 once, at most 2^-8 of
// themselves and so of the largest output. y is rounded once too, and inherits x''s rounding: the errors d_k of x'_k
// enter y_j as sum_k d_k W[j, k], a sum of independent signs near 0.2% of y's rms (the rms of d / x' is about
// 2^-7.5 / sqrt(12)) and 0.7% at the worst of 2.5e5 columns. The harness keeps |y| below 2 (half an ulp <= 2^-8)
// while h or x' exceed 2.5, so y's rounding plus that (~0.002 at y's rms of 0.3) stays within 2^-8 * 2.5 = 0.0098.
// Simulating the kernel's roundings on the GPU test's shapes, y's error peaks near half the bound, x''s near 0.8;
// the fp32 sums (of squares, of products) add ~1e-6 relative.
constexpr Tolerance kBf16OutputTolerance{.rel = 1.0 / 256, .abs = 0.0};

}  // namespace

GemmDeviceInputs gemm_upload(const GemmInputs& in, cudaStream_t stream) {
  return GemmDeviceInputs{.x = cuda_upload(in.x_bf16, stream), .w_bf16 = cuda_upload(in.w_bf16, stream),
                          .w_packed = cuda_upload(in.w_packed, stream), .w_scales = cuda_upload(in.w_scales, stream),
                          .w_row_scales = cuda_upload(in.w_row_scales, stream)};
}

namespace {

Expected<RunOutput> rms_norm_gemv_separate_run(const DeviceContext& ctx, const RmsNormGemvInputs& in) {
  const DeviceBuffer x = cuda_upload(in.x, ctx.stream()), residual = cuda_upload(in.residual_in, ctx.stream());
  const DeviceBuffer norm_weight = cuda_upload(in.norm_weight, ctx.stream()), w = cuda_upload(in.w_bf16, ctx.stream());
  const int64_t x_at = in.residual ? in.k : 0;
  return cuda_run_timed(ctx, 1, rms_norm_gemv_output_size(in), [&](uint16_t* out) -> Expected<void> {
    TERN_TRY(rms_norm(ctx, RmsNormArgs{.x = x.as<uint16_t>(),
                                       .residual = in.residual ? residual.as<uint16_t>() : nullptr,
                                       .h_out = in.residual ? out : nullptr,
                                       .weight = norm_weight.as<uint16_t>(),
                                       .y = out + x_at,
                                       .rows = 1,
                                       .dim = in.k,
                                       .eps = in.eps,
                                       .zero_centred = in.form == RmsNormForm::kZeroCentred}));
    return gemv_bf16(
        ctx,
        GemmBf16Args{
            .x = out + x_at, .w = w.as<uint16_t>(), .y = out + x_at + in.k, .m = 1, .n = in.n, .k = in.k, .ldy = in.n});
  });
}

}  // namespace

Expected<RunOutput> rms_norm_gemv_cuda_run(const DeviceContext& ctx, const RmsNormGemvInputs& in,
                                           const RmsNormGemvTweak& tweak) {
  const DeviceBuffer x = cuda_upload(in.x, ctx.stream()), residual = cuda_upload(in.residual_in, ctx.stream());
  const DeviceBuffer norm_weight = cuda_upload(in.norm_weight, ctx.stream()), w = cuda_upload(in.w_bf16, ctx.stream());
  // K is a multiple of 8, so x_out and y stay 16-byte aligned within the buffer.
  const int64_t x_at = in.residual ? in.k : 0;
  return cuda_run_timed(ctx, 1, rms_norm_gemv_output_size(in), [&](uint16_t* out) {
    GemmBf16Args args{.x = x.as<uint16_t>(),
                      .w = w.as<uint16_t>(),
                      .y = out + x_at + in.k,
                      .m = 1,
                      .n = in.n,
                      .k = in.k,
                      .ldy = in.n};
    GemvNormArgs norm{.weight = norm_weight.as<uint16_t>(),
                      .residual = in.residual ? residual.as<uint16_t>() : nullptr,
                      .eps = in.eps,
                      .zero_centred = in.form == RmsNormForm::kZeroCentred,
                      .h_out = in.residual ? out : nullptr,
                      .x_out = out + x_at};
    if (tweak) tweak(args, norm);
    return gemv_bf16_rmsnorm(ctx, args, norm);
  });
}

namespace {

// A gemm_bf16 implementation: the harness's inputs uploaded, `gemm` timed into a poisoned output.
using Bf16Gemm = Expected<void> (*)(const DeviceContext&, const GemmBf16Args&);
Implementation bf16_implementation(std::string name, int priority, std::shared_ptr<DeviceContext> context,
                                   Bf16Gemm gemm) {
  return Implementation{
      .op = "gemm_bf16",
      .name = std::move(name),
      .backend = Backend::kCuda,
      .priority = priority,
      .tolerance = kBf16OutputTolerance,
      .unsupported_reason = cuda_unsupported_reason,
      .run = [context, gemm](const OpInputs& base) -> Expected<RunOutput> {
        const auto& in = static_cast<const GemmInputs&>(base);
        const GemmDeviceInputs d = gemm_upload(in, context->stream());
        return cuda_run_timed(*context, in.m, in.n, [&](uint16_t* y) {
          return gemm(*context,
                      {.x = d.x.as<uint16_t>(), .w = d.w_bf16.as<uint16_t>(), .y = y, .m = in.m, .n = in.n, .k = in.k});
        });
      },
  };
}

// The decode GEMV where gemv_bf16_preferred holds and cuBLASLt elsewhere, as the model calls them: one
// implementation, so a model calls one entry point at every batch size, and its self-test (run over every batch
// size and verification size the model uses) verifies both paths.
Expected<void> gemv_or_cublaslt(const DeviceContext& ctx, const GemmBf16Args& args) {
  return gemv_bf16_preferred(args.m, args.n, args.k) ? gemv_bf16(ctx, args) : gemm_bf16(ctx, args);
}

// The weight-only GEMMs' kernels (NVFP4 and FP8 decoded to bf16 mma.sync operands).
std::string needs_bf16_mma(const DeviceDescription& d, const SelfTestCase&) {
  if (std::string why = cuda_unsupported_reason(d); !why.empty()) return why;
  return arch_features(d.cc_major, d.cc_minor).mma_bf16 ? "" : "needs bf16 mma.sync (sm_80 or later targets)";
}

}  // namespace

Expected<void> gemm_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context) {
  TERN_TRY(registry.add(bf16_implementation("cublaslt", 10, context, gemm_bf16)));
  TERN_TRY(registry.add(bf16_implementation("gemv", 20, context, gemv_or_cublaslt)));
  TERN_TRY(registry.add(Implementation{
      .op = "gemm_nvfp4",
      .name = "w4a16",
      .backend = Backend::kCuda,
      .priority = 10,
      .tolerance = kBf16OutputTolerance,
      .unsupported_reason = needs_bf16_mma,
      .run = [context](const OpInputs& base) -> Expected<RunOutput> {
        const auto& in = static_cast<const GemmInputs&>(base);
        const GemmDeviceInputs d = gemm_upload(in, context->stream());
        const Nvfp4WeightView w{.packed = d.w_packed.as<uint8_t>(), .scales = d.w_scales.as<uint8_t>(),
                                .global_scale = in.w_global_scale, .n = in.n, .k = in.k};
        return cuda_run_timed(*context, in.m, in.n, [&](uint16_t* y) {
          return gemm_nvfp4_w4a16(*context, {.x = d.x.as<uint16_t>(), .w = w, .y = y, .m = in.m});
        });
      },
  }));
  TERN_TRY(registry.add(Implementation{
      .op = "gemm_fp8",
      .name = "w8a16",
      .backend = Backend::kCuda,
      .priority = 10,
      .tolerance = kBf16OutputTolerance,
      .unsupported_reason = needs_bf16_mma,
      .run = [context](const OpInputs& base) -> Expected<RunOutput> {
        const auto& in = static_cast<const GemmInputs&>(base);
        const GemmDeviceInputs d = gemm_upload(in, context->stream());
        const Fp8WeightView w{
            .codes = d.w_packed.as<uint8_t>(), .row_scales = d.w_row_scales.as<float>(), .n = in.n, .k = in.k};
        return cuda_run_timed(*context, in.m, in.n, [&](uint16_t* y) {
          return gemm_fp8_w8a16(*context, {.x = d.x.as<uint16_t>(), .w = w, .y = y, .m = in.m});
        });
      },
  }));
  // The norm inside the GEMV ("fused"), or the same two steps as two kernels ("separate": rms_norm, then the GEMV
  // on its output): the self-test verifies and times both on the model's shapes; the fused one runs only when forced.
  for (const bool fused : {true, false}) {
    TERN_TRY(registry.add(Implementation{
        .op = "rms_norm_gemv",
        .name = fused ? "fused" : "separate",
        .backend = Backend::kCuda,
        .priority = fused ? 5 : 10,
        .tolerance = kBf16OutputTolerance,
        .unsupported_reason = cuda_unsupported_reason,
        .run = [context, fused](const OpInputs& base) -> Expected<RunOutput> {
          const auto& in = static_cast<const RmsNormGemvInputs&>(base);
          return fused ? rms_norm_gemv_cuda_run(*context, in) : rms_norm_gemv_separate_run(*context, in);
        },
        // Opt-in: every block repeats the norm pass, which the lead case's few waves of blocks hide and the model's
        // many-wave gate_up and lm_head do not (see docs/perf/gpu.md §fused-rms-norm-gemv).
        .opt_in = fused,
    }));
  }
  return {};
}

}  // namespace tern
