// The CUDA implementations of the GEMM ops (built only with CUDA): "cublaslt" and "gemv" (the decode GEMV up to
// kGemvPreferredMaxRows rows, cuBLASLt above) for gemm_bf16, "w4a16" for gemm_nvfp4 and "cuda" (the GEMV with its
// fused RMSNorm) for rms_norm_gemv, run through the same harnesses and verdicts as the CPU ones.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/gemv_bf16.h"
#include "ops/device.h"
#include "ops/registry.h"

namespace tern {

struct GemmInputs;
struct RmsNormGemvInputs;

// The CUDA devices present (empty when there is no driver or no GPU).
std::vector<DeviceDescription> cuda_devices_describe();

// What this binary holds: the CUDA architectures it was compiled for (machine code and PTX for each).
BinaryImage cuda_binary_image();

// "" when an implementation compiled into this binary can run on `device`: a CUDA device this binary holds code
// for; else the reason, whatever the case. The CUDA implementations of every op start their requirement check with
// it (its signature is that of Implementation::unsupported_reason).
std::string cuda_unsupported_reason(const DeviceDescription& device, const SelfTestCase& any_case = {});

// A host vector in a new device buffer (at least 16 bytes, so an empty input still has a valid pointer), queued on
// `stream`; the caller synchronizes before the host vector goes away.
template <class T>
DeviceBuffer cuda_upload(const std::vector<T>& host, cudaStream_t stream) {
  DeviceBuffer b(std::max<size_t>(host.size() * sizeof(T), 16));
  if (!host.empty()) {
    TERN_CUDA_CHECK(cudaMemcpyAsync(b.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  return b;
}

// A GEMM case's inputs on the device (bf16 activations; the weight in whichever form the case has).
struct GemmDeviceInputs {
  DeviceBuffer x, w_bf16, w_packed, w_scales;
};
GemmDeviceInputs gemm_upload(const GemmInputs& inputs, cudaStream_t stream);

// Seconds of the fastest of 5 calls of `launch` after one warm-up, timed with events on ctx.stream(), each after
// the L2 is overwritten. `prepare` (poisoning outputs, restoring state) is queued before each call, outside the
// timed span. A launch error ends it with that error; a failed kernel with its CUDA error.
Expected<double> cuda_time_best(const DeviceContext& ctx, const std::function<void()>& prepare,
                                const std::function<Expected<void>()>& launch);

// Runs `launch` (which writes a bf16 [m, n] output) once to warm up and then several times on ctx's stream; returns
// the last output widened to float and the fastest time. The output is poisoned before every run, so elements a
// launch skips keep the poison pattern; a launch error or a failed kernel is an error.
Expected<RunOutput> cuda_run_timed(const DeviceContext& ctx, int64_t m, int64_t n,
                                   const std::function<Expected<void>(uint16_t* y)>& launch);

// Adjusts the fused kernel's arguments before each launch (the GPU tests inject faults that way).
using RmsNormGemvTweak = std::function<void(GemmBf16Args&, GemvNormArgs&)>;

// Uploads an rms_norm_gemv case and times gemv_bf16_rmsnorm into one poisoned bf16 buffer laid out as the harness's
// output: h_out at 0 (with a residual), x_out after it, y (ldy = N) after x_out; returns it widened to float.
Expected<RunOutput> rms_norm_gemv_cuda_run(const DeviceContext& ctx, const RmsNormGemvInputs& inputs,
                                           const RmsNormGemvTweak& tweak = {});

// Registers the implementations; they run on `context`'s device and stream.
Expected<void> gemm_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context);

}  // namespace tern
