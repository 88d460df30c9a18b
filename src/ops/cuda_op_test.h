// The set-up every CUDA op test shares (label gpu): the CUDA devices, a context on device 0, and a registry holding
// the op's CPU implementation (its reference) and its CUDA implementations on that context.
//
//   class CudaGdnOps : public CudaOpTest<gdn_register_cpu, gdn_register_cuda> {};
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/device.h"
#include "ops/gemm_cuda.h"
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

}  // namespace tern
