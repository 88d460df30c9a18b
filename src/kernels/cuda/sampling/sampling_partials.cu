// The split first walk of small batches: sample_partials_kernel spreads a row's first read over
// kSampleSplitBlocks one-warp blocks and leaves its statistics in the row workspace for sample_rows_kernel
// (sampling.cu); contract in sampling_launch.h.
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/sampling/sampling_walk.cuh"

namespace tern {
namespace {

// The first walk of small batches: block (row, b) computes the RawStats of slots [b, b + 1) * kSplitThreads, slot s
// over the 16-byte groups s, s + kSplitSlots, ... and then the tail ids s, s + kSplitSlots, ..., with raw logits as
// the values (the row's block redoes the best where a penalty is active). The groups are staged through shared memory
// with cp.async, kStageGroups per thread at a time in two buffers, so that many loads are in flight while the previous
// stage is summed.
constexpr int kStageGroups = 16;

__global__ void __launch_bounds__(kSplitThreads) sample_partials_kernel(const SampleParams p) {
  ptx::grid_dependency_begin();
  __shared__ uint4 stage[2][kStageGroups][kSplitThreads];
  const SampleArgs& a = p.a;
  const int64_t row = blockIdx.x;
  const int slot = static_cast<int>(blockIdx.y) * kSplitThreads + static_cast<int>(threadIdx.x);
  const uint16_t* raw = a.logits + row * a.logits_stride;
  const auto identity = [](int64_t, float x) { return x; };
  const auto push = [&](RawStats& t, int64_t id, float x) { raw_stats_push(t, id, x, identity); };
  RawStats t;
  int64_t tail_start = 0;
  if (reinterpret_cast<uintptr_t>(raw) % 16 == 0) {
    const int64_t n_vec = a.vocab / 8;
    const uint4* groups = reinterpret_cast<const uint4*>(raw);
    const int64_t n_mine = slot < n_vec ? (n_vec - 1 - slot) / kSplitSlots + 1 : 0;  // groups slot + k * kSplitSlots
    const int64_t n_stages = (n_mine + kStageGroups - 1) / kStageGroups;
    const auto issue = [&](int64_t st) {
      for (int j = 0; j < kStageGroups; ++j) {
        const int64_t k = st * kStageGroups + j;
        if (k < n_mine) ptx::cp_async_16_zfill(&stage[st & 1][j][threadIdx.x], groups + slot + k * kSplitSlots, true);
      }
      ptx::cp_async_commit();  // possibly empty: one group per stage keeps the wait count uniform
    };
    issue(0);
    for (int64_t st = 0; st < n_stages; ++st) {
      issue(st + 1);            // into the other buffer, whose stage this thread finished summing
      ptx::cp_async_wait<1>();  // this thread's copies of stage st have landed (each thread reads only its own)
      for (int j = 0; j < kStageGroups; ++j) {
        const int64_t k = st * kStageGroups + j;
        if (k >= n_mine) break;
        group_for_each(slot + k * kSplitSlots, stage[st & 1][j][threadIdx.x],
                       [&](int64_t id, float x) { push(t, id, x); });
      }
    }
    ptx::cp_async_wait<0>();
    tail_start = n_vec * 8;
  }
  for (int64_t id = tail_start + slot; id < a.vocab; id += kSplitSlots) {
    push(t, id, cuda_common::bf16_to_f32(raw[id]));
  }
  PartialSlots::at(row_workspace(p, row) + p.partials_offset).store(slot, t);
}

}  // namespace

void sample_partials_launch(const DeviceContext& ctx, const SampleArgs& args) {
  const SampleParams p = sample_params(args, /*from_partials=*/true);
  const dim3 grid(static_cast<unsigned>(args.rows), kSampleSplitBlocks);
  launch_kernel(ctx, sample_partials_kernel, grid, dim3(kSplitThreads), 0, p);
  TERN_CUDA_CHECK_LAUNCH();
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t sampling_partials_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, sample_partials_kernel);
}

}  // namespace tern
