#include "dist/loopback.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

namespace tern {

class LoopbackCommunicator final : public Communicator {
 public:
  LoopbackCommunicator(LoopbackGroup& group, int rank) : g_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return g_.world_; }
  std::string describe() const override { return "loopback (threads of one process)"; }

  Expected<void> all_reduce_sum(std::span<float> data) override {
    g_.in_[rank_] = data.data();
    TERN_TRY(g_.arrive(rank_, "all_reduce_sum"));
    // Every rank sums every buffer in rank order into its own copy, then (once no rank reads any more) writes it.
    sum_.assign(data.size(), 0.0f);
    for (int r = 0; r < g_.world_; ++r) {
      const float* in = static_cast<const float*>(g_.in_[r]);
      for (size_t i = 0; i < data.size(); ++i) sum_[i] = r == 0 ? in[i] : sum_[i] + in[i];
    }
    TERN_TRY(g_.arrive(rank_, "all_reduce_sum"));
    std::copy(sum_.begin(), sum_.end(), data.begin());
    return {};
  }

  Expected<void> all_gather(std::span<const float> mine, std::span<float> all) override {
    if (all.size() != mine.size() * static_cast<size_t>(g_.world_)) {
      return make_error("all_gather on rank {}: {} elements gathered into {} (world size {})", rank_, mine.size(),
                        all.size(), g_.world_);
    }
    g_.in_[rank_] = mine.data();
    TERN_TRY(g_.arrive(rank_, "all_gather"));
    for (int r = 0; r < g_.world_; ++r) {
      const float* in = static_cast<const float*>(g_.in_[r]);
      std::copy(in, in + mine.size(), all.begin() + static_cast<std::ptrdiff_t>(r * mine.size()));
    }
    return g_.arrive(rank_, "all_gather");
  }

  Expected<void> broadcast(std::span<std::byte> data, int root) override {
    if (root < 0 || root >= g_.world_) return make_error("broadcast: root {} outside world size {}", root, g_.world_);
    g_.in_[rank_] = data.data();
    TERN_TRY(g_.arrive(rank_, "broadcast"));
    if (rank_ != root) std::memcpy(data.data(), g_.in_[root], data.size());
    return g_.arrive(rank_, "broadcast");
  }

  Expected<void> barrier() override { return g_.arrive(rank_, "barrier"); }

 private:
  LoopbackGroup& g_;
  const int rank_;
  std::vector<float> sum_;
};

LoopbackGroup::LoopbackGroup(int world, std::chrono::milliseconds timeout)
    : world_(std::max(world, 1)), timeout_(timeout), in_(static_cast<size_t>(world_), nullptr),
      arrivals_(static_cast<size_t>(world_), 0) {
  for (int r = 0; r < world_; ++r) ranks_.push_back(std::make_unique<LoopbackCommunicator>(*this, r));
}

LoopbackGroup::~LoopbackGroup() = default;

Communicator& LoopbackGroup::rank(int r) { return *ranks_.at(static_cast<size_t>(r)); }

void LoopbackGroup::abort(const std::string& reason) {
  std::lock_guard lock(mu_);
  if (aborted_.empty()) aborted_ = reason;
  cv_.notify_all();
}

Expected<void> LoopbackGroup::arrive(int rank, const char* what) {
  std::unique_lock lock(mu_);
  if (!aborted_.empty()) return make_error("{} on rank {}: the group was aborted: {}", what, rank, aborted_);
  const uint64_t generation = generation_;
  ++arrivals_[static_cast<size_t>(rank)];
  if (++arrived_ == world_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return {};
  }
  const bool done = cv_.wait_for(lock, timeout_, [&] { return generation_ != generation || !aborted_.empty(); });
  if (generation_ != generation) return {};
  if (!done && aborted_.empty()) {
    std::vector<int> missing;
    for (int r = 0; r < world_; ++r) {
      if (arrivals_[static_cast<size_t>(r)] < arrivals_[static_cast<size_t>(rank)]) missing.push_back(r);
    }
    aborted_ = fmt::format("rank {} waited {} ms in {} for rank(s) {} (world size {})", rank, timeout_.count(), what,
                           fmt::join(missing, ", "), world_);
    cv_.notify_all();
  }
  return make_error("{} on rank {}: {}", what, rank, aborted_);
}

}  // namespace tern
