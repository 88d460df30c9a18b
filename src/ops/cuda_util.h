// The CUDA side of the op harnesses, shared by every op's CUDA implementations (built only with CUDA): the devices
// present and what this binary can run on them, uploads, and the timed runs every CUDA implementation goes through.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/device.h"
#include "ops/device.h"
#include "ops/registry.h"

namespace tern {

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

}  // namespace tern
