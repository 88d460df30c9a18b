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

// As launch_kernel, with the grid's blocks grouped into thread-block clusters of `cluster` blocks (dim3(1, 1, 1):
// no clusters). Each grid dimension must be a multiple of the cluster's; portable sizes are at most 8 blocks.
template <class... Params, class... Args>
void launch_kernel_clustered(const DeviceContext& ctx, void (*kernel)(Params...), dim3 grid, dim3 block,
                             size_t smem_bytes, dim3 cluster, Args&&... args) {
  cudaLaunchAttribute attributes[2] = {};
  unsigned count = 0;
  if (ctx.programmatic_launch()) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = cluster.x;
    attributes[count].val.clusterDim.y = cluster.y;
    attributes[count++].val.clusterDim.z = cluster.z;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = ctx.stream();
  config.attrs = attributes;
  config.numAttrs = count;
  (void)cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <class... Params, class... Args>
void launch_kernel(const DeviceContext& ctx, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                   Args&&... args) {
  launch_kernel_clustered(ctx, kernel, grid, block, smem_bytes, dim3(1, 1, 1), std::forward<Args>(args)...);
}

// programmatic_launch_probe (device.h) is implemented in launch.cu.

}  // namespace tern
