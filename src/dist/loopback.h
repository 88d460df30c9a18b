// The ranks of a tensor-parallel group as threads of one process (dist/communicator.h): each collective meets at a
// barrier, reads every rank's buffer in place and sums in rank order 0, 1, ..., so every rank gets the same bits.
// For tests of N ranks on one machine, and for N ranks sharing one GPU (which NCCL refuses).
//
//   LoopbackGroup group(2);
//   std::thread t([&] { group.rank(1).all_reduce_sum(mine1); });
//   group.rank(0).all_reduce_sum(mine0);  // both now hold mine0 + mine1
//   t.join();
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dist/communicator.h"

namespace tern {

class LoopbackGroup {
 public:
  // A collective waits at most `timeout` for the other ranks; past it every rank waiting fails.
  explicit LoopbackGroup(int world, std::chrono::milliseconds timeout = std::chrono::seconds(60));
  ~LoopbackGroup();
  LoopbackGroup(const LoopbackGroup&) = delete;
  LoopbackGroup& operator=(const LoopbackGroup&) = delete;

  int world() const { return world_; }
  // Rank r's communicator, owned by the group; each is driven by one thread at a time.
  Communicator& rank(int r);
  // Fails every collective waiting now and every later one with `reason` (a rank whose thread failed calls this so
  // that its peers stop waiting for it).
  void abort(const std::string& reason);

 private:
  friend class LoopbackCommunicator;
  // Waits until every rank has arrived at this barrier generation; errors when aborted or past the deadline.
  Expected<void> arrive(int rank, const char* what);

  const int world_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::string aborted_;  // non-empty once aborted
  std::vector<const void*> in_;      // per rank: the buffer it brought to the collective
  std::vector<uint64_t> arrivals_;   // per rank: barriers reached, to name the ranks a timed-out wait missed
  std::vector<std::unique_ptr<Communicator>> ranks_;
};

}  // namespace tern
