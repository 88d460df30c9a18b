#include "runtime/cuda_sampler.h"

#include <algorithm>
#include <utility>

#include "core/formats.h"
#include "kernels/cuda/sampling/sampling.h"

namespace tern {

CudaSampler::~CudaSampler() {
  if (host_ != nullptr) cudaFreeHost(host_);
}

Expected<void> CudaSampler::allocate(int64_t max_rows, int64_t vocab) {
  max_rows_ = max_rows;
  vocab_ = vocab;
  const size_t rows = static_cast<size_t>(max_rows), top = rows * kSampleMaxTopLogprobs;
  const size_t parts[] = {rows * sizeof(SamplingRow), rows * 4, rows * 4, top * 4, top * 4, rows * 4};
  size_t bytes = 0;
  for (const size_t p : parts) bytes += sampling_align256(p);
  const size_t ws = sampling_workspace_bytes(max_rows, vocab);
  if (!DeviceBuffer::try_allocate(bytes, device_) || !DeviceBuffer::try_allocate(ws, workspace_)) {
    return make_error("out of device memory for sampling {} sequences ({} bytes)", max_rows, bytes + ws);
  }
  TERN_CUDA_CHECK(cudaMallocHost(&host_, bytes));
  for (auto [base, io] : {std::pair{static_cast<char*>(device_.data()), &d_}, std::pair{host_, &h_}}) {
    size_t offset = 0;
    auto take = [&](size_t n) {
      char* p = base + offset;
      offset += sampling_align256(n);
      return p;
    };
    io->rows = reinterpret_cast<SamplingRow*>(take(parts[0]));
    io->ids = reinterpret_cast<int32_t*>(take(parts[1]));
    io->logprobs = reinterpret_cast<float*>(take(parts[2]));
    io->top_ids = reinterpret_cast<int32_t*>(take(parts[3]));
    io->top_logprobs = reinterpret_cast<float*>(take(parts[4]));
    io->status = reinterpret_cast<int32_t*>(take(parts[5]));
  }
  return {};
}

Expected<void> CudaSampler::upload(const DeviceContext& ctx, std::span<const SampleRow> rows) {
  if (static_cast<int64_t>(rows.size()) > max_rows_) {
    return make_error("{} sampling rows; this model was set up for at most {}", rows.size(), max_rows_);
  }
  penalty_host_.clear();
  for (size_t i = 0; i < rows.size(); ++i) {
    const SampleRow& r = rows[i];
    if (r.sampler == nullptr) {
      h_.rows[i] = sampling_row_make(SamplingParams{.temperature = 0.0f}, 0.0, 0, 0, 0);
      continue;
    }
    const SamplingParams& params = r.sampler->params();
    const int32_t begin = static_cast<int32_t>(penalty_host_.size());
    const bool penalised =
        params.repetition_penalty != 1.0f || params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f;
    if (penalised) penalty_host_.insert(penalty_host_.end(), r.prompt_ids.begin(), r.prompt_ids.end());
    const int32_t prompt_end = static_cast<int32_t>(penalty_host_.size());
    if (penalised) penalty_host_.insert(penalty_host_.end(), r.output_ids.begin(), r.output_ids.end());
    h_.rows[i] = sampling_row_make(params, r.sampler->next_draw(), begin, prompt_end,
                                   static_cast<int32_t>(penalty_host_.size()));
  }
  const size_t penalty_bytes = penalty_host_.size() * 4;
  if (penalty_ids_.size_bytes() < penalty_bytes) {
    ctx.synchronize();  // the previous step may still read the old buffer
    if (!DeviceBuffer::try_allocate(std::max(penalty_bytes, 2 * penalty_ids_.size_bytes()), penalty_ids_)) {
      return make_error("out of device memory for {} penalty ids", penalty_host_.size());
    }
  }
  if (penalty_bytes > 0) {
    TERN_CUDA_CHECK(cudaMemcpyAsync(penalty_ids_.data(), penalty_host_.data(), penalty_bytes, cudaMemcpyHostToDevice,
                                    ctx.stream()));
  }
  TERN_CUDA_CHECK(cudaMemcpyAsync(d_.rows, h_.rows, rows.size() * sizeof(SamplingRow), cudaMemcpyHostToDevice,
                                  ctx.stream()));
  return {};
}

Expected<void> CudaSampler::launch(const DeviceContext& ctx, const uint16_t* logits, int64_t n_rows) {
  return sample_rows(ctx, SampleArgs{.logits = logits,
                                     .logits_stride = vocab_,
                                     .rows_params = d_.rows,
                                     .penalty_ids = penalty_host_.empty() ? nullptr : penalty_ids_.as<int32_t>(),
                                     .rows = n_rows,
                                     .vocab = vocab_,
                                     .out_id = d_.ids,
                                     .out_logprob = d_.logprobs,
                                     .out_top_ids = d_.top_ids,
                                     .out_top_logprobs = d_.top_logprobs,
                                     .out_status = d_.status,
                                     .workspace = workspace_.data(),
                                     .workspace_bytes = workspace_.size_bytes()});
}

Expected<SampledToken> CudaSampler::row_result(const DeviceContext& ctx, size_t i, const SampleRow& row,
                                              const uint16_t* logits, int64_t n_rows) const {
  const int32_t status = h_.status[i];
  if (status != kSampleStatusOk) {
    // Name the bad logit as the CPU sampler would: download this row only.
    std::vector<float> values;
    if (status > 0 && static_cast<int64_t>(i) < n_rows) {
      std::vector<uint16_t> bits(static_cast<size_t>(vocab_));
      TERN_CUDA_CHECK(cudaMemcpyAsync(bits.data(), logits + i * vocab_, bits.size() * 2, cudaMemcpyDeviceToHost,
                                      ctx.stream()));
      ctx.synchronize();
      for (uint16_t b : bits) values.push_back(bf16_to_float(b));
    }
    TERN_TRY(sampling_status_check(status, values.empty() ? nullptr : values.data(), vocab_));
    return make_error("sampling failed with status {}", status);
  }
  SampledToken token{.id = h_.ids[i], .logprob = h_.logprobs[i], .top_logprobs = {}};
  const int32_t k = std::min(row.sampler->params().logprobs, kSampleMaxTopLogprobs);
  for (int32_t j = 0; j < k && j < vocab_; ++j) {
    token.top_logprobs.emplace_back(h_.top_ids[i * kSampleMaxTopLogprobs + j],
                                    h_.top_logprobs[i * kSampleMaxTopLogprobs + j]);
  }
  return token;
}

Expected<SampleResults> CudaSampler::download(const DeviceContext& ctx, std::span<const SampleRow> rows,
                                             const uint16_t* logits, int64_t n_rows) {
  const size_t n = rows.size();
  const std::pair<const void*, void*> parts[] = {{d_.ids, h_.ids},
                                                 {d_.logprobs, h_.logprobs},
                                                 {d_.status, h_.status},
                                                 {d_.top_ids, h_.top_ids},
                                                 {d_.top_logprobs, h_.top_logprobs}};
  for (size_t i = 0; i < std::size(parts); ++i) {
    const size_t bytes = (i < 3 ? n : n * kSampleMaxTopLogprobs) * 4;
    TERN_CUDA_CHECK(cudaMemcpyAsync(parts[i].second, parts[i].first, bytes, cudaMemcpyDeviceToHost, ctx.stream()));
  }
  const cudaError_t status = cudaStreamSynchronize(ctx.stream());
  if (status != cudaSuccess) return make_error("CUDA error in the forward step: {}", cudaGetErrorString(status));
  SampleResults results;
  results.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (rows[i].sampler == nullptr) {
      results.emplace_back(SampledToken{});
    } else {
      results.push_back(row_result(ctx, i, rows[i], logits, n_rows));
    }
  }
  return results;
}

}  // namespace tern
