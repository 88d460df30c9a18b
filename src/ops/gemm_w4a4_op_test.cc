// The W4A4 GEMM op on the CPU: the harness (calibrated input_scale, a reference that really quantizes the
// activations: W4A16 semantics or a dropped scale are rejected), the CPU implementation through the registry, and
// where "fp4-native" may run, decided on simulated devices for binaries with and without the right machine code.
#include "ops/gemm_w4a4_op.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "core/formats.h"
#include "core/nvfp4.h"
#include "ops/gemm_w4a4_test_util.h"

namespace tern {
namespace {

constexpr const char* kOp = "gemm_nvfp4_w4a4";

TEST(GemmW4a4Op, CpuImplementationPassesItsSelfTest) {
  Registry r;
  ASSERT_TRUE(gemm_w4a4_register_cpu(r).has_value());
  const auto cases = gemm_selftest_cases({{64, 256}, {48, 1040}}, {1, 5});
  auto s = registry_select(r, kOp, cpu_device_describe(), cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu") << s->candidates.front().reason;
  EXPECT_GT(s->candidates.front().max_error, 0.0) << "an fp32 result equal to fp64 everywhere is suspicious";
}

TEST(GemmW4a4Op, InputScaleIsCalibratedOnTheActivations) {
  Registry r;
  ASSERT_TRUE(gemm_w4a4_register_cpu(r).has_value());
  auto made = r.harness(kOp)->make_inputs({"M=3 N=16 K=64", {3, 16, 64}}, 77);
  ASSERT_TRUE(made.has_value()) << made.error().message;
  const auto& in = static_cast<const GemmW4a4Inputs&>(**made);
  float amax = 0.0f;
  for (float v : in.x) amax = std::max(amax, std::fabs(v));
  EXPECT_GT(amax, 0.0f);
  EXPECT_EQ(in.input_scale, amax / (6.0f * 448.0f));
  EXPECT_TRUE(in.nvfp4);
  EXPECT_EQ(in.w_packed.size(), 16u * 64 / 2);
  EXPECT_EQ(in.w_scales.size(), 16u * 64 / 16);
}

// A W4A4 GEMM on the CPU that is wrong in one way: activations left unquantized (W4A16 semantics), the
// activation's per-tensor scale dropped, or each activation block given its neighbour's scale.
enum class W4a4Fault { kUnquantizedActivations, kNoInputScale, kShiftedActivationScales };

std::vector<float> activations_with(const GemmW4a4Inputs& in, W4a4Fault fault) {
  std::vector<float> xq(in.x.size());
  std::vector<uint8_t> packed(static_cast<size_t>(in.k / 2)), scales(static_cast<size_t>(in.k / 16));
  for (int64_t i = 0; i < in.m; ++i) {
    const float* row = &in.x[i * in.k];
    float* out = &xq[i * in.k];
    if (fault == W4a4Fault::kUnquantizedActivations) {
      std::copy(row, row + in.k, out);
      continue;
    }
    nvfp4_quantize_activation_row(row, in.k, in.input_scale, packed.data(), scales.data());
    for (int64_t k = 0; k < in.k; ++k) {
      const int64_t b = fault == W4a4Fault::kShiftedActivationScales ? (k / 16 + 1) % (in.k / 16) : k / 16;
      const float scale = e4m3_to_float(scales[b]) * (fault == W4a4Fault::kNoInputScale ? 1.0f : in.input_scale);
      out[k] = e2m1_to_float(fp4_get(packed.data(), static_cast<size_t>(k))) * scale;
    }
  }
  return xq;
}

Implementation broken_w4a4(std::string name, W4a4Fault fault) {
  return Implementation{
      .op = kOp,
      .name = std::move(name),
      .priority = 10,
      .tolerance = {.rel = 1e-5},
      .run = [fault](const OpInputs& base) -> Expected<RunOutput> {
        const auto& in = static_cast<const GemmW4a4Inputs&>(base);
        const std::vector<float> xq = activations_with(in, fault);
        RunOutput out{.values = std::vector<float>(static_cast<size_t>(in.m * in.n))};
        std::vector<float> w_row(static_cast<size_t>(in.k));
        for (int64_t j = 0; j < in.n; ++j) {
          nvfp4_dequantize_row(in.w_packed.data() + j * in.k / 2, in.w_scales.data() + j * in.k / 16, in.w_global_scale,
                               in.k, w_row.data());
          for (int64_t i = 0; i < in.m; ++i) {
            double acc = 0.0;
            for (int64_t k = 0; k < in.k; ++k) acc += double(xq[i * in.k + k]) * w_row[k];
            out.values[i * in.n + j] = static_cast<float>(acc);
          }
        }
        return out;
      },
  };
}

TEST(GemmW4a4Op, WrongActivationHandlingIsRejected) {
  Registry r;
  ASSERT_TRUE(gemm_w4a4_register_cpu(r).has_value());
  ASSERT_TRUE(r.add(broken_w4a4("w4a16-semantics", W4a4Fault::kUnquantizedActivations)).has_value());
  ASSERT_TRUE(r.add(broken_w4a4("no-input-scale", W4a4Fault::kNoInputScale)).has_value());
  ASSERT_TRUE(r.add(broken_w4a4("shifted-activation-scales", W4a4Fault::kShiftedActivationScales)).has_value());
  const auto cases = gemm_selftest_cases({{32, 256}}, {3});
  auto s = registry_select(r, kOp, cpu_device_describe(), cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu");
  ASSERT_EQ(s->candidates.size(), 4u);
  for (const auto& c : s->candidates) {
    if (c.name == "cpu") continue;
    EXPECT_EQ(c.status, CandidateStatus::kFailed) << c.name;
    EXPECT_NE(c.reason.find("exceeds the tolerance"), std::string::npos) << c.name << ": " << c.reason;
  }
}

TEST(GemmW4a4Op, BadCasesAreErrors) {
  Registry r;
  ASSERT_TRUE(gemm_w4a4_register_cpu(r).has_value());
  const std::vector<SelfTestCase> not_blocks = {{"K=40", {1, 8, 40}}};
  EXPECT_FALSE(registry_select(r, kOp, cpu_device_describe(), not_blocks, {}).has_value());
  const std::vector<SelfTestCase> two_dims = {{"M=1 N=8", {1, 8}}};
  EXPECT_FALSE(registry_select(r, kOp, cpu_device_describe(), two_dims, {}).has_value());
}

// ---------------------------------------------------------------------------------------------------------------
// Selection of "fp4-native" on simulated devices. --selftest off: nothing runs, so a supported candidate is
// "not tested" and chosen, and the stand-in run must never be called.

using w4a4_test::kFullImage;
const BinaryImage kNoSm120Image{.sass = {"sm_90a", "sm_100a"}, .ptx = {"compute_90a", "compute_100a"}};

Selection select_on(const std::string& device_name, const BinaryImage& image,
                    const std::vector<SelfTestCase>& cases = gemm_selftest_cases({{4096, 4096}}, {1, 64})) {
  return w4a4_test::select_on(device_name, image, cases);
}

TEST(GemmW4a4Selection, UnsupportedWithoutFp4TensorCores) {
  for (const auto& [name, arch] :
       std::vector<std::pair<std::string, std::string>>{{"h200", "sm_90"}, {"rtx-4090", "sm_89"}}) {
    const Selection s = select_on(name, kFullImage);
    EXPECT_TRUE(s.chosen.empty()) << name << " chose " << s.chosen;
    const CandidateReport* native = s.candidate("fp4-native");
    ASSERT_NE(native, nullptr);
    EXPECT_EQ(native->status, CandidateStatus::kUnsupported) << name;
    EXPECT_NE(native->reason.find("needs block-scaled FP4 tensor-core MMA"), std::string::npos) << native->reason;
    EXPECT_NE(native->reason.find(arch), std::string::npos) << native->reason;
    const CandidateReport* cpu = s.candidate("cpu");
    ASSERT_NE(cpu, nullptr);
    EXPECT_EQ(cpu->status, CandidateStatus::kUnsupported) << name;
  }
}

TEST(GemmW4a4Selection, SupportedOnBlackwellWithItsMachineCode) {
  for (const std::string name : {"b200", "rtx-pro-6000"}) {
    const Selection s = select_on(name, kFullImage);
    EXPECT_EQ(s.chosen, "fp4-native") << name;
    const CandidateReport* native = s.candidate("fp4-native");
    ASSERT_NE(native, nullptr);
    EXPECT_EQ(native->status, CandidateStatus::kNotTested) << name << ": " << native->reason;
    const CandidateReport* cpu = s.candidate("cpu");
    ASSERT_NE(cpu, nullptr);
    EXPECT_EQ(cpu->status, CandidateStatus::kUnsupported) << name;
  }
}

TEST(GemmW4a4Selection, UnsupportedWhenTheBinaryLacksTheArchitecture) {
  const Selection pro = select_on("rtx-pro-6000", kNoSm120Image);
  EXPECT_TRUE(pro.chosen.empty());
  const CandidateReport* native = pro.candidate("fp4-native");
  ASSERT_NE(native, nullptr);
  EXPECT_EQ(native->status, CandidateStatus::kUnsupported);
  EXPECT_NE(native->reason.find("no machine code for sm_120"), std::string::npos) << native->reason;
  // The same image still serves a B200 (sm_100a).
  EXPECT_EQ(select_on("b200", kNoSm120Image).chosen, "fp4-native");
}

TEST(GemmW4a4Selection, ShapesOutsideCublasLtAlignment) {
  const std::vector<SelfTestCase> odd_k = {{"M=1 N=64 K=48", {1, 64, 48}}};
  const Selection with_odd_k = select_on("b200", kFullImage, odd_k);
  const CandidateReport* k = with_odd_k.candidate("fp4-native");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->status, CandidateStatus::kUnsupported);
  EXPECT_NE(k->reason.find("K=48 is not a multiple of 32"), std::string::npos) << k->reason;
  const std::vector<SelfTestCase> odd_n = {{"M=1 N=12 K=64", {1, 12, 64}}};
  const Selection with_odd_n = select_on("b200", kFullImage, odd_n);
  const CandidateReport* n = with_odd_n.candidate("fp4-native");
  ASSERT_NE(n, nullptr);
  EXPECT_EQ(n->status, CandidateStatus::kUnsupported);
  EXPECT_NE(n->reason.find("N=12 is not a multiple of 8"), std::string::npos) << n->reason;
}

}  // namespace
}  // namespace tern
