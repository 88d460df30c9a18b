// Checked launcher of token sampling on the GPU (argument structs, status codes and semantics in
// sampling_launch.h): one call samples `rows` rows of bf16 logits, each with its own parameters, as the CPU
// Sampler (kernels/cpu/sampler.h) would for the same uniform draw.
//
//   std::vector<SamplingRow> host_rows;  // sampling_row_make(params, rng.next_unit(), ...) per row
//   ... copy host_rows and the penalty ids to the device, size the workspace ...
//   TERN_TRY(sample_rows(ctx, SampleArgs{.logits = ..., .rows_params = ..., ...}));
//   ... copy out_id / out_status back; sampling_status_check(status, ...) names a failed row's cause.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/sampling/sampling_launch.h"
#include "kernels/cpu/sampler.h"

namespace tern {

// Bytes of SampleArgs::workspace for `rows` rows of `vocab` logits.
size_t sampling_workspace_bytes(int64_t rows, int64_t vocab);

// Validates shapes, pointers, the workspace and the shared memory the vocabulary needs, then queues one kernel on
// ctx.stream(). rows == 0 is a no-op. Per-row failures are reported through out_status, not here.
Expected<void> sample_rows(const DeviceContext& ctx, const SampleArgs& args);

// A row's device parameters from validated SamplingParams and the draw the CPU Sampler would take for this step
// (ignored by greedy rows). The row's penalty ids are penalty_ids[penalty_begin, penalty_end), prompt first.
SamplingRow sampling_row_make(const SamplingParams& params, double uniform, int32_t penalty_begin, int32_t prompt_end,
                              int32_t penalty_end);

// The CPU Sampler's error for a row's out_status (the non-finite logit is named from `logits_row`, the row as
// the host sees it); success for kSampleStatusOk.
Expected<void> sampling_status_check(int32_t status, const float* logits_row, int64_t vocab);

}  // namespace tern
