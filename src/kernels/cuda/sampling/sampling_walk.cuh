// What the two sampling kernels share (sampling.cu: the row kernel and the launcher; sampling_partials.cu: the
// split first walk of small batches): the block shape, the 16-byte group walk, the first walk's per-thread
// statistics and their slots in the row workspace, and the kernels' parameters. Internal to those files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/device.h"
#include "kernels/cuda/sampling/sampling_launch.h"

namespace tern {
namespace {

constexpr int kThreads = kSampleSlots;
constexpr int kSplitSlots = kThreads * kSampleSlotsPerThread;    // partial slots of a row
constexpr int kSplitThreads = kSplitSlots / kSampleSplitBlocks;  // one warp per split block
static_assert(kSplitThreads * kSampleSplitBlocks == kSplitSlots && kSplitThreads == 32);
constexpr int32_t kNoId = INT32_MAX;

// The largest value, ties to the lowest id (the CPU's first maximum).
struct Best {
  float value;
  int32_t id;
};

__device__ __forceinline__ bool better(const Best& a, const Best& b) {
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

// f(id, value) for the 8 bf16 values of 16-byte group `c`, in id order.
template <class F>
__device__ __forceinline__ void group_for_each(int64_t c, const uint4& q, F&& f) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f(c * 8 + 2 * j, __uint_as_float(words[j] << 16));
    f(c * 8 + 2 * j + 1, __uint_as_float(words[j] & 0xFFFF0000u));
  }
}

// Per thread: first non-finite id, running max with the sum of exp(x - max) (in double, rescaled when the max
// grows), and the best penalised logit. Combined over the block by raw_combine.
struct RawStats {
  int32_t first_bad = kNoId;
  float max = -INFINITY;
  double sum = 0.0;
  Best best{-INFINITY, kNoId};
};

// One raw logit into a thread's RawStats; value(id, x) is its penalised logit. The sum's roundings depend on the
// order of the calls, which is why the split first walk visits each thread's ids in row_for_each's order. The
// rescale is an explicit FMA, what the compiler made of `sum * exp(...) + 1.0` here, so both kernels round alike.
template <class Value>
__device__ __forceinline__ void raw_stats_push(RawStats& t, int64_t id, float x, Value&& value) {
  if (!isfinite(x)) {
    t.first_bad = min(t.first_bad, static_cast<int32_t>(id));
    return;
  }
  if (x > t.max) {
    t.sum = __fma_rn(t.sum, exp(static_cast<double>(t.max) - static_cast<double>(x)), 1.0);
    t.max = x;
  } else {
    t.sum = __dadd_rn(t.sum, static_cast<double>(expf(__fsub_rn(x, t.max))));
  }
  const Best b{value(id, x), static_cast<int32_t>(id)};
  if (better(b, t.best)) t.best = b;
}

// The launcher computes the workspace layout (sampling_launch.h's helpers are host functions).
struct SampleParams {
  SampleArgs a;
  float mass_scale;
  size_t row_workspace_bytes;
  size_t counts_bytes;
  size_t partials_offset;
  bool from_partials;  // sample_partials_kernel has done the first walk
};

inline SampleParams sample_params(const SampleArgs& args, bool from_partials) {
  const int bit_width = 64 - __builtin_clzll(static_cast<unsigned long long>(args.vocab));
  return SampleParams{args,
                      ldexpf(1.0f, 62 - bit_width),
                      sampling_row_workspace_bytes(args.vocab),
                      sampling_counts_bytes(args.vocab),
                      sampling_counts_bytes(args.vocab) + sampling_chunk_sums_bytes(args.vocab),
                      from_partials};
}

// The split first walk's partials in the row's workspace: kSplitSlots slots, kSampleSlotsPerThread per thread of
// the row's block.
struct PartialSlots {
  double* sum;
  float* max;
  int32_t* first_bad;
  float* best_value;
  int32_t* best_id;

  __device__ static PartialSlots at(char* base) {
    return {reinterpret_cast<double*>(base), reinterpret_cast<float*>(base + kSplitSlots * 8),
            reinterpret_cast<int32_t*>(base + kSplitSlots * 12), reinterpret_cast<float*>(base + kSplitSlots * 16),
            reinterpret_cast<int32_t*>(base + kSplitSlots * 20)};
  }
  __device__ void store(int slot, const RawStats& t) const {
    sum[slot] = t.sum;
    max[slot] = t.max;
    first_bad[slot] = t.first_bad;
    best_value[slot] = t.best.value;
    best_id[slot] = t.best.id;
  }
  __device__ RawStats load(int slot) const {
    RawStats t;
    t.sum = sum[slot];
    t.max = max[slot];
    t.first_bad = first_bad[slot];
    t.best = Best{best_value[slot], best_id[slot]};
    return t;
  }
};
static_assert(kSampleSlotBytes == 8 + 4 + 4 + 4 + 4);

__device__ char* row_workspace(const SampleParams& p, int64_t row) {
  return static_cast<char*>(p.a.workspace) + row * p.row_workspace_bytes;
}

}  // namespace

// The first walk of small batches (sample_partials_kernel) for every row of args; sample_rows_launch runs it before
// the row kernel when it splits the first walk.
void sample_partials_launch(const DeviceContext& ctx, const SampleArgs& args);

}  // namespace tern
