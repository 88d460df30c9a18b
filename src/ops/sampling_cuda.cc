#include "ops/sampling_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>

#include "kernels/cuda/sampling/sampling.h"
#include "ops/cuda_util.h"

namespace tern {
namespace {

// A case on the device: logits, per-row parameters, the concatenated penalty ids, outputs and workspace.
struct SamplingDevice {
  DeviceBuffer logits, rows, penalty_ids, id, logprob, top_ids, top_logprobs, status, workspace;
  SampleArgs args;
};

SamplingDevice sampling_upload(const SamplingInputs& in, cudaStream_t stream) {
  std::vector<SamplingRow> rows;
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < in.rows; ++r) {
    const auto begin = static_cast<int32_t>(ids.size());
    ids.insert(ids.end(), in.prompt_ids[r].begin(), in.prompt_ids[r].end());
    const auto prompt_end = static_cast<int32_t>(ids.size());
    ids.insert(ids.end(), in.output_ids[r].begin(), in.output_ids[r].end());
    rows.push_back(
        sampling_row_make(in.params[r], in.uniforms[r], begin, prompt_end, static_cast<int32_t>(ids.size())));
  }
  const auto n = static_cast<size_t>(in.rows);
  SamplingDevice d{.logits = cuda_upload(in.logits, stream),
                   .rows = cuda_upload(rows, stream),
                   .penalty_ids = cuda_upload(ids, stream),
                   .id = DeviceBuffer(n * 4),
                   .logprob = DeviceBuffer(n * 4),
                   .top_ids = DeviceBuffer(n * kSampleMaxTopLogprobs * 4),
                   .top_logprobs = DeviceBuffer(n * kSampleMaxTopLogprobs * 4),
                   .status = DeviceBuffer(n * 4),
                   .workspace = DeviceBuffer(std::max<size_t>(sampling_workspace_bytes(in.rows, in.vocab), 16))};
  // The kernel keeps per-id counts there and must not rely on a cleared workspace.
  TERN_CUDA_CHECK(cudaMemsetAsync(d.workspace.data(), 0xA5, d.workspace.size_bytes(), stream));
  d.args = SampleArgs{.logits = d.logits.as<uint16_t>(),
                      .logits_stride = in.stride,
                      .rows_params = d.rows.as<SamplingRow>(),
                      .penalty_ids = d.penalty_ids.as<int32_t>(),
                      .rows = in.rows,
                      .vocab = in.vocab,
                      .out_id = d.id.as<int32_t>(),
                      .out_logprob = d.logprob.as<float>(),
                      .out_top_ids = d.top_ids.as<int32_t>(),
                      .out_top_logprobs = d.top_logprobs.as<float>(),
                      .out_status = d.status.as<int32_t>(),
                      .workspace = d.workspace.data(),
                      .workspace_bytes = d.workspace.size_bytes()};
  TERN_CUDA_CHECK(cudaStreamSynchronize(stream));  // `rows` and `ids` go away on return
  return d;
}

void poison_outputs(const SamplingDevice& d, const std::vector<int32_t>& poison, cudaStream_t stream) {
  for (const DeviceBuffer* b : {&d.id, &d.logprob, &d.status}) {
    TERN_CUDA_CHECK(cudaMemcpyAsync(b->data(), poison.data(), poison.size() * 4, cudaMemcpyHostToDevice, stream));
  }
  for (const DeviceBuffer* b : {&d.top_ids, &d.top_logprobs}) {
    TERN_CUDA_CHECK(cudaMemsetAsync(b->data(), 0x7B, b->size_bytes(), stream));
  }
}

std::string sampling_cuda_unsupported(const DeviceDescription& d, const SelfTestCase& c) {
  if (std::string why = cuda_unsupported_reason(d); !why.empty()) return why;
  const int64_t vocab = c.dims.size() == 2 ? c.dims[1] : 0;
  const size_t shared = sampling_dynamic_shared_bytes(vocab) + kSampleStaticSharedBytes;
  if (static_cast<int64_t>(shared) > d.smem_per_block_optin) {
    return fmt::format("vocab={} needs {} bytes of shared memory per block, the device allows {}", vocab, shared,
                       d.smem_per_block_optin);
  }
  return "";
}

}  // namespace

Expected<SamplingCudaResult> sampling_cuda_sample(const DeviceContext& ctx, const SamplingInputs& in,
                                                  const ArgsTweak<SampleArgs>& tweak) {
  const cudaStream_t stream = ctx.stream();
  const SamplingDevice d = sampling_upload(in, stream);
  const std::vector<int32_t> poison(static_cast<size_t>(in.rows), kSamplingPoisonWord);
  SampleArgs args;
  TERN_ASSIGN_OR_RETURN(const double seconds, cuda_time_best(
                                                  ctx,
                                                  [&] {
                                                    poison_outputs(d, poison, stream);
                                                    args = d.args;
                                                    if (tweak) tweak(args);
                                                  },
                                                  [&] { return sample_rows(ctx, args); }));
  const auto n = static_cast<size_t>(in.rows);
  SamplingCudaResult r{.ids = std::vector<int32_t>(n),
                       .status = std::vector<int32_t>(n),
                       .logprobs = std::vector<float>(n),
                       .seconds = seconds};
  TERN_CUDA_CHECK(cudaMemcpy(r.ids.data(), d.id.data(), n * 4, cudaMemcpyDeviceToHost));
  TERN_CUDA_CHECK(cudaMemcpy(r.status.data(), d.status.data(), n * 4, cudaMemcpyDeviceToHost));
  TERN_CUDA_CHECK(cudaMemcpy(r.logprobs.data(), d.logprob.data(), n * 4, cudaMemcpyDeviceToHost));
  return r;
}

Expected<RunOutput> sampling_cuda_output(const SamplingInputs& in, const SamplingCudaResult& result) {
  const float poison = std::bit_cast<float>(kPoisonF32Bits);
  RunOutput out{.values = std::vector<float>(static_cast<size_t>(2 * in.rows)), .seconds = result.seconds};
  for (int64_t r = 0; r < in.rows; ++r) {
    const int32_t status = result.status[r];
    if (status != kSampleStatusOk && status != kSamplingPoisonWord) {
      const std::vector<float> row = in.row(r);
      const Expected<void> why = sampling_status_check(status, row.data(), in.vocab);
      return make_error("row {}: {}", r, why ? "failed" : why.error().message);
    }
    const bool written = status == kSampleStatusOk && result.ids[r] != kSamplingPoisonWord;
    out.values[2 * r] = written ? static_cast<float>(result.ids[r]) : poison;
    out.values[2 * r + 1] = status == kSampleStatusOk ? result.logprobs[r] : poison;
  }
  return out;
}

Expected<RunOutput> sampling_cuda_run(const DeviceContext& ctx, const SamplingInputs& in,
                                      const ArgsTweak<SampleArgs>& tweak) {
  TERN_ASSIGN_OR_RETURN(const SamplingCudaResult result, sampling_cuda_sample(ctx, in, tweak));
  return sampling_cuda_output(in, result);
}

Expected<void> sampling_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context) {
  return registry.add(Implementation{
      .op = "sampling",
      .name = "cuda",
      .backend = Backend::kCuda,
      .priority = 10,
      .tolerance = kSamplingDeviceTolerance,
      .unsupported_reason = sampling_cuda_unsupported,
      .run =
          [context](const OpInputs& b) { return sampling_cuda_run(*context, static_cast<const SamplingInputs&>(b)); },
  });
}

}  // namespace tern
