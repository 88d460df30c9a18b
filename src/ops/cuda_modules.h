// Per kernel module, what this binary holds for the current CUDA device (kernels/cuda/module_attributes.h), for
// `tern doctor`: machine code for the device's architecture, PTX the driver compiled, or nothing it can run.
#pragma once

#include <string>
#include <vector>

namespace tern {

struct CudaModuleReport {
  std::string module;
  bool runs = false;
  std::string detail;  // "sm_90 machine code (PTX 9.0), 64 registers" or the CUDA error
};

// Empty without a CUDA device. Queries the current device (cudaSetDevice first to pick another).
std::vector<CudaModuleReport> cuda_modules_describe();

}  // namespace tern
