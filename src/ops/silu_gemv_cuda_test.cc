// silu_mul_gemv on the GPU through the registry (label gpu): the CUDA implementation passes its self-test on the
// down projections it serves, the CPU one is unsupported there, and deliberately wrong calls of the kernel are
// rejected.
#include "ops/silu_gemv_cuda.h"

#include <gtest/gtest.h>

#include <cstdio>

#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda/gemv/gemv_bf16.h"
#include "ops/cuda_op_test.h"
#include "ops/silu_gemv_op.h"

namespace tern {
namespace {

struct Fault {
  std::string name;
  std::string expected_reason;
  // Queues a wrong product of the uploaded gate|up row and W into y.
  std::function<Expected<void>(const DeviceContext&, const SiluGemvInputs&, const uint16_t* gate_up, const uint16_t* w,
                               uint16_t* y)>
      launch;
};

std::vector<Fault> faults() {
  return {
      {"no-silu", "exceeds the tolerance",  // the plain GEMV of the gate half
       [](auto& ctx, auto& in, const uint16_t* x, const uint16_t* w, uint16_t* y) {
         return gemv_bf16(ctx, {.x = x, .w = w, .y = y, .m = 1, .n = in.n, .k = in.k});
       }},
      {"short-k", "exceeds the tolerance",  // up read 8 elements early, the last 8 act elements dropped
       [](auto& ctx, auto& in, const uint16_t* x, const uint16_t* w, uint16_t* y) {
         return gemv_bf16_silu_mul(ctx, {.x = x, .w = w, .y = y, .m = 1, .n = in.n, .k = in.k - 8, .ldy = in.n},
                                   2 * in.k);
       }},
      {"skips-the-last-column", "never written",
       [](auto& ctx, auto& in, const uint16_t* x, const uint16_t* w, uint16_t* y) {
         return gemv_bf16_silu_mul(ctx, {.x = x, .w = w, .y = y, .m = 1, .n = in.n - 1, .k = in.k}, 2 * in.k);
       }},
  };
}

class CudaSiluGemvOps : public CudaOpTest<silu_gemv_register_cpu, silu_gemv_register_cuda> {};

TEST_F(CudaSiluGemvOps, CudaImplementationPassesOnModelShapes) {
  // Qwen3-8B's down_proj (intermediate 12288 -> 4096) and Qwen3.5-35B-A3B's shared-expert down (512 -> 2048), the
  // latter also over a speculative verification's 4 rows and the GEMV's most (8).
  const std::vector<SelfTestCase> cases = {silu_mul_gemv_case(4096, 12288), silu_mul_gemv_case(2048, 512),
                                           silu_mul_gemv_case(2048, 512, 4), silu_mul_gemv_case(2048, 512, 8)};
  auto s = registry_select(registry_, "silu_mul_gemv", devices_[0], cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  expect_fused_and_separate_pass(*s, cases.size());
}

TEST_F(CudaSiluGemvOps, InjectedFaultsAreRejectedOnTheGpu) {
  for (const Fault& f : faults()) {
    ASSERT_TRUE(registry_
                    .add(Implementation{
                        .op = "silu_mul_gemv",
                        .name = f.name,
                        .backend = Backend::kCuda,
                        .priority = 100,
                        .tolerance = {.rel = 1.0 / 128},
                        .run = [this, launch = f.launch](const OpInputs& base) -> Expected<RunOutput> {
                          const auto& in = static_cast<const SiluGemvInputs&>(base);
                          const DeviceBuffer x = cuda_upload(in.gate_up, context_->stream()),
                                             w = cuda_upload(in.w, context_->stream());
                          return cuda_run_timed(*context_, 1, in.n, [&](uint16_t* y) {
                            return launch(*context_, in, x.as<uint16_t>(), w.as<uint16_t>(), y);
                          });
                        },
                    })
                    .has_value());
  }
  const std::vector<SelfTestCase> cases = {silu_mul_gemv_case(1000, 1024), silu_mul_gemv_case(37, 4104)};
  auto s = registry_select(registry_, "silu_mul_gemv", devices_[0], cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_TRUE(s->chosen == "fused" || s->chosen == "separate") << s->chosen;
  for (const Fault& f : faults()) {
    const CandidateReport* c = s->candidate(f.name);
    ASSERT_NE(c, nullptr) << f.name;
    EXPECT_EQ(c->status, CandidateStatus::kFailed) << f.name;
    EXPECT_NE(c->reason.find(f.expected_reason), std::string::npos) << f.name << ": " << c->reason;
  }
}

}  // namespace
}  // namespace tern
