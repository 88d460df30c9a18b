#include "ops/gemm_op.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "core/formats.h"
#include "core/nvfp4.h"
#include "kernels/cpu/matmul.h"
#include "layers/norms.h"
#include "ops/harness_util.h"

namespace tern {
namespace {

// Inputs of real model sizes run to hundreds of millions of elements (an lm_head), so values come from
// hashed_bf16 (ops/harness_util.h), in parallel: fresh for every seed, non-zero, symmetric, the same whatever the
// thread count.

std::string cpu_only(const DeviceDescription& d, const SelfTestCase&) {
  return d.backend == Backend::kCpu ? "" : "runs on the CPU backend only";
}

}  // namespace

// Block-wise FP8 as DeepSeek-V3's checkpoints are made: per 128 x 128 block, scale = amax / 448 and
// code = e4m3(w / scale); the scales are kept per row (CpuMatrix's and the device's layout).
void fp8_quantize(const std::vector<float>& w, GemmInputs& in) {
  constexpr int64_t kBlock = 128;
  const int64_t cols = (in.k + kBlock - 1) / kBlock;
  in.w_packed.resize(w.size());
  in.w_row_scales.resize(static_cast<size_t>(in.n * cols));
#pragma omp parallel for schedule(static)
  for (int64_t br = 0; br < in.n; br += kBlock) {
    for (int64_t bc = 0; bc < in.k; bc += kBlock) {
      float amax = 0.0f;
      for (int64_t r = br; r < std::min(in.n, br + kBlock); ++r) {
        for (int64_t c = bc; c < std::min(in.k, bc + kBlock); ++c) amax = std::max(amax, std::fabs(w[r * in.k + c]));
      }
      const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
      for (int64_t r = br; r < std::min(in.n, br + kBlock); ++r) {
        in.w_row_scales[r * cols + bc / kBlock] = scale;
        for (int64_t c = bc; c < std::min(in.k, bc + kBlock); ++c) {
          in.w_packed[r * in.k + c] = float_to_e4m3(w[r * in.k + c] / scale);
        }
      }
    }
  }
}

Expected<void> gemm_fill_inputs(const SelfTestCase& c, uint64_t seed, GemmWeight weight, GemmInputs& in) {
  if (c.dims.size() != 3 || c.dims[0] <= 0 || c.dims[1] <= 0 || c.dims[2] <= 0) {
    return make_error("gemm case '{}' needs dims {{M, N, K}} > 0", c.label);
  }
  in.m = c.dims[0];
  in.n = c.dims[1];
  in.k = c.dims[2];
  in.nvfp4 = weight == GemmWeight::kNvfp4;
  in.fp8 = weight == GemmWeight::kFp8;
  if (in.nvfp4 && in.k % kNvfp4BlockSize != 0) {
    return make_error("NVFP4 gemm case '{}': K must be a multiple of 16", c.label);
  }
  if (in.fp8 && in.k % 16 != 0) return make_error("FP8 gemm case '{}': K must be a multiple of 16", c.label);
  auto value = [seed](uint64_t stream, int64_t i, float scale) { return hashed_bf16(seed, stream, i, scale); };
  in.x_bf16.resize(static_cast<size_t>(in.m * in.k));
  in.x.resize(in.x_bf16.size());
  for (int64_t i = 0; i < in.m * in.k; ++i) {
    in.x_bf16[i] = value(1, i, 2.0f);
    in.x[i] = bf16_to_float(in.x_bf16[i]);
  }
  std::vector<float> w(static_cast<size_t>(in.n * in.k));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < in.n * in.k; ++i) w[i] = bf16_to_float(value(2, i, 0.1f));
  if (in.fp8) {
    // Blocks of different magnitudes (0.5x to 1.85x), so a scale taken from the wrong block shows in the output.
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < in.n; ++r) {
      for (int64_t c = 0; c < in.k; ++c) {
        w[r * in.k + c] *= 0.5f + 0.45f * static_cast<float>((3 * (r / 128) + c / 128) % 4);
      }
    }
    fp8_quantize(w, in);
  } else if (in.nvfp4) {
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

Expected<std::unique_ptr<OpInputs>> make_gemm_inputs(const SelfTestCase& c, uint64_t seed, GemmWeight weight) {
  auto in = std::make_unique<GemmInputs>();
  TERN_TRY(gemm_fill_inputs(c, seed, weight, *in));
  return in;
}

CpuMatrix cpu_matrix_of(const GemmInputs& in) {
  CpuMatrix w{.rows = in.n, .cols = in.k};
  if (in.fp8) {
    w.format = CpuWeightFormat::kFp8Block128;
    w.data = in.w_packed.data();
    w.row_block_scales = in.w_row_scales.data();
  } else if (in.nvfp4) {
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
    if (in.fp8) {
      const int64_t cols = (in.k + 127) / 128;
      for (int64_t k = 0; k < in.k; ++k) {
        w_row[k] = e4m3_to_float(in.w_packed[j * in.k + k]) * in.w_row_scales[j * cols + k / 128];
      }
    } else if (in.nvfp4) {
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

// ---------------------------------------------------------------------------------------------------------------
// rms_norm_gemv

Expected<std::unique_ptr<OpInputs>> rms_norm_gemv_make(const SelfTestCase& c, uint64_t seed) {
  const std::vector<int64_t>& d = c.dims;
  if (d.size() != 4) return make_error("rms_norm_gemv case '{}' needs dims {{N, K, form, residual}}", c.label);
  if (d[0] <= 0) return make_error("rms_norm_gemv case '{}': N={} must be positive", c.label, d[0]);
  if (d[1] <= 0 || d[1] % 8 != 0) {
    return make_error("rms_norm_gemv case '{}': K={} must be a positive multiple of 8 (16-byte rows)", c.label, d[1]);
  }
  if (d[2] != static_cast<int64_t>(RmsNormForm::kPlain) && d[2] != static_cast<int64_t>(RmsNormForm::kZeroCentred)) {
    return make_error(
        "rms_norm_gemv case '{}': form={} is not plain (0) or zero-centred (1); the gated norm is not fused", c.label,
        d[2]);
  }
  if (d[3] != 0 && d[3] != 1) return make_error("rms_norm_gemv case '{}': residual={} is not 0 or 1", c.label, d[3]);
  auto in = std::make_unique<RmsNormGemvInputs>();
  in->n = d[0];
  in->k = d[1];
  in->form = static_cast<RmsNormForm>(d[2]);
  in->residual = d[3] == 1;
  in->x.resize(static_cast<size_t>(in->k));
  in->norm_weight.resize(in->x.size());
  // Zero-centred checkpoints store small offsets from 1; plain weights sit around 1 (as rms_norm's harness).
  const float w_center = in->form == RmsNormForm::kZeroCentred ? 0.0f : 1.0f;
  for (int64_t i = 0; i < in->k; ++i) {
    in->x[i] = hashed_bf16(seed, 1, i, 2.0f);
    in->norm_weight[i] = hashed_bf16(seed, 3, i, 0.5f, w_center);
    if (in->residual) in->residual_in.push_back(hashed_bf16(seed, 2, i, 2.0f));
  }
  // x' has an rms near 1 and reaches 2.5-3.6 (h: 4 with a residual). W uniform in +-0.5/sqrt(K) gives y an rms of
  // 0.3 and a largest value of 1.1-1.4 over up to 2.5e5 columns: close to the norm's outputs, so the tolerance
  // (relative to the largest output) checks h, x' and y alike, yet below 2, where a bf16 ulp doubles, so a GPU's
  // rounding of y plus the x' rounding it inherits stays within its bound (see gemm_cuda.cc).
  const float w_scale = 0.5f / std::sqrt(static_cast<float>(in->k));
  in->w_bf16.resize(static_cast<size_t>(in->n * in->k));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < in->n * in->k; ++i) in->w_bf16[i] = hashed_bf16(seed, 4, i, w_scale);
  return in;
}

std::vector<float> rms_norm_gemv_reference(const OpInputs& base) {
  const auto& in = static_cast<const RmsNormGemvInputs&>(base);
  std::vector<float> out(static_cast<size_t>(rms_norm_gemv_output_size(in)));
  const int64_t x_at = in.residual ? in.k : 0, y_at = x_at + in.k;
  std::vector<double> xn(static_cast<size_t>(in.k));
  double sum = 0.0;
  for (int64_t i = 0; i < in.k; ++i) {
    xn[i] = double(bf16_to_float(in.x[i])) + (in.residual ? double(bf16_to_float(in.residual_in[i])) : 0.0);
    if (in.residual) out[i] = static_cast<float>(xn[i]);
    sum += xn[i] * xn[i];
  }
  const double inv = 1.0 / std::sqrt(sum / double(in.k) + double(in.eps));
  const double offset = in.form == RmsNormForm::kZeroCentred ? 1.0 : 0.0;
  for (int64_t i = 0; i < in.k; ++i) {
    xn[i] *= inv * (offset + bf16_to_float(in.norm_weight[i]));
    out[x_at + i] = static_cast<float>(xn[i]);
  }
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < in.n; ++j) {
    const uint16_t* w_row = in.w_bf16.data() + j * in.k;
    double acc = 0.0;
    for (int64_t i = 0; i < in.k; ++i) acc += xn[i] * bf16_to_float(w_row[i]);
    out[y_at + j] = static_cast<float>(acc);
  }
  return out;
}

// The CPU model path's arithmetic: h in fp32, layers' RmsNorm, cpu_matmul on the unrounded fp32 x'.
Expected<RunOutput> rms_norm_gemv_cpu(const OpInputs& base) {
  const auto& in = static_cast<const RmsNormGemvInputs&>(base);
  std::vector<float> h(static_cast<size_t>(in.k)), weight(h.size());
  for (int64_t i = 0; i < in.k; ++i) {
    h[i] = bf16_to_float(in.x[i]) + (in.residual ? bf16_to_float(in.residual_in[i]) : 0.0f);
    weight[i] = bf16_to_float(in.norm_weight[i]);
  }
  const RmsNorm norm{.weight = std::move(weight), .eps = in.eps, .zero_centred = in.form == RmsNormForm::kZeroCentred};
  const CpuMatrix w{.format = CpuWeightFormat::kBf16, .rows = in.n, .cols = in.k, .data = in.w_bf16.data()};
  RunOutput out{.values = std::vector<float>(static_cast<size_t>(rms_norm_gemv_output_size(in)))};
  poison_f32(out.values);
  float* xn = out.values.data() + (in.residual ? in.k : 0);
  const auto start = std::chrono::steady_clock::now();
  if (in.residual) std::copy(h.begin(), h.end(), out.values.begin());
  norm.forward(h.data(), 1, xn);
  cpu_matmul(xn, 1, w, xn + in.k);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace

Expected<void> gemm_register_cpu(Registry& registry) {
  for (const GemmWeight weight : {GemmWeight::kBf16, GemmWeight::kNvfp4, GemmWeight::kFp8}) {
    const std::string op = weight == GemmWeight::kNvfp4 ? "gemm_nvfp4" : weight == GemmWeight::kFp8 ? "gemm_fp8"
                                                                                                     : "gemm_bf16";
    TERN_TRY(registry.add_harness(OpHarness{
        .op = op,
        .make_inputs = [weight](const SelfTestCase& c, uint64_t seed) { return make_gemm_inputs(c, seed, weight); },
        .reference = gemm_reference,
    }));
    // fp32 accumulation in a fixed 16-lane order against an fp64 reference: the error grows like sqrt(K) ulps of
    // the row's magnitude; 1e-5 of the largest output leaves a wide margin for K up to ~10^5.
    TERN_TRY(registry.add(Implementation{
        .op = op,
        .name = "cpu",
        .backend = Backend::kCpu,
        .tolerance = {.rel = 1e-5, .abs = 0.0},
        .unsupported_reason = cpu_only,
        .run = run_cpu_gemm,
    }));
  }
  TERN_TRY(registry.add_harness(
      OpHarness{.op = "rms_norm_gemv", .make_inputs = rms_norm_gemv_make, .reference = rms_norm_gemv_reference}));
  // fp32 against fp64: the sum of squares and the dot product, K terms each, stay within ~1e-6 of the output's
  // scale (see gemm_bf16 above); 1e-5 leaves margin and still rejects a missing residual or 1 + w by far.
  TERN_TRY(registry.add(Implementation{.op = "rms_norm_gemv",
                                       .name = "cpu",
                                       .backend = Backend::kCpu,
                                       .tolerance = {.rel = 1e-5, .abs = 0.0},
                                       .unsupported_reason = cpu_only,
                                       .run = rms_norm_gemv_cpu}));
  return {};
}

int64_t rms_norm_gemv_output_size(const RmsNormGemvInputs& in) {
  return (in.residual ? 2 * in.k : in.k) + in.n;
}

std::vector<SelfTestCase> gemm_selftest_cases(const std::vector<std::pair<int64_t, int64_t>>& shapes,
                                              const std::vector<int64_t>& batch_sizes) {
  std::vector<SelfTestCase> cases;
  for (int64_t m : batch_sizes) {
    for (auto [n, k] : shapes) cases.push_back({fmt::format("M={} N={} K={}", m, n, k), {m, n, k}});
  }
  return cases;
}

SelfTestCase rms_norm_gemv_case(int64_t n, int64_t k, RmsNormForm form, bool residual) {
  const char* form_name = form == RmsNormForm::kPlain         ? "plain"
                          : form == RmsNormForm::kZeroCentred ? "zero-centred"
                                                              : "gated";
  return {fmt::format("N={} K={} {}{}", n, k, form_name, residual ? " +residual" : ""),
          {n, k, static_cast<int64_t>(form), residual ? 1 : 0}};
}

}  // namespace tern
