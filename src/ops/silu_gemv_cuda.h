// The CUDA implementation of silu_mul_gemv (built only with CUDA): "cuda", the BF16 GEMV with the SiLU-and-mul
// prologue (gemv_bf16_silu_mul), run through the same harness and verdicts as the CPU one.
#pragma once

#include <memory>

#include "core/error.h"
#include "kernels/cuda/device.h"
#include "ops/registry.h"

namespace tern {

// Registers the implementation; it runs on `context`'s device and stream.
Expected<void> silu_gemv_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context);

}  // namespace tern
