// Token sampling in the registry: op "sampling", dims {rows, vocab}. Each row is a bf16 logits row like a language
// model's (a broad body and a few strong candidates, padded to a row stride that is not the width) with its own
// SamplingParams (kernels/cpu/sampler.h): greedy (with ties), temperature with top_k / top_p / min_p, and the
// repetition / presence / frequency penalties over prompt and output ids drawn mostly from the row's best tokens.
// A random row's draw is the first value of SamplerRng(seed), which the CPU Sampler seeded with `seed` takes as its
// one draw of the step.
//
// Output per row: [sampled id (as a float), log_softmax of the raw row at that id] (2 * rows values).
//
// The reference follows the Sampler's semantics in double (penalties by sampling_apply_penalties, the CPU stage
// device implementations are held to; then the kept set, the top_p cut, the inverse-CDF draw and the raw logprob).
// Implementations may compute weights with a float expf that is a few ulp off, which moves a cut by ~1e-7 of the
// mass; so the harness redraws a row (new logits and draw) whose draw, min_p cut or top_p cut lies within 1e-6 of a
// boundary, and the sampled id is then exact. The CPU implementation ("cpu") runs the Sampler.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "ops/registry.h"
#include "kernels/cpu/sampler.h"

namespace tern {

struct SamplingInputs : OpInputs {
  int64_t rows = 0, vocab = 0, stride = 0;
  std::vector<uint16_t> logits;        // [rows, stride] bf16 (columns past vocab are padding)
  std::vector<SamplingParams> params;  // [rows], each with its seed set
  std::vector<double> uniforms;        // [rows]: SamplerRng(seed)'s first draw (0 for greedy rows)
  std::vector<std::vector<int32_t>> prompt_ids, output_ids;  // [rows]: the penalties' ids (empty without one)
  std::vector<float> row(int64_t r) const;                   // row r widened to float, `vocab` values
};

// Ids must match exactly, so the bound is absolute and below 1 (a wrong id is off by >= 1). Logprobs: the Sampler's
// float result is within 5e-7 + 2e-7 |x| of double, a device's (expf within 2 ulp) a further 1e-6 + 3e-7 |x|;
// the harness keeps |logprob| <= kSamplingMaxLogprob, so 2e-5 and 4e-5 cover them.
inline constexpr double kSamplingMaxLogprob = 64.0;
inline constexpr Tolerance kSamplingCpuTolerance{.rel = 0.0, .abs = 2e-5};
inline constexpr Tolerance kSamplingDeviceTolerance{.rel = 0.0, .abs = 4e-5};

// The CPU Sampler over every row, in the op's output layout.
Expected<std::vector<float>> sampling_cpu(const SamplingInputs& in);

// Adds the harness and the CPU implementation ("cpu").
Expected<void> sampling_register_cpu(Registry& registry);

SelfTestCase sampling_case(int64_t rows, int64_t vocab);

}  // namespace tern
