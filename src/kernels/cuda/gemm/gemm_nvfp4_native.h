// Native block-scaled FP4 GEMM (W4A4) through cuBLASLt, for GPUs with FP4 tensor cores (sm_100 family, sm_120):
//   y[M,N] = dequant(quant_act(x)) . dequant(W)^T
// x [M,K] bf16 is quantized to NVFP4 per 16-element block with the layer's input_scale (nvfp4_quantize.h, the
// ModelOpt semantics of docs/model-specs.md §1.5); W is the checkpoint's NVFP4 weight whose block scales were
// re-laid once into cuBLASLt's tiled layout (nvfp4_scale_layout.h). cuBLASLt multiplies e2m1 codes times their e4m3
// block scales (CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 on both operands), sums in fp32, and applies the two
// per-tensor scales folded into alpha = weight_scale_2 * input_scale before the single bf16 rounding of y
// (vLLM / SGLang / TensorRT-LLM fold them the same way).
//
// cuBLASLt's requirements for narrow-precision operands (cuBLAS docs, cublasLtMatmul): "TN" (A = W transposed,
// B = x not transposed, in cuBLASLt's column-major view of our row-major data), fp32 compute and scale type, and
// 16-byte alignment of every matrix pointer and leading dimension: k a multiple of 32 (16 bytes of packed FP4 per row
// step) and ldy a multiple of 8 (16 bytes of bf16).
//
// On GPUs without FP4 tensor cores (sm_90) cuBLASLt has no algorithm; the call then returns an error saying so, after
// the activation quantizer has run (it writes only the workspace).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/device.h"

namespace tern {

// An NVFP4 weight [n, k] prepared for the native path.
struct Nvfp4NativeWeightView {
  const uint8_t* packed = nullptr;        // [n, k/2] as in the checkpoint (even k in the low nibble)
  const uint8_t* scales_tiled = nullptr;  // nvfp4_tiled_scale_bytes(n, k): nvfp4_scales_to_tiled(weight_scale)
  float global_scale = 0.0f;              // weight_scale_2
  int64_t n = 0;
  int64_t k = 0;
};

struct GemmNvfp4NativeArgs {
  const uint16_t* x = nullptr;  // [m, k] bf16, row-major
  Nvfp4NativeWeightView w;
  float input_scale = 0.0f;                   // the layer's input_scale (host copy, for alpha)
  const float* input_scale_device = nullptr;  // the same value in device memory (read by the quantizer)
  uint16_t* y = nullptr;                      // [m, ldy] bf16, row-major; columns [0, n) are written
  int64_t m = 0;
  int64_t ldy = 0;            // row stride of y in elements; 0 means n
  // 16-byte aligned; gemm_nvfp4_native_workspace_bytes(m, k) bytes run the rows at once, less (at least one row's)
  // runs them a chunk of rows at a time.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Scratch for the quantized activations: packed codes [m, k/2] then their tiled scales.
size_t gemm_nvfp4_native_workspace_bytes(int64_t m, int64_t k);

// Whether the device's exact architecture has block-scaled FP4 tensor-core MMA (sm_100 / sm_101 / sm_103 with
// tcgen05, sm_120 / sm_121 with mma.sync), the instructions cuBLASLt's FP4 kernels use; sm_90 and older have none.
bool nvfp4_native_supported(const DeviceProps& props);

// Queues the quantization and the product on ctx.stream() (per chunk of rows where the workspace holds fewer). Errors
// name the bad argument (shape, k not a multiple of 32, null or misaligned pointer, ldy, a non-finite or non-positive
// scale, a workspace short of one row) or say that cuBLASLt has no algorithm for the case on this device. m == 0 is
// a no-op.
Expected<void> gemm_nvfp4_native(const DeviceContext& ctx, const GemmNvfp4NativeArgs& args);

}  // namespace tern
