// The per-tensor storage rule for linear layers (docs/model-specs.md §1.1/1.2): each case writes a tiny
// safetensors file and checks the verdict and that errors name the offending tensor.
#include "io/linear_weight.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "core/formats.h"

namespace tern {
namespace {

namespace fs = std::filesystem;

struct Blob {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

class LinearWeightTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ = fs::temp_directory_path() / ("tern_linear_weight_" + std::to_string(rd()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes the blobs (random bytes of the right size) and opens them.
  SafetensorsSet write(const std::vector<Blob>& blobs) {
    std::mt19937 rng(3);
    storage_.clear();
    storage_.reserve(blobs.size());
    std::vector<TensorToWrite> tensors;
    for (const Blob& b : blobs) {
      int64_t n = 1;
      for (int64_t d : b.shape) n *= d;
      auto& bytes = storage_.emplace_back(static_cast<size_t>(n) * dtype_size(b.dtype));
      for (auto& x : bytes) x = static_cast<std::byte>(rng() & 0x3F);  // keeps fp8/bf16 values finite
      tensors.push_back({b.name, b.dtype, b.shape, bytes});
    }
    auto ok = safetensors_write(dir_ / "model.safetensors", tensors);
    EXPECT_TRUE(ok.has_value()) << ok.error().message;
    auto set = SafetensorsSet::open_dir(dir_);
    EXPECT_TRUE(set.has_value()) << set.error().message;
    return std::move(*set);
  }

  fs::path dir_;
  std::vector<std::vector<std::byte>> storage_;
};

TEST_F(LinearWeightTest, DenseBf16) {
  auto set = write({{"m.weight", DType::kBF16, {32, 64}}, {"m.bias", DType::kBF16, {32}}});
  auto w = linear_weight_resolve(set, "m", 32, 64);
  ASSERT_TRUE(w.has_value()) << w.error().message;
  EXPECT_EQ(w->format, WeightFormat::kBf16);
  EXPECT_NE(w->bias, nullptr);
  EXPECT_EQ(w->num_parameters(), 32 * 64 + 32);
  EXPECT_EQ(w->num_bytes(), 2 * (32 * 64 + 32));
}

TEST_F(LinearWeightTest, Nvfp4WithF32AndBf16Scalars) {
  auto set = write({{"m.weight", DType::kU8, {32, 32}},
                    {"m.weight_scale", DType::kF8E4M3, {32, 4}},
                    {"m.weight_scale_2", DType::kF32, {}},
                    {"m.input_scale", DType::kBF16, {}}});
  auto w = linear_weight_resolve(set, "m", 32, 64);
  ASSERT_TRUE(w.has_value()) << w.error().message;
  EXPECT_EQ(w->format, WeightFormat::kNvfp4);
  EXPECT_EQ(w->num_parameters(), 32 * 64);  // logical out x in; scales do not count
  EXPECT_EQ(w->num_bytes(), 32 * 32 + 32 * 4 + 4 + 2);
  EXPECT_EQ(linear_weight_tensor_names(*w).size(), 4u);
}

TEST_F(LinearWeightTest, Fp8WithBlockScales) {
  // 200 x 300: a partial last block in both directions, so the grid is [2, 3].
  auto set = write({{"m.weight", DType::kF8E4M3, {200, 300}}, {"m.weight_scale_inv", DType::kF32, {2, 3}}});
  auto w = linear_weight_resolve(set, "m", 200, 300);
  ASSERT_TRUE(w.has_value()) << w.error().message;
  EXPECT_EQ(w->format, WeightFormat::kFp8Block128);
  EXPECT_EQ(weight_format_name(w->format), "fp8-block128");
  EXPECT_EQ(w->num_parameters(), 200 * 300);
  EXPECT_EQ(w->num_bytes(), 200 * 300 + 2 * 3 * 4);
  EXPECT_EQ(linear_weight_tensor_names(*w), (std::vector<std::string>{"m.weight", "m.weight_scale_inv"}));
}

TEST_F(LinearWeightTest, Errors) {
  struct Case {
    std::vector<Blob> blobs;
    int64_t out, in;
    std::string must_mention;
  };
  const std::vector<Case> cases = {
      {{}, 32, 64, "'m.weight' is missing"},
      {{{"m.weight", DType::kBF16, {64, 32}}}, 32, 64, "m.weight"},
      {{{"m.weight", DType::kI32, {32, 64}}}, 32, 64, "unsupported weight type"},
      {{{"m.weight", DType::kU8, {32, 32}}, {"m.weight_scale_2", DType::kF32, {}}}, 32, 64, "m.weight_scale"},
      {{{"m.weight", DType::kU8, {32, 32}}, {"m.weight_scale", DType::kF8E4M3, {32, 4}}}, 32, 64, "weight_scale_2"},
      {{{"m.weight", DType::kU8, {32, 32}},
        {"m.weight_scale", DType::kBF16, {32, 4}},
        {"m.weight_scale_2", DType::kF32, {}}},
       32, 64, "m.weight_scale' must be F8_E4M3"},
      {{{"m.weight", DType::kU8, {32, 16}},
        {"m.weight_scale", DType::kF8E4M3, {32, 4}},
        {"m.weight_scale_2", DType::kF32, {}}},
       32, 64, "m.weight"},
      {{{"m.weight", DType::kU8, {32, 32}},
        {"m.weight_scale", DType::kF8E4M3, {32, 4}},
        {"m.weight_scale_2", DType::kF32, {2}}},
       32, 64, "m.weight_scale_2"},
      {{{"m.weight", DType::kU8, {32, 20}},
        {"m.weight_scale", DType::kF8E4M3, {32, 2}},
        {"m.weight_scale_2", DType::kF32, {}}},
       32, 40, "multiple of 16"},
      {{{"m.weight", DType::kBF16, {32, 64}}, {"m.bias", DType::kBF16, {64}}}, 32, 64, "m.bias"},
      {{{"m.weight", DType::kF8E4M3, {200, 300}}}, 200, 300, "'m.weight_scale_inv' (its 128 x 128 block scales)"},
      {{{"m.weight", DType::kF8E4M3, {200, 300}}, {"m.weight_scale_inv", DType::kF32, {2, 2}}}, 200, 300,
       "m.weight_scale_inv' must be F32 or BF16 [2, 3]"},
      {{{"m.weight", DType::kF8E4M3, {200, 300}}, {"m.weight_scale_inv", DType::kF8E4M3, {2, 3}}}, 200, 300,
       "m.weight_scale_inv' must be F32 or BF16"},
      {{{"m.weight", DType::kF8E4M3, {300, 200}}, {"m.weight_scale_inv", DType::kF32, {2, 3}}}, 200, 300,
       "m.weight' must have shape [200, 300]"},
  };
  for (const Case& c : cases) {
    auto set = write(c.blobs);
    auto w = linear_weight_resolve(set, "m", c.out, c.in);
    ASSERT_FALSE(w.has_value()) << c.must_mention;
    EXPECT_NE(w.error().message.find(c.must_mention), std::string::npos) << w.error().message;
  }
}

TEST_F(LinearWeightTest, ReadScalar) {
  std::vector<std::byte> f32(4), bf16(2);
  const float value = 0.0123f;
  std::memcpy(f32.data(), &value, 4);
  const uint16_t b = float_to_bf16(value);
  std::memcpy(bf16.data(), &b, 2);
  ASSERT_TRUE(safetensors_write(dir_ / "model.safetensors",
                                {{"a", DType::kF32, {}, f32}, {"b", DType::kBF16, {1}, bf16}, {"c", DType::kF32, {1, 1}, f32}})
                  .has_value());
  auto set = SafetensorsSet::open_dir(dir_);
  ASSERT_TRUE(set.has_value());
  EXPECT_EQ(*read_scalar(*set->find("a")), value);
  EXPECT_EQ(*read_scalar(*set->find("b")), bf16_to_float(b));
  EXPECT_FALSE(read_scalar(*set->find("c")).has_value());  // 2-d is not a scalar
}

}  // namespace
}  // namespace tern
