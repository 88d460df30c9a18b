// NVFP4 quantization of bf16 activations for the native W4A4 GEMM: every 16-element block of a row gets an e4m3
// scale and 16 e2m1 codes, bit for bit as core/nvfp4.h nvfp4_quantize_activation_row() computes them (ModelOpt /
// sgl-kernel semantics with act_global_scale = 1 / input_scale; docs/model-specs.md §1.5). The fp32
// operations run in the reference's order with explicitly rounded intrinsics, and the e4m3 / e2m1 encoders are CUDA's
// own, which the format probe test checks against core/formats over every code and midpoint.
//
// input_scale is read from device memory so that it can be produced on the device (a dynamic per-batch scale) without
// a host round trip. The kernel uses no FP4 instruction, so it runs on every architecture the binary targets.
#pragma once

#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/nvfp4/nvfp4_quantize_launch.h"

namespace tern {

// Queues the quantization on ctx.stream(). Errors name the bad argument: shape (k not a multiple of 16), null
// pointer, misalignment (x 16 bytes, packed 8, input_scale 4). With kTiled128x4 the whole padded scale buffer is
// written (padding zero). m == 0 is a no-op.
Expected<void> nvfp4_quantize_activations(const DeviceContext& ctx, const Nvfp4QuantizeArgs& args);

}  // namespace tern
