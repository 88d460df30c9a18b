#include "kernels/cuda/device.h"

#include <algorithm>
#include <utility>

namespace tern {

DeviceProps device_query_props(int device) {
  cudaDeviceProp p{};
  TERN_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  DeviceProps out;
  out.device = device;
  out.name = p.name;
  out.cc_major = p.major;
  out.cc_minor = p.minor;
  out.num_sms = p.multiProcessorCount;
  out.shared_mem_per_block = p.sharedMemPerBlock;
  out.shared_mem_per_block_optin = p.sharedMemPerBlockOptin;
  out.shared_mem_per_sm = p.sharedMemPerMultiprocessor;
  out.regs_per_sm = p.regsPerMultiprocessor;
  out.regs_per_block = p.regsPerBlock;
  out.max_threads_per_sm = p.maxThreadsPerMultiProcessor;
  out.l2_bytes = p.l2CacheSize;
  out.global_mem_bytes = p.totalGlobalMem;
  out.memory_bus_bits = p.memoryBusWidth;
  // CUDA 13 removed the clock fields from cudaDeviceProp; they remain device attributes.
  TERN_CUDA_CHECK(cudaDeviceGetAttribute(&out.memory_clock_khz, cudaDevAttrMemoryClockRate, device));
  TERN_CUDA_CHECK(cudaDeviceGetAttribute(&out.sm_clock_khz, cudaDevAttrClockRate, device));
  return out;
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes > 0) TERN_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
}

bool DeviceBuffer::try_allocate(size_t bytes, DeviceBuffer& out) {
  out = DeviceBuffer();
  if (bytes == 0) return true;
  void* ptr = nullptr;
  if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free allocation error
    return false;
  }
  out.ptr_ = ptr;
  out.bytes_ = bytes;
  return true;
}

void DeviceBuffer::fill(uint8_t byte) const {
  if (bytes_ == 0) return;
  TERN_CUDA_CHECK(cudaMemset(ptr_, byte, bytes_));
  TERN_CUDA_CHECK(cudaDeviceSynchronize());
}

void DeviceBuffer::upload(const void* host, size_t bytes) const {
  if (bytes == 0) return;
  TERN_CUDA_CHECK(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
  TERN_CUDA_CHECK(cudaDeviceSynchronize());
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) TERN_CUDA_CHECK(cudaFree(ptr_));
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) TERN_CUDA_CHECK(cudaFree(ptr_));
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceContext::DeviceContext(int device) : props_(device_query_props(device)) {
  TERN_CUDA_CHECK(cudaSetDevice(device));
  TERN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  TERN_CUBLAS_CHECK(cublasLtCreate(&cublaslt_));
  workspace_ = DeviceBuffer(kCublasWorkspaceBytes);
  weight_workspace_ = DeviceBuffer(kWeightWorkspaceBytes);
}

const DeviceBuffer& DeviceContext::l2_flush_buffer() const {
  if (l2_flush_.data() == nullptr) l2_flush_ = DeviceBuffer(static_cast<size_t>(std::max(2 * props_.l2_bytes, 1)));
  return l2_flush_;
}

DeviceContext::~DeviceContext() {
  if (stream_ != nullptr) TERN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (cublaslt_ != nullptr) TERN_CUBLAS_CHECK(cublasLtDestroy(cublaslt_));
  if (stream_ != nullptr) TERN_CUDA_CHECK(cudaStreamDestroy(stream_));
}

}  // namespace tern
