// The multi-head latent attention ops on the GPU through the registry (label gpu): "cuda" passes the self-test of
// mla_attention and of indexer_select (against the harnesses' fp64 references) on ragged batches at GLM-5's and the
// tiny fixture's shapes, causal and with DSA selections, decode rows and prefill chunks; deliberately broken launches
// (each one fault class, all-zero outputs included) are rejected.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>

#include <fmt/format.h>

#include "kernels/cuda/mla/indexer.h"
#include "kernels/cuda/mla/mla.h"
#include "ops/cuda_fault_test_util.h"
#include "ops/cuda_op_test.h"
#include "ops/cuda_util.h"
#include "ops/mla_cuda.h"

namespace tern {
namespace {

class CudaMlaOps : public CudaOpTest<mla_register_cpu, mla_register_cuda> {
 protected:
  // "cuda" passes every case, and the CPU implementation is not a candidate on the GPU.
  void expect_cuda_passes(const std::string& op, const std::vector<SelfTestCase>& cases) {
    auto s = registry_select(registry_, op, devices_[0], cases, {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(s->chosen, "cuda") << op;
    const CandidateReport* c = s->candidate("cuda");
    ASSERT_NE(c, nullptr) << op;
    EXPECT_EQ(c->status, CandidateStatus::kPassed) << op << ": " << c->reason;
    std::printf("%-15s %zu cases, max error %.3g (bound %.3g), %.1f us\n", op.c_str(), cases.size(), c->max_error,
                c->bound, c->seconds * 1e6);
  }
};

// GLM-5's latent (512 + 64, qk_head_dim 256) at 16 heads (two blocks of heads) and 12 (a partial block), and the
// fixture's (32 + 16, 4 heads): decode rows with ragged pasts, causal and selecting 256 or 16 keys, prefill chunks
// whose first rows list all their keys.
TEST_F(CudaMlaOps, MlaAttentionPassesOnModelShapes) {
  expect_cuda_passes(
      "mla_attention",
      {mla_attention_case(1, 1, 1000, 16, 512, 64, 256, 256), mla_attention_case(8, 1, 1000, 16, 512, 64, 256, 256),
       mla_attention_case(2, 128, 192, 16, 512, 64, 256, 256), mla_attention_case(4, 1, 1000, 12, 512, 64, 0, 256),
       mla_attention_case(2, 128, 0, 12, 512, 64, 0, 256), mla_attention_case(3, 2, 300, 64, 512, 64, 2048, 256),
       mla_attention_case(8, 1, 1000, 4, 32, 16, 16, 48), mla_attention_case(2, 128, 0, 4, 32, 16, 16, 48),
       mla_attention_case(3, 5, 30, 4, 32, 16, 0, 48)});
}

// The FP8 latent cache (GLM-5's 656-byte entries, fp32 and power-of-two scales): decode rows causal and selecting,
// a prefill chunk, a partial head group.
TEST_F(CudaMlaOps, MlaAttentionPassesOnFp8Caches) {
  expect_cuda_passes("mla_attention",
                     {mla_attention_case(8, 1, 1000, 16, 512, 64, 256, 256, MlaCacheCase::kFp8),
                      mla_attention_case(2, 128, 192, 16, 512, 64, 256, 256, MlaCacheCase::kFp8),
                      mla_attention_case(4, 1, 1000, 12, 512, 64, 0, 256, MlaCacheCase::kFp8Pow2),
                      mla_attention_case(3, 2, 300, 64, 512, 64, 2048, 256, MlaCacheCase::kFp8)});
}

// GLM-5's indexer (32 heads of 128, topk 2048) with rows above topk and a prefill chunk straddling it, the fixture's
// (16 heads of 32, topk 16), and head counts that are not multiples of 16.
TEST_F(CudaMlaOps, IndexerSelectPassesOnModelShapes) {
  expect_cuda_passes("indexer_select",
                     {indexer_select_case(1, 1, 4096, 32, 128, 2048), indexer_select_case(8, 1, 4096, 32, 128, 2048),
                      indexer_select_case(1, 128, 1984, 32, 128, 2048), indexer_select_case(8, 1, 1000, 16, 32, 16),
                      indexer_select_case(1, 128, 0, 16, 32, 16), indexer_select_case(3, 4, 500, 20, 64, 100),
                      indexer_select_case(2, 3, 60, 3, 48, 8)});
}

// The fault cases: a decode batch of ragged pasts and a prefill chunk, both past topk.
const SelfTestCase kMlaFaultCases[] = {mla_attention_case(5, 1, 300, 16, 512, 64, 64, 256),
                                       mla_attention_case(2, 70, 20, 12, 512, 64, 32, 256)};
const SelfTestCase kIndexerFaultCases[] = {indexer_select_case(5, 1, 300, 32, 128, 64),
                                           indexer_select_case(2, 70, 20, 16, 32, 16)};

template <class Args>
struct Fault {
  std::string name, expected_reason;
  ArgsTweak<Args> tweak;
};

// `stream`: the context's, on which the all-zeros faults clear the output (cuda_fault_test_util.h).
std::vector<Fault<MlaAttentionArgs>> mla_faults(cudaStream_t stream) {
  auto zero = std::make_shared<ZeroedOutputs>(stream);  // its scratch lives as long as the registered fault
  return {
      {"scale-doubled", "exceeds the tolerance", [](MlaAttentionArgs& a) { a.scale *= 2.0f; }},
      {"selection-ignored", "exceeds the tolerance", [](MlaAttentionArgs& a) { a.selected = nullptr; }},
      {"selection-halved", "exceeds the tolerance", [](MlaAttentionArgs& a) { a.topk /= 2; }},
      {"last-token-dropped", "never written", [](MlaAttentionArgs& a) { a.tokens -= 1; }},
      {"heads-dropped", "never written", [](MlaAttentionArgs& a) { a.n_heads -= 1; }},
      {"all-zeros", "all zeros",
       [zero](MlaAttentionArgs& a) {
         zero->redirect(a.out_latent, static_cast<size_t>(a.tokens * a.n_heads * a.cache.kv_lora_rank));
       }},
  };
}

std::vector<Fault<IndexerSelectArgs>> indexer_faults(cudaStream_t stream) {
  auto zero = std::make_shared<ZeroedOutputs>(stream);
  return {
      // Reads each row's weights one head on (a zero of the row's padding for the last head).
      {"weights-shifted", "exceeds the tolerance", [](IndexerSelectArgs& a) { a.weights += 1; }},
      {"heads-dropped", "exceeds the tolerance", [](IndexerSelectArgs& a) { a.n_heads /= 2; }},
      {"last-token-dropped", "never written", [](IndexerSelectArgs& a) { a.tokens -= 1; }},
      // Zeros where the lists should be: duplicates of key 0, a broken list.
      {"all-zeros", "non-finite",
       [zero](IndexerSelectArgs& a) { zero->redirect(a.selected, static_cast<size_t>(a.tokens * a.topk)); }},
  };
}

TEST_F(CudaMlaOps, InjectedFaultsAreRejectedOnTheGpu) {
  const auto attention = mla_faults(context_->stream());
  const auto indexer = indexer_faults(context_->stream());
  for (const auto& f : attention) {
    ASSERT_TRUE(registry_
                    .add(Implementation{.op = "mla_attention",
                                        .name = f.name,
                                        .backend = Backend::kCuda,
                                        .priority = 100,
                                        .tolerance = kMlaAttentionCudaTolerance,
                                        .run =
                                            [this, f](const OpInputs& in) {
                                              return mla_attention_cuda_run(
                                                  *context_, static_cast<const MlaAttentionInputs&>(in), f.tweak);
                                            }})
                    .has_value());
  }
  for (const auto& f : indexer) {
    ASSERT_TRUE(registry_
                    .add(Implementation{.op = "indexer_select",
                                        .name = f.name,
                                        .backend = Backend::kCuda,
                                        .priority = 100,
                                        .tolerance = kIndexerSelectTolerance,
                                        .run =
                                            [this, f](const OpInputs& in) {
                                              return indexer_select_cuda_run(
                                                  *context_, static_cast<const IndexerSelectInputs&>(in), f.tweak);
                                            }})
                    .has_value());
  }
  auto check = [&](const std::string& op, const SelfTestCase& c, const auto& faults) {
    auto s = registry_select(registry_, op, devices_[0], std::span(&c, 1), {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    const CandidateReport* good = s->candidate("cuda");
    ASSERT_NE(good, nullptr);
    EXPECT_EQ(good->status, CandidateStatus::kPassed) << c.label << ": " << good->reason;
    EXPECT_EQ(s->chosen, "cuda") << c.label;
    for (const auto& f : faults) {
      const CandidateReport* it = s->candidate(f.name);
      ASSERT_NE(it, nullptr) << f.name;
      EXPECT_EQ(it->status, CandidateStatus::kFailed) << c.label << " " << f.name;
      EXPECT_NE(it->reason.find(f.expected_reason), std::string::npos)
          << c.label << " " << f.name << ": " << it->reason;
    }
  };
  for (const SelfTestCase& c : kMlaFaultCases) check("mla_attention", c, attention);
  for (const SelfTestCase& c : kIndexerFaultCases) check("indexer_select", c, indexer);
}

}  // namespace
}  // namespace tern
