#include "ops/gemm_w4a4_op.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/nvfp4.h"
#include "layers/linear.h"

namespace tern {
namespace {

constexpr const char* kOp = "gemm_nvfp4_w4a4";

Expected<std::unique_ptr<OpInputs>> make_w4a4_inputs(const SelfTestCase& c, uint64_t seed) {
  auto in = std::make_unique<GemmW4a4Inputs>();
  TERN_TRY(gemm_fill_inputs(c, seed, GemmWeight::kNvfp4, *in));
  float amax = 0.0f;
  for (float v : in->x) amax = std::max(amax, std::fabs(v));
  in->input_scale = nvfp4_global_scale_from_amax(amax);  // ModelOpt's calibration of the activation quantizer
  return in;
}

// fp64 sums over the activations quantize-dequantized by core/nvfp4 and the dequantized weight.
std::vector<float> w4a4_reference(const OpInputs& base) {
  const auto& in = static_cast<const GemmW4a4Inputs&>(base);
  std::vector<float> xq(in.x.size());
  for (int64_t i = 0; i < in.m; ++i) {
    nvfp4_fake_quantize_activation_row(&in.x[i * in.k], in.k, in.input_scale, &xq[i * in.k]);
  }
  std::vector<float> y(static_cast<size_t>(in.m * in.n));
#pragma omp parallel for schedule(dynamic, 64)
  for (int64_t j = 0; j < in.n; ++j) {
    std::vector<float> w_row(static_cast<size_t>(in.k));
    nvfp4_dequantize_row(in.w_packed.data() + j * in.k / 2, in.w_scales.data() + j * in.k / kNvfp4BlockSize,
                         in.w_global_scale, in.k, w_row.data());
    for (int64_t i = 0; i < in.m; ++i) {
      double acc = 0.0;
      for (int64_t k = 0; k < in.k; ++k) acc += static_cast<double>(xq[i * in.k + k]) * w_row[k];
      y[i * in.n + j] = static_cast<float>(acc);
    }
  }
  return y;
}

// The CPU model's W4A4 layer: a Linear over the NVFP4 weight that quantizes its input.
Expected<RunOutput> run_cpu_w4a4(const OpInputs& base) {
  const auto& in = static_cast<const GemmW4a4Inputs&>(base);
  Linear linear(kOp, CpuMatrix{.format = CpuWeightFormat::kNvfp4,
                               .rows = in.n,
                               .cols = in.k,
                               .data = in.w_packed.data(),
                               .block_scales = in.w_scales.data(),
                               .global_scale = in.w_global_scale});
  linear.set_input_quantization(in.input_scale);
  RunOutput out{.values = std::vector<float>(static_cast<size_t>(in.m * in.n))};
  poison_f32(out.values);
  const auto start = std::chrono::steady_clock::now();
  linear.forward(in.x.data(), in.m, out.values.data());
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace

Expected<void> gemm_w4a4_register_cpu(Registry& registry) {
  TERN_TRY(registry.add_harness(OpHarness{.op = kOp, .make_inputs = make_w4a4_inputs, .reference = w4a4_reference}));
  // As gemm_nvfp4's "cpu": fp32 accumulation in a fixed order against fp64; the activations are quantized by the
  // same function on both sides, so they add nothing.
  return registry.add(Implementation{
      .op = kOp,
      .name = "cpu",
      .backend = Backend::kCpu,
      .tolerance = {.rel = 1e-5, .abs = 0.0},
      .unsupported_reason = [](const DeviceDescription& d, const SelfTestCase&) -> std::string {
        return d.backend == Backend::kCpu ? "" : "runs on the CPU backend only";
      },
      .run = run_cpu_w4a4,
  });
}

std::string gemm_w4a4_native_unsupported_reason(const DeviceDescription& device, const SelfTestCase& c,
                                                const BinaryImage& image) {
  if (device.backend != Backend::kCuda) return "runs on CUDA devices only";
  if (!arch_features(device.cc_major, device.cc_minor).fp4_block_scaled_mma) {
    return fmt::format("needs block-scaled FP4 tensor-core MMA (sm_100a family or sm_120a), which {} ({}) lacks",
                       device.arch(), device.name);
  }
  if (std::string why = binary_can_run(image, device); !why.empty()) return "the activation quantizer: " + why;
  if (c.dims.size() == 3 && c.dims[2] % 32 != 0) {
    return fmt::format("K={} is not a multiple of 32 (cuBLASLt needs 16-byte rows of packed FP4)", c.dims[2]);
  }
  if (c.dims.size() == 3 && c.dims[1] % 8 != 0) {
    return fmt::format("N={} is not a multiple of 8 (cuBLASLt needs 16-byte rows of the bf16 output)", c.dims[1]);
  }
  return "";
}

Implementation gemm_w4a4_native_implementation(BinaryImage image,
                                               std::function<Expected<RunOutput>(const OpInputs&)> run) {
  return Implementation{
      .op = kOp,
      .name = "fp4-native",
      .backend = Backend::kCuda,
      .priority = 10,
      // bf16 output (half an ulp, 2^-9 relative) plus tensor-core accumulation order: 2^-8 of the largest output,
      // as the other bf16 GEMMs; a wrong block scale or a dropped per-tensor scale is far outside it.
      .tolerance = {.rel = 1.0 / 256, .abs = 0.0},
      .unsupported_reason = [image = std::move(image)](
                                const DeviceDescription& d,
                                const SelfTestCase& c) { return gemm_w4a4_native_unsupported_reason(d, c, image); },
      .run = std::move(run),
  };
}

}  // namespace tern
