#include "ops/cuda_modules.h"

#include <fmt/format.h>

#include "kernels/cuda/module_attributes.h"

namespace tern {

std::vector<CudaModuleReport> cuda_modules_describe() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    return {};
  }
  using Query = cudaError_t (*)(cudaFuncAttributes*);
  const std::pair<const char*, Query> modules[] = {{"gemm_nvfp4_w4a16", gemm_nvfp4_module_attributes},
                                                   {"gemm_fp8_w8a16", gemm_fp8_module_attributes},
                                                   {"elementwise", elementwise_module_attributes},
                                                   {"attention_prepare", attention_prepare_module_attributes},
                                                   {"attention_decode", attention_decode_module_attributes},
                                                   {"attention_prefill", attention_prefill_module_attributes},
                                                   {"attention_prefill_sm90", attention_prefill_sm90_module_attributes},
                                                   {"gated_delta", gated_delta_module_attributes},
                                                   {"moe_route", moe_route_module_attributes},
                                                   {"moe_gemm", moe_gemm_module_attributes},
                                                   {"moe_gemm_decode", moe_gemm_decode_module_attributes},
                                                   {"moe_gemm_prefill_sm90", moe_gemm_prefill_sm90_module_attributes},
                                                   {"sampling", sampling_module_attributes},
                                                   {"sampling_partials", sampling_partials_module_attributes},
                                                   {"gemv_bf16", gemv_bf16_module_attributes},
                                                   {"mla", mla_module_attributes},
                                                   {"mla_indexer", mla_indexer_module_attributes}};
  std::vector<CudaModuleReport> out;
  for (const auto& [name, query] : modules) {
    cudaFuncAttributes a{};
    const cudaError_t status = query(&a);
    CudaModuleReport r{.module = name};
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      r.detail = fmt::format("no code this device can run ({})", cudaGetErrorName(status));
    } else {
      r.runs = true;
      r.detail = fmt::format("sm_{} machine code (PTX {}.{}), {} registers per thread", a.binaryVersion,
                             a.ptxVersion / 10, a.ptxVersion % 10, a.numRegs);
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace tern
