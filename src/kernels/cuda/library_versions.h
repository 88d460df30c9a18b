// The CUDA libraries this process runs with, for `tern --version` (core/build_info.h): their versions decide which
// kernels run, and the ones loaded at run time can differ from the headers tern was compiled against.
#pragma once

#include <vector>

#include "core/build_info.h"  // LibraryVersion only (a plain struct: nothing to link)

namespace tern {

// The CUDA runtime (cudaRuntimeGetVersion), the driver (cudaDriverGetVersion: the newest CUDA it supports; "none
// found" without a driver) and cuBLASLt (cublasLtGetVersion), each beside the version of its headers. Creates no
// CUDA context and touches no device, so it answers at once on a machine without a GPU or driver.
// NCCL goes here when tern links it (ncclGetVersion beside NCCL_VERSION_CODE).
std::vector<LibraryVersion> cuda_library_versions();

}  // namespace tern
