// The mla_attention and indexer_select harnesses and CPU implementations through the registry, and injected faults:
// for mla_attention a doubled scale, the rope part ignored, the selection ignored, keys one position off and a
// skipped tail; for indexer_select exact ties given to the later key, the head weights ignored, half the heads
// dropped, keys one position off, a dropped entry, a duplicate, a future key, a list not ascending, a wrong -1 tail
// and a row never written. Each must be rejected. The judge of a selection is checked on hand-set scores.
#include "ops/mla_op.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>

#include "core/formats.h"

namespace tern {
namespace {

template <class Inputs>
std::unique_ptr<Inputs> make(const Registry& r, const std::string& op, const SelfTestCase& c, uint64_t seed = 5) {
  auto in = r.harness(op)->make_inputs(c, seed);
  EXPECT_TRUE(in.has_value()) << (in ? "" : in.error().message);
  return in ? std::unique_ptr<Inputs>(static_cast<Inputs*>(in->release())) : nullptr;
}

void expect_rejected(const Selection& s, const std::string& name, const std::string& expected_reason) {
  const CandidateReport* it = s.candidate(name);
  ASSERT_NE(it, nullptr) << name;
  EXPECT_EQ(it->status, CandidateStatus::kFailed) << name;
  EXPECT_NE(it->reason.find(expected_reason), std::string::npos) << name << ": " << it->reason;
}

// ---------------------------------------------------------------------------------------------------------------
// mla_attention

TEST(MlaAttentionOp, CpuImplementationPassesItsSelfTest) {
  Registry r;
  ASSERT_TRUE(mla_register_cpu(r).has_value());
  const std::vector<SelfTestCase> cases = {
      mla_attention_case(3, 1, 40, 4, 32, 16, 0, 48),      // the tiny fixture's shapes, causal decode
      mla_attention_case(2, 1, 100, 4, 32, 16, 16, 48),    // and with its DSA selection
      mla_attention_case(2, 20, 0, 4, 32, 16, 16, 48),     // a prefill whose first rows take all their keys
      mla_attention_case(1, 2, 300, 8, 512, 64, 64, 256),  // GLM-5's latent
      mla_attention_case(2, 3, 5, 3, 8, 2, 0, 10),
      // FP8 caches: GLM-5's latent with fp32 scales, a narrower one with DeepSeek's power-of-two scales
      mla_attention_case(2, 1, 200, 8, 512, 64, 64, 256, MlaCacheCase::kFp8),
      mla_attention_case(2, 4, 30, 4, 128, 16, 0, 48, MlaCacheCase::kFp8Pow2)};
  auto s = registry_select(r, "mla_attention", cpu_device_describe(), cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu") << s->candidates.front().reason;
  std::printf("cpu: max error %.3g (bound %.3g)\n", s->candidates.front().max_error, s->candidates.front().bound);
}

TEST(MlaAttentionOp, SelectionsAreAscendingCausalSubsets) {
  Registry r;
  ASSERT_TRUE(mla_register_cpu(r).has_value());
  auto in = make<MlaAttentionInputs>(r, "mla_attention", mla_attention_case(2, 30, 0, 1, 8, 2, 16, 10));
  ASSERT_TRUE(in);
  for (int64_t t = 0; t < in->tokens(); ++t) {
    const int64_t n = in->batch.row_keys(t), m = std::min<int64_t>(n, 16);
    const int32_t* sel = &in->selected[t * 16];
    for (int64_t e = 0; e < 16; ++e) {
      if (e >= m) {
        EXPECT_EQ(sel[e], -1) << "row " << t << " entry " << e;
      } else {
        EXPECT_TRUE(sel[e] >= 0 && sel[e] < n && (e == 0 || sel[e] > sel[e - 1])) << "row " << t << " entry " << e;
      }
    }
  }
}

TEST(MlaAttentionOp, ReferenceMatchesHandComputedValues) {
  // One head, a latent of lora 2 and rope 2, one sequence of two tokens (past 1, one query): both keys attended.
  MlaAttentionInputs in;
  in.batch = {.n_seqs = 1, .query_len = 1, .past = 1};
  in.n_heads = 1, in.kv_lora_rank = 2, in.rope_dim = 2;
  in.scale = 0.5f;
  auto bf = [](std::initializer_list<float> v) {
    std::vector<uint16_t> out;
    for (float x : v) out.push_back(float_to_bf16(x));
    return out;
  };
  in.q = bf({1.0f, 2.0f, 1.0f, 0.0f});
  in.latent = bf({3.0f, -1.0f, 1.0f, 0.0f, -2.0f, 5.0f, 0.0f, 1.0f});
  Registry r;
  ASSERT_TRUE(mla_register_cpu(r).has_value());
  std::vector<float> y = r.harness("mla_attention")->reference(in);
  // scores: (3 - 2 + 1) * 0.5 = 1 and (-2 + 10 + 0) * 0.5 = 4; the rope part enters the score only.
  const double p0 = std::exp(1.0) / (std::exp(1.0) + std::exp(4.0)), p1 = 1.0 - p0;
  ASSERT_EQ(y.size(), 2u);
  EXPECT_NEAR(y[0], p0 * 3.0 - p1 * 2.0, 1e-6);
  EXPECT_NEAR(y[1], -p0 + p1 * 5.0, 1e-6);
  // A selection of key 0 alone gives its c.
  in.topk = 1;
  in.selected = {0};
  y = r.harness("mla_attention")->reference(in);
  EXPECT_NEAR(y[0], 3.0, 1e-6);
  EXPECT_NEAR(y[1], -1.0, 1e-6);
}

// Wraps the CPU implementation and corrupts its inputs or output in one way.
Implementation broken_attention(const Registry& r, std::string name,
                                std::function<void(MlaAttentionInputs&)> corrupt_inputs,
                                std::function<void(std::vector<float>&)> corrupt_out) {
  const Implementation* cpu = r.implementations("mla_attention").front();
  return Implementation{
      .op = "mla_attention",
      .name = std::move(name),
      .priority = 10,
      .tolerance = cpu->tolerance,
      .run = [run = cpu->run, corrupt_inputs, corrupt_out](const OpInputs& base) -> Expected<RunOutput> {
        MlaAttentionInputs copy = static_cast<const MlaAttentionInputs&>(base);
        if (corrupt_inputs) corrupt_inputs(copy);
        TERN_ASSIGN_OR_RETURN(RunOutput out, run(copy));
        if (corrupt_out) corrupt_out(out.values);
        return out;
      },
  };
}

struct AttentionFault {
  std::string name, expected_reason;
  std::function<void(MlaAttentionInputs&)> corrupt_inputs;
  std::function<void(std::vector<float>&)> corrupt_out;
};

std::vector<AttentionFault> attention_faults() {
  return {
      {"scale-doubled", "exceeds the tolerance", [](MlaAttentionInputs& in) { in.scale *= 2.0f; }, nullptr},
      {"rope-ignored", "exceeds the tolerance",
       [](MlaAttentionInputs& in) {
         for (size_t i = 0; i < in.q.size(); ++i) {
           if (static_cast<int64_t>(i) % in.width() >= in.kv_lora_rank) in.q[i] = 0;
         }
       },
       nullptr},
      {"selection-ignored", "exceeds the tolerance", [](MlaAttentionInputs& in) { in.topk = 0; }, nullptr},
      // The first sequence's latents one position off (as a mask or position off by one reads them).
      {"keys-off-by-one", "exceeds the tolerance",
       [](MlaAttentionInputs& in) {
         const int64_t w = in.width();
         std::rotate(in.latent.begin(), in.latent.begin() + w, in.latent.begin() + in.batch.seq_len(0) * w);
       },
       nullptr},
      {"tail-skipped", "never written", nullptr,
       [](std::vector<float>& v) { v.back() = std::bit_cast<float>(kPoisonF32Bits); }},
  };
}

TEST(MlaAttentionOp, InjectedFaultsAreRejected) {
  Registry r;
  ASSERT_TRUE(mla_register_cpu(r).has_value());
  for (const AttentionFault& f : attention_faults())
    ASSERT_TRUE(r.add(broken_attention(r, f.name, f.corrupt_inputs, f.corrupt_out)).has_value());
  const SelfTestCase c = mla_attention_case(2, 3, 40, 4, 32, 16, 16, 48);
  auto s = registry_select(r, "mla_attention", cpu_device_describe(), std::span(&c, 1), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu");
  for (const AttentionFault& f : attention_faults()) expect_rejected(*s, f.name, f.expected_reason);
}

// An FP8 case's keys are the values its entries hold, read here from the bytes (code x scale, exact in double, rounded
// to fp32 then bf16) and k_pe's bf16 words; the scales differ across a row's tiles; power-of-two scales are powers
// of two.
TEST(MlaAttentionOp, Fp8CasesHoldTheirEntriesValues) {
  Registry r;
  ASSERT_TRUE(mla_register_cpu(r).has_value());
  for (const MlaCacheCase cache : {MlaCacheCase::kFp8, MlaCacheCase::kFp8Pow2}) {
    auto in = make<MlaAttentionInputs>(r, "mla_attention", mla_attention_case(2, 3, 20, 4, 256, 32, 0, 48, cache));
    ASSERT_TRUE(in);
    const int64_t rows = in->batch.cache_begin(2), w = in->width(), lora = 256, entry = lora + 4 * 2 + 2 * 32;
    ASSERT_EQ(static_cast<int64_t>(in->latent_fp8.size()), rows * entry);
    ASSERT_EQ(static_cast<int64_t>(in->latent.size()), rows * w);
    for (int64_t row = 0; row < rows; ++row) {
      const uint8_t* bytes = &in->latent_fp8[row * entry];
      float scales[2];
      std::memcpy(scales, bytes + lora, 8);
      EXPECT_NE(scales[0], scales[1]) << "row " << row;
      for (const float sc : scales) {
        int exp = 0;
        if (cache == MlaCacheCase::kFp8Pow2) {
          EXPECT_EQ(std::frexp(sc, &exp), 0.5f) << sc;
        }
      }
      for (int64_t e = 0; e < lora; ++e) {
        const auto product = static_cast<float>(static_cast<double>(e4m3_to_float(bytes[e])) * scales[e / 128]);
        ASSERT_EQ(in->latent[row * w + e], float_to_bf16(product)) << "row " << row << " value " << e;
      }
      for (int64_t e = 0; e < 32; ++e) {
        uint16_t pe;
        std::memcpy(&pe, bytes + lora + 8 + 2 * e, 2);
        ASSERT_EQ(in->latent[row * w + lora + e], pe) << "row " << row << " k_pe " << e;
      }
    }
  }
}

TEST(MlaAttentionOp, BadCasesAreErrors) {
  Registry r;
  ASSERT_TRUE(mla_register_cpu(r).has_value());
  const OpHarness* h = r.harness("mla_attention");
  EXPECT_FALSE(h->make_inputs({"short", {1, 1, 0, 4, 32, 16, 0}}, 1).has_value());
  EXPECT_FALSE(h->make_inputs(mla_attention_case(1, 0, 0, 4, 32, 16, 0, 48), 1).has_value());  // no queries
  EXPECT_FALSE(h->make_inputs(mla_attention_case(1, 1, 0, 4, 32, 16, -1, 48), 1).has_value());
  EXPECT_FALSE(h->make_inputs(mla_attention_case(1, 1, 0, 4, 32, 16, 0, 0), 1).has_value());  // no scale
  EXPECT_FALSE(h->make_inputs(mla_attention_case(1, 1, 0, 4, 32, 16, 0, 48, MlaCacheCase::kFp8), 1).has_value());
  EXPECT_FALSE(h->make_inputs({"cache 3", {1, 1, 0, 4, 128, 16, 0, 48, 3}}, 1).has_value());
}

// ---------------------------------------------------------------------------------------------------------------
// indexer_select

TEST(IndexerSelectOp, CpuImplementationPassesItsSelfTest) {
  Registry r;
  ASSERT_TRUE(mla_register_cpu(r).has_value());
  const std::vector<SelfTestCase> cases = {
      indexer_select_case(3, 1, 1000, 16, 32, 16),  // the tiny fixture's shapes
      indexer_select_case(1, 40, 0, 16, 32, 16),    // a prefill whose first rows take all their keys
      indexer_select_case(2, 2, 300, 32, 128, 64),  // GLM-5's heads, a smaller topk
      indexer_select_case(2, 3, 2, 3, 16, 5)};
  auto s = registry_select(r, "indexer_select", cpu_device_describe(), cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu") << s->candidates.front().reason;
  std::printf("cpu: max error %.3g (bound %.3g)\n", s->candidates.front().max_error, s->candidates.front().bound);
}

TEST(IndexerSelectOp, PlantedTiesAreExact) {
  Registry r;
  ASSERT_TRUE(mla_register_cpu(r).has_value());
  auto in = make<IndexerSelectInputs>(r, "indexer_select", indexer_select_case(2, 3, 30, 4, 16, 8));
  ASSERT_TRUE(in);
  // Positions 3, 7, ... repeat the key before them, in every sequence, and score the same.
  for (int64_t s = 0; s < 2; ++s) {
    const int64_t k0 = in->batch.cache_begin(s);
    const std::vector<double>& scores = in->scores[s * 3];  // the sequence's first row
    ASSERT_EQ(static_cast<int64_t>(scores.size()), in->batch.row_keys(s * 3));
    for (int64_t j = 3; j < in->batch.seq_len(s); j += 4) {
      EXPECT_TRUE(std::equal(&in->keys[(k0 + j) * 16], &in->keys[(k0 + j + 1) * 16], &in->keys[(k0 + j - 1) * 16]))
          << "sequence " << s << " key " << j;
      if (j < static_cast<int64_t>(scores.size())) {
        EXPECT_EQ(scores[j], scores[j - 1]) << "key " << j;
      }
    }
  }
  for (float v : indexer_select_output(*in, indexer_select_cpu(*in))) EXPECT_EQ(v, 0.0f);
}

TEST(IndexerSelectOp, JudgeMeasuresGapsAndRefusesBrokenLists) {
  // One row of 6 keys (past 5), topk 2, with scores set by hand: the exact top-2 is {2, 5} (keys 2 and 3 tie, and
  // position 3 is a planted repeat of position 2, so the earlier key wins).
  IndexerSelectInputs in;
  in.batch = {.n_seqs = 1, .query_len = 1, .past = 5};
  in.n_heads = 1, in.head_dim = 16, in.topk = 2;
  in.scores = {{0.0, 1.0, 4.0, 4.0, 3.0, 5.0}};  // range 5
  auto judge = [&](std::vector<int32_t> sel) { return indexer_select_output(in, sel).at(0); };
  EXPECT_EQ(judge({2, 5}), 0.0f);
  EXPECT_FLOAT_EQ(judge({4, 5}), 0.2f);     // key 2 (4.0) left out for key 4 (3.0)
  EXPECT_FLOAT_EQ(judge({1, 2}), 0.8f);     // key 5 (5.0) left out for key 1 (1.0)
  EXPECT_FLOAT_EQ(judge({2, 3}), 0.2f);     // key 5 left out for key 3 (4.0); the tie is kept in order
  EXPECT_TRUE(std::isinf(judge({3, 5})));   // the tie given to the later key
  EXPECT_TRUE(std::isinf(judge({5, 2})));   // not ascending
  EXPECT_TRUE(std::isinf(judge({2, 2})));   // a duplicate
  EXPECT_TRUE(std::isinf(judge({2, 6})));   // a future key
  EXPECT_TRUE(std::isinf(judge({2, -1})));  // an entry missing
  EXPECT_EQ(std::bit_cast<uint32_t>(judge({2, kIndexerSelectPoison})), kPoisonF32Bits);
  // A row with no more keys than topk lists them all, then -1.
  in.batch.past = 0;
  in.scores = {{}};
  EXPECT_EQ(judge({0, -1}), 0.0f);
  EXPECT_TRUE(std::isinf(judge({0, 0})));
  EXPECT_TRUE(std::isinf(judge({-1, -1})));
  EXPECT_TRUE(std::isinf(judge({1, -1})));
}

// Wraps the CPU selection: runs it on corrupted inputs and/or corrupts its lists; judged against the true inputs.
Implementation broken_select(std::string name, std::function<void(IndexerSelectInputs&)> corrupt_inputs,
                             std::function<void(const IndexerSelectInputs&, std::vector<int32_t>&)> corrupt_out) {
  return Implementation{
      .op = "indexer_select",
      .name = std::move(name),
      .priority = 10,
      .tolerance = kIndexerSelectTolerance,
      .run = [corrupt_inputs, corrupt_out](const OpInputs& base) -> Expected<RunOutput> {
        const auto& in = static_cast<const IndexerSelectInputs&>(base);
        IndexerSelectInputs copy = in;
        if (corrupt_inputs) corrupt_inputs(copy);
        std::vector<int32_t> sel = indexer_select_cpu(copy);
        if (corrupt_out) corrupt_out(in, sel);
        return RunOutput{.values = indexer_select_output(in, sel)};
      },
  };
}

// The CPU selection as if ties went to the later key: wherever a planted pair (j - 1, j) is split at the k-th
// score (the earlier key listed, the later not; their scores are bit-identical), the later key instead.
void ties_to_later(const IndexerSelectInputs& in, std::vector<int32_t>& sel) {
  for (int64_t t = 0; t < in.tokens(); ++t) {
    const int64_t n = in.batch.row_keys(t);
    if (n <= in.topk) continue;
    int32_t* row = &sel[t * in.topk];
    for (int64_t e = 0; e < in.topk; ++e) {
      const int32_t j = row[e] + 1;
      if (j % 4 == 3 && j < n && std::find(row, row + in.topk, j) == row + in.topk) row[e] = j;
    }
    std::sort(row, row + in.topk);
  }
}

struct SelectFault {
  std::string name, expected_reason;
  std::function<void(IndexerSelectInputs&)> corrupt_inputs;
  std::function<void(const IndexerSelectInputs&, std::vector<int32_t>&)> corrupt_out;
};

// The last row of the case has more keys than topk (see the fault case).
std::vector<SelectFault> select_faults() {
  auto last_row = [](const IndexerSelectInputs& in, std::vector<int32_t>& sel) {
    return sel.begin() + (in.tokens() - 1) * in.topk;
  };
  return {
      {"ties-to-later-key", "non-finite", nullptr, ties_to_later},
      {"weights-ignored", "exceeds the tolerance",
       [](IndexerSelectInputs& in) { std::fill(in.weights.begin(), in.weights.end(), float_to_bf16(1.0f)); }, nullptr},
      {"heads-dropped", "exceeds the tolerance",
       [](IndexerSelectInputs& in) {
         for (int64_t t = 0; t < in.tokens(); ++t) {
           for (int64_t h = in.n_heads / 2; h < in.n_heads; ++h) in.weights[t * in.n_heads + h] = 0;
         }
       },
       nullptr},
      // The planted ties move with the keys: a later key of a pair is listed without its earlier one.
      {"keys-off-by-one", "non-finite",
       [](IndexerSelectInputs& in) {
         const int64_t hd = in.head_dim, n = in.batch.seq_len(0);
         std::rotate(in.keys.begin(), in.keys.begin() + hd, in.keys.begin() + n * hd);
       },
       nullptr},
      {"entry-dropped", "non-finite", nullptr,
       [=](const IndexerSelectInputs& in, std::vector<int32_t>& sel) { last_row(in, sel)[in.topk - 1] = -1; }},
      {"duplicate", "non-finite", nullptr,
       [=](const IndexerSelectInputs& in, std::vector<int32_t>& sel) {
         auto row = last_row(in, sel);
         row[1] = row[0];
       }},
      {"future-key", "non-finite", nullptr,
       [=](const IndexerSelectInputs& in, std::vector<int32_t>& sel) {
         last_row(in, sel)[in.topk - 1] = static_cast<int32_t>(in.batch.row_keys(in.tokens() - 1));
       }},
      {"not-ascending", "non-finite", nullptr,
       [=](const IndexerSelectInputs& in, std::vector<int32_t>& sel) {
         auto row = last_row(in, sel);
         std::reverse(row, row + in.topk);
       }},
      {"tail-not-minus-one", "non-finite", nullptr,
       [](const IndexerSelectInputs& in, std::vector<int32_t>& sel) { sel[in.topk - 1] = 0; }},  // row 0: 1 key
      {"row-never-written", "never written", nullptr,
       [=](const IndexerSelectInputs& in, std::vector<int32_t>& sel) { last_row(in, sel)[3] = kIndexerSelectPoison; }},
  };
}

TEST(IndexerSelectOp, InjectedFaultsAreRejected) {
  Registry r;
  ASSERT_TRUE(mla_register_cpu(r).has_value());
  for (const SelectFault& f : select_faults())
    ASSERT_TRUE(r.add(broken_select(f.name, f.corrupt_inputs, f.corrupt_out)).has_value());
  // A prefill of 60 rows from position 0: the first rows list all their keys (row 0 one key and a -1 tail), the
  // later ones select 8 out of up to 60, with planted ties at the k-th score in some of them.
  const SelfTestCase c = indexer_select_case(1, 60, 0, 4, 16, 8);
  auto s = registry_select(r, "indexer_select", cpu_device_describe(), std::span(&c, 1), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu");
  for (const SelectFault& f : select_faults()) expect_rejected(*s, f.name, f.expected_reason);
}

TEST(IndexerSelectOp, BadCasesAreErrors) {
  Registry r;
  ASSERT_TRUE(mla_register_cpu(r).has_value());
  const OpHarness* h = r.harness("indexer_select");
  EXPECT_FALSE(h->make_inputs({"short", {1, 1, 0, 4, 32}}, 1).has_value());
  EXPECT_FALSE(h->make_inputs(indexer_select_case(0, 1, 0, 4, 32, 16), 1).has_value());  // no sequences
  EXPECT_FALSE(h->make_inputs(indexer_select_case(1, 1, 0, 4, 32, 0), 1).has_value());   // topk 0
}

}  // namespace
}  // namespace tern
