// The W4A4 NVFP4 GEMM op of the registry, "gemm_nvfp4_w4a4": y[M, N] = dequant(quant_act(x)) . dequant(W)^T, the
// semantics of a ModelOpt NVFP4 checkpoint on GPUs with FP4 tensor cores (docs/model-specs.md §1.5): x is
// quantized per 16-element block with the layer's input_scale (core/nvfp4.h nvfp4_quantize_activation_row), W is
// the checkpoint's NVFP4 weight. A case's dims are {M, N, K}. The harness draws the gemm_nvfp4 inputs and calibrates
// input_scale on the case's activations as ModelOpt does, amax / (6 * 448); the reference is an fp64 product of the
// fake-quantized activations and the dequantized weight.
//
// Implementations: "cpu" (layers/linear.h with set_input_quantization, the CPU model's W4A4 path) and, in CUDA builds,
// "fp4-native" (cuBLASLt block-scaled FP4, kernels/cuda/gemm/gemm_nvfp4_native.h), which needs FP4 tensor cores: on
// sm_90 this op has no CUDA implementation, and GPUs without FP4 run NVFP4 layers through gemm_nvfp4 (W4A16) instead.
#pragma once

#include <functional>
#include <string>

#include "core/error.h"
#include "ops/device.h"
#include "ops/gemm_op.h"
#include "ops/registry.h"

namespace tern {

struct GemmW4a4Inputs : GemmInputs {
  float input_scale = 1.0f;  // the layer's input_scale = amax(x) / (6 * 448)
};

// Adds the harness and the CPU implementation ("cpu").
Expected<void> gemm_w4a4_register_cpu(Registry& registry);

// Why "fp4-native" cannot run a case on a device with a binary holding `image` ("" when it can): it needs a CUDA
// device whose architecture has block-scaled FP4 MMA, machine code (or PTX) for that architecture in the binary
// (the activation quantizer is ours), and the case's shape within cuBLASLt's FP4 alignment (K a multiple of 32,
// N a multiple of 8).
std::string gemm_w4a4_native_unsupported_reason(const DeviceDescription& device, const SelfTestCase& c,
                                                const BinaryImage& image);

// The "fp4-native" implementation's declaration around a `run` function; the CUDA registration passes the real run
// and this binary's image, CPU tests of selection a stand-in.
Implementation gemm_w4a4_native_implementation(BinaryImage image,
                                               std::function<Expected<RunOutput>(const OpInputs&)> run);

}  // namespace tern
