// Fail-fast checks for CUDA runtime calls: print file:line, the call and the error's name, then abort. Used for
// calls that cannot fail on user input (a failure means a broken device or a bug).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define TERN_CUDA_CHECK(call)                                                                              \
  do {                                                                                                     \
    const cudaError_t tern_cuda_status_ = (call);                                                          \
    if (tern_cuda_status_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d: CUDA call failed: %s: %s (%s)\n", __FILE__, __LINE__, #call,            \
                   cudaGetErrorName(tern_cuda_status_), cudaGetErrorString(tern_cuda_status_));            \
      std::abort();                                                                                        \
    }                                                                                                      \
  } while (0)

// After a kernel launch: catches bad launch configurations at once.
#define TERN_CUDA_CHECK_LAUNCH() TERN_CUDA_CHECK(cudaGetLastError())
