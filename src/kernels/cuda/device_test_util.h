// Host <-> device copies for the kernel tests (tests only; the op harnesses' stream-ordered upload is
// ops/cuda_util.h cuda_upload).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"

namespace tern::cuda_test {

// A host vector in a new device buffer of at least min_bytes (so an empty vector still has a valid pointer), copied
// synchronously.
template <class T>
DeviceBuffer upload(const std::vector<T>& host, size_t min_bytes = 16) {
  DeviceBuffer b(std::max<size_t>(host.size() * sizeof(T), min_bytes));
  if (!host.empty()) b.upload(host.data(), host.size() * sizeof(T));
  return b;
}

// The first `count` elements of a device buffer, copied synchronously.
template <class T>
std::vector<T> download(const DeviceBuffer& b, size_t count) {
  std::vector<T> host(count);
  TERN_CUDA_CHECK(cudaMemcpy(host.data(), b.data(), count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

}  // namespace tern::cuda_test
