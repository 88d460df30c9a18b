// Collectives over the ranks of one tensor-parallel group, on host memory: what the CPU path reduces between
// blocks and what a step's plan travels by. Implementations: LoopbackGroup (dist/loopback.h: the ranks are threads of
// one process, for tests and for one-device runs) and Gloo over TCP (dist/gloo_communicator.h: ranks in separate
// processes or machines).
//
// Every rank calls the same collectives in the same order with the same sizes. A collective returns an error
// (naming the collective, the rank and what went wrong: a peer gone, the group aborted, the deadline passed)
// instead of hanging; after an error the communicator is broken and every later call fails the same way.
//
// Results are the same bits on every rank: all_reduce_sum adds in one fixed order per element, so replicated
// activations (the residual stream, the router's input) stay identical across ranks and every rank picks the same
// experts and tokens.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "core/error.h"

namespace tern {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world() const = 0;
  // What carries it, for logs and `tern doctor` ("loopback", "gloo tcp").
  virtual std::string describe() const = 0;

  // In place: data[i] becomes the sum over ranks of their data[i]. Every rank passes the same size.
  virtual Expected<void> all_reduce_sum(std::span<float> data) = 0;
  // all[r * mine.size() + i] = rank r's mine[i]; all.size() == world() * mine.size() on every rank.
  virtual Expected<void> all_gather(std::span<const float> mine, std::span<float> all) = 0;
  // root's bytes into every rank's `data` (all the same size).
  virtual Expected<void> broadcast(std::span<std::byte> data, int root) = 0;
  virtual Expected<void> barrier() = 0;
};

}  // namespace tern
