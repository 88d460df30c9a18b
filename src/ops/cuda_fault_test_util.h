// For the GPU tests' fault tables: the all-zeros fault class. A kernel runs as usual, but its outputs come back as
// zeros, as from a kernel whose results went to the wrong buffer over an output someone had cleared. Inside a
// launcher's argument tweak (which runs just before the launch, on the launch's stream), redirect() queues a copy of
// an output (or in-place state) to a scratch buffer and a clear of the original, then points the kernel at the
// scratch copy: the kernel reads what it would have read and writes where nobody looks.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <vector>

#include "kernels/cuda/device.h"

namespace tern {

class ZeroedOutputs {
 public:
  explicit ZeroedOutputs(cudaStream_t stream) : stream_(stream) {}

  // `count` elements at `ptr`. The scratch buffers live as long as this object: keep it alive until the launches
  // that use them have finished (the registry runners synchronize before they return).
  template <class T>
  void redirect(T*& ptr, size_t count) {
    const size_t bytes = count * sizeof(T);
    auto& scratch = scratch_.emplace_back(std::make_unique<DeviceBuffer>(std::max<size_t>(bytes, 16)));
    TERN_CUDA_CHECK(cudaMemcpyAsync(scratch->data(), ptr, bytes, cudaMemcpyDeviceToDevice, stream_));
    TERN_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream_));
    ptr = scratch->template as<T>();
  }

 private:
  cudaStream_t stream_;
  std::vector<std::unique_ptr<DeviceBuffer>> scratch_;
};

}  // namespace tern
