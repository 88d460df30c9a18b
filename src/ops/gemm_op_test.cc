// The GEMM harnesses and the CPU implementations through the registry, plus injected faults on a real op: a
// NVFP4 GEMM that reads the block scales one block off, or drops the global scale, and an RMSNorm + GEMV that
// forgets the residual in h, ignores the zero-centred 1 + w, or skips y's last element must be rejected.
#include "ops/gemm_op.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <functional>

#include "core/formats.h"
#include "core/nvfp4.h"

namespace tern {
namespace {

TEST(GemmOp, CpuImplementationsPassTheirSelfTest) {
  Registry r;
  ASSERT_TRUE(gemm_register_cpu(r).has_value());
  const auto cases = gemm_selftest_cases({{64, 256}, {48, 1040}}, {1, 5});
  for (const char* op : {"gemm_bf16", "gemm_nvfp4", "gemm_fp8"}) {
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

// An FP8 GEMM that takes each weight's scale from the 128-column block after its own (the last block keeps its own):
// the harness's weights vary by block enough for the self-test to see it.
TEST(GemmOp, Fp8ScaleOfTheWrongBlockIsRejected) {
  Registry r;
  ASSERT_TRUE(gemm_register_cpu(r).has_value());
  ASSERT_TRUE(r.add(Implementation{
                        .op = "gemm_fp8",
                        .name = "next-block-scale",
                        .priority = 10,
                        .tolerance = {.rel = 1e-5},
                        .run = [](const OpInputs& base) -> Expected<RunOutput> {
                          const auto& in = static_cast<const GemmInputs&>(base);
                          const int64_t cols = (in.k + 127) / 128;
                          RunOutput out{.values = std::vector<float>(static_cast<size_t>(in.m * in.n))};
                          for (int64_t j = 0; j < in.n; ++j) {
                            for (int64_t i = 0; i < in.m; ++i) {
                              double acc = 0.0;
                              for (int64_t k = 0; k < in.k; ++k) {
                                const int64_t b = std::min(k / 128 + 1, cols - 1);
                                acc += double(in.x[i * in.k + k]) * e4m3_to_float(in.w_packed[j * in.k + k]) *
                                       in.w_row_scales[j * cols + b];
                              }
                              out.values[i * in.n + j] = static_cast<float>(acc);
                            }
                          }
                          return out;
                        },
                    })
                  .has_value());
  const auto cases = gemm_selftest_cases({{300, 384}}, {3});
  auto s = registry_select(r, "gemm_fp8", cpu_device_describe(), cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu");
  const CandidateReport* wrong = s->candidate("next-block-scale");
  ASSERT_NE(wrong, nullptr);
  EXPECT_EQ(wrong->status, CandidateStatus::kFailed) << wrong->reason;
}

TEST(GemmOp, BadCasesAreErrors) {
  Registry r;
  ASSERT_TRUE(gemm_register_cpu(r).has_value());
  const std::vector<SelfTestCase> bad = {{"K=40", {1, 8, 40}}};
  EXPECT_FALSE(registry_select(r, "gemm_nvfp4", cpu_device_describe(), bad, {}).has_value());
  EXPECT_FALSE(registry_select(r, "gemm_fp8", cpu_device_describe(), bad, {}).has_value());
  const std::vector<SelfTestCase> cuda_only = {{"M=1 N=8 K=16", {1, 8, 16}}};
  auto on_gpu = registry_select(r, "gemm_bf16", *simulated_device("h200"), cuda_only, {});
  ASSERT_TRUE(on_gpu.has_value());
  EXPECT_TRUE(on_gpu->chosen.empty()) << "the CPU implementation must not be chosen for a CUDA device";
}

std::vector<SelfTestCase> rms_norm_gemv_cases() {
  return {rms_norm_gemv_case(64, 256, RmsNormForm::kPlain, false),
          rms_norm_gemv_case(37, 1040, RmsNormForm::kPlain, true),
          rms_norm_gemv_case(129, 512, RmsNormForm::kZeroCentred, false),
          rms_norm_gemv_case(33, 1040, RmsNormForm::kZeroCentred, true)};
}

TEST(GemmOp, RmsNormGemvCpuPassesItsSelfTest) {
  Registry r;
  ASSERT_TRUE(gemm_register_cpu(r).has_value());
  auto s = registry_select(r, "rms_norm_gemv", cpu_device_describe(), rms_norm_gemv_cases(), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu") << s->candidates.front().reason;
  EXPECT_GT(s->candidates.front().max_error, 0.0) << "an fp32 result equal to fp64 everywhere is suspicious";
}

TEST(GemmOp, RmsNormGemvLayoutAndReference) {
  Registry r;
  ASSERT_TRUE(gemm_register_cpu(r).has_value());
  const OpHarness* h = r.harness("rms_norm_gemv");
  ASSERT_NE(h, nullptr);
  auto in = h->make_inputs(rms_norm_gemv_case(5, 16, RmsNormForm::kZeroCentred, true), 3);
  ASSERT_TRUE(in.has_value()) << in.error().message;
  const auto& g = static_cast<const RmsNormGemvInputs&>(**in);
  ASSERT_EQ(rms_norm_gemv_output_size(g), 16 + 16 + 5);
  ASSERT_EQ(g.residual_in.size(), 16u);
  ASSERT_EQ(g.w_bf16.size(), 5u * 16);
  // [h | x' | y] recomputed by hand in fp64 from the drawn inputs.
  const std::vector<float> ref = h->reference(g);
  std::vector<double> hv(16);
  double sum = 0.0;
  for (int i = 0; i < 16; ++i) {
    hv[i] = double(bf16_to_float(g.x[i])) + bf16_to_float(g.residual_in[i]);
    EXPECT_EQ(ref[i], static_cast<float>(hv[i])) << i;
    sum += hv[i] * hv[i];
  }
  const double inv = 1.0 / std::sqrt(sum / 16 + double(1e-6f));
  for (int j = 0; j < 5; ++j) {
    double y = 0.0;
    for (int i = 0; i < 16; ++i) {
      const double xn = hv[i] * inv * (1.0 + bf16_to_float(g.norm_weight[i]));
      if (j == 0) {
        EXPECT_NEAR(ref[16 + i], xn, 1e-6 * std::fabs(xn)) << i;
      }
      y += xn * bf16_to_float(g.w_bf16[j * 16 + i]);
    }
    EXPECT_NEAR(ref[32 + j], y, 1e-6) << j;
  }
  // Without a residual the output starts with x'.
  auto plain = h->make_inputs(rms_norm_gemv_case(5, 16, RmsNormForm::kPlain, false), 3);
  ASSERT_TRUE(plain.has_value());
  EXPECT_EQ(rms_norm_gemv_output_size(static_cast<const RmsNormGemvInputs&>(**plain)), 16 + 5);
  EXPECT_TRUE(static_cast<const RmsNormGemvInputs&>(**plain).residual_in.empty());
}

// The CPU implementation (`cpu`) run on corrupted inputs, or with its output corrupted afterwards.
Implementation broken_norm_gemv(const Implementation& cpu, std::string name,
                                std::function<void(RmsNormGemvInputs&)> inputs,
                                std::function<void(const RmsNormGemvInputs&, std::vector<float>&)> output) {
  return Implementation{
      .op = "rms_norm_gemv",
      .name = std::move(name),
      .priority = 10,
      .tolerance = cpu.tolerance,
      .run = [run = cpu.run, inputs, output](const OpInputs& base) -> Expected<RunOutput> {
        RmsNormGemvInputs copy = static_cast<const RmsNormGemvInputs&>(base);
        if (inputs) inputs(copy);
        TERN_ASSIGN_OR_RETURN(RunOutput out, run(copy));
        if (output) output(static_cast<const RmsNormGemvInputs&>(base), out.values);
        return out;
      },
  };
}

TEST(GemmOp, WrongRmsNormGemvIsRejected) {
  Registry r;
  ASSERT_TRUE(gemm_register_cpu(r).has_value());
  const Implementation cpu = *r.implementations("rms_norm_gemv").front();
  ASSERT_EQ(cpu.name, "cpu");
  struct Fault {
    std::string name, expected_reason;
    std::function<void(RmsNormGemvInputs&)> inputs;
    std::function<void(const RmsNormGemvInputs&, std::vector<float>&)> output;
  };
  const std::vector<Fault> faults = {
      {"h-without-residual", "exceeds the tolerance", nullptr,
       [](const RmsNormGemvInputs& in, std::vector<float>& v) {
         if (!in.residual) return;
         for (int64_t i = 0; i < in.k; ++i) v[i] = bf16_to_float(in.x[i]);
       }},
      {"no-zero-centred-offset", "exceeds the tolerance", [](RmsNormGemvInputs& in) { in.form = RmsNormForm::kPlain; },
       nullptr},
      {"skips-last-y", "never written", nullptr,
       [](const RmsNormGemvInputs&, std::vector<float>& v) { v.back() = std::bit_cast<float>(kPoisonF32Bits); }},
  };
  for (const Fault& f : faults) ASSERT_TRUE(r.add(broken_norm_gemv(cpu, f.name, f.inputs, f.output)).has_value());
  auto s = registry_select(r, "rms_norm_gemv", cpu_device_describe(), rms_norm_gemv_cases(), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu");
  for (const Fault& f : faults) {
    const CandidateReport* c = s->candidate(f.name);
    ASSERT_NE(c, nullptr) << f.name;
    EXPECT_EQ(c->status, CandidateStatus::kFailed) << f.name;
    EXPECT_NE(c->reason.find(f.expected_reason), std::string::npos) << f.name << ": " << c->reason;
  }
}

TEST(GemmOp, BadRmsNormGemvCasesAreErrors) {
  Registry r;
  ASSERT_TRUE(gemm_register_cpu(r).has_value());
  const OpHarness* h = r.harness("rms_norm_gemv");
  ASSERT_NE(h, nullptr);
  auto expect_error = [&](const SelfTestCase& c, const std::string& text) {
    auto in = h->make_inputs(c, 1);
    ASSERT_FALSE(in.has_value()) << c.label;
    EXPECT_NE(in.error().message.find(text), std::string::npos) << in.error().message;
  };
  expect_error(rms_norm_gemv_case(8, 64, RmsNormForm::kGated, false), "the gated norm is not fused");
  expect_error(rms_norm_gemv_case(8, 60, RmsNormForm::kPlain, false), "K=60 must be a positive multiple of 8");
  expect_error(rms_norm_gemv_case(0, 64, RmsNormForm::kPlain, false), "N=0 must be positive");
  expect_error({"three dims", {8, 64, 0}}, "needs dims {N, K, form, residual}");
  expect_error({"residual 2", {8, 64, 0, 2}}, "residual=2 is not 0 or 1");
  // The CPU implementation is not chosen for a CUDA device.
  const std::vector<SelfTestCase> one = {rms_norm_gemv_case(8, 64, RmsNormForm::kPlain, true)};
  auto on_gpu = registry_select(r, "rms_norm_gemv", *simulated_device("h200"), one, {});
  ASSERT_TRUE(on_gpu.has_value());
  EXPECT_TRUE(on_gpu->chosen.empty());
}

}  // namespace
}  // namespace tern
