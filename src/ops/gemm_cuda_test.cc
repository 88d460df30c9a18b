// The GEMM ops on the GPU through the registry (label gpu): the real implementations pass their self-test on
// model-sized shapes (rms_norm_gemv included), and test-only registrations of broken variants — each one fault
// class — are rejected.
#include "ops/gemm_cuda.h"
#include "ops/cuda_util.h"

#include <gtest/gtest.h>

#include <cstdio>

#include "kernels/cuda/gemm/gemm_bf16.h"
#include "kernels/cuda/gemm/gemm_fp8_w8a16.h"
#include "kernels/cuda/gemm/gemm_nvfp4_w4a16.h"
#include "kernels/cuda/gemv/gemv_bf16.h"
#include "ops/cuda_op_test.h"
#include "ops/gemm_op.h"

namespace tern {
namespace {

struct Fault {
  std::string name;
  std::string expected_reason;
  // Launches a deliberately wrong GEMM (NVFP4, or the BF16 GEMV).
  std::function<Expected<void>(const DeviceContext&, const GemmInputs&, const GemmDeviceInputs&, uint16_t*)> launch;
};

Nvfp4WeightView view_of(const GemmInputs& in, const GemmDeviceInputs& d) {
  return {.packed = d.w_packed.as<uint8_t>(), .scales = d.w_scales.as<uint8_t>(), .global_scale = in.w_global_scale,
          .n = in.n, .k = in.k};
}

std::vector<Fault> nvfp4_faults() {
  auto gemm = [](const DeviceContext& ctx, const GemmInputs&, const GemmDeviceInputs& d, uint16_t* y,
                 Nvfp4WeightView w, int64_t m) {
    return gemm_nvfp4_w4a16(ctx, {.x = d.x.as<uint16_t>(), .w = w, .y = y, .m = m});
  };
  return {
      {"all-zeros", "all zeros",
       [=](auto& ctx, auto& in, auto& d, uint16_t* y) {
         Nvfp4WeightView w = view_of(in, d);
         w.global_scale = 0.0f;
         return gemm(ctx, in, d, y, w, in.m);
       }},
      {"wrong-scale", "exceeds the tolerance",
       [=](auto& ctx, auto& in, auto& d, uint16_t* y) {
         Nvfp4WeightView w = view_of(in, d);
         w.global_scale *= 1.03f;
         return gemm(ctx, in, d, y, w, in.m);
       }},
      {"shifted-block-scales", "exceeds the tolerance",
       [=](auto& ctx, auto& in, auto& d, uint16_t* y) {
         // Every block reads its neighbour's scale (the last wraps to the first).
         std::vector<uint8_t> shifted(in.w_scales.size());
         for (size_t i = 0; i < shifted.size(); ++i) shifted[i] = in.w_scales[(i + 1) % shifted.size()];
         auto scales = std::make_shared<DeviceBuffer>(shifted.size());
         scales->upload(shifted.data(), shifted.size());
         Nvfp4WeightView w = view_of(in, d);
         w.scales = scales->template as<uint8_t>();
         auto status = gemm(ctx, in, d, y, w, in.m);
         TERN_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));  // keep the buffer alive until the kernel is done
         return status;
       }},
      {"skips-the-last-row", "never written",
       [=](auto& ctx, auto& in, auto& d, uint16_t* y) { return gemm(ctx, in, d, y, view_of(in, d), in.m - 1); }},
      {"nan-global-scale", "weight_scale_2 is not finite",
       [=](auto& ctx, auto& in, auto& d, uint16_t* y) {
         Nvfp4WeightView w = view_of(in, d);
         w.global_scale = NAN;
         return gemm(ctx, in, d, y, w, in.m);
       }},
  };
}

// The FP8 W8A16 GEMM called with one argument wrong.
std::vector<Fault> fp8_faults() {
  auto gemm = [](const DeviceContext& ctx, const GemmInputs& in, const GemmDeviceInputs& d, uint16_t* y,
                 const float* row_scales, int64_t m) {
    const Fp8WeightView w{.codes = d.w_packed.as<uint8_t>(), .row_scales = row_scales, .n = in.n, .k = in.k};
    return gemm_fp8_w8a16(ctx, {.x = d.x.as<uint16_t>(), .w = w, .y = y, .m = m});
  };
  return {
      {"scales-off-by-3-percent", "exceeds the tolerance",
       [=](auto& ctx, auto& in, auto& d, uint16_t* y) {
         std::vector<float> scaled(in.w_row_scales);
         for (float& v : scaled) v *= 1.03f;
         auto scales = std::make_shared<DeviceBuffer>(scaled.size() * 4);
         scales->upload(scaled.data(), scaled.size() * 4);
         auto status = gemm(ctx, in, d, y, scales->template as<float>(), in.m);
         TERN_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));  // keep the buffer alive until the kernel is done
         return status;
       }},
      {"skips-the-last-row", "never written",
       [=](auto& ctx, auto& in, auto& d, uint16_t* y) {
         return gemm(ctx, in, d, y, d.w_row_scales.template as<float>(), in.m - 1);
       }},
      {"null-scales", "null pointer",
       [=](auto& ctx, auto& in, auto& d, uint16_t* y) { return gemm(ctx, in, d, y, nullptr, in.m); }},
  };
}

// The BF16 GEMV called with one argument wrong (cases have 1 <= m <= kGemvMaxRows and n >= 2).
std::vector<Fault> gemv_faults() {
  auto gemv = [](const DeviceContext& ctx, const GemmInputs& in, const GemmDeviceInputs& d, uint16_t* y, int64_t m,
                 int64_t n, int64_t k) {
    return gemv_bf16(
        ctx, {.x = d.x.as<uint16_t>(), .w = d.w_bf16.as<uint16_t>(), .y = y, .m = m, .n = n, .k = k, .ldy = in.n});
  };
  return {
      {"gemv-skips-the-last-row", "never written",
       [=](auto& ctx, auto& in, auto& d, uint16_t* y) { return gemv(ctx, in, d, y, in.m - 1, in.n, in.k); }},
      {"gemv-skips-the-last-column", "never written",
       [=](auto& ctx, auto& in, auto& d, uint16_t* y) { return gemv(ctx, in, d, y, in.m, in.n - 1, in.k); }},
      {"gemv-short-k", "exceeds the tolerance",
       [=](auto& ctx, auto& in, auto& d, uint16_t* y) { return gemv(ctx, in, d, y, in.m, in.n, in.k - 8); }},
  };
}

// The fused RMSNorm + GEMV called with one argument wrong (cases have a residual and the zero-centred form).
struct NormGemvFault {
  std::string name;
  std::string expected_reason;
  RmsNormGemvTweak tweak;
};

std::vector<NormGemvFault> norm_gemv_faults() {
  return {
      {"norm-gemv-drops-the-residual", "exceeds the tolerance",
       [](GemmBf16Args&, GemvNormArgs& n) { n.residual = nullptr; }},
      {"norm-gemv-plain-weight", "exceeds the tolerance",
       [](GemmBf16Args&, GemvNormArgs& n) { n.zero_centred = false; }},
      {"norm-gemv-no-x-out", "never written", [](GemmBf16Args&, GemvNormArgs& n) { n.x_out = nullptr; }},
      {"norm-gemv-skips-the-last-column", "never written", [](GemmBf16Args& a, GemvNormArgs&) { a.n -= 1; }},
  };
}

class CudaGemmOps : public CudaOpTest<gemm_register_cpu, gemm_register_cuda> {
 protected:
  // Registers each fault as an implementation of `op` that outranks the real ones.
  void add_faults(const std::string& op, const std::vector<Fault>& faults) {
    for (const Fault& f : faults) {
      ASSERT_TRUE(registry_
                      .add(Implementation{
                          .op = op,
                          .name = f.name,
                          .backend = Backend::kCuda,
                          .priority = 100,
                          .tolerance = {.rel = 1.0 / 256},
                          .run = [this, launch = f.launch](const OpInputs& base) -> Expected<RunOutput> {
                            const auto& in = static_cast<const GemmInputs&>(base);
                            const GemmDeviceInputs d = gemm_upload(in, context_->stream());
                            return cuda_run_timed(*context_, in.m, in.n,
                                                  [&](uint16_t* y) { return launch(*context_, in, d, y); });
                          },
                      })
                      .has_value());
    }
  }

  void add_norm_gemv_faults(const std::vector<NormGemvFault>& faults) {
    for (const NormGemvFault& f : faults) {
      ASSERT_TRUE(registry_
                      .add(Implementation{
                          .op = "rms_norm_gemv",
                          .name = f.name,
                          .backend = Backend::kCuda,
                          .priority = 100,
                          .tolerance = {.rel = 1.0 / 256},
                          .run = [this, tweak = f.tweak](const OpInputs& base) -> Expected<RunOutput> {
                            return rms_norm_gemv_cuda_run(*context_, static_cast<const RmsNormGemvInputs&>(base),
                                                          tweak);
                          },
                      })
                      .has_value());
    }
  }

  // Every fault is a candidate of `s` that failed with its expected reason.
  template <class F>
  static void expect_rejected(const Selection& s, const std::vector<F>& faults) {
    for (const F& f : faults) {
      const CandidateReport* c = s.candidate(f.name);
      ASSERT_NE(c, nullptr) << f.name;
      EXPECT_EQ(c->status, CandidateStatus::kFailed) << f.name;
      EXPECT_NE(c->reason.find(f.expected_reason), std::string::npos) << f.name << ": " << c->reason;
    }
  }
};

TEST_F(CudaGemmOps, RealImplementationsPassOnModelShapes) {
  // Qwen3.5-35B-A3B-like projections and expert sizes at decode and prefill batch sizes.
  const auto cases = gemm_selftest_cases({{4096, 2048}, {2048, 4096}, {1024, 2048}, {2048, 512}}, {1, 8, 200});
  auto nvfp4 = registry_select(registry_, "gemm_nvfp4", devices_[0], cases, {});
  ASSERT_TRUE(nvfp4.has_value()) << nvfp4.error().message;
  EXPECT_EQ(nvfp4->chosen, "w4a16") << nvfp4->candidates.front().reason;
  auto fp8 = registry_select(registry_, "gemm_fp8", devices_[0], cases, {});
  ASSERT_TRUE(fp8.has_value()) << fp8.error().message;
  EXPECT_EQ(fp8->chosen, "w8a16") << fp8->candidates.front().reason;
  auto bf16 = registry_select(registry_, "gemm_bf16", devices_[0], cases, {});
  ASSERT_TRUE(bf16.has_value()) << bf16.error().message;
  // Both pass (the GEMV's cases at M = 1 and 8, cuBLASLt's at 200); the faster over the cases is chosen.
  for (const char* name : {"gemv", "cublaslt"}) {
    const CandidateReport* c = bf16->candidate(name);
    ASSERT_NE(c, nullptr) << name;
    EXPECT_EQ(c->status, CandidateStatus::kPassed) << name << ": " << c->reason;
  }
  EXPECT_TRUE(bf16->chosen == "gemv" || bf16->chosen == "cublaslt") << bf16->chosen;
  for (const Selection* s : {&*nvfp4, &*fp8, &*bf16}) {
    for (const auto& c : s->candidates) {
      if (c.name == "cpu") {
        EXPECT_EQ(c.status, CandidateStatus::kUnsupported);
      }
    }
  }
}

TEST_F(CudaGemmOps, InjectedFaultsAreRejectedOnTheGpu) {
  add_faults("gemm_nvfp4", nvfp4_faults());
  const auto cases = gemm_selftest_cases({{1000, 1024}}, {1, 40});
  auto s = registry_select(registry_, "gemm_nvfp4", devices_[0], cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "w4a16");
  expect_rejected(*s, nvfp4_faults());
}

TEST_F(CudaGemmOps, InjectedFp8FaultsAreRejectedOnTheGpu) {
  add_faults("gemm_fp8", fp8_faults());
  const auto cases = gemm_selftest_cases({{1000, 1040}}, {1, 40, 200});
  auto s = registry_select(registry_, "gemm_fp8", devices_[0], cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "w8a16");
  expect_rejected(*s, fp8_faults());
}

TEST_F(CudaGemmOps, InjectedGemvFaultsAreRejectedOnTheGpu) {
  add_faults("gemm_bf16", gemv_faults());
  const auto cases = gemm_selftest_cases({{1000, 1024}, {37, 4104}}, {1, 5, 8});
  auto s = registry_select(registry_, "gemm_bf16", devices_[0], cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_TRUE(s->chosen == "gemv" || s->chosen == "cublaslt") << s->chosen;
  expect_rejected(*s, gemv_faults());
}

TEST_F(CudaGemmOps, RmsNormGemvPassesOnModelShapes) {
  const std::vector<SelfTestCase> cases = {
      // Qwen3-8B (hidden 4096): qkv after input_layernorm, gate|up after post_attention_layernorm.
      rms_norm_gemv_case(6144, 4096, RmsNormForm::kPlain, true),
      rms_norm_gemv_case(6144, 4096, RmsNormForm::kPlain, false),
      rms_norm_gemv_case(24576, 4096, RmsNormForm::kPlain, true),
      // Qwen3.5 (hidden 2048, zero-centred norms): attention and GDN input projections.
      rms_norm_gemv_case(8192, 2048, RmsNormForm::kZeroCentred, true),
      rms_norm_gemv_case(12352, 2048, RmsNormForm::kZeroCentred, false),
      // An lm_head after the final norm, and a ragged one (a partial column group, an odd chunk count).
      rms_norm_gemv_case(151936, 4096, RmsNormForm::kPlain, true),
      rms_norm_gemv_case(37, 1032, RmsNormForm::kZeroCentred, true),
  };
  auto s = registry_select(registry_, "rms_norm_gemv", devices_[0], cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  expect_fused_and_separate_pass(*s, cases.size());
}

TEST_F(CudaGemmOps, InjectedRmsNormGemvFaultsAreRejectedOnTheGpu) {
  add_norm_gemv_faults(norm_gemv_faults());
  const std::vector<SelfTestCase> cases = {rms_norm_gemv_case(1000, 2048, RmsNormForm::kZeroCentred, true),
                                           rms_norm_gemv_case(37, 4104, RmsNormForm::kZeroCentred, true)};
  auto s = registry_select(registry_, "rms_norm_gemv", devices_[0], cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_TRUE(s->chosen == "fused" || s->chosen == "separate") << s->chosen;
  expect_rejected(*s, norm_gemv_faults());
}

}  // namespace
}  // namespace tern
