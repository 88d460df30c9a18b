// The attention harness and CPU implementation through the registry, and injected faults: a doubled scale, an
// ignored gate, swapped kv heads, keys one position off and a skipped tail must each be rejected.
#include "ops/attention_op.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>

#include "core/formats.h"

namespace tern {
namespace {

TEST(AttentionOp, CpuImplementationPassesItsSelfTest) {
  Registry r;
  ASSERT_TRUE(attention_register_cpu(r).has_value());
  const std::vector<SelfTestCase> cases = {
      attention_case(3, 1, 20, 4, 2, 32, false), attention_case(2, 9, 0, 8, 2, 64, true),
      attention_case(1, 5, 300, 16, 1, 128, true), attention_case(4, 2, 3, 3, 3, 16, false),
      attention_case(1, 1, 32000, 4, 1, 64, false)};  // a long context, whose output averages down
  auto s = registry_select(r, "attention", cpu_device_describe(), cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu") << s->candidates.front().reason;
  std::printf("cpu: max error %.3g (bound %.3g)\n", s->candidates.front().max_error, s->candidates.front().bound);
}

TEST(AttentionOp, ReferenceMatchesHandComputedValues) {
  // One head of dim 2, one sequence of two tokens (past 1, one query): scores q.k * scale over both keys.
  AttentionInputs in;
  in.n_seqs = 1, in.query_len = 1, in.past = 1, in.n_heads = 1, in.n_kv_heads = 1, in.head_dim = 2;
  in.scale = 0.5f;
  in.q = {float_to_bf16(1.0f), float_to_bf16(2.0f)};
  in.k = {float_to_bf16(1.0f), float_to_bf16(0.0f), float_to_bf16(0.0f), float_to_bf16(1.0f)};
  in.v = {float_to_bf16(3.0f), float_to_bf16(-1.0f), float_to_bf16(-2.0f), float_to_bf16(5.0f)};
  Registry r;
  ASSERT_TRUE(attention_register_cpu(r).has_value());
  std::vector<float> y = r.harness("attention")->reference(in);
  const double p0 = std::exp(0.5) / (std::exp(0.5) + std::exp(1.0)), p1 = 1.0 - p0;
  EXPECT_NEAR(y[0], p0 * 3.0 - p1 * 2.0, 1e-6);
  EXPECT_NEAR(y[1], -p0 + p1 * 5.0, 1e-6);
  // The gate multiplies by sigmoid(g): g = 0 halves.
  in.gated = true;
  in.gate = {float_to_bf16(0.0f), float_to_bf16(0.0f)};
  y = r.harness("attention")->reference(in);
  EXPECT_NEAR(y[0], 0.5 * (p0 * 3.0 - p1 * 2.0), 1e-6);
  // A sequence with no past sees only its own key.
  in.past = 0;
  in.k.resize(2), in.v.resize(2);
  y = r.harness("attention")->reference(in);
  EXPECT_NEAR(y[1], -0.5, 1e-6);
}

// Wraps the CPU implementation and corrupts its inputs or output in one way.
Implementation broken(const Registry& r, std::string name, std::function<void(AttentionInputs&)> corrupt_inputs,
                      std::function<void(std::vector<float>&)> corrupt_out) {
  const Implementation* cpu = r.implementations("attention").front();
  return Implementation{
      .op = "attention",
      .name = std::move(name),
      .priority = 10,
      .tolerance = cpu->tolerance,
      .run = [run = cpu->run, corrupt_inputs, corrupt_out](const OpInputs& base) -> Expected<RunOutput> {
        AttentionInputs copy = static_cast<const AttentionInputs&>(base);
        if (corrupt_inputs) corrupt_inputs(copy);
        TERN_ASSIGN_OR_RETURN(RunOutput out, run(copy));
        if (corrupt_out) corrupt_out(out.values);
        return out;
      },
  };
}

struct CpuFault {
  std::string name, expected_reason;
  std::function<void(AttentionInputs&)> corrupt_inputs;
  std::function<void(std::vector<float>&)> corrupt_out;
};

std::vector<CpuFault> cpu_faults() {
  return {
      {"scale-doubled", "exceeds the tolerance", [](AttentionInputs& in) { in.scale *= 2.0f; }, nullptr},
      {"gate-ignored", "exceeds the tolerance", [](AttentionInputs& in) { in.gated = false; }, nullptr},
      {"kv-heads-swapped", "exceeds the tolerance",
       [](AttentionInputs& in) {
         const int64_t row = in.n_kv_heads * in.head_dim;
         for (size_t r = 0; r < in.k.size() / row; ++r) {
           std::rotate(in.k.begin() + r * row, in.k.begin() + r * row + in.head_dim, in.k.begin() + (r + 1) * row);
           std::rotate(in.v.begin() + r * row, in.v.begin() + r * row + in.head_dim, in.v.begin() + (r + 1) * row);
         }
       },
       nullptr},
      // The first sequence's keys and values one position off (as a mask or position off by one reads them).
      {"keys-off-by-one", "exceeds the tolerance",
       [](AttentionInputs& in) {
         const int64_t row = in.n_kv_heads * in.head_dim;
         std::rotate(in.k.begin(), in.k.begin() + row, in.k.begin() + in.seq_len(0) * row);
         std::rotate(in.v.begin(), in.v.begin() + row, in.v.begin() + in.seq_len(0) * row);
       },
       nullptr},
      {"tail-skipped", "never written", nullptr,
       [](std::vector<float>& v) { v.back() = std::bit_cast<float>(kPoisonF32Bits); }},
  };
}

TEST(AttentionOp, InjectedFaultsAreRejected) {
  Registry r;
  ASSERT_TRUE(attention_register_cpu(r).has_value());
  for (const CpuFault& f : cpu_faults())
    ASSERT_TRUE(r.add(broken(r, f.name, f.corrupt_inputs, f.corrupt_out)).has_value());
  const SelfTestCase c = attention_case(2, 3, 5, 4, 2, 32, true);
  auto s = registry_select(r, "attention", cpu_device_describe(), std::span(&c, 1), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu");
  for (const CpuFault& f : cpu_faults()) {
    const auto it = std::find_if(s->candidates.begin(), s->candidates.end(), [&](auto& k) { return k.name == f.name; });
    ASSERT_NE(it, s->candidates.end()) << f.name;
    EXPECT_EQ(it->status, CandidateStatus::kFailed) << f.name;
    EXPECT_NE(it->reason.find(f.expected_reason), std::string::npos) << f.name << ": " << it->reason;
  }
}

TEST(AttentionOp, BadCasesAreErrors) {
  Registry r;
  ASSERT_TRUE(attention_register_cpu(r).has_value());
  const OpHarness* h = r.harness("attention");
  EXPECT_FALSE(h->make_inputs({"short", {1, 1, 0}}, 1).has_value());
  EXPECT_FALSE(h->make_inputs(attention_case(1, 1, 0, 6, 4, 64, false), 1).has_value());  // 6 % 4 != 0
  EXPECT_FALSE(h->make_inputs(attention_case(1, 0, 0, 4, 4, 64, false), 1).has_value());  // no queries
  EXPECT_FALSE(h->make_inputs({"gate 2", {1, 1, 0, 4, 4, 64, 2}}, 1).has_value());
}

}  // namespace
}  // namespace tern
