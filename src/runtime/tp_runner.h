// A model split over N tensor-parallel ranks in this process (or over several processes, "nodes", each running its
// share of the ranks: NodeLayout): each rank is a runner of its own (runtime/
// cpu_runner.h) holding its slice of every weight (models/shard.h), driven by its own thread, and the ranks sum
// their partial outputs over a LoopbackGroup (dist/loopback.h). One step here is the same step on every rank: the
// same sequences and tokens, each rank extending its own slice of every sequence's caches; rank 0's logits (every
// rank holds the whole logits after lm_head's gather) are the step's, and rank 0 alone samples.
//
//   ModelLoadOptions options;
//   options.tensor_parallel_size = 2;
//   TERN_ASSIGN_OR_RETURN(auto runner, runner_load("/models/qwen3", options));  // a TpRunner of 2 CPU ranks
//
// A rank that fails (or a collective past its deadline) aborts the group, so that no rank waits for it; the step
// fails with the first rank's reason, and so does every later step: the runner is broken.
#pragma once

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/causal_lm.h"
#include "runtime/model_runner.h"

namespace tern {

// Where the ranks run: `nnodes` processes (machines, or processes of one machine) of world / nnodes ranks each,
// meeting through the store node 0 serves at store_host:store_port (--dist-init-addr).
struct NodeLayout {
  int nnodes = 1;
  int node_rank = 0;
  std::string store_host;
  int store_port = 0;
  bool front_end = false;  // node 0 runs no ranks (ModelLoadOptions::front_end)

  int worker_nodes() const { return front_end ? nnodes - 1 : nnodes; }
  // The ranks of node `node` of a group of `world`: [first_rank(node), first_rank(node) + ranks_on(node)).
  int ranks_on(int world, int node) const { return front_end && node == 0 ? 0 : world / worker_nodes(); }
  int first_rank(int world, int node) const { return (front_end ? node - 1 : node) * (world / worker_nodes()); }
};

// The GPU of each of this node's ranks of a group of `world` (layout.node_rank's), from --cuda-devices (`listed`):
// empty, rank r of the node on GPU r; this node's ranks' GPUs; or, with several nodes, every rank's, of which the
// node takes its ranks' (nodes sharing a machine, as --distributed-executor-backend mp starts them). Each must be
// one of the `present` GPUs. A front end (no ranks) has none.
Expected<std::vector<int>> tp_rank_devices(const std::vector<int>& listed, int world, const NodeLayout& layout,
                                           int present);

// What the start-up check of a tensor-parallel group found, before any weight was read.
struct TpGroupCheck {
  int world = 0;
  std::vector<int> devices;         // each rank's GPU; empty on the CPU
  std::string transport;            // "NCCL 2.28.9", "staged through the host over loopback ...", "loopback ..."
  std::vector<std::string> peers;   // peer access between every pair of GPUs
  int64_t probe_bytes = 0;          // the all-reduce each rank ran
  double all_reduce_ms = 0;         // its time on the slowest rank
};

// The group of options.tensor_parallel_size ranks on options.device (and options.cuda_devices) made and checked:
// the device collectives joined and one all-reduce that finished within `deadline` with the exact sum on every
// rank. An error says what failed and what to try. `tern doctor --tensor-parallel-size N` prints it.
Expected<TpGroupCheck> tp_group_check(const ModelLoadOptions& options, std::chrono::milliseconds deadline);

// options.tensor_parallel_size ranks: the group checked as tp_group_check does (options.tp_check_deadline), then
// each rank loaded from `dir` with its slice (in parallel). Errors name the rank and what could not be split (a
// tensor, its sizes and the world size) or loaded.
Expected<std::unique_ptr<ModelRunner>> tp_runner_load(const std::filesystem::path& dir, const ModelLoadOptions& options);

// With ModelLoadOptions::front_end, node 0's runner holds no rank: it builds the model's shapes only (for the
// scheduler's config), sends each step's plan and receives rank 0's logits from the node holding it, and samples
// on the host; a step that fails on the ranks fails there with the ranks' reason.
//
// A node other than 0 (options.node_rank > 0): its ranks joined, checked and loaded as on node 0, then every step
// node 0's runner sends run on them, until node 0 stops (success) or is lost (an error past the control group's
// deadline). The command line's --node-rank N > 0 runs this instead of the command.
Expected<void> tp_worker_run(const std::filesystem::path& dir, const ModelLoadOptions& options);

}  // namespace tern
