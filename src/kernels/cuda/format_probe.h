// CUDA's own number-format conversions (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h, cuda_fp4.h), run on the device.
// They are an independent reference for core/formats: the GPU test compares both over every code and millions of
// floats, so host and device agree bit for bit on what a checkpoint's numbers mean.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tern {

struct DeviceEncodings {  // one entry per input float
  std::vector<uint16_t> bf16, fp16;
  std::vector<uint8_t> e4m3_satfinite, e4m3_nonfinite, e5m2_satfinite, e5m2_nonfinite, e2m1;
  std::vector<uint8_t> ue8m0_up, ue8m0_toward_zero;
};

struct DeviceDecodings {  // indexed by code
  std::vector<float> e4m3, e5m2;  // 256 each
  std::vector<float> e2m1;        // 16
  std::vector<float> ue8m0;       // 256
};

// Encodes `in` with the device intrinsics. Aborts on CUDA errors (TERN_CUDA_CHECK).
DeviceEncodings cuda_probe_encode(std::span<const float> in);
DeviceDecodings cuda_probe_decode();

}  // namespace tern
