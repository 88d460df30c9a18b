#include "ops/gemm_op.h"

#include <fmt/format.h>

#include <chrono>

#include "core/formats.h"
#include "core/nvfp4.h"
#include "kernels/cpu/matmul.h"

namespace tern {

Expected<void> gemm_fill_inputs(const SelfTestCase& c, uint64_t seed, bool nvfp4, GemmInputs& in) {
  if (c.dims.size() != 3 || c.dims[0] <= 0 || c.dims[1] <= 0 || c.dims[2] <= 0) {
    return make_error("gemm case '{}' needs dims {{M, N, K}} > 0", c.label);
  }
  in.m = c.dims[0];
  in.n = c.dims[1];
  in.k = c.dims[2];
  in.nvfp4 = nvfp4;
  if (nvfp4 && in.k % kNvfp4BlockSize != 0) return make_error("NVFP4 gemm case '{}': K must be a multiple of 16", c.label);
  // Inputs of real model sizes run to hundreds of millions of elements (an lm_head), so values come from a
  // counter-based hash, in parallel: fresh for every seed, non-zero, symmetric, the same whatever the thread count.
  auto value = [seed](uint64_t stream, int64_t i, float scale) {
    uint64_t z = (seed ^ (stream << 56)) + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * 0x1p-24f;  // [0, 1)
    return float_to_bf16(scale * (2.0f * u - 1.0f) + (z & 1 ? 1e-3f : -1e-3f));
  };
  in.x_bf16.resize(static_cast<size_t>(in.m * in.k));
  in.x.resize(in.x_bf16.size());
  for (int64_t i = 0; i < in.m * in.k; ++i) {
    in.x_bf16[i] = value(1, i, 2.0f);
    in.x[i] = bf16_to_float(in.x_bf16[i]);
  }
  std::vector<float> w(static_cast<size_t>(in.n * in.k));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < in.n * in.k; ++i) w[i] = bf16_to_float(value(2, i, 0.1f));
  if (nvfp4) {
    Nvfp4Matrix q = nvfp4_quantize_weight(w, in.n, in.k);
    in.w_packed = std::move(q.packed);
    in.w_scales = std::move(q.block_scales);
    in.w_global_scale = q.global_scale;
  } else {
    in.w_bf16.resize(w.size());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < in.n * in.k; ++i) in.w_bf16[i] = float_to_bf16(w[i]);
  }
  return {};
}

namespace {

Expected<std::unique_ptr<OpInputs>> make_gemm_inputs(const SelfTestCase& c, uint64_t seed, bool nvfp4) {
  auto in = std::make_unique<GemmInputs>();
  TERN_TRY(gemm_fill_inputs(c, seed, nvfp4, *in));
  return in;
}

CpuMatrix cpu_matrix_of(const GemmInputs& in) {
  CpuMatrix w{.rows = in.n, .cols = in.k};
  if (in.nvfp4) {
    w.format = CpuWeightFormat::kNvfp4;
    w.data = in.w_packed.data();
    w.block_scales = in.w_scales.data();
    w.global_scale = in.w_global_scale;
  } else {
    w.format = CpuWeightFormat::kBf16;
    w.data = in.w_bf16.data();
  }
  return w;
}

std::vector<float> gemm_reference(const OpInputs& base) {
  const auto& in = static_cast<const GemmInputs&>(base);
  std::vector<float> y(static_cast<size_t>(in.m * in.n));
#pragma omp parallel for schedule(dynamic, 64)
  for (int64_t j = 0; j < in.n; ++j) {
    std::vector<float> w_row(static_cast<size_t>(in.k));
    if (in.nvfp4) {
      nvfp4_dequantize_row(in.w_packed.data() + j * in.k / 2, in.w_scales.data() + j * in.k / kNvfp4BlockSize,
                           in.w_global_scale, in.k, w_row.data());
    } else {
      for (int64_t k = 0; k < in.k; ++k) w_row[k] = bf16_to_float(in.w_bf16[j * in.k + k]);
    }
    for (int64_t i = 0; i < in.m; ++i) {
      double acc = 0.0;
      for (int64_t k = 0; k < in.k; ++k) acc += static_cast<double>(in.x[i * in.k + k]) * w_row[k];
      y[i * in.n + j] = static_cast<float>(acc);
    }
  }
  return y;
}

Expected<RunOutput> run_cpu_gemm(const OpInputs& base) {
  const auto& in = static_cast<const GemmInputs&>(base);
  RunOutput out{.values = std::vector<float>(static_cast<size_t>(in.m * in.n))};
  poison_f32(out.values);
  const auto start = std::chrono::steady_clock::now();
  cpu_matmul(in.x.data(), in.m, cpu_matrix_of(in), out.values.data());
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace

Expected<void> gemm_register_cpu(Registry& registry) {
  for (const bool nvfp4 : {false, true}) {
    const std::string op = nvfp4 ? "gemm_nvfp4" : "gemm_bf16";
    TERN_TRY(registry.add_harness(OpHarness{
        .op = op,
        .make_inputs = [nvfp4](const SelfTestCase& c, uint64_t seed) { return make_gemm_inputs(c, seed, nvfp4); },
        .reference = gemm_reference,
    }));
    // fp32 accumulation in a fixed 16-lane order against an fp64 reference: the error grows like sqrt(K) ulps of
    // the row's magnitude; 1e-5 of the largest output leaves a wide margin for K up to ~10^5.
    TERN_TRY(registry.add(Implementation{
        .op = op,
        .name = "cpu",
        .backend = Backend::kCpu,
        .tolerance = {.rel = 1e-5, .abs = 0.0},
        .unsupported_reason = [](const DeviceDescription& d, const SelfTestCase&) -> std::string {
          return d.backend == Backend::kCpu ? "" : "runs on the CPU backend only";
        },
        .run = run_cpu_gemm,
    }));
  }
  return {};
}

std::vector<SelfTestCase> gemm_selftest_cases(const std::vector<std::pair<int64_t, int64_t>>& shapes,
                                              const std::vector<int64_t>& batch_sizes) {
  std::vector<SelfTestCase> cases;
  for (int64_t m : batch_sizes) {
    for (auto [n, k] : shapes) cases.push_back({fmt::format("M={} N={} K={}", m, n, k), {m, n, k}});
  }
  return cases;
}

}  // namespace tern
