// The W4A4 GEMM op on the GPU through the registry (label gpu). The outcome depends on the device, and each branch
// is asserted exactly:
//   - no block-scaled FP4 MMA (the H200, sm_90): "fp4-native" is unsupported (not failed) with the reason, "cpu" is
//     unsupported on a CUDA device, so the op has no implementation here; NVFP4 layers run W4A16 (gemm_nvfp4);
//   - FP4 tensor cores and machine code in this binary (B200, RTX PRO 6000): "fp4-native" passes its self-test on
//     model-sized shapes and is chosen, and injected faults are rejected.
#include "ops/gemm_w4a4_cuda.h"

#include <gtest/gtest.h>

#include "kernels/cuda/gemm/gemm_nvfp4_native.h"
#include "kernels/cuda/nvfp4/nvfp4_scale_layout.h"
#include "ops/cuda_fault_test_util.h"
#include "ops/cuda_op_test.h"
#include "ops/cuda_util.h"
#include "ops/gemm_cuda.h"
#include "ops/gemm_w4a4_op.h"

namespace tern {
namespace {

constexpr const char* kOp = "gemm_nvfp4_w4a4";

class CudaGemmW4a4 : public CudaOpTest<gemm_w4a4_register_cpu, gemm_w4a4_register_cuda> {
 protected:
  bool has_fp4() const { return arch_features(devices_[0].cc_major, devices_[0].cc_minor).fp4_block_scaled_mma; }
};

TEST_F(CudaGemmW4a4, SelectionOnThisDevice) {
  // Qwen3.5-35B-A3B-like projections and expert sizes at decode and prefill batch sizes.
  const auto cases = gemm_selftest_cases({{4096, 2048}, {2048, 4096}, {1024, 2048}, {2048, 512}}, {1, 8, 200});
  auto s = registry_select(registry_, kOp, devices_[0], cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  const CandidateReport* native = s->candidate("fp4-native");
  const CandidateReport* cpu = s->candidate("cpu");
  ASSERT_NE(native, nullptr);
  ASSERT_NE(cpu, nullptr);
  EXPECT_EQ(cpu->status, CandidateStatus::kUnsupported);
  EXPECT_NE(cpu->reason.find("runs on the CPU backend only"), std::string::npos) << cpu->reason;
  std::printf("%s on %s: chosen '%s'; fp4-native %s: %s\n", kOp, devices_[0].name.c_str(), s->chosen.c_str(),
              std::string(candidate_status_name(native->status)).c_str(), native->reason.c_str());
  if (!has_fp4()) {
    EXPECT_TRUE(s->chosen.empty()) << "chose " << s->chosen;
    EXPECT_EQ(native->status, CandidateStatus::kUnsupported);
    EXPECT_NE(native->reason.find("needs block-scaled FP4 tensor-core MMA"), std::string::npos) << native->reason;
    EXPECT_NE(native->reason.find(devices_[0].arch()), std::string::npos) << native->reason;
    EXPECT_FALSE(nvfp4_native_supported(context_->props()));
  } else if (!binary_can_run(cuda_binary_image(), devices_[0]).empty()) {
    EXPECT_TRUE(s->chosen.empty());
    EXPECT_EQ(native->status, CandidateStatus::kUnsupported);
    EXPECT_NE(native->reason.find("no machine code"), std::string::npos) << native->reason;
  } else {
    EXPECT_EQ(s->chosen, "fp4-native") << native->reason;
    EXPECT_EQ(native->status, CandidateStatus::kPassed) << native->reason;
    EXPECT_GT(native->max_error, 0.0) << "bf16 outputs equal to the fp64 reference everywhere are suspicious";
  }
}

// A deliberately wrong native GEMM: the activation scale or the weight scale missing from alpha, the weight's
// scales handed over row-major instead of tiled, or (fault 3) an output that comes back all zeros although the GEMM
// ran (cuda_fault_test_util.h). Each must fail its self-test where the native path runs.
Implementation broken_native(std::shared_ptr<DeviceContext> context, std::string name, int fault) {
  Implementation impl = gemm_w4a4_native_implementation(
      cuda_binary_image(), [context, fault](const OpInputs& base) -> Expected<RunOutput> {
        const auto& in = static_cast<const GemmW4a4Inputs&>(base);
        const GemmDeviceInputs d = gemm_upload(in, context->stream());
        std::vector<uint8_t> scales = fault == 2 ? in.w_scales : nvfp4_scales_to_tiled(in.w_scales, in.n, in.k);
        scales.resize(static_cast<size_t>(nvfp4_tiled_scale_bytes(in.n, in.k)), 0);
        DeviceBuffer dscales(scales.size()), dscale(sizeof(float)),
            workspace(gemm_nvfp4_native_workspace_bytes(in.m, in.k));
        dscales.upload(scales.data(), scales.size());
        dscale.upload(&in.input_scale, sizeof(float));
        ZeroedOutputs zero(context->stream());
        return cuda_run_timed(*context, in.m, in.n, [&](uint16_t* y) {
          if (fault == 3) zero.redirect(y, static_cast<size_t>(in.m * in.n));
          return gemm_nvfp4_native(*context, {.x = d.x.as<uint16_t>(),
                                              .w = {.packed = d.w_packed.as<uint8_t>(),
                                                    .scales_tiled = dscales.as<uint8_t>(),
                                                    .global_scale = fault == 1 ? 1.0f : in.w_global_scale,
                                                    .n = in.n,
                                                    .k = in.k},
                                              .input_scale = fault == 0 ? 1.0f : in.input_scale,
                                              .input_scale_device = dscale.as<float>(),
                                              .y = y,
                                              .m = in.m,
                                              .workspace = workspace.data(),
                                              .workspace_bytes = workspace.size_bytes()});
        });
      });
  impl.name = std::move(name);
  impl.priority = 100;
  return impl;
}

TEST_F(CudaGemmW4a4, InjectedFaultsAreRejectedWhereTheNativePathRuns) {
  if (!has_fp4() || !binary_can_run(cuda_binary_image(), devices_[0]).empty()) {
    GTEST_SKIP() << devices_[0].name << " cannot run the native FP4 path";
  }
  const std::vector<std::pair<std::string, std::string>> faults = {
      {"alpha-without-input-scale", "exceeds the tolerance"},
      {"alpha-without-weight-scale-2", "exceeds the tolerance"},
      {"row-major-weight-scales", "exceeds the tolerance"},
      {"all-zeros", "all zeros"}};
  for (size_t f = 0; f < faults.size(); ++f) {
    ASSERT_TRUE(registry_.add(broken_native(context_, faults[f].first, static_cast<int>(f))).has_value());
  }
  const auto cases = gemm_selftest_cases({{1024, 1024}}, {1, 40});
  auto s = registry_select(registry_, kOp, devices_[0], cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "fp4-native");
  for (const auto& [f, why] : faults) {
    const CandidateReport* c = s->candidate(f);
    ASSERT_NE(c, nullptr) << f;
    EXPECT_EQ(c->status, CandidateStatus::kFailed) << f;
    EXPECT_NE(c->reason.find(why), std::string::npos) << f << ": " << c->reason;
  }
}

}  // namespace
}  // namespace tern
