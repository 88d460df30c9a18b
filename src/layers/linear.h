// One linear layer y = x . W^T (+ bias) over fp32 activations, W in its stored format (kernels/cpu/matmul.h). An
// NVFP4 layer can also quantize its input (W4A4): every row is quantize-dequantized with the layer's input_scale
// exactly as core/nvfp4.h nvfp4_fake_quantize_activation_row does, before the product.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/cpu/matmul.h"

namespace tern {

class Linear {
 public:
  Linear() = default;
  Linear(std::string name, CpuMatrix matrix) : name_(std::move(name)), matrix_(matrix) {}

  void set_bias(std::vector<float> bias) { bias_ = std::move(bias); }
  void set_input_quantization(float input_scale) {
    quantize_input_ = true;
    input_scale_ = input_scale;
  }

  // y [m, out] = x [m, in] . W^T
  void forward(const float* x, int64_t m, float* y) const;

  int64_t out_features() const { return matrix_.rows; }
  int64_t in_features() const { return matrix_.cols; }
  const CpuMatrix& matrix() const { return matrix_; }
  const std::string& name() const { return name_; }
  const std::vector<float>& bias() const { return bias_; }
  bool quantizes_input() const { return quantize_input_; }
  float input_scale() const { return input_scale_; }  // with quantizes_input()

 private:
  std::string name_;
  CpuMatrix matrix_;
  std::vector<float> bias_;
  bool quantize_input_ = false;
  float input_scale_ = 1.0f;
};

// A device computes the BF16 linears a block fuses (Block::input_projections) as one GEMM whose weight rows end with
// zero rows up to a multiple of this: cuBLASLt takes 1-aligned kernels for an odd row count (the Qwen3.5 MoE
// router group has 2 * 512 + 256 + 1 rows), 20x slower at 4096 tokens (docs/perf/gpu.md §fused-rows). The self-test
// plans the padded shape.
inline constexpr int64_t kFusedProjectionRowMultiple = 8;
// Adjacent NVFP4 linears of a block's input projections are one stacked weight on a device, each part keeping its
// weight_scale_2; at most this many parts a weight (the NVFP4 kernels' part table, gemm_nvfp4_w4a16_launch.h).
inline constexpr int kNvfp4MaxStackedParts = 4;
inline int64_t fused_projection_rows(int64_t rows) {
  return (rows + kFusedProjectionRowMultiple - 1) / kFusedProjectionRowMultiple * kFusedProjectionRowMultiple;
}

// How a device stores and multiplies a linear: BF16 (also fp32 / fp16 weights, rounded to it), NVFP4 with BF16
// activations (W4A16), NVFP4 with quantized activations (W4A4), block-wise FP8.
enum class LinearKind { kBf16, kNvfp4, kW4a4, kFp8 };
LinearKind linear_kind(const Linear& l);
// Stored as NVFP4 codes (W4A16 or W4A4).
inline bool is_nvfp4(const Linear& l) { return l.matrix().format == CpuWeightFormat::kNvfp4; }
inline bool is_fp8(const Linear& l) { return linear_kind(l) == LinearKind::kFp8; }
// Computed as BF16 on a device (BF16, or fp32 / fp16 rounded to it).
inline bool is_bf16(const Linear& l) { return linear_kind(l) == LinearKind::kBf16; }
// Whether W4A4 linears can be one GEMM: cuBLASLt's FP4 GEMM takes one alpha = weight_scale_2 * input_scale.
bool share_w4a4_scales(std::span<const Linear* const> linears);

// One GEMM of a block's fused input projections: parts [begin, end), adjacent and of one kind, their rows stacked.
// BF16 and FP8 runs go as far as their kind does; NVFP4 and W4A4 runs take at most kNvfp4MaxStackedParts parts;
// W4A4 parts whose weight_scale_2 or input_scale differ are a run each (cuBLASLt's FP4 GEMM takes one alpha). A BF16
// run that ends the projection gets zero rows up to kFusedProjectionRowMultiple, so `rows` is the GEMM's.
struct ProjectionRun {
  LinearKind kind = LinearKind::kBf16;
  size_t begin = 0, end = 0;
  int64_t rows = 0;
};
// The runs a device computes `parts` in (DeviceWeights::projection), and so those the self-test plans
// (models/selftest_plan.cc); the first run is the one a device may fuse the block's norm into.
std::vector<ProjectionRun> projection_runs(const std::vector<const Linear*>& parts);

}  // namespace tern
