// Selection of gemm_nvfp4_w4a4 on a simulated device, for tests (gemm_w4a4_op_test, selftest_plan_test): the CPU
// implementation and "fp4-native" for a binary holding `image`, selected with --selftest off, so nothing runs: a
// supported candidate is "not tested" and chosen, and the stand-in run must never be called.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ops/device.h"
#include "ops/gemm_w4a4_op.h"
#include "ops/registry.h"

namespace tern::w4a4_test {

// A binary with machine code and PTX for sm_90a, sm_100a and sm_120a (what CI builds).
inline const BinaryImage kFullImage{.sass = {"sm_90a", "sm_100a", "sm_120a"},
                                    .ptx = {"compute_90a", "compute_100a", "compute_120a"}};

inline Selection select_on(const std::string& device_name, const BinaryImage& image,
                           const std::vector<SelfTestCase>& cases) {
  Registry r;
  EXPECT_TRUE(gemm_w4a4_register_cpu(r).has_value());
  EXPECT_TRUE(r.add(gemm_w4a4_native_implementation(image, [](const OpInputs&) -> Expected<RunOutput> {
                 ADD_FAILURE() << "a simulated device ran a kernel";
                 return make_error("simulated");
               })).has_value());
  auto device = simulated_device(device_name);
  EXPECT_TRUE(device.has_value()) << device_name;
  if (!device) return Selection{};
  auto s = registry_select(r, "gemm_nvfp4_w4a4", *device, cases, {.mode = SelftestMode::kOff});
  EXPECT_TRUE(s.has_value()) << (s ? "" : s.error().message);
  return s ? *s : Selection{};
}

}  // namespace tern::w4a4_test
