// `tern bench --plan-only` and the tensor-parallel part of `tern bench`'s report.
//
// The plan builds rank 0's slice of the model from its config alone (LoadFormat::kShapes: every tensor a view of one
// shared zero buffer, models/weights.h) split `--tp` ways, counts it with bench_traffic.h and prints what one rank
// holds, the memory it needs for weights and caches at --batch x --context, the decode step's bytes and the time
// they take at --hbm-gbs, and the collectives each step adds; nothing is loaded on a device, so any --tp can be
// planned on a machine without GPUs. A split that cannot be made fails naming the tensor (models/shard.h). An
// architecture tern has no blocks for yet (GLM-5) is planned from its weight schema alone: weights and caches per
// rank, no step traffic.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/bench_traffic.h"

namespace tern {

struct BenchPlanOptions {
  std::string model_dir;
  int world = 1;
  bool expert_parallel = false;  // --enable-expert-parallel
  std::vector<int64_t> batch_sizes;
  int64_t context = 0;
  double hbm_gbs = 0;  // the bandwidth the decode time per step is computed at
  bool json = false;
  std::string kv_cache_dtype = "auto";  // --kv-cache-dtype
};

// Prints the plan; 0, or 2 with the reason on stderr (a split that cannot be made, an unreadable config).
int run_bench_plan(const BenchPlanOptions& options);

// Adds to a bench report of a model counted per rank as `t`: tensor_parallel_size, and collectives_computed (the
// all-reduces per decode step and, for each batch size, the bytes of each, of all of them and of the logits'
// all-gather), with the measured all-reduce time null and `measured_note` saying why.
void add_tensor_parallel_report(nlohmann::ordered_json& report, const StepTraffic& t, int64_t world,
                                const std::vector<int64_t>& batch_sizes, const std::string& measured_note);
// The text form of what add_tensor_parallel_report added (nothing at one rank).
void print_tensor_parallel_report(const nlohmann::ordered_json& report);

}  // namespace tern
