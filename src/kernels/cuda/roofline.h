// What the device can do at best, measured in the same run as the numbers compared with it (tern bench, the kernel
// benchmarks): the copy bandwidth of a plain copy kernel (bytes read plus written per second) and the rate of a
// large BF16 GEMM through cuBLASLt. Both are medians of graph replays (bench_timing.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/device.h"

namespace tern {

struct Roofline {
  double copy_gbs = 0.0;     // copy kernel over 2 GiB, read + written
  double gemm_tflops = 0.0;  // BF16 8192 x 8192 x 8192, fp32 accumulation
};

Expected<Roofline> roofline_measure(const DeviceContext& ctx);

// The copy kernel alone (roofline.cu): `bytes` a multiple of 16, pointers 16-byte aligned.
void bench_copy_launch(const void* src, void* dst, size_t bytes, int num_sms, cudaStream_t stream);

}  // namespace tern
