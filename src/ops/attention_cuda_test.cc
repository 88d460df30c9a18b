// The attention op on the GPU through the registry (label gpu): both CUDA implementations pass their self-test
// (against the harness's fp64 reference) on ragged batches of every head dim and GQA group, deliberately broken
// launches (each one fault class, all-zero outputs included) are rejected, and a timing table reports achieved KV
// bandwidth.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

#include "kernels/cuda/attention/attention.h"
#include "ops/attention_cuda.h"
#include "ops/cuda_fault_test_util.h"
#include "ops/cuda_op_test.h"
#include "ops/cuda_util.h"

namespace tern {
namespace {

class CudaAttentionOps : public CudaOpTest<attention_register_cpu, attention_register_cuda> {
 protected:
  // Both CUDA implementations pass every case (the choice between them is by speed).
  void expect_both_pass(const std::vector<SelfTestCase>& cases) {
    auto s = registry_select(registry_, "attention", devices_[0], cases, {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    for (const auto& c : s->candidates) {
      if (c.name == "cpu") continue;
      EXPECT_EQ(c.status, CandidateStatus::kPassed) << c.name << ": " << c.reason;
      std::printf("%-13s %zu cases, max error %.3g (bound %.3g), %.1f us\n", c.name.c_str(), cases.size(), c.max_error,
                  c.bound, c.seconds * 1e6);
    }
  }
  std::unique_ptr<AttentionInputs> inputs(const SelfTestCase& c, uint64_t seed = 7) {
    auto in = registry_.harness("attention")->make_inputs(c, seed);
    EXPECT_TRUE(in.has_value());
    return std::unique_ptr<AttentionInputs>(static_cast<AttentionInputs*>(in->release()));
  }
};

TEST_F(CudaAttentionOps, BothVariantsPassOnRaggedShapes) {
  for (int64_t hd : {32, 64, 128, 256}) {
    std::vector<SelfTestCase> cases;
    for (int64_t group : {1, 2, 8}) {
      const bool gated = group == 2;
      cases.push_back(attention_case(4, 1, 100, 2 * group, 2, hd, gated));    // decode, ragged pasts
      cases.push_back(attention_case(2, 3, 1000, 2 * group, 2, hd, !gated));  // speculative-style few queries
      cases.push_back(attention_case(3, 70, 10, 2 * group, 2, hd, gated));    // prefill chunks past one tile
      cases.push_back(attention_case(1, 200, 0, 2 * group, 2, hd, !gated));   // a fresh prompt
    }
    SCOPED_TRACE(fmt::format("head_dim {}", hd));
    expect_both_pass(cases);
  }
}

TEST_F(CudaAttentionOps, LongContextsAndGroupOf16Pass) {
  expect_both_pass({attention_case(2, 1, 32000, 16, 2, 128, false), attention_case(1, 2, 20000, 16, 1, 256, true),
                    attention_case(3, 1, 5000, 32, 2, 64, true)});
}

// Serving-sized decode steps (ragged pasts around 1k): Qwen3-8B's 32/8 heads of 128 at 96 rows, Qwen3.5's 32/2 heads
// of 256 (group 16) at 64 rows; the launch picks one to a few splits here, where the cases above get many.
TEST_F(CudaAttentionOps, LargeDecodeBatchesPass) {
  expect_both_pass({attention_case(96, 1, 1000, 32, 8, 128, false), attention_case(64, 1, 1000, 32, 2, 256, true)});
}

// The two fault cases: a prefill-shaped batch (130 queries per sequence: three query tiles) and a decode-shaped one
// (one query, a past long enough that half of max_seq_len drops keys). Both gated.
const SelfTestCase kPrefillFaultCase = attention_case(3, 130, 20, 8, 2, 64, true);
const SelfTestCase kDecodeFaultCase = attention_case(5, 1, 300, 16, 2, 128, true);

struct Fault {
  std::string name, expected_reason;
  AttentionVariant variant;
  bool decode_case_only, prefill_case_only;
  ArgsTweak<PagedAttentionArgs> tweak;
};

// `stream`: the context's, on which the all-zeros faults clear the output (cuda_fault_test_util.h).
std::vector<Fault> gpu_faults(cudaStream_t stream) {
  std::vector<Fault> faults;
  for (const auto variant : {AttentionVariant::kDecode, AttentionVariant::kPrefill}) {
    const std::string v = variant == AttentionVariant::kDecode ? "decode:" : "prefill:";
    faults.push_back({v + "scale-doubled", "exceeds the tolerance", variant, false, false,
                      [](PagedAttentionArgs& a) { a.scale *= 2.0f; }});
  }
  // Decode blocks walk the token rows, prefill blocks the sequences: each variant's own way to skip the tail.
  faults.push_back({"decode:last-token-dropped", "never written", AttentionVariant::kDecode, false, false,
                    [](PagedAttentionArgs& a) { a.tokens -= 1; }});
  faults.push_back({"prefill:last-sequence-dropped", "never written", AttentionVariant::kPrefill, false, false,
                    [](PagedAttentionArgs& a) { a.n_seqs -= 1; }});
  for (const auto variant : {AttentionVariant::kDecode, AttentionVariant::kPrefill}) {
    const std::string v = variant == AttentionVariant::kDecode ? "decode:" : "prefill:";
    faults.push_back({v + "gate-dropped", "exceeds the tolerance", variant, false, false,
                      [](PagedAttentionArgs& a) { a.gate = nullptr; }});
  }
  // (No max_seq_len fault for decode: each query row divides its own key count, read from seq_lens, among the
  // splits, so a smaller max_seq_len only means fewer splits, not skipped keys.)
  faults.push_back({"prefill:max-query-len-halved", "never written", AttentionVariant::kPrefill, false, true,
                    [](PagedAttentionArgs& a) { a.max_query_len /= 2; }});
  for (const auto variant : {AttentionVariant::kDecode, AttentionVariant::kPrefill}) {
    const std::string v = variant == AttentionVariant::kDecode ? "decode:" : "prefill:";
    auto zero = std::make_shared<ZeroedOutputs>(stream);  // its scratch lives as long as the registered fault
    faults.push_back({v + "all-zeros", "all zeros", variant, false, false, [zero](PagedAttentionArgs& a) {
                        zero->redirect(a.out, static_cast<size_t>(a.tokens * a.n_heads * a.cache.head_dim));
                      }});
  }
  return faults;
}

TEST_F(CudaAttentionOps, InjectedFaultsAreRejectedOnTheGpu) {
  const std::vector<Fault> faults = gpu_faults(context_->stream());
  for (const Fault& f : faults) {
    const Tolerance tolerance =
        f.variant == AttentionVariant::kDecode ? kAttentionDecodeTolerance : kAttentionPrefillTolerance;
    ASSERT_TRUE(registry_
                    .add(Implementation{.op = "attention",
                                        .name = f.name,
                                        .backend = Backend::kCuda,
                                        .priority = 100,
                                        .tolerance = tolerance,
                                        .run =
                                            [this, f](const OpInputs& in) {
                                              return attention_cuda_run(*context_,
                                                                        static_cast<const AttentionInputs&>(in),
                                                                        f.variant, f.tweak);
                                            }})
                    .has_value());
  }
  for (const bool decode_case : {false, true}) {
    const SelfTestCase& c = decode_case ? kDecodeFaultCase : kPrefillFaultCase;
    auto s = registry_select(registry_, "attention", devices_[0], std::span(&c, 1), {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    for (const char* good : {"cuda-decode", "cuda-prefill"}) {
      const CandidateReport* it = s->candidate(good);
      ASSERT_NE(it, nullptr) << good;
      EXPECT_EQ(it->status, CandidateStatus::kPassed) << c.label << " " << good << ": " << it->reason;
    }
    for (const Fault& f : faults) {
      if ((f.decode_case_only && !decode_case) || (f.prefill_case_only && decode_case)) continue;
      const CandidateReport* it = s->candidate(f.name);
      ASSERT_NE(it, nullptr) << f.name;
      EXPECT_EQ(it->status, CandidateStatus::kFailed) << c.label << " " << f.name;
      EXPECT_NE(it->reason.find(f.expected_reason), std::string::npos)
          << c.label << " " << f.name << ": " << it->reason;
    }
  }
}

// Achieved bandwidth of the KV cache reads at decode sizes (the limit is the device's copy bandwidth).
TEST_F(CudaAttentionOps, DecodeBandwidth) {
  for (int64_t n_seqs : {int64_t{1}, int64_t{16}}) {
    auto in = inputs(attention_case(n_seqs, 1, 8192, 32, 8, 128, false));
    auto out = attention_cuda_run(*context_, *in, AttentionVariant::kDecode);
    ASSERT_TRUE(out.has_value()) << out.error().message;
    const double kv_bytes = 2.0 * double(in->k.size()) * 2.0;
    std::printf("decode seqs=%lld ctx=8k 32/8x128: %8.1f us %8.1f GB/s of KV\n", static_cast<long long>(n_seqs),
                out->seconds * 1e6, kv_bytes / out->seconds / 1e9);
  }
}

}  // namespace
}  // namespace tern
