// Counters the engine keeps for /metrics: updated by the engine thread, read by any thread.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace tern {

// A Prometheus-style cumulative histogram over fixed upper bounds (seconds).
class LatencyHistogram {
 public:
  explicit LatencyHistogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1) {}
  void observe(double seconds);
  // `name` without suffix; appends _bucket/_sum/_count lines in the text exposition format.
  void render(std::string& out, const std::string& name, const std::string& help) const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mutex_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

struct EngineMetrics {
  std::atomic<uint64_t> prompt_tokens{0};
  std::atomic<uint64_t> generation_tokens{0};
  std::atomic<uint64_t> nan_aborts{0};
  std::atomic<uint64_t> preemptions{0};
  // Speculative decoding: verification steps of one sequence, the draft tokens they checked and those accepted.
  std::atomic<uint64_t> spec_verify_steps{0};
  std::atomic<uint64_t> spec_draft_tokens{0};
  std::atomic<uint64_t> spec_accepted_tokens{0};
  // The same by draft position (the k-th draft of a step is verified only when it was proposed, and accepted only
  // after the k - 1 before it were): a layer whose acceptance falls off after the first position reads the wrong
  // hidden state when chained, which the totals hide.
  static constexpr int kSpecPositions = 4;  // runtime/speculative.h kMaxSpeculativeSteps
  std::array<std::atomic<uint64_t>, kSpecPositions> spec_draft_tokens_at{};
  std::array<std::atomic<uint64_t>, kSpecPositions> spec_accepted_tokens_at{};
  std::atomic<int64_t> num_running{0};
  std::atomic<int64_t> num_waiting{0};
  std::atomic<int64_t> kv_blocks_used{0};
  std::atomic<int64_t> kv_blocks_total{0};
  LatencyHistogram ttft{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  LatencyHistogram inter_token{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}};
};

}  // namespace tern
