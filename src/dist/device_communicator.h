// Collectives over the ranks' device buffers, enqueued on the rank's CUDA stream: what the CUDA blocks sum their
// partial outputs with under tensor parallelism (models/gpu/cuda_ops.h). Implementations (dist/cuda/): NCCL, one
// GPU per rank, capturable into CUDA graphs; and one staged through the host over a host Communicator, for ranks
// that share one GPU (tests of N ranks on one device, which NCCL refuses), which a graph cannot hold.
//
// The same contract as Communicator (dist/communicator.h): every rank calls the same collectives in the same order
// with the same sizes, errors instead of hangs, the same bits on every rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace tern {

class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;

  virtual int rank() const = 0;
  virtual int world() const = 0;
  virtual std::string describe() const = 0;
  // Whether the collectives may be captured into a CUDA graph (the runner replays decode steps from graphs only
  // then).
  virtual bool graph_capturable() const = 0;

  // In place on the device: data[i] (bf16, n elements) becomes the sum over ranks. `stream` is a cudaStream_t.
  virtual Expected<void> all_reduce_sum_bf16(uint16_t* data, size_t n, void* stream) = 0;
  // all[r * n + i] = rank r's mine[i] (bf16, device memory).
  virtual Expected<void> all_gather_bf16(const uint16_t* mine, uint16_t* all, size_t n, void* stream) = 0;
  // Gives up on the collectives in flight (a peer that will never join): NCCL aborts its communicator, which is
  // unusable afterwards. The host-staged one waits on its host group, which has its own deadline.
  virtual void abort() {}
};

}  // namespace tern
