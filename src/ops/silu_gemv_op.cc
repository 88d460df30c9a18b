#include "ops/silu_gemv_op.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>

#include "core/formats.h"
#include "kernels/cpu/matmul.h"
#include "layers/norms.h"
#include "ops/harness_util.h"

namespace tern {
namespace {

// Values are uniform(-scale, scale) nudged away from zero by 1e-3 of the scale (hashed_bf16_relative_nudge,
// ops/harness_util.h): fresh for every seed and stream, the same whatever the order (or thread) of generation.

Expected<std::unique_ptr<OpInputs>> silu_gemv_make(const SelfTestCase& c, uint64_t seed) {
  const bool rows_given = c.dims.size() == 3;
  if ((c.dims.size() != 2 && !rows_given) || c.dims[0] <= 0 || c.dims[1] <= 0 ||
      (rows_given && (c.dims[2] <= 0 || c.dims[2] > 64))) {
    return make_error("silu_mul_gemv case '{}' needs dims {{N, K}} or {{N, K, M}} > 0 (M at most 64)", c.label);
  }
  auto in = std::make_unique<SiluGemvInputs>();
  in->n = c.dims[0];
  in->k = c.dims[1];
  in->m = rows_given ? c.dims[2] : 1;
  // Gates over +-6 cover silu's linear, curved and vanishing regions; up over +-2 (the silu_mul harness's ranges).
  in->gate_up.resize(static_cast<size_t>(2 * in->k * in->m));
  for (int64_t r = 0; r < in->m; ++r) {
    for (int64_t i = 0; i < in->k; ++i) {
      in->gate_up[2 * in->k * r + i] = hashed_bf16_relative_nudge(seed, 1, in->k * r + i, 6.0f);
      in->gate_up[2 * in->k * r + in->k + i] = hashed_bf16_relative_nudge(seed, 2, in->k * r + i, 2.0f);
    }
  }
  // A down projection's weights run to 10^8 values: generated in parallel.
  in->w.resize(static_cast<size_t>(in->n * in->k));
  const float w_scale = 1.0f / std::sqrt(static_cast<float>(in->k));
  const int64_t count = in->n * in->k;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) in->w[i] = hashed_bf16_relative_nudge(seed, 3, i, w_scale);
  return in;
}

double silu_f64(double x) {
  return x / (1.0 + std::exp(-x));
}

std::vector<float> silu_gemv_reference(const OpInputs& base) {
  const auto& in = static_cast<const SiluGemvInputs&>(base);
  std::vector<float> y(static_cast<size_t>(in.m * in.n));
  for (int64_t r = 0; r < in.m; ++r) {
    const uint16_t* row = &in.gate_up[2 * in.k * r];
    std::vector<double> act(static_cast<size_t>(in.k));
    for (int64_t i = 0; i < in.k; ++i) {
      act[i] = silu_f64(bf16_to_float(row[i])) * static_cast<double>(bf16_to_float(row[in.k + i]));
    }
#pragma omp parallel for schedule(dynamic, 64)
    for (int64_t j = 0; j < in.n; ++j) {
      double acc = 0.0;
      for (int64_t i = 0; i < in.k; ++i) acc += act[i] * bf16_to_float(in.w[j * in.k + i]);
      y[r * in.n + j] = static_cast<float>(acc);
    }
  }
  return y;
}

// The CPU MLP's arithmetic: the act in fp32 (layers/norms.h silu, times up), then the fp32 matmul of the bf16 W.
Expected<RunOutput> run_cpu_silu_gemv(const OpInputs& base) {
  const auto& in = static_cast<const SiluGemvInputs&>(base);
  RunOutput out{.values = std::vector<float>(static_cast<size_t>(in.m * in.n))};
  poison_f32(out.values);
  const auto start = std::chrono::steady_clock::now();
  std::vector<float> act(static_cast<size_t>(in.m * in.k));
  for (int64_t r = 0; r < in.m; ++r) {
    const uint16_t* row = &in.gate_up[2 * in.k * r];
    for (int64_t i = 0; i < in.k; ++i) act[r * in.k + i] = silu(bf16_to_float(row[i])) * bf16_to_float(row[in.k + i]);
  }
  const CpuMatrix w{.format = CpuWeightFormat::kBf16, .rows = in.n, .cols = in.k, .data = in.w.data()};
  cpu_matmul(act.data(), in.m, w, out.values.data());
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace

Expected<void> silu_gemv_register_cpu(Registry& registry) {
  TERN_TRY(registry.add_harness(OpHarness{
      .op = "silu_mul_gemv",
      .make_inputs = silu_gemv_make,
      .reference = silu_gemv_reference,
  }));
  // fp32 act (a few ulps each) and fp32 accumulation in a fixed 16-lane order against fp64: as gemm_bf16's CPU
  // implementation, 1e-5 of the largest output leaves a wide margin and rejects any wrong formula.
  return registry.add(Implementation{
      .op = "silu_mul_gemv",
      .name = "cpu",
      .backend = Backend::kCpu,
      .tolerance = {.rel = 1e-5, .abs = 0.0},
      .unsupported_reason = [](const DeviceDescription& d, const SelfTestCase&) -> std::string {
        return d.backend == Backend::kCpu ? "" : "runs on the CPU backend only";
      },
      .run = run_cpu_silu_gemv,
  });
}

SelfTestCase silu_mul_gemv_case(int64_t n, int64_t k, int64_t m) {
  if (m == 1) return {fmt::format("N={} K={}", n, k), {n, k}};
  return {fmt::format("N={} K={} M={}", n, k, m), {n, k, m}};
}

}  // namespace tern
