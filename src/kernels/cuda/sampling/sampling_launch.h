// Argument structs and the unchecked launcher of token sampling on the GPU, with the semantics of the CPU Sampler
// (kernels/cpu/sampler.h, vLLM v1 order):
//
//   raw bf16 row ──► status (first non-finite id), raw max and log-sum-exp, top-N raw logprobs
//       └─► penalties (repetition over prompt+output, presence/frequency over output counts)
//             ├─► temperature < 1e-5: greedy argmax, ties to the lowest id
//             └─► temperature ─► min_p ─► top_k ─► top_p ─► draw from the renormalised kept set with `uniform`
//
// The kept set and the draw use the CPU Sampler's fixed-point masses (weight * 2^(62 - bit_width(vocab)),
// truncated to an integer): integer sums do not depend on the order of addition, so a parallel reduction gives
// the CPU's totals exactly. The only difference left is expf (the device's is within 2 ulp, glibc's within 0.502),
// which moves a token's mass by ~1e-7 of itself: a sampled id can differ only when the uniform, a min_p cut or
// the top_p cut falls within that distance of a boundary.
//
// The .cu side cannot include core/error.h (nvcc rejects fmt's consteval format strings), so validation lives in
// sampling.cc and callers use sampling.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/device.h"

namespace tern {

// Per row, filled on the host (sampling_row_make in sampling.h) and copied to the device by the caller. The
// fields must lie in the ranges sampling_params_validate accepts; the kernel does not check them again.
struct SamplingRow {
  float temperature = 1.0f;
  int32_t top_k = -1;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  double uniform = 0.0;       // the draw in [0, 1) the CPU Sampler would take from its SamplerRng for this step
  int32_t n_logprobs = 0;     // 0..20 (clamped into that range on the device)
  int32_t penalty_begin = 0;  // this row's slice [penalty_begin, penalty_end) of SampleArgs::penalty_ids
  int32_t penalty_end = 0;
  int32_t prompt_end = 0;     // ids in [penalty_begin, prompt_end) are prompt ids, [prompt_end, penalty_end) output ids
};

inline constexpr int32_t kSampleMaxTopLogprobs = 20;

// out_status values. A row with a non-zero status has out_id -1, out_logprob NaN and every top slot (-1, NaN).
inline constexpr int32_t kSampleStatusOk = 0;
// > 0: 1 + the first id whose raw logit is NaN or +-inf (the host reads that logit to name it).
// < 0 and > INT32_MIN + 1: -(1 + id), the penalties pushed the logit at id past the float range (the lowest such
//   id after the repetition penalty, else the lowest after frequency/presence, as the CPU reports it).
inline constexpr int32_t kSampleStatusBadPenaltyId = INT32_MIN;  // an id of the row's active lists is outside [0, vocab)
inline constexpr int32_t kSampleStatusInternal = INT32_MIN + 1;  // a selection found no token: a kernel bug

struct SampleArgs {
  const uint16_t* logits = nullptr;  // bf16 [rows, vocab] with row stride logits_stride (>= vocab)
  int64_t logits_stride = 0;
  const SamplingRow* rows_params = nullptr;  // [rows], device
  // Concatenated prompt+output ids of all rows, device. Only read for rows with an active penalty (prompt ids only
  // when the repetition penalty is active, as on the CPU). May be null when no row has a non-empty slice.
  const int32_t* penalty_ids = nullptr;
  int64_t rows = 0;
  int64_t vocab = 0;
  int32_t* out_id = nullptr;             // [rows]
  float* out_logprob = nullptr;          // [rows]: log_softmax of the raw row at out_id
  int32_t* out_top_ids = nullptr;        // [rows, 20]: the n_logprobs best raw logprobs, highest first, ties to
  float* out_top_logprobs = nullptr;     //   the lower id; slots past n_logprobs (or past vocab) are (-1, -inf)
  int32_t* out_status = nullptr;         // [rows]: kSampleStatus* above
  void* workspace = nullptr;             // 16-byte aligned, sampling_workspace_bytes(rows, vocab)
  size_t workspace_bytes = 0;
};

// Workspace per row: the output count of every penalised id (int32 [vocab]; only the listed ids are touched, so
// it is never cleared), the mass of each 128-id chunk for the ordered searches (uint64 [ceil(vocab / 128)]) and,
// for small batches, the first walk's partial results (kSampleSlotsPerThread slots per thread of the row's block,
// each: first non-finite id, max, sum, best value and best id, 24 bytes), written by the split first walk and
// merged by the row's block.
inline constexpr int64_t kSampleChunkIds = 128;  // one warp, four ids per lane
inline constexpr int kSampleSlots = 512;         // threads of the block that finishes a row
inline constexpr int kSampleSlotsPerThread = 8;  // split first walk: 4096 partial slots per row
inline constexpr size_t kSampleSlotBytes = 24;
inline constexpr size_t sampling_align256(size_t bytes) { return (bytes + 255) / 256 * 256; }
inline constexpr int64_t sampling_chunks(int64_t vocab) { return (vocab + kSampleChunkIds - 1) / kSampleChunkIds; }
inline constexpr size_t sampling_counts_bytes(int64_t vocab) { return sampling_align256(static_cast<size_t>(vocab) * 4); }
inline constexpr size_t sampling_chunk_sums_bytes(int64_t vocab) {
  return sampling_align256(static_cast<size_t>(sampling_chunks(vocab)) * 8);
}
inline constexpr size_t sampling_partials_bytes() {
  return sampling_align256(kSampleSlots * kSampleSlotsPerThread * kSampleSlotBytes);
}
inline constexpr size_t sampling_row_workspace_bytes(int64_t vocab) {
  return sampling_counts_bytes(vocab) + sampling_chunk_sums_bytes(vocab) + sampling_partials_bytes();
}

// Shared memory of one block: the radix histogram (2048 uint64 bins), a bitmap of the row's penalised ids (one bit
// per vocabulary entry) and the block's reduction scratch (at most kSampleStaticSharedBytes, static).
inline constexpr int kSampleHistBins = 2048;
inline constexpr size_t kSampleStaticSharedBytes = 2048;
inline constexpr size_t sampling_dynamic_shared_bytes(int64_t vocab) {
  return kSampleHistBins * 8 + static_cast<size_t>((vocab + 31) / 32) * 4;
}

// Unchecked launch on ctx.stream() for arguments sampling.cc has validated (rows >= 1). One block per row; with
// fewer rows than the device has SMs, a first kernel spreads each row's first walk over kSampleSplitBlocks blocks
// of one warp, whose threads each own one of the row's kSampleSlots * kSampleSlotsPerThread partial slots; each
// thread of the row's block then merges its kSampleSlotsPerThread slots (the ids its own walk would visit).
inline constexpr int kSampleSplitBlocks = kSampleSlots * kSampleSlotsPerThread / 32;
void sample_rows_launch(const DeviceContext& ctx, const SampleArgs& args);

}  // namespace tern
