// The CUDA implementation of the W4A4 GEMM op (built only with CUDA): "fp4-native", cuBLASLt's block-scaled FP4 GEMM
// with our activation quantizer (kernels/cuda/gemm/gemm_nvfp4_native.h), declared by gemm_w4a4_native_implementation()
// in gemm_w4a4_op.h with this binary's image (cuda_binary_image()).
#pragma once

#include <memory>

#include "core/error.h"
#include "kernels/cuda/device.h"
#include "ops/registry.h"

namespace tern {

// Registers "fp4-native" for gemm_nvfp4_w4a4; it runs on `context`'s device and stream. The harness and the CPU
// implementation come from gemm_w4a4_register_cpu().
Expected<void> gemm_w4a4_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context);

}  // namespace tern
