// The NVFP4 activation quantizer's argument struct and unchecked launcher. The .cu side cannot include
// core/error.h (nvcc rejects fmt's consteval format strings), so validation lives in nvfp4_quantize.cc and callers
// use nvfp4_quantize_activations() from nvfp4_quantize.h.
#pragma once

#include <cstdint>

#include "kernels/cuda/device.h"

namespace tern {

enum class Nvfp4ScaleLayout {
  kRowMajor,    // [m, k/16], as a checkpoint stores a weight's scales
  kTiled128x4,  // cuBLASLt's block-scaled layout, zero padded (nvfp4_scale_layout.h)
};

struct Nvfp4QuantizeArgs {
  const uint16_t* x = nullptr;         // [m, k] bf16, row-major
  const float* input_scale = nullptr;  // device, one fp32: ModelOpt's input_scale (act_global_scale = 1 / it)
  uint8_t* packed = nullptr;           // [m, k/2] two e2m1 codes per byte, even k in the low nibble
  uint8_t* scales = nullptr;           // e4m3 block scales in `layout`: m * k/16 or nvfp4_tiled_scale_bytes(m, k)
  int64_t m = 0;
  int64_t k = 0;  // a multiple of 16
  Nvfp4ScaleLayout layout = Nvfp4ScaleLayout::kRowMajor;
};

// Unchecked launch on ctx.stream(), for arguments nvfp4_quantize_activations() has validated (m >= 1).
void nvfp4_quantize_launch(const DeviceContext& ctx, const Nvfp4QuantizeArgs& args);

}  // namespace tern
