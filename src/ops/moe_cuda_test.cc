// The moe op on the GPU through the registry (label gpu): the CUDA implementation passes its self-test against the
// fp64 reference on the test fixture's shape and on 35B- and 397B-like expert counts, in bf16, NVFP4 and block-wise
// FP8, with each grouped-GEMM variant forced; deliberately broken launches (each one fault class, all-zero outputs
// included) are rejected; and a timing line per case is printed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "ops/cuda_fault_test_util.h"
#include "ops/cuda_op_test.h"
#include "ops/cuda_util.h"
#include "ops/moe_cuda.h"

namespace tern {
namespace {

class CudaMoeOp : public CudaOpTest<moe_register_cpu, moe_register_cuda> {
 protected:
  void expect_chosen(const std::vector<SelfTestCase>& cases) {
    auto s = registry_select(registry_, "moe", devices_[0], cases, {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(s->chosen, "cuda") << s->candidates.front().reason;
    for (const auto& c : s->candidates) {
      std::printf("moe %-6s %-11s %zu cases, max error %.3g (bound %.3g) %s\n", c.name.c_str(),
                  std::string(candidate_status_name(c.status)).c_str(), cases.size(), c.max_error, c.bound,
                  c.reason.c_str());
    }
  }
};

TEST_F(CudaMoeOp, PassesOnFixtureAndModelLikeShapes) {
  std::vector<SelfTestCase> cases;
  for (const MoeCaseFormat format : {MoeCaseFormat::kBf16, MoeCaseFormat::kNvfp4, MoeCaseFormat::kFp8}) {
    for (int64_t t : {1, 3, 37, 1000}) {
      cases.push_back(moe_case(t, 64, 32, 8, 2, format, true));      // the test fixture
      cases.push_back(moe_case(t, 512, 128, 256, 8, format, true));  // 35B-like expert count and top-k
    }
    cases.push_back(moe_case(37, 256, 64, 512, 10, format, false));  // 397B-like
    cases.push_back(moe_case(37, 2048, 512, 16, 8, format, true));   // 35B hidden and expert width
    cases.push_back(moe_case(200, 128, 32, 16, 1, format, false));   // top-1
    // Sigmoid routing with a correction bias and an unweighted shared expert: the GLM-5 fixture's shape and
    // DeepSeek-V3's 4 of 8 groups.
    const MoeCaseRouting glm5{.sigmoid = true, .correction_bias = true, .shared_gate = false};
    const MoeCaseRouting dsv3{.sigmoid = true, .n_group = 8, .topk_group = 4, .correction_bias = true,
                              .shared_gate = false};
    for (int64_t t : {1, 3, 37, 1000}) {
      cases.push_back(moe_case(t, 64, 32, 8, 2, format, true, glm5));
      cases.push_back(moe_case(t, 512, 128, 256, 8, format, true, dsv3));
    }
    // One expert-parallel rank's share (the others' experts NaN): the fixture's 8 over 4 ranks, a 35B-like 256
    // over 8 with its shared expert, GLM-5's sigmoid router over 8.
    for (int64_t t : {1, 3, 37, 1000}) {
      cases.push_back(moe_case(t, 64, 32, 8, 2, format, true, {.expert_begin = 2, .local_experts = 2}));
      cases.push_back(moe_case(t, 512, 128, 256, 8, format, true, {.expert_begin = 96, .local_experts = 32}));
      cases.push_back(moe_case(t, 512, 128, 256, 8, format, true,
                               {.sigmoid = true, .correction_bias = true, .shared_gate = false, .expert_begin = 224,
                                .local_experts = 32}));
    }
  }
  expect_chosen(cases);
}

// Both grouped-GEMM variants on the same cases, whichever kAuto would pick.
TEST_F(CudaMoeOp, BothGemmVariantsPass) {
  for (const MoeGemmVariant v : {MoeGemmVariant::kDecode, MoeGemmVariant::kPrefill}) {
    const std::string name = v == MoeGemmVariant::kDecode ? "cuda-decode" : "cuda-prefill";
    ASSERT_TRUE(registry_
                    .add(Implementation{.op = "moe", .name = name, .backend = Backend::kCuda, .priority = 20,
                                        .tolerance = kMoeCudaTolerance,
                                        .run = [this, v](const OpInputs& in) {
                                          return moe_cuda_run(*context_, static_cast<const MoeInputs&>(in), {}, v);
                                        }})
                    .has_value());
  }
  std::vector<SelfTestCase> cases;
  for (const MoeCaseFormat f : {MoeCaseFormat::kBf16, MoeCaseFormat::kNvfp4, MoeCaseFormat::kFp8}) {
    for (int64_t t : {1, 37, 300}) cases.push_back(moe_case(t, 256, 64, 64, 8, f, true));
  }
  auto s = registry_select(registry_, "moe", devices_[0], cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  for (const auto& c : s->candidates) {
    if (c.name == "cpu") continue;
    EXPECT_EQ(c.status, CandidateStatus::kPassed) << c.name << ": " << c.reason;
  }
}

struct Fault {
  std::string name, expected_reason;
  ArgsTweak<MoeForwardArgs> tweak;
};

// `stream`: the context's, on which the all-zeros fault clears the output (cuda_fault_test_util.h).
std::vector<Fault> gpu_faults(cudaStream_t stream) {
  auto zero = std::make_shared<ZeroedOutputs>(stream);  // its scratch lives as long as the registered fault
  return {
      {"all-zeros", "all zeros",
       [zero](MoeForwardArgs& a) { zero->redirect(a.y, static_cast<size_t>(a.tokens * a.hidden)); }},
      {"no-renormalize", "exceeds the tolerance", [](MoeForwardArgs& a) { a.renormalize = false; }},
      {"last-token-skipped", "never written", [](MoeForwardArgs& a) { a.tokens -= 1; }},
      {"shared-expert-dropped", "exceeds the tolerance",
       [](MoeForwardArgs& a) {
         a.shared_out = nullptr;
         a.shared_gate = nullptr;
       }},
      // Logits read one column to the right: every token routed to its neighbours' experts.
      // Shifted logits route tokens to experts the harness left NaN (only routed experts get weights).
      {"router-shifted", "non-finite", [](MoeForwardArgs& a) { a.router_logits += 1; }},
      // The down projection's weight_scale_2 used for gate/up.
      {"wrong-global-scale", "exceeds the tolerance",
       [](MoeForwardArgs& a) { a.gate_up.global_scales = a.down.global_scales; }},
  };
}

TEST_F(CudaMoeOp, InjectedFaultsAreRejectedOnTheGpu) {
  for (const Fault& f : gpu_faults(context_->stream())) {
    ASSERT_TRUE(registry_
                    .add(Implementation{.op = "moe", .name = f.name, .backend = Backend::kCuda, .priority = 100,
                                        .tolerance = kMoeCudaTolerance,
                                        .run = [this, t = f.tweak](const OpInputs& in) {
                                          return moe_cuda_run(*context_, static_cast<const MoeInputs&>(in), t);
                                        }})
                    .has_value());
  }
  for (const int64_t tokens : {1, 3, 100}) {  // decode (one token: the combine folded), decode and prefill GEMMs
    const SelfTestCase c = moe_case(tokens, 256, 64, 32, 4, true, true);
    auto s = registry_select(registry_, "moe", devices_[0], std::span(&c, 1), {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(s->chosen, "cuda");
    for (const Fault& f : gpu_faults(context_->stream())) {
      const CandidateReport* it = s->candidate(f.name);
      ASSERT_NE(it, nullptr) << f.name;
      EXPECT_EQ(it->status, CandidateStatus::kFailed) << f.name;
      EXPECT_NE(it->reason.find(f.expected_reason), std::string::npos) << f.name << ": " << it->reason;
    }
  }
}

TEST_F(CudaMoeOp, BadArgumentsAreErrors) {
  auto in = registry_.harness("moe")->make_inputs(moe_case(3, 64, 32, 8, 2, false, true), 5);
  ASSERT_TRUE(in.has_value());
  const auto& moe_in = static_cast<const MoeInputs&>(**in);
  auto out = moe_cuda_run(*context_, moe_in, [](MoeForwardArgs& a) { a.workspace_bytes -= 1; });
  ASSERT_FALSE(out.has_value());
  EXPECT_NE(out.error().message.find("moe_forward: workspace of"), std::string::npos) << out.error().message;
  out = moe_cuda_run(*context_, moe_in, [](MoeForwardArgs& a) { a.down.k = 16; });
  ASSERT_FALSE(out.has_value());
  EXPECT_NE(out.error().message.find("down weights are [8][64][16], want [8][64][32]"), std::string::npos)
      << out.error().message;
}

}  // namespace
}  // namespace tern
