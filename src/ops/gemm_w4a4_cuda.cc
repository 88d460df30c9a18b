#include "ops/gemm_w4a4_cuda.h"

#include <vector>

#include "kernels/cuda/gemm/gemm_nvfp4_native.h"
#include "kernels/cuda/nvfp4/nvfp4_scale_layout.h"
#include "ops/cuda_util.h"
#include "ops/gemm_cuda.h"
#include "ops/gemm_w4a4_op.h"

namespace tern {
namespace {

// A case's extra device state: the weight's scales re-laid for cuBLASLt (as a model does once at upload), the
// input_scale for the quantizer, and the quantized activations' workspace.
struct NativeDeviceInputs {
  DeviceBuffer scales_tiled, input_scale, workspace;
};

NativeDeviceInputs native_upload(const GemmW4a4Inputs& in, cudaStream_t stream) {
  const std::vector<uint8_t> tiled = nvfp4_scales_to_tiled(in.w_scales, in.n, in.k);
  NativeDeviceInputs d{.scales_tiled = DeviceBuffer(tiled.size()),
                       .input_scale = DeviceBuffer(sizeof(float)),
                       .workspace = DeviceBuffer(gemm_nvfp4_native_workspace_bytes(in.m, in.k))};
  TERN_CUDA_CHECK(cudaMemcpyAsync(d.scales_tiled.data(), tiled.data(), tiled.size(), cudaMemcpyHostToDevice, stream));
  TERN_CUDA_CHECK(
      cudaMemcpyAsync(d.input_scale.data(), &in.input_scale, sizeof(float), cudaMemcpyHostToDevice, stream));
  TERN_CUDA_CHECK(cudaStreamSynchronize(stream));  // the host sources above are about to go away
  return d;
}

}  // namespace

Expected<void> gemm_w4a4_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context) {
  return registry.add(
      gemm_w4a4_native_implementation(cuda_binary_image(), [context](const OpInputs& base) -> Expected<RunOutput> {
        const auto& in = static_cast<const GemmW4a4Inputs&>(base);
        const GemmDeviceInputs d = gemm_upload(in, context->stream());
        const NativeDeviceInputs native = native_upload(in, context->stream());
        const GemmNvfp4NativeArgs args{.x = d.x.as<uint16_t>(),
                                       .w = {.packed = d.w_packed.as<uint8_t>(),
                                             .scales_tiled = native.scales_tiled.as<uint8_t>(),
                                             .global_scale = in.w_global_scale,
                                             .n = in.n,
                                             .k = in.k},
                                       .input_scale = in.input_scale,
                                       .input_scale_device = native.input_scale.as<float>(),
                                       .m = in.m,
                                       .workspace = native.workspace.data(),
                                       .workspace_bytes = native.workspace.size_bytes()};
        return cuda_run_timed(*context, in.m, in.n, [&](uint16_t* y) {
          GemmNvfp4NativeArgs call = args;
          call.y = y;
          return gemm_nvfp4_native(*context, call);
        });
      }));
}

}  // namespace tern
