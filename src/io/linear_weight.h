// Resolves how a checkpoint stores one linear layer `<module>.weight` ([out, in] logically). The rule is per tensor,
// from what the files hold (docs/model-specs.md §1.1): a uint8 weight [out, in/2] with an F8_E4M3
// `weight_scale` [out, in/16] and a scalar `weight_scale_2` is ModelOpt NVFP4; an F8_E4M3 weight [out, in] with an
// F32 `weight_scale_inv` [ceil(out/128), ceil(in/128)] is block-wise FP8 (DeepSeek-V3, GLM-5-FP8); a BF16/F16/F32
// weight [out, in] is dense. Anything else is an error naming the tensor and what was found.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/error.h"
#include "io/safetensors.h"

namespace tern {

enum class WeightFormat { kBf16, kF16, kF32, kNvfp4, kFp8Block128 };
std::string_view weight_format_name(WeightFormat format);  // "bf16", "f16", "f32", "nvfp4", "fp8-block128"

struct LinearWeight {
  std::string module;
  WeightFormat format = WeightFormat::kBf16;
  int64_t out_features = 0;
  int64_t in_features = 0;
  const TensorView* weight = nullptr;          // [out, in] dense or F8_E4M3, or U8 [out, in/2] packed e2m1
  const TensorView* weight_scale = nullptr;    // NVFP4: F8_E4M3 [out, in/16]; FP8: weight_scale_inv [out/128, in/128]
  const TensorView* weight_scale_2 = nullptr;  // NVFP4: F32 or BF16 scalar
  const TensorView* input_scale = nullptr;     // NVFP4: F32 or BF16 scalar; absent in weight-only exports
  const TensorView* bias = nullptr;            // [out], optional

  int64_t num_parameters() const;  // logical: out * in (+ out for a bias); scale tensors do not count
  int64_t num_bytes() const;       // as stored, scales included
};

// Reads a 0-d (or one-element) F32/BF16/F16 scale tensor.
Expected<float> read_scalar(const TensorView& tensor);

// Finds `<module>.weight` and its companions and checks their dtypes and shapes against [out, in].
Expected<LinearWeight> linear_weight_resolve(const SafetensorsSet& tensors, std::string_view module,
                                             int64_t out_features, int64_t in_features);

// The tensor names a resolved linear consumes (to find tensors nothing consumed).
std::vector<std::string> linear_weight_tensor_names(const LinearWeight& linear);

}  // namespace tern
