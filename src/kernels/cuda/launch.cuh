// Kernel launches on a DeviceContext's stream, with programmatic dependent launch while the context has it on
// (DeviceContext::programmatic_launch): the kernel may then be scheduled while the stream's previous kernel is still
// running, which hides the launch and the block scheduling of a short kernel behind the tail of the one before.
// Every block of a kernel launched here calls ptx::grid_dependency_wait() (ptx.cuh) before it reads or writes memory
// that any kernel writes, and before it can exit; ptx::grid_dependency_begin() at the top does so. Errors
// surface through cudaGetLastError, as for <<<>>> (TERN_CUDA_CHECK_LAUNCH). Include from .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda/device.h"

namespace tern {

template <class... Params, class... Args>
void launch_kernel(const DeviceContext& ctx, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                   Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = ctx.stream();
  config.attrs = &attribute;
  config.numAttrs = ctx.programmatic_launch() ? 1 : 0;
  (void)cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// programmatic_launch_probe (device.h) is implemented in launch.cu.

}  // namespace tern
