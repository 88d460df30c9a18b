#include "kernels/cuda/library_versions.h"

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

namespace tern {
namespace {

// CUDA encodes 13.0 as 13000.
std::string cuda_version(int v) {
  return fmt::format("{}.{}", v / 1000, v % 1000 / 10);
}
// cuBLAS encodes 13.1.0 as 130100.
std::string cublas_version(size_t v) {
  return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

}  // namespace

std::vector<LibraryVersion> cuda_library_versions() {
  int runtime = 0, driver = 0;
  const bool runtime_ok = cudaRuntimeGetVersion(&runtime) == cudaSuccess;
  const bool driver_ok = cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0;  // 0: no driver installed
  (void)cudaGetLastError();
  return {{"cuda_runtime", "CUDA runtime", runtime_ok ? cuda_version(runtime) : "", cuda_version(CUDART_VERSION)},
          {"cuda_driver", "CUDA driver", driver_ok ? cuda_version(driver) : "", ""},
          {"cublaslt", "cuBLASLt", cublas_version(cublasLtGetVersion()), cublas_version(CUBLAS_VERSION)}};
}

}  // namespace tern
