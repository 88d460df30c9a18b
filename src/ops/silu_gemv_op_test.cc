// The silu_mul_gemv harness and CPU implementation through the registry: the reference against a hand-computed
// value, the CPU implementation passing (with a non-zero error, as fp32 against fp64 must show), and deliberately
// wrong activations (silu on the up half, a sigmoid for the silu) rejected; bad cases are errors.
#include "ops/silu_gemv_op.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/formats.h"

namespace tern {
namespace {

std::vector<SelfTestCase> small_cases() {
  // K = 8: one chunk; 1040 and 12 not multiples of 16 (the CPU dot's lanes); N = 1 and 37: odd.
  // M = 3 and 4: a speculative verification's rows.
  return {silu_mul_gemv_case(1, 8),  silu_mul_gemv_case(64, 256),    silu_mul_gemv_case(37, 1040),
          silu_mul_gemv_case(5, 12), silu_mul_gemv_case(37, 1040, 3), silu_mul_gemv_case(64, 256, 4)};
}

TEST(SiluGemvOp, ReferenceMatchesHandComputedValue) {
  // gate [0, 2], up [3, -1], W [[1, 0.5]]: act = [0, -silu(2)], y = 0.5 * -2 / (1 + e^-2).
  SiluGemvInputs in;
  in.n = 1;
  in.k = 2;
  in.gate_up = {float_to_bf16(0.0f), float_to_bf16(2.0f), float_to_bf16(3.0f), float_to_bf16(-1.0f)};
  in.w = {float_to_bf16(1.0f), float_to_bf16(0.5f)};
  Registry r;
  ASSERT_TRUE(silu_gemv_register_cpu(r).has_value());
  const std::vector<float> y = r.harness("silu_mul_gemv")->reference(in);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_NEAR(y[0], 0.5 * -2.0 / (1.0 + std::exp(-2.0)), 1e-7);
}

TEST(SiluGemvOp, CpuImplementationPassesItsSelfTest) {
  Registry r;
  ASSERT_TRUE(silu_gemv_register_cpu(r).has_value());
  auto s = registry_select(r, "silu_mul_gemv", cpu_device_describe(), small_cases(), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu") << s->candidates.front().reason;
  EXPECT_GT(s->candidates.front().max_error, 0.0) << "an fp32 result equal to fp64 everywhere is suspicious";
}

// A CPU implementation that forms the act wrongly (in fp64, so only the formula is wrong).
Implementation broken(std::string name, std::function<double(double gate, double up)> act) {
  return Implementation{
      .op = "silu_mul_gemv",
      .name = std::move(name),
      .priority = 10,
      .tolerance = {.rel = 1e-5},
      .run = [act](const OpInputs& base) -> Expected<RunOutput> {
        const auto& in = static_cast<const SiluGemvInputs&>(base);
        RunOutput out{.values = std::vector<float>(static_cast<size_t>(in.m * in.n))};
        for (int64_t r = 0; r < in.m; ++r) {
          const uint16_t* row = &in.gate_up[2 * in.k * r];
          for (int64_t j = 0; j < in.n; ++j) {
            double acc = 0.0;
            for (int64_t i = 0; i < in.k; ++i) {
              acc += act(bf16_to_float(row[i]), bf16_to_float(row[in.k + i])) * bf16_to_float(in.w[j * in.k + i]);
            }
            out.values[r * in.n + j] = static_cast<float>(acc);
          }
        }
        return out;
      },
  };
}

TEST(SiluGemvOp, WrongActivationsAreRejected) {
  Registry r;
  ASSERT_TRUE(silu_gemv_register_cpu(r).has_value());
  const std::vector<std::string> names = {"silu-of-up", "sigmoid-for-silu"};
  ASSERT_TRUE(r.add(broken(names[0], [](double g, double u) { return u / (1.0 + std::exp(-u)) * g; })).has_value());
  ASSERT_TRUE(r.add(broken(names[1], [](double g, double u) { return 1.0 / (1.0 + std::exp(-g)) * u; })).has_value());
  auto s = registry_select(r, "silu_mul_gemv", cpu_device_describe(), small_cases(), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu");
  for (const std::string& name : names) {
    const CandidateReport* c = s->candidate(name);
    ASSERT_NE(c, nullptr) << name;
    EXPECT_EQ(c->status, CandidateStatus::kFailed) << name;
    EXPECT_NE(c->reason.find("exceeds the tolerance"), std::string::npos) << name << ": " << c->reason;
  }
}

TEST(SiluGemvOp, BadCasesAreErrors) {
  Registry r;
  ASSERT_TRUE(silu_gemv_register_cpu(r).has_value());
  for (const SelfTestCase& bad : {SelfTestCase{"N=0", {0, 64}}, SelfTestCase{"K=0", {8, 0}},
                                  SelfTestCase{"M=0", {8, 64, 0}}, SelfTestCase{"M=65", {8, 64, 65}},
                                  SelfTestCase{"N", {8}}, SelfTestCase{"4 dims", {8, 64, 1, 1}}}) {
    const std::vector<SelfTestCase> cases = {bad};
    auto s = registry_select(r, "silu_mul_gemv", cpu_device_describe(), cases, {});
    ASSERT_FALSE(s.has_value()) << bad.label;
    EXPECT_NE(s.error().message.find("needs dims {N, K} or {N, K, M} > 0"), std::string::npos) << s.error().message;
  }
  const std::vector<SelfTestCase> cuda_only = {silu_mul_gemv_case(8, 64)};
  auto on_gpu = registry_select(r, "silu_mul_gemv", *simulated_device("h200"), cuda_only, {});
  ASSERT_TRUE(on_gpu.has_value()) << on_gpu.error().message;
  EXPECT_TRUE(on_gpu->chosen.empty()) << "the CPU implementation must not be chosen for a CUDA device";
}

}  // namespace
}  // namespace tern
