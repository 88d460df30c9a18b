#include "io/linear_weight.h"

#include <fmt/ranges.h>

#include "core/formats.h"

namespace tern {
namespace {

std::string shape_string(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::string describe(const TensorView& t) {
  return fmt::format("{} {} (in {})", dtype_name(t.dtype), shape_string(t.shape), t.file->filename().string());
}

bool is_scalar(const TensorView& t) { return t.numel() == 1 && t.shape.size() <= 1; }

Expected<void> check_scale_tensor(const TensorView* t, std::string_view role) {
  if (t == nullptr) return {};
  if (!is_scalar(*t) || (t->dtype != DType::kF32 && t->dtype != DType::kBF16)) {
    return make_error("tensor '{}': {} must be an F32 or BF16 scalar, found {}", t->name, role, describe(*t));
  }
  return {};
}

Expected<void> resolve_nvfp4(const SafetensorsSet& tensors, const std::string& module, LinearWeight& linear) {
  const int64_t out = linear.out_features, in = linear.in_features;
  linear.format = WeightFormat::kNvfp4;
  linear.weight_scale = tensors.find(module + ".weight_scale");
  linear.weight_scale_2 = tensors.find(module + ".weight_scale_2");
  linear.input_scale = tensors.find(module + ".input_scale");
  if (linear.weight_scale == nullptr || linear.weight_scale_2 == nullptr) {
    return make_error("tensor '{}.weight' is U8 (packed NVFP4) but '{}.{}' is missing", module, module,
                      linear.weight_scale == nullptr ? "weight_scale" : "weight_scale_2");
  }
  if (in % 16 != 0) {
    return make_error("linear '{}': NVFP4 needs in_features to be a multiple of 16, the model has {}", module, in);
  }
  const std::vector<int64_t> packed_shape{out, in / 2}, scale_shape{out, in / 16};
  if (linear.weight->shape != packed_shape) {
    return make_error("tensor '{}.weight': NVFP4 weight must be U8 {}, found {}", module, shape_string(packed_shape),
                      describe(*linear.weight));
  }
  if (linear.weight_scale->dtype != DType::kF8E4M3 || linear.weight_scale->shape != scale_shape) {
    return make_error("tensor '{}.weight_scale' must be F8_E4M3 {}, found {}", module, shape_string(scale_shape),
                      describe(*linear.weight_scale));
  }
  TERN_TRY(check_scale_tensor(linear.weight_scale_2, "weight_scale_2"));
  TERN_TRY(check_scale_tensor(linear.input_scale, "input_scale"));
  return {};
}

// DeepSeek-V3 / GLM-5-FP8 block-wise FP8: an F8_E4M3 weight [out, in] and an F32 (or BF16) `weight_scale_inv`
// [ceil(out / 128), ceil(in / 128)], the weight being e4m3 times its block's scale.
Expected<void> resolve_fp8_block(const SafetensorsSet& tensors, const std::string& module, LinearWeight& linear) {
  const int64_t out = linear.out_features, in = linear.in_features;
  linear.format = WeightFormat::kFp8Block128;
  if (linear.weight->shape != std::vector<int64_t>{out, in}) {
    return make_error("tensor '{}.weight' must have shape {}, found {}", module, shape_string({out, in}),
                      describe(*linear.weight));
  }
  linear.weight_scale = tensors.find(module + ".weight_scale_inv");
  if (linear.weight_scale == nullptr) {
    return make_error("tensor '{}.weight' is F8_E4M3 but '{}.weight_scale_inv' (its 128 x 128 block scales) is missing",
                      module, module);
  }
  const std::vector<int64_t> scale_shape{(out + 127) / 128, (in + 127) / 128};
  const DType st = linear.weight_scale->dtype;
  if ((st != DType::kF32 && st != DType::kBF16) || linear.weight_scale->shape != scale_shape) {
    return make_error("tensor '{}.weight_scale_inv' must be F32 or BF16 {} (one scale per 128 x 128 block), found {}",
                      module, shape_string(scale_shape), describe(*linear.weight_scale));
  }
  return {};
}

}  // namespace

std::string_view weight_format_name(WeightFormat format) {
  switch (format) {
    case WeightFormat::kBf16: return "bf16";
    case WeightFormat::kF16: return "f16";
    case WeightFormat::kF32: return "f32";
    case WeightFormat::kNvfp4: return "nvfp4";
    case WeightFormat::kFp8Block128: return "fp8-block128";
  }
  return "?";
}

int64_t LinearWeight::num_parameters() const { return out_features * in_features + (bias ? out_features : 0); }

int64_t LinearWeight::num_bytes() const {
  int64_t bytes = 0;
  for (const TensorView* t : {weight, weight_scale, weight_scale_2, input_scale, bias}) {
    if (t != nullptr) bytes += static_cast<int64_t>(t->data.size());
  }
  return bytes;
}

Expected<float> read_scalar(const TensorView& tensor) {
  if (!is_scalar(tensor)) return make_error("tensor '{}' must be a scalar, found {}", tensor.name, describe(tensor));
  switch (tensor.dtype) {
    case DType::kF32: return tensor.as<float>()[0];
    case DType::kBF16: return bf16_to_float(tensor.as<uint16_t>()[0]);
    case DType::kF16: return fp16_to_float(tensor.as<uint16_t>()[0]);
    default: return make_error("tensor '{}' must be F32, BF16 or F16, found {}", tensor.name, describe(tensor));
  }
}

Expected<LinearWeight> linear_weight_resolve(const SafetensorsSet& tensors, std::string_view module_view,
                                             int64_t out_features, int64_t in_features) {
  const std::string module(module_view);
  LinearWeight linear{.module = module, .out_features = out_features, .in_features = in_features};
  linear.weight = tensors.find(module + ".weight");
  if (linear.weight == nullptr) return make_error("tensor '{}.weight' is missing", module);
  linear.bias = tensors.find(module + ".bias");
  if (linear.bias != nullptr && linear.bias->shape != std::vector<int64_t>{out_features}) {
    return make_error("tensor '{}.bias' must have shape [{}], found {}", module, out_features, describe(*linear.bias));
  }
  const std::vector<int64_t> dense_shape{out_features, in_features};
  switch (linear.weight->dtype) {
    case DType::kU8:
      TERN_TRY(resolve_nvfp4(tensors, module, linear));
      return linear;
    case DType::kF8E4M3:
      TERN_TRY(resolve_fp8_block(tensors, module, linear));
      return linear;
    case DType::kBF16: linear.format = WeightFormat::kBf16; break;
    case DType::kF16: linear.format = WeightFormat::kF16; break;
    case DType::kF32: linear.format = WeightFormat::kF32; break;
    default:
      return make_error(
          "tensor '{}.weight': unsupported weight type {} (supported: BF16, F16, F32, NVFP4 as U8, FP8 e4m3 with "
          "128 x 128 block scales)",
          module, describe(*linear.weight));
  }
  if (linear.weight->shape != dense_shape) {
    return make_error("tensor '{}.weight' must have shape {}, found {}", module, shape_string(dense_shape),
                      describe(*linear.weight));
  }
  return linear;
}

std::vector<std::string> linear_weight_tensor_names(const LinearWeight& linear) {
  std::vector<std::string> names;
  for (const TensorView* t : {linear.weight, linear.weight_scale, linear.weight_scale_2, linear.input_scale,
                              linear.bias}) {
    if (t != nullptr) names.push_back(t->name);
  }
  return names;
}

}  // namespace tern
