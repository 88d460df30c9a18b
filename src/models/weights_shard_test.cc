// The sharding seam (models/shard.h, WeightStore::set_sharding) against the committed fixtures. World 1 must be
// what the loader always did: views into the mapped file, bit-identical values. At world 2 and 4 the ranks' slices,
// put back together by the declarations alone, must give the checkpoint's tensors exactly; a few slices are also
// checked element by element against the raw safetensors bytes with the index arithmetic written out; shapes that
// cannot be split are errors naming the tensor.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>

#include "core/formats.h"
#include "io/linear_weight.h"
#include "io/model_config.h"
#include "io/quant_config.h"
#include "io/safetensors.h"
#include "models/weights.h"
#include "models/weight_schema.h"

namespace tern {
namespace {

namespace fs = std::filesystem;

fs::path fixture_dir(const std::string& name) {
  return fs::path(TERN_FIXTURES_DIR) / name;
}

struct Checkpoint {
  ModelConfig config;
  WeightSchema schema;
  SafetensorsSet raw;  // the same files, read independently of the store
};

Checkpoint open_fixture(const std::string& name) {
  auto config = model_config_load(fixture_dir(name));
  EXPECT_TRUE(config.has_value()) << config.error().message;
  auto raw = SafetensorsSet::open_dir(fixture_dir(name));
  EXPECT_TRUE(raw.has_value()) << raw.error().message;
  WeightSchema schema = weight_schema_build(*config, weight_schema_text_prefix(*raw));
  return {std::move(*config), std::move(schema), std::move(*raw)};
}

// One store per rank; `shard` false: the store is never given a sharding (the loader as it was).
std::unique_ptr<WeightStore> open_store(const std::string& name, const WeightSchema& schema, ShardRank rank,
                                        bool shard = true) {
  auto store = WeightStore::open_checkpoint(fixture_dir(name));
  EXPECT_TRUE(store.has_value()) << store.error().message;
  if (shard) (*store)->set_sharding(schema, rank);
  return std::move(*store);
}

template <class T>
T value(const Expected<T>& e, const std::string& what) {
  EXPECT_TRUE(e.has_value()) << what << ": " << (e ? "" : e.error().message);
  return e ? *e : T{};
}

uint16_t u16_at(const void* base, int64_t index) {
  uint16_t v;
  std::memcpy(&v, static_cast<const std::byte*>(base) + index * 2, 2);
  return v;
}

// A raw tensor's values as fp32, decoded here from its bytes (BF16 or F32).
std::vector<float> decode(const TensorView& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (int64_t k = 0; k < t.numel(); ++k) {
    if (t.dtype == DType::kF32) {
      std::memcpy(&v[k], t.data.data() + k * 4, 4);
    } else {
      EXPECT_EQ(t.dtype, DType::kBF16) << t.name;
      v[k] = bf16_to_float(u16_at(t.data.data(), k));
    }
  }
  return v;
}

// A [rows, cols] matrix's bytes as planes: dense values, or NVFP4 codes (1/2 byte an element) and scales (1/16).
struct Plane {
  const std::byte* data;
  int64_t rows, cols, num, den;  // an element is num / den bytes
  int64_t row_bytes() const { return cols * num / den; }
  std::vector<std::byte> bytes() const { return {data, data + rows * row_bytes()}; }
};

std::vector<Plane> planes(const CpuMatrix& m) {
  const auto* d = static_cast<const std::byte*>(m.data);
  switch (m.format) {
    case CpuWeightFormat::kNvfp4:
      return {{d, m.rows, m.cols, 1, 2}, {reinterpret_cast<const std::byte*>(m.block_scales), m.rows, m.cols, 1, 16}};
    case CpuWeightFormat::kF32:
      return {{d, m.rows, m.cols, 4, 1}};
    default:
      return {{d, m.rows, m.cols, 2, 1}};
  }
}

// The test's inverse of a declaration: rebuilds the split dimension from the ranks' planes segment by segment, rank by
// rank, each rank contributing its next count / world units, or, for a segment replicated below the world size, the
// unit r * count / world from the first rank holding it (the other holders must have the same bytes).
std::vector<std::byte> reassemble(const Shard& shard, const std::vector<Plane>& ranks, const std::string& what) {
  const int64_t world = static_cast<int64_t>(ranks.size());
  std::vector<std::byte> out;
  if (shard.dim == ShardDim::kReplicated || shard.dim == ShardDim::kVocab) {
    for (int64_t r = 0; r < world; ++r) {
      const std::vector<std::byte> b = ranks[r].bytes();
      if (shard.dim == ShardDim::kVocab || r == 0) {
        out.insert(out.end(), b.begin(), b.end());
      } else {
        EXPECT_TRUE(b == ranks[0].bytes()) << what << ": replicated rank " << r << " differs";
      }
    }
    return out;
  }
  const bool by_rows = shard.dim == ShardDim::kOutput;
  const Plane& p0 = ranks[0];
  auto bytes_of = [&](int64_t elements) { return by_rows ? elements * p0.row_bytes() : elements * p0.num / p0.den; };
  for (int64_t line = 0; line < (by_rows ? 1 : p0.rows); ++line) {
    std::vector<int64_t> used(world, 0);
    auto take = [&](int64_t r, int64_t n) {
      const std::byte* at = ranks[r].data + (by_rows ? 0 : line * ranks[r].row_bytes()) + used[r];
      used[r] += n;
      return at;
    };
    for (const ShardSegment& s : shard.segments) {
      if (s.count % world == 0) {
        for (int64_t r = 0; r < world; ++r) {
          const int64_t n = bytes_of(s.count / world * s.size);
          const std::byte* at = take(r, n);
          out.insert(out.end(), at, at + n);
        }
        continue;
      }
      EXPECT_TRUE(s.replicate) << what;
      const int64_t n = bytes_of(s.size);
      const std::byte* first = nullptr;
      for (int64_t r = 0; r < world; ++r) {
        const std::byte* at = take(r, n);
        if (r == 0 || r * s.count / world != (r - 1) * s.count / world) {
          out.insert(out.end(), at, at + n);
          first = at;
        } else {
          EXPECT_EQ(std::memcmp(at, first, static_cast<size_t>(n)), 0) << what << ": replica on rank " << r;
        }
      }
    }
    for (int64_t r = 0; r < world; ++r) {
      EXPECT_EQ(used[r], by_rows ? ranks[r].rows * ranks[r].row_bytes() : ranks[r].row_bytes())
          << what << ": rank " << r << " holds more than its declaration";
    }
  }
  return out;
}

void expect_reassembles(const Shard& shard, const std::vector<CpuMatrix>& ranks, const CpuMatrix& full,
                        const std::string& what) {
  const std::vector<Plane> whole = planes(full);
  for (size_t k = 0; k < whole.size(); ++k) {
    std::vector<Plane> parts;
    for (const CpuMatrix& m : ranks) parts.push_back(planes(m)[k]);
    EXPECT_TRUE(reassemble(shard, parts, what) == whole[k].bytes()) << what << " (plane " << k << ")";
  }
}

// A parameter's values as [entries of dim 0, the rest].
CpuMatrix f32_matrix(const std::vector<float>& v, int64_t row_length) {
  return {.format = CpuWeightFormat::kF32,
          .rows = static_cast<int64_t>(v.size()) / row_length,
          .cols = row_length,
          .data = v.data()};
}

// The raw checkpoint's matrix of one linear, resolved without the store.
CpuMatrix raw_linear(const SafetensorsSet& raw, const std::string& module, int64_t out, int64_t in) {
  const LinearWeight lw = value(linear_weight_resolve(raw, module, out, in), module);
  if (lw.format == WeightFormat::kNvfp4) {
    return {.format = CpuWeightFormat::kNvfp4,
            .rows = out,
            .cols = in,
            .data = lw.weight->data.data(),
            .block_scales = reinterpret_cast<const uint8_t*>(lw.weight_scale->data.data())};
  }
  return {.format = lw.format == WeightFormat::kF32 ? CpuWeightFormat::kF32 : CpuWeightFormat::kBf16,
          .rows = out,
          .cols = in,
          .data = lw.weight->data.data()};
}

// Expert x's gate, up and down of a fused group, from `find`'s tensors.
template <class Find>
std::vector<CpuMatrix> fused_expert(const Find& find, const ExpertGroupSpec& g, int64_t x) {
  const int64_t i = g.intermediate, h = g.hidden;
  const std::byte* gu = find(g.prefix + ".gate_up_proj")->data.data();
  const std::byte* d = find(g.prefix + ".down_proj")->data.data();
  return {{.rows = i, .cols = h, .data = gu + x * 2 * i * h * 2},
          {.rows = i, .cols = h, .data = gu + (x * 2 * i + i) * h * 2},
          {.rows = h, .cols = i, .data = d + x * h * i * 2}};
}

std::vector<CpuMatrix> raw_expert(const SafetensorsSet& raw, const ExpertGroupSpec& g, int64_t x) {
  auto find = [&](const std::string& n) { return raw.find(n); };
  if (find(g.prefix + ".gate_up_proj") != nullptr) return fused_expert(find, g, x);
  const std::string name = g.prefix + "." + std::to_string(x);
  return {raw_linear(raw, name + ".gate_proj", g.intermediate, g.hidden),
          raw_linear(raw, name + ".up_proj", g.intermediate, g.hidden),
          raw_linear(raw, name + ".down_proj", g.hidden, g.intermediate)};
}

const std::vector<std::string> kFixtures = {"qwen3",       "qwen3_moe",         "qwen3_5_moe",
                                            "glm_moe_dsa", "qwen3_5_moe_fused", "qwen3_5_moe_nvfp4"};

// World 1, with the schema's declarations and without any: every matrix is the mapped tensor itself (the same
// address, where its alignment allowed that before) and every parameter its decoded bytes.
class WorldOne : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

// `got` has `raw`'s shape and bytes (read from a mapping of its own) and, where the store's own tensor was aligned for
// its element type, points into that tensor at `stored`.
void expect_view(const CpuMatrix& got, const CpuMatrix& raw, const std::vector<const std::byte*>& stored,
                 const std::string& what) {
  EXPECT_EQ(got.format, raw.format) << what;
  EXPECT_EQ(got.rows, raw.rows) << what;
  EXPECT_EQ(got.cols, raw.cols) << what;
  const std::vector<Plane> g = planes(got), r = planes(raw);
  ASSERT_EQ(stored.size(), r.size()) << what;
  for (size_t k = 0; k < r.size(); ++k) {
    const auto align = static_cast<uintptr_t>(raw.format == CpuWeightFormat::kNvfp4 ? 1 : r[k].num);
    if (reinterpret_cast<uintptr_t>(stored[k]) % align == 0) {
      EXPECT_EQ(g[k].data, stored[k]) << what << ": not a view into the checkpoint (plane " << k << ")";
    }
    EXPECT_TRUE(g[k].bytes() == r[k].bytes()) << what;
  }
}

std::vector<const std::byte*> stored_planes(const WeightStore& store, const std::string& module) {
  std::vector<const std::byte*> p = {store.find(module + ".weight")->data.data()};
  if (const TensorView* s = store.find(module + ".weight_scale")) p.push_back(s->data.data());
  return p;
}

TEST_P(WorldOne, IsTheWholeTensorInPlace) {
  const auto& [name, shard] = GetParam();
  const Checkpoint c = open_fixture(name);
  auto store = open_store(name, c.schema, {0, 1}, shard);
  for (const LinearSpec& l : c.schema.linears) {
    if (c.raw.find(l.module + ".weight") == nullptr && l.role == LinearRole::kLmHead) continue;  // tied
    const Linear got = value(store->linear(l.module, l.out_features, l.in_features), l.module);
    expect_view(got.matrix(), raw_linear(c.raw, l.module, l.out_features, l.in_features),
                stored_planes(*store, l.module), l.module);
  }
  for (const ParamSpec& p : c.schema.params) {
    const std::vector<float> got = value(store->vector(p.name, p.shape), p.name);
    const std::vector<float> want = decode(*c.raw.find(p.name));
    ASSERT_EQ(got.size(), want.size()) << p.name;
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0) << p.name;
  }
  const std::string embed = c.schema.text_prefix + "embed_tokens.weight";
  const CpuMatrix e = value(store->dense_matrix(embed, c.config.vocab_size, c.config.hidden_size), embed);
  const std::string embed_module = embed.substr(0, embed.size() - 7);
  expect_view(e, raw_linear(c.raw, embed_module, c.config.vocab_size, c.config.hidden_size),
              stored_planes(*store, embed_module), embed);
  for (const ExpertGroupSpec& g : c.schema.expert_groups) {
    const std::vector<MlpWeights> got = value(store->experts(g), g.prefix).experts;
    ASSERT_EQ(static_cast<int64_t>(got.size()), g.num_experts);
    for (int64_t x = 0; x < g.num_experts; ++x) {
      const std::vector<CpuMatrix> want = raw_expert(c.raw, g, x);
      std::vector<std::vector<const std::byte*>> stored;
      if (store->find(g.prefix + ".gate_up_proj") != nullptr) {
        auto find = [&](const std::string& n) { return store->find(n); };
        for (const CpuMatrix& m : fused_expert(find, g, x)) stored.push_back({static_cast<const std::byte*>(m.data)});
      } else {
        for (const char* p : {".gate_proj", ".up_proj", ".down_proj"}) {
          stored.push_back(stored_planes(*store, g.prefix + "." + std::to_string(x) + p));
        }
      }
      const std::string what = g.prefix + "." + std::to_string(x);
      expect_view(got[x].gate_proj.matrix(), want[0], stored[0], what + " gate");
      expect_view(got[x].up_proj.matrix(), want[1], stored[1], what + " up");
      expect_view(got[x].down_proj.matrix(), want[2], stored[2], what + " down");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, WorldOne, ::testing::Combine(::testing::ValuesIn(kFixtures), ::testing::Bool()));

// Every tensor of a fixture at world 2 or 4: the ranks' slices reassemble to the checkpoint's tensor.
class Reassembly : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(Reassembly, RanksPutBackTogetherGiveTheCheckpoint) {
  const auto& [name, world] = GetParam();
  const Checkpoint c = open_fixture(name);
  std::vector<std::unique_ptr<WeightStore>> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(open_store(name, c.schema, {r, world}));
  for (const LinearSpec& l : c.schema.linears) {
    if (c.raw.find(l.module + ".weight") == nullptr && l.role == LinearRole::kLmHead) continue;
    std::vector<CpuMatrix> slices;
    for (auto& s : ranks)
      slices.push_back(value(s->linear(l.module, l.out_features, l.in_features), l.module).matrix());
    expect_reassembles(l.shard, slices, raw_linear(c.raw, l.module, l.out_features, l.in_features), l.module);
  }
  for (const ParamSpec& p : c.schema.params) {
    std::vector<std::vector<float>> values;
    for (auto& s : ranks) values.push_back(value(s->vector(p.name, p.shape), p.name));
    const std::vector<float> full = decode(*c.raw.find(p.name));
    std::vector<CpuMatrix> slices;
    const int64_t row = static_cast<int64_t>(full.size()) / p.shape[0];
    for (const auto& v : values) slices.push_back(f32_matrix(v, row));
    expect_reassembles(p.shard, slices, f32_matrix(full, row), p.name);
  }
  const std::string embed = c.schema.text_prefix + "embed_tokens.weight";
  std::vector<CpuMatrix> slices;
  for (auto& s : ranks)
    slices.push_back(value(s->dense_matrix(embed, c.config.vocab_size, c.config.hidden_size), embed));
  expect_reassembles(Shard::vocab(), slices,
                     raw_linear(c.raw, embed.substr(0, embed.size() - 7), c.config.vocab_size, c.config.hidden_size),
                     embed);
  for (const ExpertGroupSpec& g : c.schema.expert_groups) {
    std::vector<std::vector<MlpWeights>> got;
    for (auto& s : ranks) {
      WeightStore::Experts mine = value(s->experts(g), g.prefix);
      ASSERT_EQ(mine.first, 0) << g.prefix;
      got.push_back(std::move(mine.experts));
    }
    for (int64_t x = 0; x < g.num_experts; ++x) {
      const std::vector<CpuMatrix> want = raw_expert(c.raw, g, x);
      std::vector<CpuMatrix> gate, up, down;
      for (const auto& e : got) {
        gate.push_back(e[x].gate_proj.matrix());
        up.push_back(e[x].up_proj.matrix());
        down.push_back(e[x].down_proj.matrix());
      }
      const std::string what = g.prefix + "." + std::to_string(x);
      expect_reassembles(g.gate_up_shard, gate, want[0], what + " gate");
      expect_reassembles(g.gate_up_shard, up, want[1], what + " up");
      expect_reassembles(g.down_shard, down, want[2], what + " down");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldTwo, Reassembly,
                         ::testing::Combine(::testing::ValuesIn(kFixtures), ::testing::Values(2)));

// Expert parallelism: rank r holds experts [r E / world, (r + 1) E / world) whole, each the checkpoint's expert, so
// the ranks' experts in rank order are the checkpoint's experts, every one once.
class ExpertParallel : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ExpertParallel, RanksHoldWholeExpertsInTurn) {
  const auto& [name, world] = GetParam();
  const Checkpoint c = open_fixture(name);
  ASSERT_FALSE(c.schema.expert_groups.empty()) << name;
  std::vector<std::unique_ptr<WeightStore>> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(open_store(name, c.schema, {r, world, true}));
  for (const ExpertGroupSpec& g : c.schema.expert_groups) {
    int64_t next = 0;
    for (int r = 0; r < world; ++r) {
      const WeightStore::Experts mine = value(ranks[r]->experts(g), g.prefix);
      EXPECT_EQ(mine.first, next) << g.prefix << " rank " << r;
      ASSERT_EQ(static_cast<int64_t>(mine.experts.size()), g.num_experts / world) << g.prefix << " rank " << r;
      for (size_t i = 0; i < mine.experts.size(); ++i) {
        const int64_t x = mine.first + static_cast<int64_t>(i);
        const std::vector<CpuMatrix> want = raw_expert(c.raw, g, x);
        const std::string what = g.prefix + "." + std::to_string(x);
        // One "slice" each: the whole matrix.
        expect_reassembles(Shard::replicated(), {mine.experts[i].gate_proj.matrix()}, want[0], what + " gate");
        expect_reassembles(Shard::replicated(), {mine.experts[i].up_proj.matrix()}, want[1], what + " up");
        expect_reassembles(Shard::replicated(), {mine.experts[i].down_proj.matrix()}, want[2], what + " down");
      }
      next = mine.first + static_cast<int64_t>(mine.experts.size());
    }
    EXPECT_EQ(next, g.num_experts) << g.prefix;
  }
}

// Every MoE fixture (8 experts) at 4, 2 and 1 expert a rank: the experts split whole whatever their widths.
INSTANTIATE_TEST_SUITE_P(MoeFixtures, ExpertParallel,
                         ::testing::Combine(::testing::Values("qwen3_moe", "qwen3_5_moe", "glm_moe_dsa",
                                                              "qwen3_5_moe_fused", "qwen3_5_moe_nvfp4"),
                                            ::testing::Values(2, 4, 8)));

// Experts that do not divide among the ranks are refused naming the group, the counts and what to do instead.
TEST(ExpertParallel, ExpertsThatDoNotDivideAreRefused) {
  const Checkpoint c = open_fixture("qwen3_moe");
  ASSERT_FALSE(c.schema.expert_groups.empty());
  const ExpertGroupSpec& g = c.schema.expert_groups.front();
  ASSERT_EQ(g.num_experts, 8);
  const auto refused = expert_group_rank(g, {1, 3, true});
  ASSERT_FALSE(refused.has_value());
  const std::string& m = refused.error().message;
  EXPECT_NE(m.find(g.prefix), std::string::npos) << m;
  EXPECT_NE(m.find("8 experts do not divide among 3"), std::string::npos) << m;
  EXPECT_NE(m.find("--enable-expert-parallel"), std::string::npos) << m;
  // Without expert parallelism the same world slices every expert instead (which these widths may or may not allow).
  const auto sliced = expert_group_rank(g, {1, 3, false});
  ASSERT_TRUE(sliced.has_value());
  EXPECT_EQ(sliced->first, 0);
  EXPECT_EQ(sliced->count, 8);
  EXPECT_EQ(sliced->gate_up.dim, ShardDim::kOutput);
}
// Qwen3.5's 2 GDN key heads and its NVFP4 experts' 32 intermediate columns do not split four ways.
INSTANTIATE_TEST_SUITE_P(WorldFour, Reassembly,
                         ::testing::Combine(::testing::Values("qwen3", "qwen3_moe", "glm_moe_dsa"),
                                            ::testing::Values(4)));

// Dummy weights (--load-format dummy) are sliced by the same declarations: NVFP4 ones included.
TEST(DummyWeights, RanksPutBackTogetherGiveTheWholeDummy) {
  const Checkpoint c = open_fixture("qwen3_5_moe_nvfp4");
  const auto quant = value(quant_config_load(fixture_dir("qwen3_5_moe_nvfp4")), "quant config");
  ASSERT_TRUE(quant.has_value());
  auto whole = WeightStore::make_dummy(c.config, c.schema, quant, 7);
  std::vector<std::unique_ptr<WeightStore>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(WeightStore::make_dummy(c.config, c.schema, quant, 7));
    ranks.back()->set_sharding(c.schema, {r, 2});
  }
  for (const LinearSpec& l : c.schema.linears) {
    std::vector<CpuMatrix> slices;
    for (auto& s : ranks) {
      slices.push_back(value(s->linear(l.module, l.out_features, l.in_features), l.module).matrix());
    }
    const Linear full = value(whole->linear(l.module, l.out_features, l.in_features), l.module);
    expect_reassembles(l.shard, slices, full.matrix(), l.module);
  }
  const ExpertGroupSpec& g = c.schema.expert_groups.at(1);
  const std::vector<MlpWeights> full = value(whole->experts(g), g.prefix).experts;
  ASSERT_EQ(full.at(3).down_proj.matrix().format, CpuWeightFormat::kNvfp4);
  std::vector<CpuMatrix> down;
  for (auto& s : ranks) down.push_back(value(s->experts(g), g.prefix).experts.at(3).down_proj.matrix());
  expect_reassembles(g.down_shard, down, full.at(3).down_proj.matrix(), g.prefix + ".3.down_proj");
}

// A block-wise FP8 config (Qwen3-FP8's quantization_config) makes FP8 dummies of every linear but the router and
// lm_head, as the releases ship them: finite e4m3 codes (no NaN byte) whose values, code times block scale, have the
// BF16 dummies' spread (N(0, 0.02)). (The fixture's 128-wide inputs cannot split over two ranks on 128-column blocks.)
TEST(DummyWeights, Fp8ConfigMakesBlockFp8Linears) {
  const Checkpoint c = open_fixture("qwen3_moe");
  const auto quant = value(quant_config_parse_quantization_config(
                               nlohmann::json::parse(R"({"quant_method": "fp8", "fmt": "e4m3",
                                   "activation_scheme": "dynamic", "weight_block_size": [128, 128]})"),
                               "config.json quantization_config"),
                           "quant config");
  auto store = WeightStore::make_dummy(c.config, c.schema, quant, 11);
  int fp8_linears = 0;
  auto check = [&](const CpuMatrix& m, const std::string& what) {
    ASSERT_EQ(m.format, CpuWeightFormat::kFp8Block128) << what;
    double sum = 0.0, sq = 0.0;
    const auto* codes = static_cast<const uint8_t*>(m.data);
    const int64_t scale_cols = (m.cols + 127) / 128;
    for (int64_t r = 0; r < m.rows; ++r) {
      for (int64_t k = 0; k < m.cols; ++k) {
        const uint8_t code = codes[r * m.cols + k];
        ASSERT_NE(code & 0x7F, 0x7F) << what << ": a NaN code at " << r << ", " << k;
        const double v = e4m3_to_float(code) * m.row_block_scales[r * scale_cols + k / 128];
        sum += v;
        sq += v * v;
      }
    }
    const double n = static_cast<double>(m.rows * m.cols), mean = sum / n;
    const double sd = std::sqrt(sq / n - mean * mean);
    EXPECT_NEAR(sd, 0.02, 0.004) << what;
    EXPECT_NEAR(mean, 0.0, 0.004) << what;
    ++fp8_linears;
  };
  for (const LinearSpec& l : c.schema.linears) {
    const Linear lin = value(store->linear(l.module, l.out_features, l.in_features), l.module);
    if (l.role == LinearRole::kRouter || l.role == LinearRole::kLmHead) {
      EXPECT_EQ(lin.matrix().format, CpuWeightFormat::kBf16) << l.module;
    } else {
      check(lin.matrix(), l.module);
    }
  }
  const ExpertGroupSpec& g = c.schema.expert_groups.at(0);
  const std::vector<MlpWeights> experts = value(store->experts(g), g.prefix).experts;
  check(experts.at(1).gate_proj.matrix(), g.prefix + ".1.gate_proj");
  check(experts.at(1).down_proj.matrix(), g.prefix + ".1.down_proj");
  EXPECT_GT(fp8_linears, 4);
}

// BF16 dummies (every linear of a BF16 model): the spread of N(0, 0.02), mean 0, each tensor distinct, no
// non-finite value.
TEST(DummyWeights, Bf16LinearsAreNormalWithTheirSpread) {
  const Checkpoint c = open_fixture("qwen3");
  auto store = WeightStore::make_dummy(c.config, c.schema, std::nullopt, 5);
  std::vector<double> sums;  // one per tensor: all distinct (each its own stream)
  for (const LinearSpec& l : c.schema.linears) {
    if (!store->contains(l.module + ".weight")) continue;  // lm_head tied to the embedding
    const CpuMatrix m = value(store->linear(l.module, l.out_features, l.in_features), l.module).matrix();
    ASSERT_EQ(m.format, CpuWeightFormat::kBf16) << l.module;
    double sum = 0.0, sq = 0.0;
    const int64_t n = m.rows * m.cols;
    for (int64_t i = 0; i < n; ++i) {
      const double v = bf16_to_float(u16_at(m.data, i));
      ASSERT_TRUE(std::isfinite(v)) << l.module << " element " << i;
      sum += v;
      sq += v * v;
    }
    const double mean = sum / static_cast<double>(n), sd = std::sqrt(sq / static_cast<double>(n) - mean * mean);
    EXPECT_NEAR(sd, 0.02, 0.02 * (0.05 + 5 / std::sqrt(2.0 * static_cast<double>(n)))) << l.module;
    EXPECT_NEAR(mean, 0.0, 5 * 0.02 / std::sqrt(static_cast<double>(n))) << l.module;
    sums.push_back(sum);
  }
  ASSERT_GT(sums.size(), 4u);
  std::sort(sums.begin(), sums.end());
  EXPECT_EQ(std::adjacent_find(sums.begin(), sums.end()), sums.end());
}

// Spot checks: one slice element against the raw bytes, the index written out by hand.

TEST(ShardSpotCheck, GatedQProjKeepsQueryAndGateOfEachHead) {
  // qwen3_5_moe layer 3 (full attention): 4 heads of [query 64 | gate 64] rows, hidden 64. World 2: rank 1 holds
  // heads 2 and 3, full rows [256, 512).
  const Checkpoint c = open_fixture("qwen3_5_moe");
  const std::string q = c.schema.text_prefix + "layers.3.self_attn.q_proj";
  auto store = open_store("qwen3_5_moe", c.schema, {1, 2});
  const CpuMatrix m = value(store->linear(q, 512, 64), q).matrix();
  ASSERT_EQ(m.rows, 256);
  ASSERT_EQ(m.cols, 64);
  const TensorView& raw = *c.raw.find(q + ".weight");
  // slice row 128 + 64 + 5 = head 3's gate row 5 = full row 3 * 128 + 64 + 5; column 7
  EXPECT_EQ(u16_at(m.data, (128 + 64 + 5) * 64 + 7), u16_at(raw.data.data(), (3 * 128 + 64 + 5) * 64 + 7));
  // slice row 10 = head 2's query row 10 = full row 2 * 128 + 10; column 63
  EXPECT_EQ(u16_at(m.data, 10 * 64 + 63), u16_at(raw.data.data(), (2 * 128 + 10) * 64 + 63));
}

TEST(ShardSpotCheck, PlainQProjAndKvHeadsReplicatedBeyondTheirCount) {
  // qwen3: 4 heads / 2 KV heads of 32 rows, hidden 64. World 4: rank 3 holds q head 3 (full rows [96, 128)) and
  // KV head 3 * 2 / 4 = 1 (full rows [32, 64)); rank 1 holds KV head 0.
  const Checkpoint c = open_fixture("qwen3");
  const std::string q = "model.layers.1.self_attn.q_proj", k = "model.layers.1.self_attn.k_proj";
  auto r3 = open_store("qwen3", c.schema, {3, 4});
  auto r1 = open_store("qwen3", c.schema, {1, 4});
  const CpuMatrix mq = value(r3->linear(q, 128, 64), q).matrix();
  const CpuMatrix mk3 = value(r3->linear(k, 64, 64), k).matrix();
  const CpuMatrix mk1 = value(r1->linear(k, 64, 64), k).matrix();
  ASSERT_EQ(mq.rows, 32);
  ASSERT_EQ(mk3.rows, 32);
  ASSERT_EQ(mk1.rows, 32);
  const std::byte* rq = c.raw.find(q + ".weight")->data.data();
  const std::byte* rk = c.raw.find(k + ".weight")->data.data();
  EXPECT_EQ(u16_at(mq.data, 17 * 64 + 3), u16_at(rq, (96 + 17) * 64 + 3));
  EXPECT_EQ(u16_at(mk3.data, 5 * 64 + 40), u16_at(rk, (32 + 5) * 64 + 40));
  EXPECT_EQ(u16_at(mk1.data, 31 * 64 + 0), u16_at(rk, 31 * 64 + 0));
}

TEST(ShardSpotCheck, RowParallelOProjTakesItsHeadsColumns) {
  // qwen3 o_proj [64, 128]: world 2, rank 1 holds input columns [64, 128) (heads 2, 3).
  const Checkpoint c = open_fixture("qwen3");
  const std::string o = "model.layers.2.self_attn.o_proj";
  auto store = open_store("qwen3", c.schema, {1, 2});
  const CpuMatrix m = value(store->linear(o, 64, 128), o).matrix();
  ASSERT_EQ(m.rows, 64);
  ASSERT_EQ(m.cols, 64);
  const std::byte* raw = c.raw.find(o + ".weight")->data.data();
  EXPECT_EQ(u16_at(m.data, 3 * 64 + 5), u16_at(raw, 3 * 128 + 64 + 5));
  EXPECT_EQ(u16_at(m.data, 63 * 64 + 63), u16_at(raw, 63 * 128 + 127));
}

TEST(ShardSpotCheck, GdnInProjQkvAndConvSplitPerPart) {
  // qwen3_5_moe layer 0 (GDN): 2 key heads and 4 value heads of 32; in_proj_qkv rows q [0, 64) | k [64, 128) |
  // v [128, 256), conv1d [256, 1, 4] channels likewise. World 2, rank 1: q rows [32, 64), k [96, 128),
  // v [192, 256), i.e. slice rows [0, 32) [32, 64) [64, 128).
  const Checkpoint c = open_fixture("qwen3_5_moe");
  const std::string p = c.schema.text_prefix + "layers.0.linear_attn.";
  auto store = open_store("qwen3_5_moe", c.schema, {1, 2});
  const CpuMatrix m = value(store->linear(p + "in_proj_qkv", 256, 64), p).matrix();
  ASSERT_EQ(m.rows, 128);
  const std::byte* raw = c.raw.find(p + "in_proj_qkv.weight")->data.data();
  EXPECT_EQ(u16_at(m.data, 10 * 64 + 1), u16_at(raw, (32 + 10) * 64 + 1));
  EXPECT_EQ(u16_at(m.data, 40 * 64 + 2), u16_at(raw, (96 + 8) * 64 + 2));
  EXPECT_EQ(u16_at(m.data, 100 * 64 + 3), u16_at(raw, (192 + 36) * 64 + 3));
  const std::vector<float> conv = value(store->vector(p + "conv1d.weight", {256, 1, 4}), p);
  ASSERT_EQ(conv.size(), 128u * 4);
  const std::byte* raw_conv = c.raw.find(p + "conv1d.weight")->data.data();
  EXPECT_EQ(conv[40 * 4 + 2], bf16_to_float(u16_at(raw_conv, (96 + 8) * 4 + 2)));
  EXPECT_EQ(conv[127 * 4 + 3], bf16_to_float(u16_at(raw_conv, 255 * 4 + 3)));
  const std::vector<float> a_log = value(store->vector(p + "A_log", {4}), p);
  ASSERT_EQ(a_log.size(), 2u);
  EXPECT_EQ(a_log[1], decode(*c.raw.find(p + "A_log"))[3]);
}

TEST(ShardSpotCheck, Nvfp4ExpertDownProjSplitsItsInputWithItsScales) {
  // qwen3_5_moe_nvfp4 layer 0 expert 5 down_proj: [64, 32] NVFP4, codes U8 [64, 16], scales e4m3 [64, 2]. World
  // 2, rank 1: input columns [16, 32), i.e. code bytes [8, 16) and scale column 1 of every row.
  const Checkpoint c = open_fixture("qwen3_5_moe_nvfp4");
  const ExpertGroupSpec& g = c.schema.expert_groups.at(0);
  auto store = open_store("qwen3_5_moe_nvfp4", c.schema, {1, 2});
  const std::vector<MlpWeights> experts = value(store->experts(g), g.prefix).experts;
  const CpuMatrix m = experts.at(5).down_proj.matrix();
  ASSERT_EQ(m.format, CpuWeightFormat::kNvfp4);
  ASSERT_EQ(m.rows, 64);
  ASSERT_EQ(m.cols, 16);
  const std::string down = g.prefix + ".5.down_proj";
  const auto* codes = reinterpret_cast<const uint8_t*>(c.raw.find(down + ".weight")->data.data());
  const auto* scales = reinterpret_cast<const uint8_t*>(c.raw.find(down + ".weight_scale")->data.data());
  const auto* got_codes = static_cast<const uint8_t*>(m.data);
  EXPECT_EQ(got_codes[5 * 8 + 3], codes[5 * 16 + 8 + 3]);
  EXPECT_EQ(got_codes[63 * 8 + 7], codes[63 * 16 + 15]);
  EXPECT_EQ(m.block_scales[5], scales[5 * 2 + 1]);
  EXPECT_EQ(m.block_scales[63], scales[63 * 2 + 1]);
  // Decoded, row 9 of the slice is columns [16, 32) of the full row 9.
  const CpuMatrix full = raw_linear(c.raw, down, 64, 32);
  CpuMatrix full_scaled = full;
  full_scaled.global_scale = m.global_scale;
  std::vector<float> got(16), want(32);
  cpu_matrix_row(m, 9, got.data());
  cpu_matrix_row(full_scaled, 9, want.data());
  for (int k = 0; k < 16; ++k) EXPECT_EQ(got[k], want[16 + k]) << k;
}

// Errors: each names the tensor and, where a shape is at fault, the world size.

void expect_error(const Expected<Linear>& got, const std::vector<std::string>& parts) {
  ASSERT_FALSE(got.has_value());
  for (const std::string& p : parts) EXPECT_NE(got.error().message.find(p), std::string::npos) << got.error().message;
}

TEST(ShardErrors, HeadsThatDoNotDivide) {
  const Checkpoint c = open_fixture("qwen3");
  auto store = open_store("qwen3", c.schema, {0, 3});
  expect_error(store->linear("model.layers.0.self_attn.q_proj", 128, 64),
               {"model.layers.0.self_attn.q_proj.weight", "world size 3", "4 units of 32"});
  expect_error(store->linear("model.layers.0.self_attn.k_proj", 64, 64),
               {"model.layers.0.self_attn.k_proj.weight", "world size 3", "2 units of 32"});
  const Checkpoint q35 = open_fixture("qwen3_5_moe");
  auto four = open_store("qwen3_5_moe", q35.schema, {0, 4});
  const std::string qkv = q35.schema.text_prefix + "layers.0.linear_attn.in_proj_qkv";
  expect_error(four->linear(qkv, 256, 64), {qkv + ".weight", "world size 4", "2 units of 32"});
}

TEST(ShardErrors, Nvfp4InputSplitOffTheScaleBlocks) {
  // 32 intermediate columns over 4 ranks: 8 each, half an NVFP4 scale block.
  const Checkpoint c = open_fixture("qwen3_5_moe_nvfp4");
  const ExpertGroupSpec& g = c.schema.expert_groups.at(0);
  auto store = open_store("qwen3_5_moe_nvfp4", c.schema, {1, 4});
  auto got = store->experts(g);
  ASSERT_FALSE(got.has_value());
  const std::string& msg = got.error().message;
  EXPECT_NE(msg.find(g.prefix + ".0.down_proj.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("16-element"), std::string::npos) << msg;
  EXPECT_NE(msg.find("world size 4"), std::string::npos) << msg;
}

TEST(ShardErrors, RankOutsideTheWorld) {
  const Checkpoint c = open_fixture("qwen3");
  for (ShardRank bad : {ShardRank{2, 2}, ShardRank{-1, 2}, ShardRank{0, 0}, ShardRank{0, -3}}) {
    auto store = open_store("qwen3", c.schema, bad);
    const std::string norm = "model.layers.0.input_layernorm.weight";
    auto v = store->vector(norm, {64});
    ASSERT_FALSE(v.has_value());
    EXPECT_NE(v.error().message.find(norm), std::string::npos) << v.error().message;
    expect_error(store->linear("model.layers.0.mlp.down_proj", 64, 128), {"model.layers.0.mlp.down_proj"});
    auto e = store->dense_matrix("model.embed_tokens.weight", 512, 64);
    ASSERT_FALSE(e.has_value());
    EXPECT_NE(e.error().message.find("model.embed_tokens.weight"), std::string::npos) << e.error().message;
  }
}

TEST(ShardErrors, UndeclaredTensorAboveWorldOne) {
  const Checkpoint c = open_fixture("qwen3");
  auto store = open_store("qwen3", WeightSchema{}, {0, 2});
  expect_error(store->linear("model.layers.0.mlp.down_proj", 64, 128),
               {"model.layers.0.mlp.down_proj", "no shard declaration"});
}

TEST(ShardPieces, DeclarationArithmetic) {
  // Segments that do not cover the extent, and the vocabulary padding rule.
  auto bad = shard_pieces(Shard::output({{4, 8}}), 40, {0, 2}, "t");
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("cover 32 of its 40"), std::string::npos) << bad.error().message;
  // 100 rows over 4 ranks pad to 256: ranges of 64 rows, rank 1's clipped to [64, 100), ranks 2 and 3 empty.
  auto second = shard_pieces(Shard::vocab(), 100, {1, 4}, "t");
  ASSERT_TRUE(second.has_value());
  ASSERT_EQ(second->size(), 1u);
  EXPECT_EQ((*second)[0].offset, 64);
  EXPECT_EQ((*second)[0].length, 36);
  auto last = shard_pieces(Shard::vocab(), 100, {3, 4}, "t");
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(shard_pieces_length(*last), 0);
  // 512 rows over 3 ranks pad to 576: [0, 192), [192, 384), [384, 512).
  auto third = shard_pieces(Shard::vocab(), 512, {2, 3}, "t");
  ASSERT_TRUE(third.has_value());
  ASSERT_EQ(third->size(), 1u);
  EXPECT_EQ((*third)[0].offset, 384);
  EXPECT_EQ((*third)[0].length, 128);
  // World 1 merges every segment into one piece.
  auto one = shard_pieces(Shard::output({{2, 32}, {2, 32}, {4, 32, true}}), 256, {0, 1}, "t");
  ASSERT_TRUE(one.has_value());
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ((*one)[0].length, 256);
}

TEST(ShardPieces, CachedStates) {
  // qwen3 K cache [2 KV heads, 32] at world 4: rank 3 holds KV head 3 * 2 / 4 = 1.
  const Checkpoint q3 = open_fixture("qwen3");
  const StateSpec& k = q3.schema.states.at(0);
  ASSERT_EQ(k.name, "model.layers.0.self_attn.k_cache");
  auto kv = value(shard_pieces(k.shard, k.shape[0], {3, 4}, k.name), k.name);
  ASSERT_EQ(kv.size(), 1u);
  EXPECT_EQ(kv[0].offset, 1);
  EXPECT_EQ(kv[0].length, 1);
  // qwen3_5_moe layer 0 GDN conv state [256 channels, 3] at world 2, rank 1: q [32, 64), k [96, 128), v [192, 256);
  // recurrent state [4 value heads, 32, 32]: heads [2, 4).
  const Checkpoint q35 = open_fixture("qwen3_5_moe");
  const std::string p = q35.schema.text_prefix + "layers.0.linear_attn.";
  for (const StateSpec& st : q35.schema.states) {
    if (st.name == p + "conv_state") {
      EXPECT_EQ(st.shape, (std::vector<int64_t>{256, 3}));
      auto c = value(shard_pieces(st.shard, 256, {1, 2}, st.name), st.name);
      ASSERT_EQ(c.size(), 3u);
      EXPECT_EQ(c[0].offset, 32);
      EXPECT_EQ(c[1].offset, 96);
      EXPECT_EQ(c[2].offset, 192);
      EXPECT_EQ(c[2].length, 64);
    }
    if (st.name == p + "recurrent_state") {
      auto r = value(shard_pieces(st.shard, 4, {1, 2}, st.name), st.name);
      ASSERT_EQ(r.size(), 1u);
      EXPECT_EQ(r[0].offset, 2);
      EXPECT_EQ(r[0].length, 2);
    }
  }
}

}  // namespace
}  // namespace tern
