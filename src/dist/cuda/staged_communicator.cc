#include "dist/cuda/staged_communicator.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <vector>

#include "core/formats.h"

namespace tern {
namespace {

Expected<void> check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) return make_error("{}: CUDA error {}", what, cudaGetErrorString(status));
  return {};
}

class StagedCommunicator final : public DeviceCommunicator {
 public:
  explicit StagedCommunicator(Communicator& host) : host_(host) {}
  int rank() const override { return host_.rank(); }
  int world() const override { return host_.world(); }
  std::string describe() const override { return fmt::format("staged through the host over {}", host_.describe()); }
  bool graph_capturable() const override { return false; }

  Expected<void> all_reduce_sum_bf16(uint16_t* data, size_t n, void* stream) override {
    TERN_TRY(download(data, n, stream, "all_reduce_sum_bf16"));
    TERN_TRY(host_.all_reduce_sum(values_));
    return upload(data, values_, stream, "all_reduce_sum_bf16");
  }

  Expected<void> all_gather_bf16(const uint16_t* mine, uint16_t* all, size_t n, void* stream) override {
    TERN_TRY(download(mine, n, stream, "all_gather_bf16"));
    gathered_.assign(n * static_cast<size_t>(world()), 0.0f);
    TERN_TRY(host_.all_gather(values_, gathered_));
    return upload(all, gathered_, stream, "all_gather_bf16");
  }

 private:
  Expected<void> download(const uint16_t* data, size_t n, void* stream, const char* what) {
    auto s = static_cast<cudaStream_t>(stream);
    bits_.resize(n);
    TERN_TRY(check(cudaMemcpyAsync(bits_.data(), data, n * 2, cudaMemcpyDeviceToHost, s), what));
    TERN_TRY(check(cudaStreamSynchronize(s), what));
    values_.resize(n);
    bf16_to_float(bits_, values_);
    return {};
  }
  Expected<void> upload(uint16_t* data, const std::vector<float>& values, void* stream, const char* what) {
    auto s = static_cast<cudaStream_t>(stream);
    bits_.resize(values.size());
    for (size_t i = 0; i < values.size(); ++i) bits_[i] = float_to_bf16(values[i]);
    TERN_TRY(check(cudaMemcpyAsync(data, bits_.data(), bits_.size() * 2, cudaMemcpyHostToDevice, s), what));
    // The host copy is reused by the next collective: wait until it is on the device.
    return check(cudaStreamSynchronize(s), what);
  }

  Communicator& host_;
  std::vector<uint16_t> bits_;
  std::vector<float> values_, gathered_;
};

}  // namespace

std::unique_ptr<DeviceCommunicator> staged_device_communicator(Communicator& host) {
  return std::make_unique<StagedCommunicator>(host);
}

}  // namespace tern
