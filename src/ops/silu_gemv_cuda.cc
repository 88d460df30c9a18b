#include "ops/silu_gemv_cuda.h"

#include <fmt/format.h>

#include <limits>
#include <string>

#include "kernels/cuda/elementwise/elementwise.h"
#include "kernels/cuda/gemv/gemv_bf16.h"
#include "ops/cuda_util.h"
#include "ops/silu_gemv_op.h"

namespace tern {
namespace {

// Two bf16 roundings against an unrounded fp64 reference: the output's (at most 2^-9 of the largest output) and the
// act's (each element within 2^-9 of itself; summed with random signs over K, it moved the worst output by up to
// 1.1 x 2^-9 of the largest output in a host model of the kernel's arithmetic on this harness's inputs, 30 seeds of
// both Qwen down shapes; both together up to 1.0 x 2^-8). 2^-7 leaves a 2x margin and still rejects a wrong scale
// of 1% (silu on the wrong half, or a sigmoid for the silu, by far).
constexpr Tolerance kBf16ActOutputTolerance{.rel = 1.0 / 128, .abs = 0.0};

std::string silu_gemv_unsupported_reason(const DeviceDescription& d, const SelfTestCase& c) {
  if (std::string why = cuda_unsupported_reason(d, c); !why.empty()) return why;
  if (c.dims.size() >= 2 && c.dims[1] % 8 != 0) return fmt::format("needs K a multiple of 8 (K={})", c.dims[1]);
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (c.dims.size() >= 2 && (c.dims[0] > kMaxDim || c.dims[1] > kMaxDim)) return "needs N and K below 2^31";
  if (c.dims.size() == 3 && c.dims[2] > kGemvMaxRows) {
    return fmt::format("needs M <= {} (M={})", kGemvMaxRows, c.dims[2]);
  }
  return "";
}

// fused: the SiLU inside the GEMV's loads; separate: silu_mul into a buffer, then the GEMV on it.
Expected<RunOutput> run_cuda_silu_gemv(const DeviceContext& ctx, const OpInputs& base, bool fused) {
  const auto& in = static_cast<const SiluGemvInputs&>(base);
  const DeviceBuffer gate_up = cuda_upload(in.gate_up, ctx.stream()), w = cuda_upload(in.w, ctx.stream());
  DeviceBuffer act(fused ? 16 : static_cast<size_t>(in.m * in.k) * 2);
  return cuda_run_timed(ctx, in.m, in.n, [&](uint16_t* y) -> Expected<void> {
    const GemmBf16Args args{
        .x = gate_up.as<uint16_t>(), .w = w.as<uint16_t>(), .y = y, .m = in.m, .n = in.n, .k = in.k};
    if (fused) return gemv_bf16_silu_mul(ctx, args, 2 * in.k);
    TERN_TRY(silu_mul(
        ctx, SiluMulArgs{.gate_up = gate_up.as<uint16_t>(), .y = act.as<uint16_t>(), .rows = in.m, .inter = in.k}));
    GemmBf16Args on_act = args;
    on_act.x = act.as<uint16_t>();
    return gemv_bf16(ctx, on_act);
  });
}

}  // namespace

Expected<void> silu_gemv_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context) {
  // Both are timed by the self-test on the model's shapes; the model folds the SiLU into the GEMV only where the
  // fused kernel was the faster.
  for (const bool fused : {true, false}) {
    TERN_TRY(registry.add(Implementation{
        .op = "silu_mul_gemv",
        .name = fused ? "fused" : "separate",
        .backend = Backend::kCuda,
        .priority = fused ? 5 : 10,  // the fused kernel must win by kSelectMargin (registry.h)
        .tolerance = kBf16ActOutputTolerance,
        .unsupported_reason = silu_gemv_unsupported_reason,
        .run = [context, fused](const OpInputs& base) { return run_cuda_silu_gemv(*context, base, fused); },
    }));
  }
  return {};
}

}  // namespace tern
