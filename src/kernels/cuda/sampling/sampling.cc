// Argument checks of the sampling kernel (sampling.cu, sampling_partials.cu) and the host-side helpers around it.
#include "kernels/cuda/sampling/sampling.h"

#include <cmath>
#include <limits>

namespace tern {
namespace {

constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

Expected<void> sample_rows_validate(const DeviceContext& ctx, const SampleArgs& a) {
  constexpr const char* k = "sample_rows";
  if (a.rows < 0 || a.rows > kMaxCount) return make_error("{}: rows={} out of range [0, {}]", k, a.rows, kMaxCount);
  // Ids are int32 and the kernel's "no id" marker is INT32_MAX.
  if (a.vocab <= 0 || a.vocab >= kMaxCount) return make_error("{}: vocab={} out of range [1, {})", k, a.vocab, kMaxCount);
  if (a.logits_stride < a.vocab) {
    return make_error("{}: logits_stride={} is smaller than vocab={}", k, a.logits_stride, a.vocab);
  }
  if (a.logits == nullptr) return make_error("{}: logits is null", k);
  if (a.rows_params == nullptr) return make_error("{}: rows_params is null", k);
  if (a.out_id == nullptr || a.out_logprob == nullptr || a.out_top_ids == nullptr ||
      a.out_top_logprobs == nullptr || a.out_status == nullptr) {
    return make_error("{}: an output (out_id, out_logprob, out_top_ids, out_top_logprobs, out_status) is null", k);
  }
  const size_t needed = sampling_workspace_bytes(a.rows, a.vocab);
  if (a.workspace == nullptr && needed > 0) return make_error("{}: workspace is null", k);
  if (!aligned16(a.workspace)) return make_error("{}: workspace is not 16-byte aligned", k);
  if (a.workspace_bytes < needed) {
    return make_error("{}: workspace_bytes={} is less than the {} bytes rows={} vocab={} need", k, a.workspace_bytes,
                      needed, a.rows, a.vocab);
  }
  const size_t shared = sampling_dynamic_shared_bytes(a.vocab) + kSampleStaticSharedBytes;
  if (shared > ctx.props().shared_mem_per_block_optin) {
    return make_error("{}: vocab={} needs {} bytes of shared memory per block, the device allows {}", k, a.vocab,
                      shared, ctx.props().shared_mem_per_block_optin);
  }
  return {};
}

}  // namespace

size_t sampling_workspace_bytes(int64_t rows, int64_t vocab) {
  if (rows <= 0 || vocab <= 0) return 0;
  return static_cast<size_t>(rows) * sampling_row_workspace_bytes(vocab);
}

Expected<void> sample_rows(const DeviceContext& ctx, const SampleArgs& args) {
  TERN_TRY(sample_rows_validate(ctx, args));
  if (args.rows > 0) sample_rows_launch(ctx, args);
  return {};
}

SamplingRow sampling_row_make(const SamplingParams& params, double uniform, int32_t penalty_begin, int32_t prompt_end,
                              int32_t penalty_end) {
  return SamplingRow{.temperature = params.temperature,
                     .top_k = params.top_k,
                     .top_p = params.top_p,
                     .min_p = params.min_p,
                     .repetition_penalty = params.repetition_penalty,
                     .presence_penalty = params.presence_penalty,
                     .frequency_penalty = params.frequency_penalty,
                     .uniform = uniform,
                     .n_logprobs = params.logprobs,
                     .penalty_begin = penalty_begin,
                     .penalty_end = penalty_end,
                     .prompt_end = prompt_end};
}

Expected<void> sampling_status_check(int32_t status, const float* logits_row, int64_t vocab) {
  if (status == kSampleStatusOk) return {};
  if (status == kSampleStatusBadPenaltyId) return make_error("a prompt or output id is outside the vocabulary [0, {})", vocab);
  if (status == kSampleStatusInternal) return make_error("sampling found no token (internal error)");
  if (status > 0) {
    const int64_t id = int64_t{status} - 1;
    const float x = id < vocab && logits_row != nullptr ? logits_row[id] : std::nanf("");
    const char* name = std::isnan(x) ? "NaN" : x > 0 ? "+inf" : "-inf";
    return make_error("logits contain {} at id {}", name, id);
  }
  return make_error("logits at id {} became non-finite after the penalties", -int64_t{status} - 1);
}

}  // namespace tern
