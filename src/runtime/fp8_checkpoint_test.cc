// Block-wise FP8 checkpoints (DeepSeek-V3 / GLM-5-FP8 layout: F8_E4M3 weights, one F32 weight_scale_inv per
// 128 x 128 block, config.json quantization_config {"quant_method": "fp8", "weight_block_size": [128, 128]}). A
// fixture's linears are quantized here to that layout, and the same values dequantized (e4m3 times the block's scale,
// core/formats.h's OCP decode) are written as an F32 checkpoint: the two models must give the same logits, and
// tensor-parallel slices of an FP8 linear must hold the dequantized rows (row splits) or be refused (an input split
// off the 128-column blocks).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/formats.h"
#include "io/model_config.h"
#include "io/safetensors.h"
#include "models/weight_schema.h"
#include "models/weights.h"
#include "runtime/fp8_checkpoint_test_util.h"
#include "runtime/logits_test_util.h"
#include "runtime/model_runner.h"

namespace tern {
namespace {

namespace fs = std::filesystem;

using fp8_test::Fp8Pair;

std::vector<float> logits_of(const fs::path& dir, const std::vector<int32_t>& tokens) {
  return all_token_logits(dir, {}, tokens);
}

class Fp8Fixture : public ::testing::TestWithParam<const char*> {};

// Every architecture the FP8 releases come in: dense Qwen3, Qwen3-MoE (experts), Qwen3.5 (Gated DeltaNet and gated
// attention projections) and GLM-5 (MLA's q_a / q_b / kv_a / kv_b and o, the DSA indexer's projections, dense and
// routed MLPs); kv_b enters the absorbed attention dequantized.
TEST_P(Fp8Fixture, LogitsEqualTheDequantizedF32Checkpoint) {
  const Fp8Pair pair(GetParam());
  ASSERT_FALSE(pair.quantized.empty());
  const std::vector<int32_t> tokens{17, 300, 42, 99, 5, 250, 123, 7, 411, 64};
  const std::vector<float> fp8 = logits_of(pair.fp8, tokens), f32 = logits_of(pair.f32, tokens);
  ASSERT_EQ(fp8.size(), f32.size());
  ASSERT_FALSE(fp8.empty());
  float scale = 0.0f;
  for (float v : f32) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < fp8.size(); ++i) {
    ASSERT_TRUE(std::isfinite(fp8[i])) << i;
    ASSERT_NEAR(fp8[i], f32[i], 1e-5f * scale) << "logit " << i;
  }
  // And the quantization was real: the FP8 model is not the BF16 fixture.
  const std::vector<float> bf16 = logits_of(fs::path(TERN_FIXTURES_DIR) / GetParam(), tokens);
  ASSERT_EQ(bf16.size(), fp8.size());
  float diff = 0.0f;
  for (size_t i = 0; i < fp8.size(); ++i) diff = std::max(diff, std::abs(fp8[i] - bf16[i]));
  EXPECT_GT(diff, 1e-3f * scale);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Fp8Fixture, ::testing::Values("qwen3", "qwen3_moe", "qwen3_5_moe", "glm_moe_dsa"));

// A row-split FP8 linear holds the dequantized rows of its rank; an input split inside a 128-column block is an
// error naming the tensor.
TEST(Fp8Checkpoint, TensorParallelSlices) {
  const Fp8Pair pair;
  auto config = model_config_load(pair.fp8);
  ASSERT_TRUE(config.has_value()) << config.error().message;
  auto fp8_raw = SafetensorsSet::open_dir(pair.fp8);
  auto f32_raw = SafetensorsSet::open_dir(pair.f32);
  ASSERT_TRUE(fp8_raw.has_value() && f32_raw.has_value());
  const WeightSchema schema = weight_schema_build(*config, weight_schema_text_prefix(*fp8_raw));
  const std::string q = "model.layers.0.self_attn.q_proj", o = "model.layers.0.self_attn.o_proj";
  const TensorView* qf = f32_raw->find(q + ".weight");
  ASSERT_NE(qf, nullptr);
  const int64_t out = qf->shape[0], in = qf->shape[1];
  for (int rank : {0, 1}) {
    auto store = WeightStore::open_checkpoint(pair.fp8);
    ASSERT_TRUE(store.has_value()) << store.error().message;
    (*store)->set_sharding(schema, {rank, 2});
    auto linear = (*store)->linear(q, out, in);
    ASSERT_TRUE(linear.has_value()) << linear.error().message;
    const CpuMatrix& m = linear->matrix();
    ASSERT_EQ(m.format, CpuWeightFormat::kFp8Block128);
    ASSERT_EQ(m.rows, out / 2);
    std::vector<float> row(static_cast<size_t>(in));
    for (int64_t r = 0; r < m.rows; ++r) {
      cpu_matrix_row(m, r, row.data());
      for (int64_t c = 0; c < in; ++c) {
        float want;
        std::memcpy(&want, f32_raw->find(q + ".weight")->data.data() + ((rank * m.rows + r) * in + c) * 4, 4);
        ASSERT_EQ(row[c], want) << "rank " << rank << " row " << r << " column " << c;
      }
    }
    const TensorView* of = f32_raw->find(o + ".weight");
    auto split = (*store)->linear(o, of->shape[0], of->shape[1]);
    ASSERT_FALSE(split.has_value());
    EXPECT_NE(split.error().message.find("straddle its 128-column scale blocks"), std::string::npos)
        << split.error().message;
  }
}

// One FP8 linear [300, 260] (a 3 x 3 block grid with partial last blocks, every block its own scale) read through the
// weight store: each row, dequantized by cpu_matrix_row, is e4m3 times its own block's scale.
TEST(Fp8Checkpoint, EveryBlockOfTheGridScalesItsOwnWeights) {
  const fs::path dir = fs::temp_directory_path() / ("tern_fp8_grid_" + std::to_string(std::random_device{}()));
  fs::create_directories(dir);
  const int64_t out = 300, in = 260;
  std::mt19937 rng(7);
  std::vector<std::byte> codes(static_cast<size_t>(out * in)), scales(9 * 4);
  for (auto& c : codes) {
    uint8_t v;
    do v = static_cast<uint8_t>(rng() & 0xFF); while ((v & 0x7F) == 0x7F);
    c = static_cast<std::byte>(v);
  }
  for (int i = 0; i < 9; ++i) {
    const float v = 0.01f * static_cast<float>(i + 1);
    std::memcpy(&scales[i * 4], &v, 4);
  }
  ASSERT_TRUE(safetensors_write(dir / "model.safetensors", {{"m.weight", DType::kF8E4M3, {out, in}, codes},
                                                           {"m.weight_scale_inv", DType::kF32, {3, 3}, scales}})
                  .has_value());
  auto store = WeightStore::open_checkpoint(dir);
  ASSERT_TRUE(store.has_value()) << store.error().message;
  auto linear = (*store)->linear("m", out, in);
  ASSERT_TRUE(linear.has_value()) << linear.error().message;
  std::vector<float> row(static_cast<size_t>(in));
  for (int64_t r = 0; r < out; ++r) {
    cpu_matrix_row(linear->matrix(), r, row.data());
    for (int64_t c = 0; c < in; ++c) {
      const float scale = 0.01f * static_cast<float>((r / 128) * 3 + c / 128 + 1);  // as written above
      const float want = e4m3_to_float(static_cast<uint8_t>(codes[r * in + c])) * scale;
      ASSERT_EQ(row[c], want) << "row " << r << " column " << c;
    }
  }
  fs::remove_all(dir);
}

TEST(Fp8Checkpoint, QuantizationConfigIsReadAndCheckedAtLoad) {
  const Fp8Pair pair;
  nlohmann::json config = nlohmann::json::parse(std::ifstream(pair.fp8 / "config.json"));
  config["quantization_config"]["weight_block_size"] = {64, 64};
  std::ofstream(pair.fp8 / "config.json") << config.dump(2);
  auto model = runner_load(pair.fp8, {});
  ASSERT_FALSE(model.has_value());
  EXPECT_NE(model.error().message.find("only [128, 128] blocks are supported"), std::string::npos)
      << model.error().message;
}

}  // namespace
}  // namespace tern
