// A model's weights on a CUDA device, uploaded once from the host model (whose views point into the mapped
// checkpoint). BF16 stays BF16, NVFP4 stays packed and block-wise FP8 stays e4m3 (its 128 x 128 block scales held
// per row, fp8_device.cuh); fp32/fp16 matrices are rounded to BF16 (the activations' format). A matrix the host
// model uses twice (tied embeddings and lm_head) is uploaded once.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/gemm/gemm_fp8_w8a16_launch.h"
#include "kernels/cuda/gemm/gemm_nvfp4_w4a16_launch.h"
#include "kernels/cuda/moe/moe.h"
#include "layers/linear.h"
#include "layers/moe.h"

namespace tern {

// One weight matrix [n, k] on the device.
struct DeviceMatrix {
  bool nvfp4 = false;
  bool fp8 = false;  // block-wise FP8 (W8A16)
  int64_t n = 0, k = 0;
  const uint16_t* bf16 = nullptr;    // [n, k]
  const uint8_t* packed = nullptr;   // NVFP4 [n, k/2]; FP8 e4m3 codes [n, k]
  const float* row_scales = nullptr; // FP8 [n, ceil(k/128)]
  const uint8_t* scales = nullptr;   // NVFP4 e4m3 [n, k/16]
  float global_scale = 1.0f;
  // NVFP4 linears stacked by rows (a projection's adjacent NVFP4 parts), each with its own weight_scale_2: the rows
  // from part_begin[i] on take part_scale[i] (Nvfp4WeightView).
  int64_t part_begin[kNvfp4MaxExtraParts] = {};
  float part_scale[kNvfp4MaxExtraParts] = {};
  bool gemv = false;  // BF16 through gemv_bf16 where gemv_bf16_preferred holds (self-test verified)
  // NVFP4 with quantized activations (W4A4) on the FP4 tensor cores (kernels/cuda/gemm/gemm_nvfp4_native.h), with
  // nvfp4 also set: `packed` as above, the block scales in cuBLASLt's tiled layout, one weight_scale_2
  // (global_scale) and the layer's input_scale, on the host and on the device.
  bool w4a4 = false;
  const uint8_t* scales_tiled = nullptr;
  float input_scale = 0.0f;
  const float* input_scale_device = nullptr;
};

// y[:, offset .. offset + n) = x . W^T for y with row stride ldy (BF16 through cuBLASLt or, for few rows when the
// matrix says so, gemv_bf16; NVFP4 through W4A16, or W4A4 on the FP4 tensor cores with the context's weight workspace
// holding the quantized activations; FP8 through W8A16).
Expected<void> device_matrix_forward(const DeviceContext& ctx, const DeviceMatrix& w, const uint16_t* x, int64_t m,
                                     uint16_t* y, int64_t ldy);

// Several linears over the same input computed as one output [m, width] with their outputs side by side (q|k|v,
// gate|up, router|shared-expert gate). Adjacent parts of one format are one matrix on the device, so one GEMM: BF16
// parts concatenated, NVFP4 parts stacked with each part's weight_scale_2 (up to kNvfp4MaxStackedParts a matrix),
// FP8 parts stacked with their row scales; W4A4 parts (Linear::quantizes_input) stacked when they share their
// weight_scale_2 and input_scale (one alpha per GEMM), each alone otherwise.
// The CUDA model computes every projection after a norm (cuda_ops.cc norm_project), the first part with the norm
// fused in where the self-test chose that.
struct DeviceProjection {
  std::vector<DeviceMatrix> parts;
  std::vector<int64_t> offsets;  // column of each part in the output
  int64_t width = 0;
  int64_t in_features = 0;
};

// The routed experts of one MoE layer: gate|up as one [2I, H] matrix per expert when BF16 or FP8 (one grouped GEMM),
// separate gate and up when NVFP4 (each has its own weight_scale_2 per expert); down [H, I].
struct DeviceExperts {
  int64_t n_experts = 0, inter = 0, hidden = 0;
  bool nvfp4 = false;
  MoeExpertWeights gate_up;  // BF16: n = 2I
  MoeExpertWeights gate, up; // NVFP4: n = I each
  MoeExpertWeights down;
};

class DeviceWeights {
 public:
  // bf16_gemv: BF16 matrices are computed by gemv_bf16 at few rows (DeviceMatrix::gemv). nvfp4_w4a4: the self-test
  // verified the FP4 tensor-core GEMM (KernelChoices::nvfp4_w4a4); without it a W4A4 linear is refused.
  DeviceWeights(cudaStream_t stream, bool bf16_gemv, bool nvfp4_w4a4 = false)
      : stream_(stream), bf16_gemv_(bf16_gemv), nvfp4_w4a4_(nvfp4_w4a4) {}

  Expected<DeviceMatrix> matrix(const Linear& linear);
  Expected<DeviceMatrix> matrix(const CpuMatrix& m, const std::string& name);
  // width_multiple: the output's row stride is rounded up to it (16-byte rows for consumers that load 8 at a time).
  // A BF16 run that ends the projection gets zero rows up to kFusedProjectionRowMultiple (layers/linear.h).
  Expected<DeviceProjection> projection(std::span<const Linear* const> linears, int64_t width_multiple = 1);
  Expected<DeviceExperts> experts(const std::vector<MlpWeights>& experts, const std::string& name);
  // A norm weight or other vector, as bf16 (exact for weights that came from bf16) or fp32.
  Expected<const uint16_t*> vector_bf16(const std::vector<float>& values);
  Expected<const float*> vector_f32(const std::vector<float>& values);

  size_t bytes() const { return bytes_; }

 private:
  Expected<void*> allocate(size_t bytes, const std::string& what);
  Expected<void*> upload(const void* host, size_t bytes, const std::string& what);
  // rows_multiple: zero rows after the last linear's up to a multiple of it.
  Expected<DeviceMatrix> concat_bf16(std::span<const Linear* const> linears, int64_t rows_multiple);
  Expected<DeviceMatrix> stack_nvfp4(std::span<const Linear* const> linears);
  Expected<DeviceMatrix> stack_fp8(std::span<const Linear* const> linears);
  // An error naming `name` unless the self-test verified the FP4 tensor-core GEMM on this device.
  Expected<void> check_w4a4_verified(const std::string& name) const;
  // W4A4 linears sharing weight_scale_2 and input_scale, stacked by rows.
  Expected<DeviceMatrix> stack_w4a4(std::span<const Linear* const> linears);
  // rows [row, row + m.rows) of an FP8 stack: codes [., k] and row scales [., ceil(k/128)]
  Expected<void> copy_fp8_rows(const CpuMatrix& m, uint8_t* codes, float* scales, int64_t row, int64_t k);
  Expected<MoeExpertWeights> expert_stack(const std::vector<MlpWeights>& experts, int part, const std::string& name);

  cudaStream_t stream_;
  bool bf16_gemv_ = false;
  bool nvfp4_w4a4_ = false;
  std::deque<DeviceBuffer> buffers_;
  std::map<const void*, DeviceMatrix> uploaded_;  // by host data pointer
  size_t bytes_ = 0;
};

}  // namespace tern
