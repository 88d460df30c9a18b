#include "ops/kernel_choices.h"

#include <gtest/gtest.h>

#include <vector>

namespace tern {
namespace {

Selection selection(std::string op, std::string chosen, std::vector<std::pair<std::string, CandidateStatus>> cands,
                    bool forced = false) {
  Selection s{.op = std::move(op), .chosen = std::move(chosen), .forced = forced};
  for (auto& [name, status] : cands) s.candidates.push_back({.name = name, .status = status});
  return s;
}

constexpr auto kPassed = CandidateStatus::kPassed;
constexpr auto kFailed = CandidateStatus::kFailed;
constexpr auto kUnsupported = CandidateStatus::kUnsupported;

TEST(KernelChoices, NoSelectionsKeepTheDefaults) {
  EXPECT_EQ(kernel_choices_of({}), KernelChoices{});
}

TEST(KernelChoices, AFamilyRunsBothWhenBothPassAndOneWhenTheOtherCannot) {
  const std::vector<Selection> both{selection("attention", "cuda-prefill",
                                              {{"cuda-decode", kPassed}, {"cuda-prefill", kPassed}})};
  EXPECT_EQ(kernel_choices_of(both).attention, AttentionChoice::kAuto);
  const std::vector<Selection> failed{selection("attention", "cuda-prefill",
                                                {{"cuda-decode", kFailed}, {"cuda-prefill", kPassed}})};
  EXPECT_EQ(kernel_choices_of(failed).attention, AttentionChoice::kPrefill);
  const std::vector<Selection> unsupported{selection("gdn_delta_rule", "cuda-recurrent",
                                                     {{"cuda-recurrent", kPassed}, {"cuda-chunked", kUnsupported}})};
  EXPECT_EQ(kernel_choices_of(unsupported).gdn, GdnChoice::kRecurrent);
}

TEST(KernelChoices, AForcedImplementationIsPinnedWhateverElsePassed) {
  const std::vector<Selection> s{selection("gdn_delta_rule", "cuda-chunked",
                                           {{"cuda-recurrent", kPassed}, {"cuda-chunked", kPassed}}, true),
                                 selection("attention", "cuda-decode",
                                           {{"cuda-decode", kPassed}, {"cuda-prefill", kPassed}}, true)};
  const KernelChoices k = kernel_choices_of(s);
  EXPECT_EQ(k.gdn, GdnChoice::kChunked);
  EXPECT_EQ(k.attention, AttentionChoice::kDecode);
}

TEST(KernelChoices, FusionsFollowTheChosenImplementation) {
  const std::vector<Selection> fused{selection("gemm_bf16", "gemv", {}), selection("rms_norm_gemv", "fused", {}),
                                     selection("silu_mul_gemv", "fused", {}),
                                     selection("gdn_delta_rule_norm", "fused", {})};
  const KernelChoices k = kernel_choices_of(fused);
  EXPECT_TRUE(k.bf16_gemv && k.norm_gemv && k.silu_gemv && k.gdn_norm_in_rule);
  const std::vector<Selection> separate{selection("gemm_bf16", "cublaslt", {}),
                                        selection("rms_norm_gemv", "separate", {}),
                                        selection("silu_mul_gemv", "separate", {}),
                                        selection("gdn_delta_rule_norm", "separate", {})};
  const KernelChoices j = kernel_choices_of(separate);
  EXPECT_FALSE(j.bf16_gemv || j.norm_gemv || j.silu_gemv || j.gdn_norm_in_rule);
}

}  // namespace
}  // namespace tern
