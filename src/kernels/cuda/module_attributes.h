// What this binary holds for the current device, module by module: cudaFuncGetAttributes on one kernel of each
// kernel file reports whether the driver found machine code (binaryVersion, e.g. 90 for sm_90) or compilable PTX
// (ptxVersion) for the device, or neither (cudaErrorNoKernelImageForDevice / cudaErrorInvalidDeviceFunction).
// `tern doctor` prints it next to the architectures the build was configured for.
#pragma once

#include <cuda_runtime.h>

namespace tern {

cudaError_t attention_prepare_module_attributes(cudaFuncAttributes* out);
cudaError_t attention_decode_module_attributes(cudaFuncAttributes* out);
cudaError_t attention_prefill_module_attributes(cudaFuncAttributes* out);
cudaError_t elementwise_module_attributes(cudaFuncAttributes* out);
cudaError_t gated_delta_module_attributes(cudaFuncAttributes* out);
cudaError_t moe_route_module_attributes(cudaFuncAttributes* out);
cudaError_t moe_gemm_module_attributes(cudaFuncAttributes* out);  // moe_gemm_prefill.cu, reported as moe_gemm
cudaError_t moe_gemm_decode_module_attributes(cudaFuncAttributes* out);
cudaError_t moe_gemm_prefill_sm90_module_attributes(cudaFuncAttributes* out);
cudaError_t attention_prefill_sm90_module_attributes(cudaFuncAttributes* out);
cudaError_t sampling_module_attributes(cudaFuncAttributes* out);
cudaError_t sampling_partials_module_attributes(cudaFuncAttributes* out);
cudaError_t gemm_nvfp4_module_attributes(cudaFuncAttributes* out);
cudaError_t gemm_fp8_module_attributes(cudaFuncAttributes* out);
cudaError_t gemv_bf16_module_attributes(cudaFuncAttributes* out);
cudaError_t mla_module_attributes(cudaFuncAttributes* out);
cudaError_t mla_indexer_module_attributes(cudaFuncAttributes* out);

}  // namespace tern
