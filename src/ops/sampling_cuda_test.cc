// The sampling op on the GPU through the registry (label gpu): the CUDA implementation passes its self-test against
// the harness's double reference of the CPU Sampler's semantics (ids exact, logprobs within 4e-5) at model and small
// vocabularies; deliberately broken runs (each one fault class) are rejected with the expected reason; a row the
// kernel fails is an error; a vocabulary whose bitmap does not fit the shared memory is unsupported, not failed.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdio>

#include <fmt/format.h>

#include "core/formats.h"
#include "ops/cuda_fault_test_util.h"
#include "ops/cuda_op_test.h"
#include "ops/cuda_util.h"
#include "ops/sampling_cuda.h"

namespace tern {
namespace {

class CudaSamplingOp : public CudaOpTest<sampling_register_cpu, sampling_register_cuda> {};

TEST_F(CudaSamplingOp, PassesAtModelAndSmallVocabularies) {
  const std::vector<SelfTestCase> cases = {sampling_case(1, 151936), sampling_case(8, 151936), sampling_case(8, 248320),
                                           sampling_case(64, 512),   sampling_case(5, 1001),   sampling_case(3, 7)};
  auto s = registry_select(registry_, "sampling", devices_[0], cases, {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  const CandidateReport* cuda = s->candidate("cuda");
  const CandidateReport* cpu = s->candidate("cpu");
  ASSERT_NE(cuda, nullptr);
  ASSERT_NE(cpu, nullptr);
  EXPECT_EQ(s->chosen, "cuda") << cuda->reason;
  EXPECT_EQ(cuda->status, CandidateStatus::kPassed) << cuda->reason;
  EXPECT_EQ(cpu->status, CandidateStatus::kUnsupported);
  std::printf("sampling cuda: %zu cases, max error %.3g (bound %.3g), %.1f us\n", cases.size(), cuda->max_error,
              cuda->bound, cuda->seconds * 1e6);
}

struct Fault {
  std::string name, expected_reason;
  std::function<Expected<RunOutput>(const DeviceContext&, const SamplingInputs&)> run;
};

// A result in the op's layout as a runner that never looks at the status would report it.
RunOutput status_ignored(const SamplingCudaResult& r) {
  RunOutput out{.values = std::vector<float>(2 * r.ids.size()), .seconds = r.seconds};
  for (size_t i = 0; i < r.ids.size(); ++i) {
    out.values[2 * i] = static_cast<float>(r.ids[i]);
    out.values[2 * i + 1] = r.logprobs[i];
  }
  return out;
}

std::vector<Fault> gpu_faults() {
  return {
      // Every row read one element late (the padding keeps the read in bounds): greedy rows come out one id low.
      {"row-shifted-by-one", "exceeds the tolerance",
       [](const DeviceContext& ctx, const SamplingInputs& in) {
         return sampling_cuda_run(ctx, in, [](SampleArgs& a) { a.logits += 1; });
       }},
      // The rows' draws not passed on (every uniform 0): random rows take their first kept token.
      {"draw-not-passed", "exceeds the tolerance",
       [](const DeviceContext& ctx, const SamplingInputs& in) {
         SamplingInputs copy = in;
         std::fill(copy.uniforms.begin(), copy.uniforms.end(), 0.0);
         return sampling_cuda_run(ctx, copy);
       }},
      // A NaN logit fails row 0 (id -1, logprob NaN, status set); a runner ignoring the status reports the row.
      {"nan-status-ignored", "non-finite value nan at element 1",
       [](const DeviceContext& ctx, const SamplingInputs& in) -> Expected<RunOutput> {
         SamplingInputs copy = in;
         copy.logits[5] = float_to_bf16(NAN);
         TERN_ASSIGN_OR_RETURN(const SamplingCudaResult r, sampling_cuda_sample(ctx, copy));
         return status_ignored(r);
       }},
      {"all-zeros", "all zeros",
       [](const DeviceContext& ctx, const SamplingInputs& in) {
         ZeroedOutputs zero(ctx.stream());
         return sampling_cuda_run(ctx, in, [&](SampleArgs& a) {
           zero.redirect(a.out_id, static_cast<size_t>(a.rows));
           zero.redirect(a.out_logprob, static_cast<size_t>(a.rows));
           zero.redirect(a.out_status, static_cast<size_t>(a.rows));
         });
       }},
  };
}

TEST_F(CudaSamplingOp, InjectedFaultsAreRejectedOnTheGpu) {
  for (const Fault& f : gpu_faults()) {
    ASSERT_TRUE(registry_
                    .add(Implementation{.op = "sampling",
                                        .name = f.name,
                                        .backend = Backend::kCuda,
                                        .priority = 100,
                                        .tolerance = kSamplingDeviceTolerance,
                                        .run =
                                            [this, run = f.run](const OpInputs& in) {
                                              return run(*context_, static_cast<const SamplingInputs&>(in));
                                            }})
                    .has_value());
  }
  // The default seed: ops_test's SamplingOp.TheGpuFaultCaseDependsOnTheDraw checks that this case's ids depend on
  // the draws, so draw-not-passed cannot go unnoticed.
  const SelfTestCase c = sampling_case(8, 151936);
  auto s = registry_select(registry_, "sampling", devices_[0], std::span(&c, 1), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cuda");
  for (const Fault& f : gpu_faults()) {
    const CandidateReport* k = s->candidate(f.name);
    ASSERT_NE(k, nullptr) << f.name;
    EXPECT_EQ(k->status, CandidateStatus::kFailed) << f.name;
    EXPECT_NE(k->reason.find(f.expected_reason), std::string::npos) << f.name << ": " << k->reason;
  }
}

TEST_F(CudaSamplingOp, AFailedRowIsAnError) {
  auto made = registry_.harness("sampling")->make_inputs(sampling_case(3, 1000), 11);
  ASSERT_TRUE(made.has_value());
  auto& in = static_cast<SamplingInputs&>(**made);
  in.logits[2 * in.stride + 17] = float_to_bf16(-INFINITY);
  auto out = sampling_cuda_run(*context_, in);
  ASSERT_FALSE(out.has_value());
  EXPECT_EQ(out.error().message, "row 2: logits contain -inf at id 17");
}

TEST_F(CudaSamplingOp, AVocabularyBeyondTheSharedMemoryIsUnsupported) {
  // One bit per id: 2^22 ids need 512 KiB of shared memory, more than any device has. --selftest off: no inputs.
  const SelfTestCase c = sampling_case(1, int64_t{1} << 22);
  auto s = registry_select(registry_, "sampling", devices_[0], std::span(&c, 1), {.mode = SelftestMode::kOff});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  const CandidateReport* cuda = s->candidate("cuda");
  ASSERT_NE(cuda, nullptr);
  EXPECT_EQ(cuda->status, CandidateStatus::kUnsupported);
  const size_t shared = sampling_dynamic_shared_bytes(c.dims[1]) + kSampleStaticSharedBytes;
  EXPECT_NE(cuda->reason.find(fmt::format("vocab={} needs {} bytes of shared memory per block", c.dims[1], shared)),
            std::string::npos)
      << cuda->reason;
}

}  // namespace
}  // namespace tern
