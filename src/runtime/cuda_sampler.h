// Sampling of a step's last-token logits on the device, for the CUDA runner's forward_sample: each sequence's
// parameters and random draw go up, and only ids, logprobs, top logprobs and a status per row come back
// (kernels/cuda/sampling/sampling.h has the semantics, the CPU Sampler's).
//
//   CudaSampler s;  TERN_TRY(s.allocate(max_rows, vocab));
//   per step: TERN_TRY(s.upload(ctx, rows));  ... logits ...;  TERN_TRY(s.launch(ctx, logits, n));
//             TERN_ASSIGN_OR_RETURN(SampleResults r, s.download(ctx, rows, logits, n));
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/sampling/sampling_launch.h"
#include "runtime/model_runner.h"

namespace tern {

class CudaSampler {
 public:
  CudaSampler() = default;
  ~CudaSampler();
  CudaSampler(const CudaSampler&) = delete;
  CudaSampler& operator=(const CudaSampler&) = delete;

  // Device and pinned host buffers for up to `max_rows` rows of `vocab` logits.
  Expected<void> allocate(int64_t max_rows, int64_t vocab);
  // Queues each row's parameters and the ids its penalties read; takes each sampler's draw for this step. A row
  // without a sampler gets greedy parameters (its result is ignored).
  Expected<void> upload(const DeviceContext& ctx, std::span<const SampleRow> rows);
  // Queues the sampling kernel over bf16 logits [n_rows, vocab].
  Expected<void> launch(const DeviceContext& ctx, const uint16_t* logits, int64_t n_rows);
  // Waits for the stream and returns each row's token, or why it failed: a non-finite logit is named from that
  // row of `logits`, as the CPU Sampler names it.
  Expected<SampleResults> download(const DeviceContext& ctx, std::span<const SampleRow> rows, const uint16_t* logits,
                                   int64_t n_rows);

 private:
  struct Io {
    SamplingRow* rows = nullptr;
    int32_t* ids = nullptr;
    float* logprobs = nullptr;
    int32_t* top_ids = nullptr;
    float* top_logprobs = nullptr;
    int32_t* status = nullptr;
  };
  Expected<SampledToken> row_result(const DeviceContext& ctx, size_t i, const SampleRow& row, const uint16_t* logits,
                                    int64_t n_rows) const;

  int64_t max_rows_ = 0, vocab_ = 0;
  DeviceBuffer device_, workspace_, penalty_ids_;
  char* host_ = nullptr;  // pinned mirror of device_
  Io d_, h_;
  std::vector<int32_t> penalty_host_;
};

}  // namespace tern
