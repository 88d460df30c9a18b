// Device descriptions, architecture features and binary compatibility, checked against the CUDA programming
// guide's rules (arch-specific "a" targets run on exactly one architecture; SASS is compatible within a major
// version upwards; PTX is JIT-compiled for newer targets) and the vendors' published per-block shared memory.
#include "ops/device.h"

#include <gtest/gtest.h>

namespace tern {
namespace {

TEST(Device, SimulatedDevicesCarryPublishedLimits) {
  EXPECT_EQ(simulated_device("h200")->smem_per_block_optin, 227 * 1024);
  EXPECT_EQ(simulated_device("b200")->smem_per_block_optin, 227 * 1024);
  EXPECT_EQ(simulated_device("rtx-pro-6000")->smem_per_block_optin, 101376);
  EXPECT_EQ(simulated_device("rtx-4090")->smem_per_block_optin, 101376);
  EXPECT_EQ(simulated_device("rtx-pro-6000")->arch(), "sm_120");
  EXPECT_EQ(simulated_device("h200")->arch(), "sm_90");
  auto bad = simulated_device("tpu");
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("rtx-pro-6000"), std::string::npos);
}

TEST(Device, FeaturesAreDecidedPerArchitectureNotByThreshold) {
  EXPECT_TRUE(arch_features(9, 0).wgmma);
  EXPECT_FALSE(arch_features(10, 0).wgmma);   // wgmma is sm_90a only
  EXPECT_FALSE(arch_features(12, 0).wgmma);
  EXPECT_TRUE(arch_features(10, 0).tcgen05);
  EXPECT_FALSE(arch_features(12, 0).tcgen05);  // consumer Blackwell has no tcgen05
  EXPECT_TRUE(arch_features(12, 0).fp4_block_scaled_mma);
  EXPECT_FALSE(arch_features(9, 0).fp4_block_scaled_mma);  // Hopper: NVFP4 runs weight-only
  EXPECT_FALSE(arch_features(8, 9).tma);
  const ArchFeatures future = arch_features(13, 0);  // unknown: portable kernels only
  EXPECT_FALSE(future.wgmma || future.tcgen05 || future.fp4_block_scaled_mma || future.tma);
}

TEST(Device, BinaryWithoutSm120CodeRefusesSm120) {
  const BinaryImage hopper_only{.sass = {"sm_90a"}, .ptx = {"compute_90a"}};
  const DeviceDescription rtx = *simulated_device("rtx-pro-6000");
  const std::string why = binary_can_run(hopper_only, rtx);
  EXPECT_NE(why.find("no machine code for sm_120"), std::string::npos) << why;
  EXPECT_EQ(binary_can_run(hopper_only, *simulated_device("h200")), "");
  // The default build's targets.
  const BinaryImage tern_default{.sass = {"sm_90a", "sm_100a", "sm_120a"}, .ptx = {"compute_90a", "compute_100a", "compute_120a"}};
  for (const char* name : {"h200", "b200", "rtx-pro-6000"}) {
    EXPECT_EQ(binary_can_run(tern_default, *simulated_device(name)), "") << name;
  }
  EXPECT_NE(binary_can_run(tern_default, *simulated_device("rtx-4090")), "");  // no sm_89 code, no portable PTX
  // Portable PTX can be compiled by the driver for newer GPUs; SASS only runs within its major version.
  EXPECT_EQ(binary_can_run({.sass = {}, .ptx = {"compute_80"}}, *simulated_device("rtx-pro-6000")), "");
  EXPECT_NE(binary_can_run({.sass = {"sm_80"}, .ptx = {}}, *simulated_device("h200")), "");
  EXPECT_EQ(binary_can_run({.sass = {"sm_80"}, .ptx = {}}, *simulated_device("rtx-4090")), "");  // 8.9 >= 8.0
  EXPECT_NE(binary_can_run({.sass = {"sm_100a"}, .ptx = {}}, *simulated_device("rtx-pro-6000")), "");
  EXPECT_NE(binary_can_run(tern_default, cpu_device_describe()), "");
}

}  // namespace
}  // namespace tern
