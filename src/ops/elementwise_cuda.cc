#include "ops/elementwise_cuda.h"

#include <algorithm>

#include "kernels/cuda/elementwise/elementwise.h"
#include "ops/cuda_util.h"

namespace tern {
namespace {

template <class Args>
void apply(const ArgsTweak<Args>& tweak, Args& args) {
  if (tweak) tweak(args);
}

}  // namespace

Expected<RunOutput> rms_norm_cuda_run(const DeviceContext& ctx, const RmsNormInputs& in,
                                      const ArgsTweak<RmsNormArgs>& tweak) {
  const DeviceBuffer x = cuda_upload(in.x, ctx.stream()), r = cuda_upload(in.residual_in, ctx.stream());
  const DeviceBuffer z = cuda_upload(in.gate, ctx.stream()), w = cuda_upload(in.weight, ctx.stream());
  const int64_t n = in.rows * in.dim;
  return cuda_run_timed(ctx, in.residual ? 2 * in.rows : in.rows, in.dim, [&](uint16_t* out) {
    RmsNormArgs a{.x = x.as<uint16_t>(),
                  .residual = in.residual ? r.as<uint16_t>() : nullptr,
                  .h_out = in.residual ? out : nullptr,
                  .gate = in.form == RmsNormForm::kGated ? z.as<uint16_t>() : nullptr,
                  .weight = w.as<uint16_t>(),
                  .y = in.residual ? out + n : out,
                  .rows = in.rows,
                  .dim = in.dim,
                  .eps = in.eps,
                  .zero_centred = in.form == RmsNormForm::kZeroCentred};
    apply(tweak, a);
    return rms_norm(ctx, a);
  });
}

Expected<RunOutput> rope_cuda_run(const DeviceContext& ctx, const RopeInputs& in, const ArgsTweak<RopeArgs>& tweak) {
  const DeviceBuffer x = cuda_upload(in.x, ctx.stream()), pos = cuda_upload(in.positions, ctx.stream());
  const DeviceBuffer inv_freq = cuda_upload(rope_inv_freq(in.rotary_dim, in.theta), ctx.stream());
  return cuda_run_timed(ctx, in.tokens * in.n_heads, in.head_dim, [&](uint16_t* out) {
    RopeArgs a{.x = x.as<uint16_t>(), .y = out, .positions = pos.as<int32_t>(), .inv_freq = inv_freq.as<float>(),
               .tokens = in.tokens, .n_heads = in.n_heads, .head_dim = in.head_dim, .rotary_dim = in.rotary_dim,
               .interleaved = in.interleaved};
    apply(tweak, a);
    return rope(ctx, a);
  });
}

Expected<RunOutput> silu_mul_cuda_run(const DeviceContext& ctx, const SiluMulInputs& in,
                                      const ArgsTweak<SiluMulArgs>& tweak) {
  const DeviceBuffer gate_up = cuda_upload(in.gate_up, ctx.stream());
  return cuda_run_timed(ctx, in.rows, in.inter, [&](uint16_t* out) {
    SiluMulArgs a{.gate_up = gate_up.as<uint16_t>(), .y = out, .rows = in.rows, .inter = in.inter};
    apply(tweak, a);
    return silu_mul(ctx, a);
  });
}

Expected<RunOutput> embedding_cuda_run(const DeviceContext& ctx, const EmbeddingInputs& in,
                                       const ArgsTweak<EmbeddingArgs>& tweak) {
  const DeviceBuffer ids = cuda_upload(in.ids, ctx.stream()), table = cuda_upload(in.table, ctx.stream());
  const DeviceBuffer bad(sizeof(unsigned long long));
  EmbeddingArgs a{.ids = ids.as<int32_t>(), .table = table.as<uint16_t>(), .bad = bad.as<unsigned long long>(),
                  .tokens = in.tokens, .vocab = in.vocab, .hidden = in.hidden};
  auto out = cuda_run_timed(ctx, in.tokens, in.hidden, [&](uint16_t* y) {
    a.y = y;
    apply(tweak, a);
    return embedding_lookup(ctx, a);
  });
  // The report of the last run is still in `bad`; checking it outside the timed launch keeps the timing clean.
  if (out) TERN_TRY(embedding_check_ids(ctx, a));
  return out;
}

Expected<RunOutput> residual_add_cuda_run(const DeviceContext& ctx, const ResidualAddInputs& in,
                                          const ArgsTweak<ResidualAddArgs>& tweak) {
  const DeviceBuffer a_dev = cuda_upload(in.a, ctx.stream()), b_dev = cuda_upload(in.b, ctx.stream());
  return cuda_run_timed(ctx, 1, in.n, [&](uint16_t* out) {
    ResidualAddArgs a{.a = a_dev.as<uint16_t>(), .b = b_dev.as<uint16_t>(), .y = out, .n = in.n};
    apply(tweak, a);
    return residual_add(ctx, a);
  });
}

Expected<void> elementwise_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context) {
  auto add = [&](const char* op, std::function<Expected<RunOutput>(const OpInputs&)> run,
                 Tolerance tolerance = kBf16ElementwiseTolerance) {
    return registry.add(Implementation{.op = op, .name = "cuda", .backend = Backend::kCuda, .priority = 10,
                                       .tolerance = tolerance, .unsupported_reason = cuda_unsupported_reason,
                                       .run = std::move(run)});
  };
  TERN_TRY(add("rms_norm", [context](const OpInputs& b) {
    return rms_norm_cuda_run(*context, static_cast<const RmsNormInputs&>(b));
  }));
  TERN_TRY(add("rope", [context](const OpInputs& b) {
    return rope_cuda_run(*context, static_cast<const RopeInputs&>(b));
  }));
  TERN_TRY(add("silu_mul", [context](const OpInputs& b) {
    return silu_mul_cuda_run(*context, static_cast<const SiluMulInputs&>(b));
  }));
  TERN_TRY(add("embedding", [context](const OpInputs& b) {
    return embedding_cuda_run(*context, static_cast<const EmbeddingInputs&>(b));
  }, Tolerance{}));  // a copy: exact
  TERN_TRY(add("residual_add", [context](const OpInputs& b) {
    return residual_add_cuda_run(*context, static_cast<const ResidualAddInputs&>(b));
  }));
  return {};
}

}  // namespace tern
