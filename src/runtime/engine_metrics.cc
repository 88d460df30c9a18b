#include "runtime/engine_metrics.h"

#include <fmt/format.h>

namespace tern {

void LatencyHistogram::observe(double seconds) {
  std::lock_guard lock(mutex_);
  size_t b = 0;
  while (b < bounds_.size() && seconds > bounds_[b]) ++b;
  ++counts_[b];
  sum_ += seconds;
  ++count_;
}

void LatencyHistogram::render(std::string& out, const std::string& name, const std::string& help) const {
  std::lock_guard lock(mutex_);
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  uint64_t cumulative = 0;
  for (size_t b = 0; b < bounds_.size(); ++b) {
    cumulative += counts_[b];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[b], cumulative);
  }
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count_, name, sum_, name, count_);
}

}  // namespace tern
