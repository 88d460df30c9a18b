// The programmatic-launch probe of launch.cuh.
#include "kernels/cuda/launch.cuh"

#include "kernels/cuda/ptx.cuh"

namespace tern {
namespace {

__global__ void probe_first_kernel(int* p) {
  ptx::grid_dependency_begin();
  p[0] = 41;
}

__global__ void probe_second_kernel(int* p) {
  ptx::grid_dependency_begin();
  p[1] = p[0] + 1;  // 42 only if the wait ordered this read after the first kernel's write
}

}  // namespace

bool programmatic_launch_probe(DeviceContext& ctx) {
  const bool was = ctx.programmatic_launch();
  ctx.set_programmatic_launch(true);
  DeviceBuffer buf(2 * sizeof(int));
  buf.fill(0);
  launch_kernel(ctx, probe_first_kernel, dim3(1), dim3(32), 0, buf.as<int>());
  launch_kernel(ctx, probe_second_kernel, dim3(1), dim3(32), 0, buf.as<int>());
  int host[2] = {0, 0};
  bool ok = cudaGetLastError() == cudaSuccess && cudaStreamSynchronize(ctx.stream()) == cudaSuccess &&
            cudaMemcpy(host, buf.data(), sizeof(host), cudaMemcpyDeviceToHost) == cudaSuccess && host[1] == 42;
  if (!ok) (void)cudaGetLastError();
  ctx.set_programmatic_launch(was);
  return ok;
}

}  // namespace tern
