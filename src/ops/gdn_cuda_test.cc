// The Gated DeltaNet ops on the GPU through the registry (label gpu): the CUDA implementations pass their self-test
// against the fp64 harness references on ragged batches, deliberately broken launches (each one fault class, all-zero
// outputs included) are rejected with the expected reason, and a timing table reports decode state bandwidth and
// prefill throughput.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

#include "kernels/cuda/gated_delta/gated_delta.h"
#include "ops/cuda_fault_test_util.h"
#include "ops/cuda_op_test.h"
#include "ops/cuda_util.h"
#include "ops/gdn_cuda.h"

namespace tern {
namespace {

class CudaGdnOps : public CudaOpTest<gdn_register_cpu, gdn_register_cuda> {
 protected:
  // Every CUDA candidate must pass; `expected` is the one chosen (the fastest, or the only one).
  void expect_all_cuda_pass(const std::string& op, const std::vector<SelfTestCase>& cases) {
    auto s = registry_select(registry_, op, devices_[0], cases, {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_FALSE(s->chosen.empty()) << op;
    for (const auto& c : s->candidates) {
      if (c.name == "cpu") continue;
      EXPECT_EQ(c.status, CandidateStatus::kPassed) << op << " " << c.name << ": " << c.reason;
      std::printf("%-15s %-15s %zu cases, max error %.3g (bound %.3g), %.3f ms\n", op.c_str(), c.name.c_str(),
                  cases.size(), c.max_error, c.bound, c.seconds * 1e3);
    }
  }
};

TEST_F(CudaGdnOps, ConvPassesOnRaggedBatches) {
  std::vector<SelfTestCase> cases;
  for (int64_t kernel : {2, 4, 7}) {
    cases.push_back(gdn_conv_case(16, 1, 4096, kernel));
    cases.push_back(gdn_conv_case(5, 19, 999, kernel));
    cases.push_back(gdn_conv_case(2, 257, 2048, kernel));
    cases.push_back(gdn_conv_case(9, 4, 1024, kernel, true));  // speculative verifications (row states)
  }
  expect_all_cuda_pass("gdn_conv", cases);
}

TEST_F(CudaGdnOps, DeltaRulePassesOnRaggedBatches) {
  std::vector<SelfTestCase> cases;
  for (int64_t d : {32, 64, 128}) {
    cases.push_back(gdn_delta_rule_case(9, 1, 2, 4, d, d));
    cases.push_back(gdn_delta_rule_case(4, 33, 1, 2, d, 32));
    cases.push_back(gdn_delta_rule_case(3, 100, 2, 2, 32, d));
  }
  cases.push_back(gdn_delta_rule_case(2, 300, 4, 16, 128, 128));
  // Speculative verifications (row states): the model's K + 1 = 4 rows, and more rows than a chunk's first stage.
  cases.push_back(gdn_delta_rule_case(9, 4, 4, 8, 128, 128, true));
  cases.push_back(gdn_delta_rule_case(3, 70, 2, 4, 64, 64, true));
  expect_all_cuda_pass("gdn_delta_rule", cases);
}

// The gated norm in the recurrent kernel: clusters of 1, 2 and 4 value slices (dv 32, 64, 128), sequences of many
// tokens (a cluster sync per token), new and continued sequences; both implementations pass against fp64, a norm
// reading the gate as its weight is rejected, and the argument errors name the problem.
TEST_F(CudaGdnOps, DeltaRuleNormPassesOnRaggedBatches) {
  std::vector<SelfTestCase> cases;
  for (int64_t d : {32, 64, 128}) {
    cases.push_back(gdn_delta_rule_case(1, 1, 16, 32, 128, d));
    cases.push_back(gdn_delta_rule_case(5, 7, 2, 4, 64, d));
  }
  cases.push_back(gdn_delta_rule_case(3, 40, 1, 2, 32, 128));
  expect_all_cuda_pass("gdn_delta_rule_norm", cases);

  ASSERT_TRUE(registry_
                  .add(Implementation{.op = "gdn_delta_rule_norm",
                                      .name = "weight-is-gate",
                                      .backend = Backend::kCuda,
                                      .priority = 100,
                                      .tolerance = kGdnDeltaRuleNormBf16Tolerance,
                                      .run =
                                          [this](const OpInputs& in) {
                                            return gdn_delta_rule_norm_cuda_run(
                                                *context_, static_cast<const GdnDeltaRuleNormInputs&>(in), true,
                                                [](GdnDeltaRuleArgs& a) { a.norm.weight = a.norm.gate; });
                                          }})
                  .has_value());
  const SelfTestCase one = gdn_delta_rule_case(2, 3, 2, 4, 64, 64);
  auto s = registry_select(registry_, "gdn_delta_rule_norm", devices_[0], std::span(&one, 1), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  const CandidateReport* bad = s->candidate("weight-is-gate");
  ASSERT_NE(bad, nullptr);
  EXPECT_EQ(bad->status, CandidateStatus::kFailed) << bad->reason;

  auto in = registry_.harness("gdn_delta_rule_norm")->make_inputs(one, 3);
  ASSERT_TRUE(in.has_value());
  const auto& norm_in = static_cast<const GdnDeltaRuleNormInputs&>(**in);
  auto expect_error = [&](GdnVariant v, std::function<void(GdnDeltaRuleArgs&)> tweak, const std::string& text) {
    auto r = v == GdnVariant::kChunked
                 ? gdn_delta_rule_cuda_run(*context_, norm_in, v,
                                           [&](GdnDeltaRuleArgs& a) {
                                             a.norm =
                                                 GdnGatedNorm{.gate = a.qkv, .gate_stride = 1 << 20, .weight = a.qkv};
                                             tweak(a);
                                           })
                 : gdn_delta_rule_norm_cuda_run(*context_, norm_in, true, tweak);
    ASSERT_FALSE(r.has_value()) << text;
    EXPECT_NE(r.error().message.find(text), std::string::npos) << r.error().message;
  };
  expect_error(
      GdnVariant::kChunked, [](GdnDeltaRuleArgs&) {}, "the gated norm runs in the recurrent kernel only");
  expect_error(
      GdnVariant::kRecurrent, [](GdnDeltaRuleArgs& a) { a.norm.weight = nullptr; }, "gate but no weight");
  expect_error(
      GdnVariant::kRecurrent, [](GdnDeltaRuleArgs& a) { a.norm.gate_stride = 8; },
      "gate_stride=8 is less than Hv * dv = 256");
  expect_error(
      GdnVariant::kRecurrent, [](GdnDeltaRuleArgs& a) { a.norm.eps = 0.0f; }, "eps=0 must be positive");
}

struct Fault {
  std::string op, name, expected_reason;
  std::function<Expected<RunOutput>(const DeviceContext&, const OpInputs&)> run;
};

std::function<Expected<RunOutput>(const DeviceContext&, const OpInputs&)> conv_fault(GdnArgsTweak<GdnConvArgs> t) {
  return [t](const DeviceContext& ctx, const OpInputs& in) {
    return gdn_conv_cuda_run(ctx, static_cast<const GdnConvInputs&>(in), t);
  };
}

std::function<Expected<RunOutput>(const DeviceContext&, const OpInputs&)> delta_fault(
    GdnVariant v, GdnArgsTweak<GdnDeltaRuleArgs> t) {
  return [v, t](const DeviceContext& ctx, const OpInputs& in) {
    return gdn_delta_rule_cuda_run(ctx, static_cast<const GdnDeltaRuleInputs&>(in), v, t);
  };
}

std::vector<Fault> gpu_faults() {
  // The harness batches start even sequences afresh over a NaN-filled slot; pointing seq_past at query_start makes
  // every sequence after the first look continued, so a kernel that read a new sequence's slot outputs NaN.
  auto past_from_query_start = [](GdnSequences& s) { s.seq_past = s.query_start; };
  return {
      // A shorter kernel also strides the conv state wrongly, so it reads the NaN-filled slot of a new sequence.
      {"gdn_conv", "kernel-one-short", "non-finite", conv_fault([](GdnConvArgs& a) { a.kernel -= 1; })},
      {"gdn_conv", "last-sequence-dropped", "never written", conv_fault([](GdnConvArgs& a) { a.seqs.n_seqs -= 1; })},
      {"gdn_conv", "new-sequence-reads-its-slot", "non-finite",
       conv_fault([=](GdnConvArgs& a) { past_from_query_start(a.seqs); })},
      {"gdn_delta_rule", "recurrent-a-b-swapped", "exceeds the tolerance",
       delta_fault(GdnVariant::kRecurrent, [](GdnDeltaRuleArgs& a) { std::swap(a.a, a.b); })},
      {"gdn_delta_rule", "recurrent-last-sequence-dropped", "never written",
       delta_fault(GdnVariant::kRecurrent, [](GdnDeltaRuleArgs& a) { a.seqs.n_seqs -= 1; })},
      {"gdn_delta_rule", "chunked-wrong-decay", "exceeds the tolerance",
       delta_fault(GdnVariant::kChunked, [](GdnDeltaRuleArgs& a) { a.a_log = a.dt_bias; })},
      {"gdn_delta_rule", "chunked-new-sequence-reads-its-slot", "non-finite",
       delta_fault(GdnVariant::kChunked, [=](GdnDeltaRuleArgs& a) { past_from_query_start(a.seqs); })},
      // All zeros: the kernels run on scratch copies of their outputs and states while the real ones are cleared.
      {"gdn_conv", "all-zeros", "all zeros",
       [](const DeviceContext& ctx, const OpInputs& base) {
         const auto& in = static_cast<const GdnConvInputs&>(base);
         ZeroedOutputs zero(ctx.stream());
         return gdn_conv_cuda_run(ctx, in, [&](GdnConvArgs& a) {
           zero.redirect(a.y, static_cast<size_t>(in.batch.tokens * in.channels));
           zero.redirect(a.conv_state, in.conv_state.size());
         });
       }},
      {"gdn_delta_rule", "recurrent-all-zeros", "all zeros",
       [](const DeviceContext& ctx, const OpInputs& base) {
         const auto& in = static_cast<const GdnDeltaRuleInputs&>(base);
         ZeroedOutputs zero(ctx.stream());
         return gdn_delta_rule_cuda_run(ctx, in, GdnVariant::kRecurrent, [&](GdnDeltaRuleArgs& a) {
           zero.redirect(a.out, static_cast<size_t>(in.batch.tokens * in.n_value_heads * in.value_dim));
           zero.redirect(a.state, in.state.size());
         });
       }},
  };
}

TEST_F(CudaGdnOps, InjectedFaultsAreRejectedOnTheGpu) {
  for (const Fault& f : gpu_faults()) {
    const Tolerance tol = f.op == "gdn_conv" ? kGdnConvBf16Tolerance : kGdnDeltaRuleBf16Tolerance;
    ASSERT_TRUE(registry_
                    .add(Implementation{.op = f.op, .name = f.name, .backend = Backend::kCuda, .priority = 100,
                                        .tolerance = tol,
                                        .run = [this, run = f.run](const OpInputs& in) { return run(*context_, in); }})
                    .has_value());
  }
  const std::vector<std::pair<std::string, SelfTestCase>> cases = {
      {"gdn_conv", gdn_conv_case(6, 20, 512, 4)}, {"gdn_delta_rule", gdn_delta_rule_case(6, 40, 2, 4, 64, 64)}};
  for (const auto& [op, c] : cases) {
    auto s = registry_select(registry_, op, devices_[0], std::span(&c, 1), {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    for (const Fault& f : gpu_faults()) {
      if (f.op != op) continue;
      const CandidateReport* it = s->candidate(f.name);
      ASSERT_NE(it, nullptr) << f.name;
      EXPECT_EQ(it->status, CandidateStatus::kFailed) << f.name;
      EXPECT_NE(it->reason.find(f.expected_reason), std::string::npos) << f.name << ": " << it->reason;
    }
  }
}

// Decode: the state is read and written once per token (8 bytes per fp32 element); prefill: tokens per second and
// the recurrence's useful FLOPs (about 6 dk dv per token and head: decay, S^T k, the rank-1 update, S^T q).
TEST_F(CudaGdnOps, Timings) {
  auto* harness = registry_.harness("gdn_delta_rule");
  for (int64_t seqs : {1, 16, 64, 256}) {
    auto in = harness->make_inputs(gdn_delta_rule_case(seqs, 1, 16, 32, 128, 128), 3);
    ASSERT_TRUE(in.has_value());
    auto out = gdn_delta_rule_cuda_run(*context_, static_cast<const GdnDeltaRuleInputs&>(**in), GdnVariant::kAuto);
    ASSERT_TRUE(out.has_value()) << out.error().message;
    const double bytes = 8.0 * seqs * 32 * 128 * 128;
    std::printf("decode seqs=%-4lld Hv=32 128x128: %8.1f us %8.1f GB/s of state\n", static_cast<long long>(seqs),
                out->seconds * 1e6, bytes / out->seconds / 1e9);
  }
  for (const GdnVariant v : {GdnVariant::kChunked, GdnVariant::kRecurrent}) {
    auto in = harness->make_inputs(gdn_delta_rule_case(1, 4096, 16, 32, 128, 128), 4);
    ASSERT_TRUE(in.has_value());
    auto out = gdn_delta_rule_cuda_run(*context_, static_cast<const GdnDeltaRuleInputs&>(**in), v);
    ASSERT_TRUE(out.has_value()) << out.error().message;
    const double flops = 6.0 * 4096 * 32 * 128 * 128;
    std::printf("prefill 4096 Hv=32 %-9s: %8.1f us %8.0f tokens/s %6.2f TFLOP/s\n",
                v == GdnVariant::kChunked ? "chunked" : "recurrent", out->seconds * 1e6, 4096 / out->seconds,
                flops / out->seconds / 1e12);
  }
}

}  // namespace
}  // namespace tern
