// Selection and fault injection on the CPU: a toy op with one correct implementation and one broken variant per
// fault class. Each broken variant must be rejected with its one-line reason; the fastest correct one is chosen;
// a forced implementation that fails stops selection with an error.
#include "ops/registry.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>

namespace tern {
namespace {

// y[i] = a * x[i] + b[i]; dims = {n}.
struct AxpyInputs : OpInputs {
  float a = 0.0f;
  std::vector<float> x, b;
};

OpHarness axpy_harness() {
  return OpHarness{
      .op = "axpy",
      .make_inputs = [](const SelfTestCase& c, uint64_t seed) -> Expected<std::unique_ptr<OpInputs>> {
        if (c.dims.size() != 1 || c.dims[0] <= 0) return make_error("axpy case '{}' needs dims {{n}}", c.label);
        auto in = std::make_unique<AxpyInputs>();
        std::mt19937_64 rng(seed);
        std::uniform_real_distribution<float> u(0.5f, 2.0f);  // non-zero, both signs below
        in->a = u(rng);
        for (int64_t i = 0; i < c.dims[0]; ++i) {
          in->x.push_back(u(rng) * (i % 3 == 0 ? -1.0f : 1.0f));
          in->b.push_back(u(rng) * (i % 5 == 0 ? -1.0f : 1.0f));
        }
        return in;
      },
      .reference =
          [](const OpInputs& base) {
            const auto& in = static_cast<const AxpyInputs&>(base);
            std::vector<float> y(in.x.size());
            for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<float>(double(in.a) * in.x[i] + in.b[i]);
            return y;
          },
  };
}

// Builds an implementation from a function writing into a poisoned output.
Implementation axpy_impl(std::string name, int priority, double seconds,
                         std::function<void(const AxpyInputs&, std::vector<float>&)> body) {
  return Implementation{
      .op = "axpy",
      .name = std::move(name),
      .priority = priority,
      .tolerance = {.rel = 1e-6, .abs = 0.0},
      .run = [seconds, body](const OpInputs& base) -> Expected<RunOutput> {
        const auto& in = static_cast<const AxpyInputs&>(base);
        RunOutput out{.values = std::vector<float>(in.x.size()), .seconds = seconds};
        poison_f32(out.values);
        body(in, out.values);
        return out;
      },
  };
}

void correct(const AxpyInputs& in, std::vector<float>& y) {
  for (size_t i = 0; i < y.size(); ++i) y[i] = in.a * in.x[i] + in.b[i];
}

Registry make_registry(bool with_faults) {
  Registry r;
  EXPECT_TRUE(r.add_harness(axpy_harness()).has_value());
  EXPECT_TRUE(r.add(axpy_impl("slow", 2, 2e-3, correct)).has_value());
  EXPECT_TRUE(r.add(axpy_impl("fast", 1, 1e-3, correct)).has_value());
  if (!with_faults) return r;
  EXPECT_TRUE(r.add(axpy_impl("zeros", 9, 1e-6, [](const AxpyInputs&, std::vector<float>& y) {
                 std::fill(y.begin(), y.end(), 0.0f);
               })).has_value());
  EXPECT_TRUE(r.add(axpy_impl("nan-block", 9, 1e-6, [](const AxpyInputs& in, std::vector<float>& y) {
                 correct(in, y);
                 for (size_t i = 32; i < 48 && i < y.size(); ++i) y[i] = NAN;
               })).has_value());
  EXPECT_TRUE(r.add(axpy_impl("wrong-scale", 9, 1e-6, [](const AxpyInputs& in, std::vector<float>& y) {
                 correct(in, y);
                 for (auto& v : y) v *= 1.01f;
               })).has_value());
  EXPECT_TRUE(r.add(axpy_impl("skips-tail", 9, 1e-6, [](const AxpyInputs& in, std::vector<float>& y) {
                 std::vector<float> full(y.size());
                 correct(in, full);
                 std::copy(full.begin(), full.begin() + static_cast<long>(y.size() / 64 * 64), y.begin());
               })).has_value());
  auto calls = std::make_shared<int>(0);
  EXPECT_TRUE(r.add(axpy_impl("racy", 9, 1e-6, [calls](const AxpyInputs& in, std::vector<float>& y) {
                 correct(in, y);
                 // A lost update on every other run: the value is within tolerance but not repeatable.
                 if ((*calls)++ % 2 == 1) y[7] = std::nextafter(y[7], 1e30f);
               })).has_value());
  Implementation big = axpy_impl("needs-200k-smem", 9, 1e-7, correct);
  big.unsupported_reason = [](const DeviceDescription& d, const SelfTestCase&) -> std::string {
    return d.smem_per_block_optin >= 200 * 1024 ? "" : "needs 200 KiB of shared memory per block";
  };
  EXPECT_TRUE(r.add(std::move(big)).has_value());
  return r;
}

const std::vector<SelfTestCase> kCases = {{"n=1000", {1000}}, {"n=4099", {4099}}};

const CandidateReport& report_of(const Selection& s, std::string_view name) {
  static const CandidateReport none;
  const CandidateReport* r = s.candidate(name);
  EXPECT_NE(r, nullptr) << "no report for " << name;
  return r != nullptr ? *r : none;
}

TEST(Registry, ChoosesTheFastestVerifiedImplementation) {
  Registry r = make_registry(false);
  auto s = registry_select(r, "axpy", cpu_device_describe(), kCases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "fast");
  EXPECT_EQ(report_of(*s, "slow").status, CandidateStatus::kPassed);
  EXPECT_EQ(report_of(*s, "fast").status, CandidateStatus::kPassed);
  EXPECT_LE(report_of(*s, "fast").max_error, report_of(*s, "fast").bound);
}

TEST(Registry, ANearTieKeepsTheHigherPriorityImplementation) {
  for (const double faster_by : {kSelectMargin / 2, kSelectMargin * 2}) {
    Registry r;
    ASSERT_TRUE(r.add_harness(axpy_harness()).has_value());
    ASSERT_TRUE(r.add(axpy_impl("preferred", 2, 1e-3, correct)).has_value());
    ASSERT_TRUE(r.add(axpy_impl("challenger", 1, 1e-3 * (1.0 - faster_by), correct)).has_value());
    auto s = registry_select(r, "axpy", cpu_device_describe(), kCases, {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(s->chosen, faster_by < kSelectMargin ? "preferred" : "challenger") << "faster by " << faster_by;
  }
}

TEST(Registry, AnOptInImplementationRunsOnlyWhenForced) {
  Registry r;
  ASSERT_TRUE(r.add_harness(axpy_harness()).has_value());
  ASSERT_TRUE(r.add(axpy_impl("plain", 2, 2e-3, correct)).has_value());
  Implementation opt = axpy_impl("experimental", 1, 1e-3, correct);
  opt.opt_in = true;
  ASSERT_TRUE(r.add(std::move(opt)).has_value());
  auto s = registry_select(r, "axpy", cpu_device_describe(), kCases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "plain") << "twice as fast, but opt-in";
  EXPECT_EQ(report_of(*s, "experimental").status, CandidateStatus::kPassed) << "still self-tested";
  EXPECT_TRUE(report_of(*s, "experimental").opt_in);
  auto forced = registry_select(r, "axpy", cpu_device_describe(), kCases, {.forced = "experimental"});
  ASSERT_TRUE(forced.has_value()) << forced.error().message;
  EXPECT_EQ(forced->chosen, "experimental");
}

TEST(Registry, RejectsEveryInjectedFaultWithItsReason) {
  const DeviceDescription rtx = *simulated_device("rtx-pro-6000");
  Registry r = make_registry(true);
  auto s = registry_select(r, "axpy", rtx, kCases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "fast");
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"zeros", "all zeros"},          {"nan-block", "non-finite value nan at element 32"},
      {"wrong-scale", "exceeds the tolerance"}, {"skips-tail", "never written"},
      {"racy", "a race?"},             {"needs-200k-smem", "needs 200 KiB of shared memory"}};
  for (const auto& [name, why] : expected) {
    const CandidateReport& rep = report_of(*s, name);
    EXPECT_NE(rep.status, CandidateStatus::kPassed) << name;
    EXPECT_NE(rep.reason.find(why), std::string::npos) << name << ": " << rep.reason;
  }
  EXPECT_EQ(report_of(*s, "needs-200k-smem").status, CandidateStatus::kUnsupported);
  // The same implementation fits an H200 and, being fastest and correct, is chosen there.
  auto h200 = registry_select(r, "axpy", *simulated_device("h200"), kCases, {});
  ASSERT_TRUE(h200.has_value());
  EXPECT_EQ(h200->chosen, "needs-200k-smem");
}

TEST(Registry, ForcedImplementationThatFailsStopsSelection) {
  Registry r = make_registry(true);
  auto s = registry_select(r, "axpy", cpu_device_describe(), kCases, {.forced = "wrong-scale"});
  ASSERT_FALSE(s.has_value());
  EXPECT_NE(s.error().message.find("forced implementation 'wrong-scale' is failed"), std::string::npos)
      << s.error().message;
  auto ok = registry_select(r, "axpy", cpu_device_describe(), kCases, {.forced = "slow"});
  ASSERT_TRUE(ok.has_value());
  EXPECT_EQ(ok->chosen, "slow");
  EXPECT_TRUE(ok->forced);
  auto unknown = registry_select(r, "axpy", cpu_device_describe(), kCases, {.forced = "nope"});
  ASSERT_FALSE(unknown.has_value());
  EXPECT_NE(unknown.error().message.find("registered:"), std::string::npos) << unknown.error().message;
  auto unsupported = registry_select(r, "axpy", *simulated_device("rtx-4090"), kCases, {.forced = "needs-200k-smem"});
  ASSERT_FALSE(unsupported.has_value());
  EXPECT_NE(unsupported.error().message.find("unsupported"), std::string::npos) << unsupported.error().message;
}

TEST(Registry, SelftestOffChoosesByPriorityWithoutRunning) {
  Registry r = make_registry(false);
  auto s = registry_select(r, "axpy", cpu_device_describe(), kCases, {.mode = SelftestMode::kOff});
  ASSERT_TRUE(s.has_value());
  EXPECT_FALSE(s->tested);
  EXPECT_EQ(s->chosen, "slow");  // highest priority
  for (const auto& rep : s->candidates) EXPECT_EQ(rep.status, CandidateStatus::kNotTested);
}

TEST(Registry, NothingVerifiedLeavesTheOpWithoutAnImplementation) {
  Registry r;
  ASSERT_TRUE(r.add_harness(axpy_harness()).has_value());
  ASSERT_TRUE(r.add(axpy_impl("zeros", 1, 1e-6, [](const AxpyInputs&, std::vector<float>& y) {
                 std::fill(y.begin(), y.end(), 0.0f);
               })).has_value());
  auto s = registry_select(r, "axpy", cpu_device_describe(), kCases, {});
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(s->chosen.empty());
  EXPECT_FALSE(registry_select(r, "nope", cpu_device_describe(), kCases, {}).has_value());
  EXPECT_FALSE(r.add(axpy_impl("zeros", 1, 1e-6, correct)).has_value()) << "duplicate names are refused";
}

// Fast mode runs each op's first case and the cases marked in_fast, not the others: an implementation wrong only
// on an unmarked later case passes in fast mode and fails in full mode; wrong only on a marked one, it fails both.
TEST(Registry, FastModeRunsTheFirstCaseAndTheMarkedOnes) {
  Registry r;
  ASSERT_TRUE(r.add_harness(axpy_harness()).has_value());
  auto wrong_at = [](size_t n) {
    return [n](const AxpyInputs& in, std::vector<float>& y) {
      correct(in, y);
      if (in.x.size() == n) y[0] += 1.0f;
    };
  };
  ASSERT_TRUE(r.add(axpy_impl("wrong-on-unmarked", 2, 1e-3, wrong_at(4099))).has_value());
  ASSERT_TRUE(r.add(axpy_impl("wrong-on-marked", 1, 1e-3, wrong_at(777))).has_value());
  const std::vector<SelfTestCase> cases = {{"n=1000", {1000}}, {"n=4099", {4099}}, {"n=777", {777}, true}};
  auto fast = registry_select(r, "axpy", cpu_device_describe(), cases, {.mode = SelftestMode::kFast});
  auto full = registry_select(r, "axpy", cpu_device_describe(), cases, {.mode = SelftestMode::kFull});
  ASSERT_TRUE(fast.has_value() && full.has_value());
  EXPECT_EQ(report_of(*fast, "wrong-on-unmarked").status, CandidateStatus::kPassed);
  EXPECT_EQ(report_of(*fast, "wrong-on-marked").status, CandidateStatus::kFailed);
  EXPECT_EQ(report_of(*full, "wrong-on-unmarked").status, CandidateStatus::kFailed);
  EXPECT_EQ(report_of(*full, "wrong-on-marked").status, CandidateStatus::kFailed);
  EXPECT_NE(report_of(*fast, "wrong-on-marked").reason.find("n=777"), std::string::npos)
      << report_of(*fast, "wrong-on-marked").reason;
}

TEST(Registry, SelftestModes) {
  EXPECT_EQ(*selftest_mode_parse("off"), SelftestMode::kOff);
  EXPECT_EQ(*selftest_mode_parse("fast"), SelftestMode::kFast);
  EXPECT_EQ(*selftest_mode_parse("full"), SelftestMode::kFull);
  EXPECT_FALSE(selftest_mode_parse("maybe").has_value());
}

}  // namespace
}  // namespace tern
