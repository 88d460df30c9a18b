// CudaOps under tensor parallelism: the sums of the blocks' partial outputs over the ranks and the gather of every
// rank's logits (models/gpu/cuda_ops.h; docs/architecture.md "Tensor parallelism"). The embedding's sum is in
// run_embedding.
#include <cuda_runtime.h>

#include <algorithm>

#include "models/gpu/cuda_ops.h"
#include "models/shard.h"

namespace tern {

Expected<void> CudaOps::reduce_out() {
  if (comm_ == nullptr) return {};
  return comm_->all_reduce_sum_bf16(out_, static_cast<size_t>(step_.tokens * hidden_), ctx_.stream());
}

Expected<void> CudaOps::gather_logits(const HeadLogits& head, int64_t rows) {
  const int64_t world = comm_->world(), range = vocab_shard_rows(vocab_, world);
  TERN_TRY(comm_->all_gather_bf16(head.local.as<uint16_t>(), head.all.as<uint16_t>(),
                                  static_cast<size_t>(rows * range), ctx_.stream()));
  // Rank k's block [rows, range] holds vocabulary rows [k * range, ...) clipped to the vocabulary.
  for (int64_t k = 0; k < world; ++k) {
    const int64_t begin = std::min(vocab_, k * range), width = std::min(vocab_, begin + range) - begin;
    if (width == 0) continue;
    TERN_CUDA_CHECK(cudaMemcpy2DAsync(step_.logits + begin, static_cast<size_t>(vocab_) * 2,
                                      head.all.as<uint16_t>() + k * rows * range, static_cast<size_t>(range) * 2,
                                      static_cast<size_t>(width) * 2, static_cast<size_t>(rows),
                                      cudaMemcpyDeviceToDevice, ctx_.stream()));
  }
  return {};
}

Expected<void> CudaOps::reserve_head_rows(int64_t rows, HeadLogits& head) {
  if (comm_ == nullptr || rows <= head.rows) return {};
  const int64_t range = vocab_shard_rows(vocab_, comm_->world());
  const size_t local = static_cast<size_t>(rows * range) * 2;
  TERN_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream()));  // the old pair may still be used by queued work
  if (!DeviceBuffer::try_allocate(local, head.local) ||
      !DeviceBuffer::try_allocate(local * static_cast<size_t>(comm_->world()), head.all)) {
    return make_error("out of device memory for the logits of {} rows on each of {} ranks", rows, comm_->world());
  }
  // The padding columns past this rank's rows are never written: zero them once.
  TERN_CUDA_CHECK(cudaMemsetAsync(head.local.data(), 0, local, ctx_.stream()));
  head.rows = rows;
  return {};
}

Expected<CudaOps::HeadLogits*> CudaOps::head_logits(int64_t rows) {
  if (rows <= head_graph_.rows) return &head_graph_;
  if (step_.graphed) {
    return make_error("the logits buffer of graphed steps ({} rows) is smaller than this step needs ({})",
                      head_graph_.rows, rows);
  }
  TERN_TRY(reserve_head_rows(rows, head_grown_));  // never inside a graph capture
  return &head_grown_;
}

}  // namespace tern
