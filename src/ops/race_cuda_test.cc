// Races on the GPU through the registry (label gpu). Two deliberately racy CUDA variants of rms_norm
// (fault_kernels_test.cu) are registered next to the real "cuda" one on the harness of ops/elementwise_op.h:
//   - "lost-updates": every thread adds into one shared float without atomics; the norm is far off, so it fails
//     its first verdict (or, should a run land inside the tolerance, the repeatability check);
//   - "racy-scale": a race whose damage stays inside the tolerance (below 2^-10 of each output). Its first run
//     passes verify_output; the registry then runs it again on the same inputs and compares the two outputs bit
//     for bit (verify_repeatable, registry.cc), which is the one check that sees it: "a race?".
// Both must be rejected while the real kernel is chosen. A direct check shows that racy-scale's runs are each
// within the tolerance and differ from each other, so the registry's verdict is about exactly that.
#include <gtest/gtest.h>

#include <cstdio>

#include "ops/cuda_op_test.h"
#include "ops/cuda_util.h"
#include "ops/elementwise_cuda.h"
#include "ops/fault_kernels_test.h"

namespace tern {
namespace {

Expected<void> check_plain(const RmsNormInputs& in) {
  if (in.form != RmsNormForm::kPlain || in.residual) return make_error("the racy rms_norm has the plain form only");
  return {};
}

Expected<RunOutput> lost_updates_run(const DeviceContext& ctx, const RmsNormInputs& in) {
  TERN_TRY(check_plain(in));
  const DeviceBuffer x = cuda_upload(in.x, ctx.stream()), w = cuda_upload(in.weight, ctx.stream());
  return cuda_run_timed(ctx, in.rows, in.dim, [&](uint16_t* y) -> Expected<void> {
    rms_norm_lost_updates_launch(
        ctx,
        {.x = x.as<uint16_t>(), .weight = w.as<uint16_t>(), .y = y, .rows = in.rows, .dim = in.dim, .eps = in.eps});
    return {};
  });
}

Expected<RunOutput> racy_scale_run(const DeviceContext& ctx, const RmsNormInputs& in) {
  TERN_TRY(check_plain(in));
  const DeviceBuffer x = cuda_upload(in.x, ctx.stream()), w = cuda_upload(in.weight, ctx.stream());
  const DeviceBuffer counters(static_cast<size_t>(in.rows) * sizeof(float));
  return cuda_run_timed(ctx, in.rows, in.dim, [&](uint16_t* y) -> Expected<void> {
    rms_norm_racy_scale_launch(
        ctx, {.x = x.as<uint16_t>(), .weight = w.as<uint16_t>(), .y = y, .rows = in.rows, .dim = in.dim, .eps = in.eps},
        counters.as<float>());
    return {};
  });
}

class CudaRaces : public CudaOpTest<elementwise_register_cpu, elementwise_register_cuda> {
 protected:
  void add_racy(const std::string& name, Expected<RunOutput> (*run)(const DeviceContext&, const RmsNormInputs&)) {
    ASSERT_TRUE(registry_
                    .add(Implementation{.op = "rms_norm",
                                        .name = name,
                                        .backend = Backend::kCuda,
                                        .priority = 100,
                                        .tolerance = kBf16ElementwiseTolerance,
                                        .run =
                                            [this, run](const OpInputs& in) {
                                              return run(*context_, static_cast<const RmsNormInputs&>(in));
                                            }})
                    .has_value());
  }
};

// 33 rows of 2048: every row's scale races on its own counter, so a pair of runs agreeing everywhere would need
// 33 counts to agree in their low 8 bits, and even one differing row changes ~1 in 1500 of its outputs per step
// of 2^-18 in the scale.
const SelfTestCase kRaceCase = rms_norm_case(33, 1, 2048, RmsNormForm::kPlain, false);

TEST_F(CudaRaces, RacyVariantsAreRejectedAndTheRealKernelIsChosen) {
  add_racy("lost-updates", lost_updates_run);
  add_racy("racy-scale", racy_scale_run);
  const std::vector<SelfTestCase> cases = {kRaceCase, rms_norm_case(1000, 1, 4096, RmsNormForm::kPlain, false)};
  auto s = registry_select(registry_, "rms_norm", devices_[0], cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cuda");
  for (const auto& c : s->candidates) {
    std::printf("%-13s %-11s max error %.3g (bound %.3g) %s\n", c.name.c_str(),
                std::string(candidate_status_name(c.status)).c_str(), c.max_error, c.bound, c.reason.c_str());
    if (c.name == "lost-updates") {
      EXPECT_EQ(c.status, CandidateStatus::kFailed);
      const bool wrong = c.reason.find("exceeds the tolerance") != std::string::npos;
      const bool racy = c.reason.find("a race?") != std::string::npos;
      EXPECT_TRUE(wrong || racy) << c.reason;
    }
    if (c.name == "racy-scale") {
      EXPECT_EQ(c.status, CandidateStatus::kFailed);
      EXPECT_NE(c.reason.find("two runs on the same input differ at element"), std::string::npos) << c.reason;
      EXPECT_NE(c.reason.find("a race?"), std::string::npos) << c.reason;
      // The first run passed the tolerance: this race is caught by the repeatability check alone.
      EXPECT_LE(c.max_error, c.bound);
      EXPECT_GT(c.max_error, 0.0);
    }
  }
}

TEST_F(CudaRaces, RacyScaleRunsAreEachWithinToleranceButNotBitIdentical) {
  auto made = registry_.harness("rms_norm")->make_inputs(kRaceCase, 3);
  ASSERT_TRUE(made.has_value());
  const auto& in = static_cast<const RmsNormInputs&>(**made);
  const std::vector<float> ref = registry_.harness("rms_norm")->reference(in);
  auto first = racy_scale_run(*context_, in);
  auto second = racy_scale_run(*context_, in);
  ASSERT_TRUE(first.has_value()) << first.error().message;
  ASSERT_TRUE(second.has_value()) << second.error().message;
  for (const auto* run : {&*first, &*second}) {
    const Verdict v = verify_output(run->values, ref, kBf16ElementwiseTolerance);
    EXPECT_TRUE(v.pass) << v.reason;
  }
  size_t differing = 0;
  for (size_t i = 0; i < ref.size(); ++i) differing += first->values[i] != second->values[i] ? 1 : 0;
  std::printf("racy-scale: %zu of %zu outputs differ between two runs\n", differing, ref.size());
  EXPECT_GT(differing, 0u);
  EXPECT_FALSE(verify_repeatable(first->values, second->values).pass);
  // The real kernel on the same input is repeatable.
  auto real_first = rms_norm_cuda_run(*context_, in), real_second = rms_norm_cuda_run(*context_, in);
  ASSERT_TRUE(real_first.has_value() && real_second.has_value());
  EXPECT_TRUE(verify_repeatable(real_first->values, real_second->values).pass);
}

}  // namespace
}  // namespace tern
