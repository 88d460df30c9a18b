// The sampling op on the CPU: the harness's reference on hand-worked rows, what the harness draws, the CPU Sampler
// passing its self-test against the double reference at small and model vocabularies, and broken variants (a wrong
// id, a logprob slightly off, a draw not passed on, a failed row reported as a token) rejected with their reason.
#include "ops/sampling_op.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "core/formats.h"

namespace tern {
namespace {

const CandidateReport& report_of(const Selection& s, std::string_view name) {
  static const CandidateReport none;
  const CandidateReport* r = s.candidate(name);
  EXPECT_NE(r, nullptr) << "no report for " << name;
  return r != nullptr ? *r : none;
}

class SamplingOp : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(sampling_register_cpu(registry_).has_value()); }
  std::unique_ptr<SamplingInputs> inputs(const SelfTestCase& c, uint64_t seed) {
    auto in = registry_.harness("sampling")->make_inputs(c, seed);
    EXPECT_TRUE(in.has_value()) << in.error().message;
    return std::unique_ptr<SamplingInputs>(static_cast<SamplingInputs*>(in->release()));
  }
  Registry registry_;
};

// Two rows written by hand: 4096 equal logits (every token has mass 1/4096, so a draw u picks floor(u * 4096)) and
// a greedy row whose maximum appears at ids 9 and 3.
TEST_F(SamplingOp, ReferenceMatchesHandWorkedRows) {
  SamplingInputs in;
  in.rows = 2;
  in.vocab = in.stride = 4096;
  in.logits.assign(2 * 4096, float_to_bf16(0.5f));
  in.logits[4096 + 9] = in.logits[4096 + 3] = float_to_bf16(7.0f);
  in.params = {SamplingParams{.temperature = 1.0f, .top_k = 4000, .top_p = 0.9f}, SamplingParams{.temperature = 0.0f}};
  in.uniforms = {0.3, 0.0};
  in.prompt_ids.resize(2);
  in.output_ids.resize(2);
  const std::vector<float> ref = registry_.harness("sampling")->reference(in);
  ASSERT_EQ(ref.size(), 4u);
  // top_k keeps the 4096 tied tokens; top_p 0.9 keeps the 3687 lowest ids (ties go to the lower id), u = 0.3.
  EXPECT_EQ(ref[0], std::floor(0.3 * 3687));
  EXPECT_NEAR(ref[1], -std::log(4096.0), 1e-6);
  EXPECT_EQ(ref[2], 3.0f);
  EXPECT_NEAR(ref[3], -std::log(2.0 + 4094.0 * std::exp(-6.5)), 1e-6);
}

TEST_F(SamplingOp, HarnessCoversTheParametersAndMatchesTheSamplersDraw) {
  std::set<std::string> seen;
  for (uint64_t seed : {1u, 2u, 3u}) {
    auto in = inputs(sampling_case(8, 1000), seed);
    ASSERT_EQ(in->params.size(), 8u);
    EXPECT_GT(in->stride, in->vocab);
    for (int64_t r = 0; r < in->rows; ++r) {
      const SamplingParams& p = in->params[r];
      ASSERT_TRUE(p.seed.has_value());
      ASSERT_TRUE(sampling_params_validate(p).has_value());
      const bool greedy = p.temperature < kSamplingGreedyTemperature;
      EXPECT_EQ(in->uniforms[r], greedy ? 0.0 : SamplerRng(*p.seed).next_unit()) << "row " << r;
      const bool penalised = p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f;
      if (greedy) seen.insert(penalised ? "greedy+penalties" : "greedy");
      if (!greedy && penalised) seen.insert("random+penalties");
      if (p.top_k > 0) seen.insert("top_k");
      if (p.top_p < 1.0f) seen.insert("top_p");
      if (p.min_p > 0.0f) seen.insert("min_p");
      if (!greedy && !penalised && p.top_k <= 0 && p.top_p == 1.0f && p.min_p == 0.0f) seen.insert("temperature");
      if (penalised) {
        EXPECT_FALSE(in->prompt_ids[r].empty() && in->output_ids[r].empty()) << "row " << r;
      }
      if (greedy && !penalised) {  // the maximum is tied, so the lowest id must win
        const std::vector<float> row = in->row(r);
        const float max = *std::max_element(row.begin(), row.end());
        EXPECT_GE(std::count(row.begin(), row.end(), max), 2) << "row " << r;
      }
    }
  }
  EXPECT_EQ(seen.size(), 7u);
  auto other = inputs(sampling_case(8, 1000), 4);
  EXPECT_NE(other->logits, inputs(sampling_case(8, 1000), 5)->logits) << "fresh inputs per seed";
  EXPECT_FALSE(registry_.harness("sampling")->make_inputs(sampling_case(0, 1000), 1).has_value());
  EXPECT_FALSE(registry_.harness("sampling")->make_inputs({"bad", {8}}, 1).has_value());
}

TEST_F(SamplingOp, CpuSamplerPassesAtSmallAndModelVocabularies) {
  const std::vector<SelfTestCase> cases = {sampling_case(1, 151936), sampling_case(8, 151936), sampling_case(16, 512),
                                           sampling_case(8, 7), sampling_case(24, 1001)};
  auto s = registry_select(registry_, "sampling", cpu_device_describe(), cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu") << report_of(*s, "cpu").reason;
  EXPECT_LE(report_of(*s, "cpu").max_error, kSamplingCpuTolerance.abs);
  EXPECT_EQ(report_of(*s, "cpu").bound, kSamplingCpuTolerance.abs);
}

// Builds a CPU variant that changes the Sampler's outputs or its inputs.
Implementation broken(std::string name, std::function<Expected<std::vector<float>>(const SamplingInputs&)> body) {
  return Implementation{.op = "sampling",
                        .name = std::move(name),
                        .priority = 100,
                        .tolerance = kSamplingDeviceTolerance,
                        .run = [body](const OpInputs& base) -> Expected<RunOutput> {
                          TERN_ASSIGN_OR_RETURN(auto values, body(static_cast<const SamplingInputs&>(base)));
                          return RunOutput{.values = std::move(values), .seconds = 1e-9};
                        }};
}

TEST_F(SamplingOp, BrokenVariantsAreRejectedWithTheirReason) {
  auto shift_ids = [](const SamplingInputs& in) -> Expected<std::vector<float>> {
    TERN_ASSIGN_OR_RETURN(auto v, sampling_cpu(in));
    for (size_t i = 0; i < v.size(); i += 2) v[i] += 1.0f;
    return v;
  };
  auto logprob_off = [](const SamplingInputs& in) -> Expected<std::vector<float>> {
    TERN_ASSIGN_OR_RETURN(auto v, sampling_cpu(in));
    v[1] -= 1e-4f;
    return v;
  };
  // Every random row sampled with another generator's draw (seed 0) instead of its own.
  auto draw_ignored = [](const SamplingInputs& in) -> Expected<std::vector<float>> {
    SamplingInputs copy = in;
    for (SamplingParams& p : copy.params) p.seed = 0;  // SamplerRng(0)'s draws are not the row's
    return sampling_cpu(copy);
  };
  // A NaN logit makes the Sampler fail the row; reporting that row as token -1 with a NaN logprob must not pass.
  auto status_ignored = [](const SamplingInputs& in) -> Expected<std::vector<float>> {
    SamplingInputs copy = in;
    copy.logits[5] = float_to_bf16(NAN);
    auto v = sampling_cpu(copy);
    EXPECT_FALSE(v.has_value());
    std::vector<float> out = *sampling_cpu(in);
    out[0] = -1.0f;
    out[1] = NAN;
    return out;
  };
  ASSERT_TRUE(registry_.add(broken("id-off-by-one", shift_ids)).has_value());
  ASSERT_TRUE(registry_.add(broken("logprob-off-by-1e-4", logprob_off)).has_value());
  ASSERT_TRUE(registry_.add(broken("draw-ignored", draw_ignored)).has_value());
  ASSERT_TRUE(registry_.add(broken("status-ignored", status_ignored)).has_value());
  const std::vector<SelfTestCase> cases = {sampling_case(8, 151936), sampling_case(8, 512)};
  auto s = registry_select(registry_, "sampling", cpu_device_describe(), cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu");
  for (const auto& [name, why] :
       std::vector<std::pair<std::string, std::string>>{{"id-off-by-one", "exceeds the tolerance"},
                                                        {"logprob-off-by-1e-4", "exceeds the tolerance"},
                                                        {"draw-ignored", "exceeds the tolerance"},
                                                        {"status-ignored", "non-finite value nan at element 1"}}) {
    const CandidateReport& r = report_of(*s, name);
    EXPECT_EQ(r.status, CandidateStatus::kFailed) << name;
    EXPECT_NE(r.reason.find(why), std::string::npos) << name << ": " << r.reason;
  }
}

// The GPU test's draw-ignored fault passes uniform 0 for every row of this case; the reference must then change, or
// that fault could not be caught there.
TEST_F(SamplingOp, TheGpuFaultCaseDependsOnTheDraw) {
  const SelfTestCase c = sampling_case(8, 151936);
  auto in = inputs(c, SelectOptions{}.seed);
  const std::vector<float> ref = registry_.harness("sampling")->reference(*in);
  for (double& u : in->uniforms) u = 0.0;
  EXPECT_NE(registry_.harness("sampling")->reference(*in), ref);
}

TEST_F(SamplingOp, CpuReportsAFailedRowAsAnError) {
  auto in = inputs(sampling_case(3, 100), 9);
  in->logits[1 * in->stride + 17] = float_to_bf16(INFINITY);
  auto out = sampling_cpu(*in);
  ASSERT_FALSE(out.has_value());
  EXPECT_EQ(out.error().message, "row 1: logits contain +inf at id 17");
}

}  // namespace
}  // namespace tern
