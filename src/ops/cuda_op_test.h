// The set-up every CUDA op test shares (label gpu): the CUDA devices, a context on device 0, and a registry holding
// the op's CPU implementation (its reference) and its CUDA implementations on that context.
//
//   class CudaGdnOps : public CudaOpTest<gdn_register_cpu, gdn_register_cuda> {};
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/device.h"
#include "ops/cuda_util.h"
#include "ops/registry.h"

namespace tern {

using RegisterCpuFn = Expected<void> (*)(Registry&);
using RegisterCudaFn = Expected<void> (*)(Registry&, std::shared_ptr<DeviceContext>);

template <RegisterCpuFn kRegisterCpu, RegisterCudaFn kRegisterCuda>
class CudaOpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    devices_ = cuda_devices_describe();
    ASSERT_FALSE(devices_.empty()) << "no CUDA device";
    context_ = std::make_shared<DeviceContext>(0);
    ASSERT_TRUE(kRegisterCpu(registry_).has_value());
    ASSERT_TRUE(kRegisterCuda(registry_, context_).has_value());
  }

  std::vector<DeviceDescription> devices_;
  std::shared_ptr<DeviceContext> context_;
  Registry registry_;
};

// An op whose CUDA implementations are the same work fused into one kernel and as separate kernels: both pass on
// the GPU (with a non-zero error: bf16 equal to fp64 everywhere is suspicious), the faster is chosen, and the CPU
// reference implementation is unsupported there. Prints both timings.
inline void expect_fused_and_separate_pass(const Selection& s, size_t n_cases) {
  for (const char* name : {"fused", "separate"}) {
    const CandidateReport* c = s.candidate(name);
    ASSERT_NE(c, nullptr) << s.op << " " << name;
    EXPECT_EQ(c->status, CandidateStatus::kPassed) << s.op << " " << name << ": " << c->reason;
    EXPECT_GT(c->max_error, 0.0) << s.op << " " << name << ": a bf16 result equal to fp64 everywhere is suspicious";
    std::printf("%s %s: %zu cases, max error %.3g (bound %.3g), %.1f us in all\n", s.op.c_str(), name, n_cases,
                c->max_error, c->bound, c->seconds * 1e6);
  }
  EXPECT_TRUE(s.chosen == "fused" || s.chosen == "separate") << s.op << ": " << s.chosen;
  const CandidateReport* cpu = s.candidate("cpu");
  ASSERT_NE(cpu, nullptr) << s.op;
  EXPECT_EQ(cpu->status, CandidateStatus::kUnsupported) << s.op << ": " << cpu->reason;
}

}  // namespace tern
