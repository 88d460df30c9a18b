// The GEMM harness and the CPU implementations through the registry, plus injected faults on a real op: a
// NVFP4 GEMM that reads the block scales one block off, or drops the global scale, must be rejected.
#include "ops/gemm_op.h"

#include <gtest/gtest.h>

#include "core/formats.h"
#include "core/nvfp4.h"

namespace tern {
namespace {

TEST(GemmOp, CpuImplementationsPassTheirSelfTest) {
  Registry r;
  ASSERT_TRUE(gemm_register_cpu(r).has_value());
  const auto cases = gemm_selftest_cases({{64, 256}, {48, 1040}}, {1, 5});
  for (const char* op : {"gemm_bf16", "gemm_nvfp4"}) {
    auto s = registry_select(r, op, cpu_device_describe(), cases, {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(s->chosen, "cpu") << op << ": " << s->candidates.front().reason;
    EXPECT_GT(s->candidates.front().max_error, 0.0) << "an fp32 result equal to fp64 everywhere is suspicious";
  }
}

// A NVFP4 GEMM whose dequantization is subtly wrong in one way each.
Implementation broken_nvfp4(std::string name, bool shift_scales, bool drop_global) {
  return Implementation{
      .op = "gemm_nvfp4",
      .name = std::move(name),
      .priority = 10,
      .tolerance = {.rel = 1e-5},
      .run = [=](const OpInputs& base) -> Expected<RunOutput> {
        const auto& in = static_cast<const GemmInputs&>(base);
        RunOutput out{.values = std::vector<float>(static_cast<size_t>(in.m * in.n))};
        std::vector<float> row(static_cast<size_t>(in.k));
        for (int64_t j = 0; j < in.n; ++j) {
          const uint8_t* scales = in.w_scales.data() + j * in.k / 16;
          for (int64_t k = 0; k < in.k; ++k) {
            const int64_t block = shift_scales ? std::min(k / 16 + 1, in.k / 16 - 1) : k / 16;
            row[k] = e2m1_to_float(fp4_get(in.w_packed.data() + j * in.k / 2, k)) * e4m3_to_float(scales[block]) *
                     (drop_global ? 1.0f : in.w_global_scale);
          }
          for (int64_t i = 0; i < in.m; ++i) {
            double acc = 0.0;
            for (int64_t k = 0; k < in.k; ++k) acc += double(in.x[i * in.k + k]) * row[k];
            out.values[i * in.n + j] = static_cast<float>(acc);
          }
        }
        return out;
      },
  };
}

TEST(GemmOp, WrongScaleHandlingIsRejected) {
  Registry r;
  ASSERT_TRUE(gemm_register_cpu(r).has_value());
  ASSERT_TRUE(r.add(broken_nvfp4("shifted-scales", true, false)).has_value());
  ASSERT_TRUE(r.add(broken_nvfp4("no-global-scale", false, true)).has_value());
  const auto cases = gemm_selftest_cases({{32, 128}}, {3});
  auto s = registry_select(r, "gemm_nvfp4", cpu_device_describe(), cases, {});
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->chosen, "cpu");
  for (const auto& c : s->candidates) {
    if (c.name != "cpu") {
      EXPECT_EQ(c.status, CandidateStatus::kFailed) << c.name;
      EXPECT_NE(c.reason.find("exceeds the tolerance"), std::string::npos) << c.name << ": " << c.reason;
    }
  }
}

TEST(GemmOp, BadCasesAreErrors) {
  Registry r;
  ASSERT_TRUE(gemm_register_cpu(r).has_value());
  const std::vector<SelfTestCase> bad = {{"K=40", {1, 8, 40}}};
  EXPECT_FALSE(registry_select(r, "gemm_nvfp4", cpu_device_describe(), bad, {}).has_value());
  const std::vector<SelfTestCase> cuda_only = {{"M=1 N=8 K=16", {1, 8, 16}}};
  auto on_gpu = registry_select(r, "gemm_bf16", *simulated_device("h200"), cuda_only, {});
  ASSERT_TRUE(on_gpu.has_value());
  EXPECT_TRUE(on_gpu->chosen.empty()) << "the CPU implementation must not be chosen for a CUDA device";
}

}  // namespace
}  // namespace tern
