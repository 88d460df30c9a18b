// The two forms of multi-head latent attention (layers/mla.h) on random fp32 weights with a DSA indexer whose top-k
// is below the sequence length: the weight-absorbed form equals the expanded one, and decoding step by step from the
// latent cache (absorbed, kAuto's choice once a cache exists) equals one pass over the whole sequence (expanded).
// The model-level check against transformers is runtime/model_reference_test.cc (glm_moe_dsa fixture).
#include "layers/mla.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "layers/batch.h"

namespace tern {
namespace {

constexpr int64_t kHidden = 48, kHeads = 4, kQLora = 24, kKvLora = 256, kNope = 16, kRope = 8, kV = 16;
constexpr int64_t kIndexHeads = 4, kIndexDim = 16, kTopK = 6;

// Random fp32 weights that outlive the layer built on them.
struct MlaFixture {
  std::mt19937 rng{20261202};
  std::vector<std::unique_ptr<std::vector<float>>> storage;

  std::vector<float> random(int64_t n, float lo, float hi) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = u(rng);
    return v;
  }
  Linear linear(const char* name, int64_t rows, int64_t cols) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(cols));
    storage.push_back(std::make_unique<std::vector<float>>(random(rows * cols, -bound, bound)));
    return Linear(name, CpuMatrix{.format = CpuWeightFormat::kF32, .rows = rows, .cols = cols,
                                  .data = storage.back()->data()});
  }
  RmsNorm norm(int64_t dim) { return RmsNorm{.weight = random(dim, 0.5f, 1.5f), .eps = 1e-6f}; }

  MlaAttention build(MlaForm form, std::optional<LatentFp8Scales> latent_fp8 = std::nullopt) {
    MlaWeights w;
    w.q_a_proj = linear("q_a_proj", kQLora, kHidden);
    w.q_a_norm = norm(kQLora);
    w.q_b_proj = linear("q_b_proj", kHeads * (kNope + kRope), kQLora);
    w.kv_a_proj = linear("kv_a_proj", kKvLora + kRope, kHidden);
    w.kv_a_norm = norm(kKvLora);
    w.kv_b_proj = linear("kv_b_proj", kHeads * (kNope + kV), kKvLora);
    w.o_proj = linear("o_proj", kHidden, kHeads * kV);
    w.indexer = MlaIndexerWeights{.wq_b = linear("wq_b", kIndexHeads * kIndexDim, kQLora),
                                  .wk = linear("wk", kIndexDim, kHidden),
                                  .k_norm = LayerNorm{.weight = random(kIndexDim, 0.5f, 1.5f),
                                                      .bias = random(kIndexDim, -0.2f, 0.2f)},
                                  .weights_proj = linear("weights_proj", kIndexHeads, kHidden)};
    const MlaShape shape{.n_heads = kHeads, .q_lora_rank = kQLora, .kv_lora_rank = kKvLora,
                         .qk_nope_head_dim = kNope, .qk_rope_head_dim = kRope, .v_head_dim = kV,
                         .scale = 1.0f / std::sqrt(static_cast<float>(kNope + kRope)), .rope_interleaved = true,
                         .index_topk = kTopK, .index_heads = kIndexHeads, .index_head_dim = kIndexDim,
                         .indexer_rope_interleaved = true, .form = form, .latent_fp8 = latent_fp8};
    return MlaAttention(shape, std::move(w), Rope(kRope, 10000.0));
  }
};

// y for rows [begin, begin + n) of x, appended to one sequence's cache.
std::vector<float> run(const MlaAttention& mla, SequenceCache& cache, const std::vector<float>& x, int64_t begin,
                       int64_t n) {
  Batch batch{.sequences = {BatchSlice{.row_begin = 0, .n_rows = n, .past = begin, .cache = &cache}}, .n_rows = n};
  std::vector<float> y(static_cast<size_t>(n * kHidden), std::nanf(""));
  mla.forward(&x[begin * kHidden], y.data(), batch, 0, nullptr);
  cache.length = begin + n;
  return y;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  float scale = 0.0f;
  for (float v : want) scale = std::max(scale, std::abs(v));
  ASSERT_GT(scale, 0.0f);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << " element " << i;
    ASSERT_NEAR(got[i], want[i], 1e-5f * scale) << what << " row " << i / kHidden << " column " << i % kHidden;
  }
}

constexpr int64_t kTokens = 20;

TEST(Mla, AbsorbedFormEqualsExpandedForm) {
  MlaFixture f, g;  // the same weights, drawn twice in the same order
  const MlaAttention expanded = f.build(MlaForm::kExpanded), absorbed = g.build(MlaForm::kAbsorbed);
  const std::vector<float> x = f.random(kTokens * kHidden, -1.0f, 1.0f);
  SequenceCache ce{.layers = std::vector<LayerCache>(1)}, ca{.layers = std::vector<LayerCache>(1)};
  // A prompt of 12 rows, then a chunk of 8 on top of the cache.
  expect_close(run(absorbed, ca, x, 0, 12), run(expanded, ce, x, 0, 12), "first chunk");
  expect_close(run(absorbed, ca, x, 12, 8), run(expanded, ce, x, 12, 8), "second chunk");
  // The indexer kept kTopK of the 20 keys for the last rows: the sparse selection was exercised.
  EXPECT_EQ(ca.layers[0].selected.back().size(), static_cast<size_t>(kTopK));
  EXPECT_EQ(ca.layers[0].selected, ce.layers[0].selected);
}

TEST(Mla, DecodeFromTheLatentCacheEqualsOnePass) {
  MlaFixture f, g;
  const MlaAttention one = f.build(MlaForm::kAuto), steps = g.build(MlaForm::kAuto);
  const std::vector<float> x = f.random(kTokens * kHidden, -1.0f, 1.0f);
  SequenceCache whole{.layers = std::vector<LayerCache>(1)}, cached{.layers = std::vector<LayerCache>(1)};
  const std::vector<float> want = run(one, whole, x, 0, kTokens);  // nothing cached: the expanded form
  std::vector<float> got = run(steps, cached, x, 0, 5);
  for (int64_t t = 5; t < kTokens; ++t) {  // one token at a time from the cache: the absorbed form
    const std::vector<float> y = run(steps, cached, x, t, 1);
    got.insert(got.end(), y.begin(), y.end());
  }
  expect_close(got, want, "decode");
  EXPECT_EQ(cached.layers[0].k, whole.layers[0].k);  // the latent cache is the same either way
}

// The FP8 latent cache (MlaShape::latent_fp8), both scale forms: the cache holds what each token's FP8 entry holds
// (the fp32 run's latent through latent_fp8_pack and unpack, bit for bit), and since every attention reads the
// cache, the two forms still agree and decoding from the cache still equals one pass.
TEST(Mla, Fp8LatentCacheHoldsTheEntriesAndKeepsTheFormsEqual) {
  for (const LatentFp8Scales scales : {LatentFp8Scales::kFp32, LatentFp8Scales::kPow2}) {
    MlaFixture f, g, h, k;
    const MlaAttention plain = f.build(MlaForm::kAuto), one = g.build(MlaForm::kAuto, scales),
                       steps = h.build(MlaForm::kAuto, scales), expanded = k.build(MlaForm::kExpanded, scales);
    const std::vector<float> x = f.random(kTokens * kHidden, -1.0f, 1.0f);
    SequenceCache fp32{.layers = std::vector<LayerCache>(1)}, whole{.layers = std::vector<LayerCache>(1)},
        cached{.layers = std::vector<LayerCache>(1)}, wide{.layers = std::vector<LayerCache>(1)};
    run(plain, fp32, x, 0, kTokens);
    const std::vector<float> want = run(one, whole, x, 0, kTokens);
    constexpr int64_t kLatent = kKvLora + kRope;
    std::vector<float> entry_values(kLatent);
    std::vector<uint8_t> entry(latent_fp8_bytes(kKvLora, kRope));
    int64_t changed = 0;
    for (int64_t t = 0; t < kTokens; ++t) {
      const float* lat = &fp32.layers[0].k[t * kLatent];
      latent_fp8_pack(lat, lat + kKvLora, kKvLora, kRope, scales, entry.data());
      latent_fp8_unpack(entry.data(), kKvLora, kRope, entry_values.data(), entry_values.data() + kKvLora);
      for (int64_t i = 0; i < kLatent; ++i) {
        ASSERT_EQ(whole.layers[0].k[t * kLatent + i], entry_values[i]) << "token " << t << " value " << i;
        changed += entry_values[i] != lat[i];
      }
    }
    EXPECT_GT(changed, kTokens * kKvLora / 2) << "the FP8 cache should differ from the fp32 one";
    std::vector<float> got = run(steps, cached, x, 0, 5);
    for (int64_t t = 5; t < kTokens; ++t) {
      const std::vector<float> y = run(steps, cached, x, t, 1);
      got.insert(got.end(), y.begin(), y.end());
    }
    expect_close(got, want, "fp8 decode");
    EXPECT_EQ(cached.layers[0].k, whole.layers[0].k);
    // A second chunk on top of a cache in the expanded form against kAuto's absorbed one.
    run(expanded, wide, x, 0, 12);
    SequenceCache auto_cache{.layers = std::vector<LayerCache>(1)};
    run(steps, auto_cache, x, 0, 12);
    expect_close(run(steps, auto_cache, x, 12, 8), run(expanded, wide, x, 12, 8), "fp8 second chunk");
  }
}

}  // namespace
}  // namespace tern
