// The CUDA implementations of the GEMM ops (built only with CUDA): "cublaslt" and "gemv" (the decode GEMV where
// gemv_bf16_preferred holds, cuBLASLt elsewhere) for gemm_bf16, "w4a16" for gemm_nvfp4 and "cuda" (the GEMV with its
// fused RMSNorm) for rms_norm_gemv, run through the same harnesses and verdicts as the CPU ones. The helpers every
// op's CUDA implementations share (uploads, timed runs, the devices) are in ops/cuda_util.h.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <memory>

#include "core/error.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/gemv/gemv_bf16.h"
#include "ops/registry.h"

namespace tern {

struct GemmInputs;
struct RmsNormGemvInputs;

// A GEMM case's inputs on the device (bf16 activations; the weight in whichever form the case has).
struct GemmDeviceInputs {
  DeviceBuffer x, w_bf16, w_packed, w_scales, w_row_scales;
};
GemmDeviceInputs gemm_upload(const GemmInputs& inputs, cudaStream_t stream);

// Adjusts the fused kernel's arguments before each launch (the GPU tests inject faults that way).
using RmsNormGemvTweak = std::function<void(GemmBf16Args&, GemvNormArgs&)>;

// Uploads an rms_norm_gemv case and times gemv_bf16_rmsnorm into one poisoned bf16 buffer laid out as the harness's
// output: h_out at 0 (with a residual), x_out after it, y (ldy = N) after x_out; returns it widened to float.
Expected<RunOutput> rms_norm_gemv_cuda_run(const DeviceContext& ctx, const RmsNormGemvInputs& inputs,
                                           const RmsNormGemvTweak& tweak = {});

// Registers the implementations; they run on `context`'s device and stream.
Expected<void> gemm_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context);

}  // namespace tern
