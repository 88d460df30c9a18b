// The moe harness and its CPU implementation through the registry: the CPU layer passes its self-test against the
// fp64 reference on every weight format, the reference agrees with a block worked out by hand, block-wise FP8 cases
// are quantized as the checkpoints are, and broken implementations (one expert too few, a scaled output, an
// unwritten element) are rejected.
#include "ops/moe_op.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "core/formats.h"

namespace tern {
namespace {

// Softmax cases, then sigmoid routing (GLM-5's one group, DeepSeek-V3-like groups) with a correction bias and the
// shared expert unweighted or absent.
std::vector<SelfTestCase> small_cases() {
  const MoeCaseRouting glm5{.sigmoid = true, .correction_bias = true, .shared_gate = false};
  const MoeCaseRouting grouped{.sigmoid = true, .n_group = 8, .topk_group = 4, .correction_bias = true,
                               .shared_gate = false};
  return {moe_case(1, 64, 32, 8, 2, false, true),          moe_case(3, 64, 32, 8, 2, true, true),
          moe_case(37, 64, 32, 8, 2, false, false),        moe_case(5, 128, 64, 64, 8, true, false),
          moe_case(4, 64, 32, 32, 32, false, true),        moe_case(9, 32, 16, 16, 1, true, true),
          moe_case(37, 64, 32, 8, 2, false, true, glm5),   moe_case(5, 128, 64, 64, 8, true, true, grouped),
          moe_case(9, 64, 32, 64, 8, false, false, grouped),
          moe_case(3, 64, 32, 8, 2, MoeCaseFormat::kFp8, true),
          moe_case(5, 256, 144, 64, 8, MoeCaseFormat::kFp8, true, grouped),
          // one expert-parallel rank's share: 2 of 8 (as many as top-k), and 16 of a grouped sigmoid router's 64
          moe_case(9, 64, 32, 8, 2, true, true, {.expert_begin = 4, .local_experts = 2}),
          moe_case(5, 128, 64, 64, 8, false, true,
                   {.sigmoid = true, .n_group = 8, .topk_group = 4, .correction_bias = true, .shared_gate = false,
                    .expert_begin = 16, .local_experts = 16})};
}

TEST(MoeOp, CpuImplementationPassesItsSelfTest) {
  Registry r;
  ASSERT_TRUE(moe_register_cpu(r).has_value());
  auto s = registry_select(r, "moe", cpu_device_describe(), small_cases(), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu") << s->candidates.front().reason;
}

TEST(MoeOp, BadCasesAreErrors) {
  Registry r;
  ASSERT_TRUE(moe_register_cpu(r).has_value());
  EXPECT_FALSE(r.harness("moe")->make_inputs({"short", {1, 64, 32}}, 1).has_value());
  EXPECT_FALSE(r.harness("moe")->make_inputs(moe_case(1, 64, 32, 4, 5, false, false), 1).has_value());  // top_k > E
  EXPECT_FALSE(r.harness("moe")->make_inputs(moe_case(1, 40, 32, 4, 2, false, false), 1).has_value());  // hidden % 16
  SelfTestCase bad_format = moe_case(1, 64, 32, 4, 2, MoeCaseFormat::kFp8, false);
  bad_format.dims[5] = 3;
  EXPECT_FALSE(r.harness("moe")->make_inputs(bad_format, 1).has_value());
  // Sigmoid routing: groups that do not divide the experts, more kept groups than groups, too few kept experts.
  for (const MoeCaseRouting& bad : {MoeCaseRouting{.sigmoid = true, .n_group = 3},
                                    MoeCaseRouting{.sigmoid = true, .n_group = 2, .topk_group = 3},
                                    MoeCaseRouting{.sigmoid = true, .n_group = 4, .topk_group = 1}}) {
    EXPECT_FALSE(r.harness("moe")->make_inputs(moe_case(1, 64, 32, 8, 4, false, false, bad), 1).has_value());
  }
}

// Block-wise FP8 (format 2): each routed expert's gate, up and down are quantized as the checkpoint's own tensors, in
// 128 x 128 blocks (inter = 144 and hidden = 208 leave partial ones; gate and up do not share a block) with
// scale = amax / 448, so every block holds a code of magnitude 448; the scales are held per row, equal within a
// block's rows; every other expert's scales are NaN.
TEST(MoeOp, Fp8CasesHoldCheckpointBlocks) {
  Registry r;
  ASSERT_TRUE(moe_register_cpu(r).has_value());
  auto made = r.harness("moe")->make_inputs(moe_case(2, 208, 144, 16, 2, MoeCaseFormat::kFp8, false), 7);
  ASSERT_TRUE(made.has_value()) << made.error().message;
  const auto& in = static_cast<const MoeInputs&>(**made);
  ASSERT_TRUE(in.fp8 && !in.nvfp4);
  struct Projection {
    const std::vector<uint8_t>& codes;
    const std::vector<float>& scales;
    int64_t rows, cols, tensor_rows;
  };
  int64_t routed = 0;
  const Projection projections[] = {
      {in.gate_up_packed, in.gate_up_row_scales, 2 * in.inter, in.hidden, in.inter},
      {in.down_packed, in.down_row_scales, in.hidden, in.inter, in.hidden}};
  for (const Projection& p : projections) {
    const int64_t cols = (p.cols + 127) / 128;
    ASSERT_EQ(p.codes.size(), static_cast<size_t>(in.n_experts * p.rows * p.cols));
    ASSERT_EQ(p.scales.size(), static_cast<size_t>(in.n_experts * p.rows * cols));
    for (int64_t e = 0; e < in.n_experts; ++e) {
      const float* s = &p.scales[e * p.rows * cols];
      if (std::isnan(s[0])) {
        for (int64_t i = 0; i < p.rows * cols; ++i) ASSERT_TRUE(std::isnan(s[i])) << "expert " << e;
        continue;
      }
      ++routed;
      for (int64_t t0 = 0; t0 < p.rows; t0 += p.tensor_rows) {  // each checkpoint tensor (gate, up; down)
        for (int64_t br = t0; br < t0 + p.tensor_rows; br += 128) {
          for (int64_t bc = 0; bc < cols; ++bc) {
            float amax = 0.0f;
            for (int64_t r = br; r < std::min(br + 128, t0 + p.tensor_rows); ++r) {
              ASSERT_EQ(s[r * cols + bc], s[br * cols + bc]) << "expert " << e << " row " << r << " block " << bc;
              for (int64_t c = bc * 128; c < std::min((bc + 1) * 128, p.cols); ++c) {
                amax = std::max(amax, std::fabs(e4m3_to_float(p.codes[(e * p.rows + r) * p.cols + c])));
              }
            }
            EXPECT_EQ(amax, 448.0f) << "expert " << e << " rows from " << br << " block " << bc;
            EXPECT_GT(s[br * cols + bc], 0.0f);
          }
        }
      }
    }
  }
  EXPECT_GT(routed, 0);
}

// One token, two experts, top-1, identity-like weights: gate = up = down = I (hidden = inter = 16), so the routed
// output is silu(x) * x; the router picks expert 1 (x[1] = 2 > x[0] = 1) with weight 1 after renormalisation; the
// shared expert uses the same identities and is scaled by sigmoid(x[2]).
TEST(MoeOp, ReferenceMatchesHandComputedBlock) {
  MoeInputs in;
  in.tokens = 1, in.hidden = 16, in.inter = 16, in.n_experts = 2, in.top_k = 1, in.shared = true;
  const int64_t h = 16;
  for (int64_t j = 0; j < h; ++j) in.x.push_back(float_to_bf16(j == 0 ? 1.0f : j == 1 ? 2.0f : 0.25f * float(j) - 2.0f));
  in.router.assign(3 * h, float_to_bf16(0.0f));
  in.router[0 * h + 0] = in.router[1 * h + 1] = in.router[2 * h + 2] = float_to_bf16(1.0f);
  auto identity = [h](int64_t blocks) {
    std::vector<uint16_t> m(static_cast<size_t>(blocks * h * h), float_to_bf16(0.0f));
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t i = 0; i < h; ++i) m[(b * h + i) * h + i] = float_to_bf16(1.0f);
    return m;
  };
  in.gate_up_bf16 = identity(4);  // 2 experts x [gate; up]
  in.down_bf16 = identity(2);
  // Expert 0 (not chosen) gets a down projection of 100 x I: any leak of it shows.
  for (int64_t i = 0; i < h; ++i) in.down_bf16[i * h + i] = float_to_bf16(100.0f);
  in.shared_gate_up = identity(2);
  in.shared_down = identity(1);
  Registry r;
  ASSERT_TRUE(moe_register_cpu(r).has_value());
  const std::vector<float> y = r.harness("moe")->reference(in);
  const double gate = 1.0 / (1.0 + std::exp(-double(bf16_to_float(in.x[2]))));
  for (int64_t j = 0; j < h; ++j) {
    const double x = bf16_to_float(in.x[j]);
    const double silu_x_x = x / (1.0 + std::exp(-x)) * x;
    EXPECT_NEAR(y[j], silu_x_x * (1.0 + gate), 1e-6 * (1.0 + std::fabs(silu_x_x))) << j;
  }
  // The CPU layer agrees on the same inputs.
  auto out = r.implementations("moe").front()->run(in);
  ASSERT_TRUE(out.has_value());
  for (int64_t j = 0; j < h; ++j) EXPECT_NEAR(out->values[j], y[j], 1e-5 * (1.0 + std::fabs(y[j]))) << j;
}

// Sigmoid routing by hand: one token, four experts in two groups, one group kept, top-2. x[e] is expert e's logit
// (1, 2, 0.5, -1): unbiased, group {0, 1} is worth more, but the bias (0, 0, 0.5, 0.5) makes group {2, 3} worth
// sigmoid(0.5) + sigmoid(-1) + 1 > sigmoid(1) + sigmoid(2), so experts 2 and 3 are taken, weighted by their unbiased
// scores renormalised, times 2.5. Expert e's down projection is (e + 1) I, so which experts and weights were used
// shows; the shared expert is added unweighted (its gate row, at x[4] = -1, must not be read).
TEST(MoeOp, SigmoidReferenceMatchesHandComputedBlock) {
  MoeInputs in;
  in.tokens = 1, in.hidden = 16, in.inter = 16, in.n_experts = 4, in.top_k = 2, in.shared = true;
  in.shared_gate = false, in.sigmoid = true, in.n_group = 2, in.topk_group = 1, in.routed_scaling = 2.5f;
  in.correction_bias = {0.0f, 0.0f, 0.5f, 0.5f};
  const int64_t h = 16;
  const float first[] = {1.0f, 2.0f, 0.5f, -1.0f};
  for (int64_t j = 0; j < h; ++j) in.x.push_back(float_to_bf16(j < 4 ? first[j] : 0.25f * float(j) - 2.0f));
  in.router.assign(5 * h, float_to_bf16(0.0f));
  for (int64_t e = 0; e < 5; ++e) in.router[e * h + e] = float_to_bf16(1.0f);
  auto identity = [h](int64_t blocks, auto scale) {
    std::vector<uint16_t> m(static_cast<size_t>(blocks * h * h), float_to_bf16(0.0f));
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t i = 0; i < h; ++i) m[(b * h + i) * h + i] = float_to_bf16(scale(b));
    return m;
  };
  auto one = [](int64_t) { return 1.0f; };
  in.gate_up_bf16 = identity(8, one);
  in.down_bf16 = identity(4, [](int64_t e) { return float(e + 1); });
  in.shared_gate_up = identity(2, one);
  in.shared_down = identity(1, one);
  Registry r;
  ASSERT_TRUE(moe_register_cpu(r).has_value());
  const std::vector<float> y = r.harness("moe")->reference(in);
  const double s2 = 1.0 / (1.0 + std::exp(-0.5)), s3 = 1.0 / (1.0 + std::exp(1.0));
  const double scale = 2.5 * (3.0 * s2 + 4.0 * s3) / (s2 + s3) + 1.0;
  for (int64_t j = 0; j < h; ++j) {
    const double x = bf16_to_float(in.x[j]);
    const double silu_x_x = x / (1.0 + std::exp(-x)) * x;
    EXPECT_NEAR(y[j], silu_x_x * scale, 1e-6 * (1.0 + std::fabs(silu_x_x * scale))) << j;
  }
  auto out = r.implementations("moe").front()->run(in);
  ASSERT_TRUE(out.has_value());
  for (int64_t j = 0; j < h; ++j) EXPECT_NEAR(out->values[j], y[j], 1e-5 * (1.0 + std::fabs(y[j]))) << j;
}

Implementation broken(const Registry& r, std::string name, std::function<void(MoeInputs&)> corrupt_inputs,
                      std::function<void(std::vector<float>&)> corrupt_out) {
  const Implementation* cpu = r.implementations("moe").front();
  return Implementation{
      .op = "moe",
      .name = std::move(name),
      .priority = 10,
      .tolerance = cpu->tolerance,
      .run = [run = cpu->run, corrupt_inputs, corrupt_out](const OpInputs& base) -> Expected<RunOutput> {
        MoeInputs copy = static_cast<const MoeInputs&>(base);
        if (corrupt_inputs) corrupt_inputs(copy);
        auto out = run(copy);
        if (out && corrupt_out) corrupt_out(out->values);
        return out;
      }};
}

TEST(MoeOp, BrokenImplementationsAreRejected) {
  Registry r;
  ASSERT_TRUE(moe_register_cpu(r).has_value());
  ASSERT_TRUE(r.add(broken(r, "one-expert-short", [](MoeInputs& in) { in.top_k -= 1; }, {})).has_value());
  ASSERT_TRUE(r.add(broken(r, "no-shared", [](MoeInputs& in) { in.shared = false; }, {})).has_value());
  ASSERT_TRUE(r.add(broken(r, "scaled", {}, [](std::vector<float>& y) { for (float& v : y) v *= 1.001f; })).has_value());
  ASSERT_TRUE(r.add(broken(r, "unwritten", {}, [](std::vector<float>& y) { poison_f32(std::span(y).last(1)); })).has_value());
  const SelfTestCase c = moe_case(7, 64, 32, 8, 2, true, true);
  auto s = registry_select(r, "moe", cpu_device_describe(), std::span(&c, 1), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu");
  for (const auto& cand : s->candidates) {
    if (cand.name == "cpu") continue;
    EXPECT_EQ(cand.status, CandidateStatus::kFailed) << cand.name;
    const char* want = cand.name == "unwritten" ? "never written" : "exceeds the tolerance";
    EXPECT_NE(cand.reason.find(want), std::string::npos) << cand.name << ": " << cand.reason;
  }
}

// The case selects the CPU implementation and fails every other one registered.
void expect_only_cpu_passes(const Registry& r, const SelfTestCase& c) {
  auto s = registry_select(r, "moe", cpu_device_describe(), std::span(&c, 1), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu");
  for (const auto& cand : s->candidates) {
    if (cand.name == "cpu") continue;
    EXPECT_EQ(cand.status, CandidateStatus::kFailed) << cand.name << ": " << cand.reason;
  }
}

// Expert parallelism's faults: every expert summed (the ones the rank does not hold are NaN), another rank's share,
// the share's pairs left out.
TEST(MoeOp, BrokenExpertParallelImplementationsAreRejected) {
  Registry r;
  ASSERT_TRUE(moe_register_cpu(r).has_value());
  ASSERT_TRUE(r.add(broken(r, "every-expert", [](MoeInputs& in) { in.expert_begin = 0, in.local_experts = 0; }, {}))
                  .has_value());
  ASSERT_TRUE(r.add(broken(r, "next-share", [](MoeInputs& in) { in.expert_begin += in.local_experts; }, {}))
                  .has_value());
  ASSERT_TRUE(r.add(broken(r, "shared-only", [](MoeInputs& in) { in.top_k = 0; }, {})).has_value());
  const SelfTestCase c = moe_case(17, 64, 32, 16, 4, true, true, {.expert_begin = 4, .local_experts = 4});
  expect_only_cpu_passes(r, c);
  // A share outside the router's experts is a bad case.
  const SelfTestCase outside = moe_case(1, 64, 32, 8, 2, false, false, {.expert_begin = 6, .local_experts = 4});
  EXPECT_FALSE(r.harness("moe")->make_inputs(outside, 1).has_value());
}

// Sigmoid routing's faults: the bias ignored (other experts, which the harness left NaN, or other weights), the shared
// expert gated, softmax routing.
TEST(MoeOp, BrokenSigmoidImplementationsAreRejected) {
  Registry r;
  ASSERT_TRUE(moe_register_cpu(r).has_value());
  ASSERT_TRUE(r.add(broken(r, "bias-dropped", [](MoeInputs& in) { in.correction_bias.clear(); }, {})).has_value());
  ASSERT_TRUE(r.add(broken(r, "shared-gated", [](MoeInputs& in) { in.shared_gate = true; }, {})).has_value());
  ASSERT_TRUE(r.add(broken(r, "softmax", [](MoeInputs& in) { in.sigmoid = false; }, {})).has_value());
  const SelfTestCase c = moe_case(7, 64, 32, 64, 8, false, true,
                                  {.sigmoid = true, .n_group = 8, .topk_group = 4, .correction_bias = true,
                                   .shared_gate = false});
  expect_only_cpu_passes(r, c);
}

}  // namespace
}  // namespace tern
