// The elementwise harnesses and CPU implementations through the registry, and injected faults: a norm without the
// 1 + w, RoPE rotating the wrong pairs, silu on the wrong half, an embedding one row off, a skipped tail must each
// be rejected.
#include "ops/elementwise_op.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>

#include "core/formats.h"

namespace tern {
namespace {

struct OpCases {
  std::string op;
  std::vector<SelfTestCase> cases;
};

std::vector<OpCases> small_cases() {
  return {
      {"rms_norm",
       {rms_norm_case(3, 1, 64, RmsNormForm::kPlain, false), rms_norm_case(2, 4, 128, RmsNormForm::kZeroCentred, false),
        rms_norm_case(5, 2, 64, RmsNormForm::kGated, false), rms_norm_case(3, 1, 256, RmsNormForm::kZeroCentred, true)}},
      {"rope", {rope_case(3, 2, 64, 64, false, 1000000), rope_case(4, 2, 256, 64, false, 10000000),
                rope_case(2, 3, 128, 64, true, 10000)}},
      {"silu_mul", {silu_mul_case(1, 64), silu_mul_case(7, 96)}},
      {"embedding", {embedding_case(1, 10, 64), embedding_case(9, 300, 32)}},
      {"residual_add", {residual_add_case(7, 64)}},
  };
}

TEST(ElementwiseOp, CpuImplementationsPassTheirSelfTest) {
  Registry r;
  ASSERT_TRUE(elementwise_register_cpu(r).has_value());
  for (const OpCases& oc : small_cases()) {
    auto s = registry_select(r, oc.op, cpu_device_describe(), oc.cases, {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(s->chosen, "cpu") << oc.op << ": " << s->candidates.front().reason;
  }
}

TEST(ElementwiseOp, ReferenceMatchesHandComputedValues) {
  // One row [3, 4] with zero-centred weight 0: rms = sqrt(12.5), y = x / rms (eps negligible at 1e-6).
  RmsNormInputs in;
  in.rows = 1;
  in.dim = 2;
  in.form = RmsNormForm::kZeroCentred;
  in.x = {float_to_bf16(3.0f), float_to_bf16(4.0f)};
  in.weight = {float_to_bf16(0.0f), float_to_bf16(0.0f)};
  Registry r;
  ASSERT_TRUE(elementwise_register_cpu(r).has_value());
  const std::vector<float> y = r.harness("rms_norm")->reference(in);
  EXPECT_NEAR(y[0], 3.0 / std::sqrt(12.5), 1e-6);
  EXPECT_NEAR(y[1], 4.0 / std::sqrt(12.5), 1e-6);
  // RoPE at position 1, rotary 2, theta irrelevant for pair 0 (inv_freq 1): a rotation by 1 radian.
  RopeInputs ri;
  ri.tokens = 1, ri.n_heads = 1, ri.head_dim = 4, ri.rotary_dim = 2, ri.theta = 10000.0;
  ri.x = {float_to_bf16(1.0f), float_to_bf16(2.0f), float_to_bf16(5.0f), float_to_bf16(-3.0f)};
  ri.positions = {1};
  const std::vector<float> ry = r.harness("rope")->reference(ri);
  EXPECT_NEAR(ry[0], std::cos(1.0) - 2.0 * std::sin(1.0), 1e-6);
  EXPECT_NEAR(ry[1], 2.0 * std::cos(1.0) + std::sin(1.0), 1e-6);
  EXPECT_EQ(ry[2], 5.0f);
  EXPECT_EQ(ry[3], -3.0f);
}

// Wraps the CPU implementation of `op` and corrupts its inputs or output in one way.
Implementation broken(const Registry& r, const std::string& op, std::string name,
                      std::function<void(OpInputs&)> corrupt_inputs, std::function<void(std::vector<float>&)> corrupt_out) {
  const Implementation* cpu = r.implementations(op).front();
  return Implementation{
      .op = op,
      .name = std::move(name),
      .priority = 10,
      .tolerance = cpu->tolerance,
      .run = [run = cpu->run, op, corrupt_inputs, corrupt_out](const OpInputs& base) -> Expected<RunOutput> {
        std::unique_ptr<OpInputs> copy;
        if (op == "rms_norm") copy = std::make_unique<RmsNormInputs>(static_cast<const RmsNormInputs&>(base));
        if (op == "rope") copy = std::make_unique<RopeInputs>(static_cast<const RopeInputs&>(base));
        if (op == "silu_mul") copy = std::make_unique<SiluMulInputs>(static_cast<const SiluMulInputs&>(base));
        if (op == "embedding") copy = std::make_unique<EmbeddingInputs>(static_cast<const EmbeddingInputs&>(base));
        if (corrupt_inputs) corrupt_inputs(*copy);
        TERN_ASSIGN_OR_RETURN(RunOutput out, run(*copy));
        if (corrupt_out) corrupt_out(out.values);
        return out;
      },
  };
}

struct CpuFault {
  std::string op, name, expected_reason;
  std::function<void(OpInputs&)> corrupt_inputs;
  std::function<void(std::vector<float>&)> corrupt_out;
};

std::vector<CpuFault> cpu_faults() {
  auto skip_tail = [](std::vector<float>& v) { v.back() = std::bit_cast<float>(kPoisonF32Bits); };
  return {
      {"rms_norm", "no-1+w", "exceeds the tolerance",
       [](OpInputs& b) { static_cast<RmsNormInputs&>(b).form = RmsNormForm::kPlain; }, nullptr},
      {"rms_norm", "no-residual", "exceeds the tolerance",
       [](OpInputs& b) {
         auto& in = static_cast<RmsNormInputs&>(b);
         for (auto& v : in.residual_in) v = 0;
       },
       nullptr},
      {"rope", "wrong-half", "exceeds the tolerance",
       [](OpInputs& b) { auto& in = static_cast<RopeInputs&>(b); in.interleaved = !in.interleaved; }, nullptr},
      {"rope", "position-off-by-one", "exceeds the tolerance",
       [](OpInputs& b) { for (auto& p : static_cast<RopeInputs&>(b).positions) p += 1; }, nullptr},
      {"silu_mul", "halves-swapped", "exceeds the tolerance",
       [](OpInputs& b) {
         auto& in = static_cast<SiluMulInputs&>(b);
         for (int64_t r = 0; r < in.rows; ++r) {
           auto row = in.gate_up.begin() + r * 2 * in.inter;
           std::rotate(row, row + in.inter, row + 2 * in.inter);
         }
       },
       nullptr},
      {"silu_mul", "tail-skipped", "never written", nullptr, skip_tail},
      // Rows no token looks up are NaN in the harness, so reading the neighbouring row yields NaN.
      {"embedding", "row-off-by-one", "non-finite",
       [](OpInputs& b) {
         auto& in = static_cast<EmbeddingInputs&>(b);
         for (auto& id : in.ids) id = static_cast<int32_t>((id + 1) % in.vocab);
       },
       nullptr},
  };
}

TEST(ElementwiseOp, InjectedFaultsAreRejected) {
  Registry r;
  ASSERT_TRUE(elementwise_register_cpu(r).has_value());
  for (const CpuFault& f : cpu_faults()) {
    ASSERT_TRUE(r.add(broken(r, f.op, f.name, f.corrupt_inputs, f.corrupt_out)).has_value());
  }
  const std::vector<std::pair<std::string, SelfTestCase>> cases = {
      {"rms_norm", rms_norm_case(3, 1, 64, RmsNormForm::kZeroCentred, true)},
      {"rope", rope_case(3, 2, 128, 64, false, 1000000)},
      {"silu_mul", silu_mul_case(5, 64)},
      {"embedding", embedding_case(4, 50, 32)},
  };
  for (const auto& [op, c] : cases) {
    auto s = registry_select(r, op, cpu_device_describe(), std::span(&c, 1), {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(s->chosen, "cpu") << op;
    for (const CpuFault& f : cpu_faults()) {
      if (f.op != op) continue;
      const auto it = std::find_if(s->candidates.begin(), s->candidates.end(), [&](auto& k) { return k.name == f.name; });
      ASSERT_NE(it, s->candidates.end()) << f.name;
      EXPECT_EQ(it->status, CandidateStatus::kFailed) << f.name;
      EXPECT_NE(it->reason.find(f.expected_reason), std::string::npos) << f.name << ": " << it->reason;
    }
  }
}

TEST(ElementwiseOp, CpuEmbeddingReportsAnOutOfRangeId) {
  Registry r;
  ASSERT_TRUE(elementwise_register_cpu(r).has_value());
  auto in = r.harness("embedding")->make_inputs(embedding_case(4, 50, 16), 1);
  ASSERT_TRUE(in.has_value());
  static_cast<EmbeddingInputs&>(**in).ids[2] = 50;
  auto out = r.implementations("embedding").front()->run(**in);
  ASSERT_FALSE(out.has_value());
  EXPECT_NE(out.error().message.find("token 2 has id 50 outside the vocabulary [0, 50)"), std::string::npos)
      << out.error().message;
}

TEST(ElementwiseOp, BadCasesAreErrors) {
  Registry r;
  ASSERT_TRUE(elementwise_register_cpu(r).has_value());
  EXPECT_FALSE(r.harness("rope")->make_inputs(rope_case(1, 1, 64, 128, false, 10000), 1).has_value());
  EXPECT_FALSE(r.harness("rms_norm")->make_inputs({"bad", {1, 1}}, 1).has_value());
}

}  // namespace
}  // namespace tern
