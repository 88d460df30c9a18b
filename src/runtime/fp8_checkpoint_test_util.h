// Test support: a fixture checkpoint quantized to block-wise FP8 (DeepSeek-V3 / GLM-5-FP8 layout: F8_E4M3 weights,
// one F32 weight_scale_inv per 128 x 128 block, config.json quantization_config {"quant_method": "fp8",
// "weight_block_size": [128, 128]}), next to the F32 checkpoint of the same dequantized values (e4m3 times the
// block's scale, core/formats.h's OCP decode). Used by fp8_checkpoint_test (CPU) and gpu_model_test (CUDA).
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/formats.h"
#include "io/safetensors.h"

namespace tern::fp8_test {

namespace fs = std::filesystem;

constexpr int64_t kBlock = 128;

// A fixture (qwen3 unless named) as an FP8 checkpoint (dir / "fp8") and as the F32 checkpoint of its dequantized
// values (dir / "f32"). Linears ("*_proj.weight" and lm_head, 2-d) are quantized; everything else is copied as it is.
struct Fp8Pair {
  fs::path root, fp8, f32;
  std::vector<std::string> quantized;  // the linears' module names

  explicit Fp8Pair(const std::string& fixture = "qwen3") {
    std::random_device rd;
    root = fs::temp_directory_path() / ("tern_fp8_" + std::to_string(rd()));
    fp8 = root / "fp8";
    f32 = root / "f32";
    fs::create_directories(fp8);
    fs::create_directories(f32);
    const fs::path src = fs::path(TERN_FIXTURES_DIR) / fixture;
    auto set = SafetensorsSet::open_dir(src);
    EXPECT_TRUE(set.has_value()) << set.error().message;
    std::vector<TensorToWrite> fp8_tensors, f32_tensors;
    std::deque<std::vector<std::byte>> storage;
    std::mt19937 rng(0xF8);
    std::uniform_real_distribution<float> spread(1.0f, 8.0f);
    auto keep = [&](std::vector<std::byte> bytes) -> std::span<const std::byte> {
      storage.push_back(std::move(bytes));
      return storage.back();
    };
    for (const TensorView* t : set->tensors()) {
      // lm_head too ([512, 64]: four row blocks with their own scales).
      const bool linear = t->shape.size() == 2 && (t->name.ends_with("_proj.weight") || t->name == "lm_head.weight");
      if (!linear) {
        fp8_tensors.push_back({t->name, t->dtype, t->shape, t->data});
        f32_tensors.push_back({t->name, t->dtype, t->shape, t->data});
        continue;
      }
      quantized.push_back(t->name.substr(0, t->name.size() - std::string(".weight").size()));
      const int64_t rows = t->shape[0], cols = t->shape[1];
      const int64_t grid_r = (rows + kBlock - 1) / kBlock, grid_c = (cols + kBlock - 1) / kBlock;
      std::vector<float> w(static_cast<size_t>(rows * cols));
      for (int64_t i = 0; i < rows * cols; ++i) {
        uint16_t b;
        std::memcpy(&b, t->data.data() + 2 * i, 2);
        w[i] = bf16_to_float(b);
      }
      // Each block's scale is its amax / 448 times a random factor in [1, 8] (the codes then span 56 to 448 at the
      // top, with e4m3's three mantissa bits throughout), so scales differ up to 8x between blocks, tensors and
      // experts: a device that applied one block's, part's or expert's scale to another would be far off.
      std::vector<float> scale(static_cast<size_t>(grid_r * grid_c));
      for (int64_t br = 0; br < grid_r; ++br) {
        for (int64_t bc = 0; bc < grid_c; ++bc) {
          float amax = 0.0f;
          for (int64_t r = br * kBlock; r < std::min(rows, (br + 1) * kBlock); ++r) {
            for (int64_t c = bc * kBlock; c < std::min(cols, (bc + 1) * kBlock); ++c) {
              amax = std::max(amax, std::abs(w[r * cols + c]));
            }
          }
          scale[br * grid_c + bc] = amax > 0.0f ? amax / 448.0f * spread(rng) : 1.0f;
        }
      }
      std::vector<std::byte> codes(static_cast<size_t>(rows * cols)), deq(static_cast<size_t>(rows * cols) * 4);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const float s = scale[(r / kBlock) * grid_c + c / kBlock];
          const uint8_t code = float_to_e4m3(w[r * cols + c] / s);
          codes[r * cols + c] = static_cast<std::byte>(code);
          const float v = e4m3_to_float(code) * s;
          std::memcpy(&deq[(r * cols + c) * 4], &v, 4);
        }
      }
      std::vector<std::byte> scale_bytes(scale.size() * 4);
      std::memcpy(scale_bytes.data(), scale.data(), scale_bytes.size());
      fp8_tensors.push_back({t->name, DType::kF8E4M3, t->shape, keep(std::move(codes))});
      fp8_tensors.push_back({t->name + "_scale_inv", DType::kF32, {grid_r, grid_c}, keep(std::move(scale_bytes))});
      f32_tensors.push_back({t->name, DType::kF32, t->shape, keep(std::move(deq))});
    }
    EXPECT_TRUE(safetensors_write(fp8 / "model.safetensors", fp8_tensors).has_value());
    EXPECT_TRUE(safetensors_write(f32 / "model.safetensors", f32_tensors).has_value());
    for (const char* file : {"generation_config.json"}) {
      fs::copy_file(src / file, fp8 / file);
      fs::copy_file(src / file, f32 / file);
    }
    fs::copy_file(src / "config.json", f32 / "config.json");
    nlohmann::json config = nlohmann::json::parse(std::ifstream(src / "config.json"));
    config["quantization_config"] = {{"quant_method", "fp8"},
                                     {"fmt", "e4m3"},
                                     {"activation_scheme", "dynamic"},
                                     {"weight_block_size", {128, 128}}};
    std::ofstream(fp8 / "config.json") << config.dump(2);
  }
  ~Fp8Pair() { fs::remove_all(root); }
};

}  // namespace tern::fp8_test
