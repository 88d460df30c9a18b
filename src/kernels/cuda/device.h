// Per-device context for the CUDA path: what the device is (DeviceProps, read once and handed to every launcher
// that sizes tiles), the stream work is queued on, the cuBLASLt handle with its workspace, and an owning device
// buffer. No globals: whoever runs a model on a GPU owns one DeviceContext per device.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/cuda/cuda_check.h"

// cuBLASLt calls fail fast like CUDA calls (a failure means a broken device, a bug, or an unsupported shape the
// launcher should have rejected first).
#define TERN_CUBLAS_CHECK(call)                                                                            \
  do {                                                                                                     \
    const cublasStatus_t tern_cublas_status_ = (call);                                                     \
    if (tern_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                                    \
      std::fprintf(stderr, "%s:%d: cuBLAS call failed: %s: %s\n", __FILE__, __LINE__, #call,               \
                   cublasLtGetStatusName(tern_cublas_status_));                                            \
      std::abort();                                                                                        \
    }                                                                                                      \
  } while (0)

namespace tern {

struct DeviceProps {
  int device = 0;
  std::string name;
  int cc_major = 0;
  int cc_minor = 0;
  int num_sms = 0;
  size_t shared_mem_per_block = 0;        // default limit of one block (48 KiB)
  size_t shared_mem_per_block_optin = 0;  // what a block may get after cudaFuncSetAttribute
  size_t shared_mem_per_sm = 0;
  int regs_per_sm = 0;
  int regs_per_block = 0;
  int max_threads_per_sm = 0;
  int l2_bytes = 0;
  size_t global_mem_bytes = 0;
  int memory_bus_bits = 0;
  int memory_clock_khz = 0;  // 0 where the runtime no longer reports it
  int sm_clock_khz = 0;
};

// Reads the properties of `device` (cudaGetDeviceProperties plus the attributes CUDA 13 dropped from it).
DeviceProps device_query_props(int device);

// Owning device allocation; move-only. Size 0 owns nothing.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  // Like the constructor, but an allocation the device cannot satisfy returns false (and leaves `out` empty)
  // instead of aborting: for sizes that depend on user input (a model's weights, a KV cache).
  static bool try_allocate(size_t bytes, DeviceBuffer& out);
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t size_bytes() const { return bytes_; }
  // Sets every byte to `byte` and waits for it: a plain cudaMemset of device memory is asynchronous and runs on the
  // legacy default stream, which a DeviceContext's non-blocking stream does not wait for, so a kernel queued next
  // could otherwise run before the fill (a poisoned output that the kernel wrote, overwritten afterwards).
  void fill(uint8_t byte) const;
  // Copies `bytes` from host memory to the start of the buffer and waits for it, for the same reason: a cudaMemcpy
  // from pageable memory may return before its DMA has landed, and a non-blocking stream does not wait for it.
  void upload(const void* host, size_t bytes) const;

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// One device's stream, cuBLASLt handle and cuBLASLt workspace. Selects the device on construction.
class DeviceContext {
 public:
  static constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;  // cuBLASLt's recommendation for Hopper
  static constexpr size_t kWeightWorkspaceBytes = size_t{32} << 20;

  explicit DeviceContext(int device = 0);
  ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  const DeviceProps& props() const { return props_; }
  // Tests: take this device as one that gives a block at most `bytes` of shared memory (an RTX PRO 6000's on an
  // H200), so that kernels which size themselves by props() run the shapes such a device gets.
  void limit_shared_memory(size_t bytes) {
    props_.shared_mem_per_block_optin = std::min(props_.shared_mem_per_block_optin, bytes);
  }
  cudaStream_t stream() const { return stream_; }
  cublasLtHandle_t cublaslt() const { return cublaslt_; }
  void* cublas_workspace() const { return workspace_.data(); }
  size_t cublas_workspace_bytes() const { return workspace_.size_bytes(); }
  void synchronize() const { TERN_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  // Scratch of the weight-only GEMMs (gemm_fp8_w8a16, gemm_nvfp4_w4a16): past 64 rows a chunk of a quantized weight
  // dequantized to bf16 there, then multiplied by cuBLASLt; at 17..64 rows the batch kernel's fp32 partial sums
  // (gemm/weight_batch.cuh). Allocated with the context, so graphs may use it; work on the context's stream only.
  uint16_t* weight_workspace() const { return weight_workspace_.as<uint16_t>(); }
  size_t weight_workspace_bytes() const { return weight_workspace_.size_bytes(); }

  // Programmatic dependent launch (launch.cuh): while on, tern's kernels are launched so that each may start while
  // the previous kernel of the stream finishes, and waits in ptx::grid_dependency_wait() before touching memory.
  // Off by default; a model turns it on after programmatic_launch_probe() succeeded on the device.
  void set_programmatic_launch(bool on) { programmatic_launch_ = on; }
  bool programmatic_launch() const { return programmatic_launch_; }

  // Twice the L2 in bytes, allocated on first use and kept for the context's life: timing code (cuda_time_best)
  // overwrites it before each timed run so the run starts from a cold L2, as a decode step does.
  const DeviceBuffer& l2_flush_buffer() const;

  // Per-shape cuBLASLt plans of gemm_bf16 (type-erased; gemm_bf16.cc owns the type). A context is used by one
  // thread at a time, like its stream.
  mutable std::shared_ptr<void> gemm_plans;

 private:
  DeviceProps props_;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t cublaslt_ = nullptr;
  DeviceBuffer workspace_;
  DeviceBuffer weight_workspace_;
  mutable DeviceBuffer l2_flush_;
  bool programmatic_launch_ = false;
};

// Whether this device takes programmatic launches (launch.cuh): two dependent launches of a tiny kernel, the second
// reading what the first wrote after its wait. False, with the error cleared, where the launch is refused or the
// read saw the old value.
bool programmatic_launch_probe(DeviceContext& ctx);

}  // namespace tern
