// --distributed-executor-backend mp: the tensor-parallel ranks of this machine as one process each, started by tern.
// The process the user started is node 0 of the multi-node machinery (runtime/tp_runner.h: it serves, holds rank 0,
// samples and sends every other rank each step's plan; with --front-end it holds no rank and rank 0 has a process
// too); it starts this same executable again with the same command line (less any --nnodes, --node-rank,
// --dist-init-addr of the user's) plus --nnodes N --node-rank i --dist-init-addr 127.0.0.1:PORT for i = 1 .. N - 1
// (N: the processes in all), so each rank runs in a process of its own (one GPU each, by --cuda-devices or rank
// order) and exits when node 0 stops. A rank process dies with its parent (PR_SET_PDEATHSIG),
// its stdout goes to stderr, and at exit node 0 waits for its rank processes, killing those still running after a
// grace period. One that ends before the group has formed stops node 0 at once with its exit status, instead of
// node 0 waiting for it until --dist-timeout; once formed, a rank process lost is a lost node (the runner fails).
#pragma once

#include <string>
#include <vector>

#include "core/error.h"

namespace tern {

// main() records its command line here, for the rank processes to repeat it.
void set_command_line(int argc, const char* const* argv);

// Starts nodes 1 .. nodes - 1 as processes of their own that join node 0's rendezvous at `addr` (HOST:PORT), with
// `extra_args` after the command line (every rank's --cuda-devices when the user gave none). Errors
// name what could not be started; processes already started are then stopped.
Expected<void> start_rank_processes(int nodes, const std::string& addr,
                                    const std::vector<std::string>& extra_args = {});

// Node 0 calls this once its runner has loaded: from then on a rank process that ends is the runner's failure to
// report, not a start-up failure.
void rank_processes_formed_group();

// A loopback HOST:PORT no one listens on now (the OS's pick), for node 0's rendezvous.
Expected<std::string> free_loopback_addr();

// In a rank process started by start_rank_processes: die with the parent (and exit at once if it is already gone).
// A no-op in any other process.
void adopt_parent_lifetime();

}  // namespace tern
