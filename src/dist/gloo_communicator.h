// A Communicator (dist/communicator.h) over Gloo's TCP transport, for ranks in separate processes or machines. The
// ranks meet through a TcpStore (dist/tcp_store.h) at --dist-init-addr HOST:PORT, served by one of them: each
// publishes the address Gloo listens on, then every pair of ranks connects (a full mesh). The collectives run on
// the calling thread and block until every rank has taken part, an error, or the timeout.
//
//   GlooOptions options;
//   options.rank = rank;                 // 0 .. world-1, the same world on every rank
//   options.world = 2;
//   options.store_host = "10.0.0.1";     // the same HOST:PORT on every rank
//   options.store_port = 29500;
//   options.serve_store = rank == 0;     // exactly one rank serves the store
//   TERN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, gloo_communicator_create(options));
//   TERN_TRY(comm->all_reduce_sum(partial));
//
// Creation fails (instead of waiting forever) when a rank has not joined within the timeout, naming the ranks
// missing. A collective that fails (a peer gone, the timeout) closes this rank's connections, so that its peers
// fail at once too instead of at their own timeout, and leaves the communicator broken.
//
// Gloo writes to sockets without MSG_NOSIGNAL: creation ignores SIGPIPE for the whole process (unless a handler is
// installed already), so that a peer gone is an error and not the end of this process.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "core/error.h"
#include "dist/communicator.h"

namespace tern {

struct GlooOptions {
  int rank = 0;
  int world = 1;
  // The rendezvous store, HOST:PORT. The serving rank listens there (port 0: a free port, reported through
  // on_store_listening); every rank connects to it as a client, retrying until the timeout.
  std::string store_host = "127.0.0.1";
  int store_port = 0;
  bool serve_store = false;
  // Called once the serving rank listens, with the port (for tests and logs; before any rank has joined).
  std::function<void(int port)> on_store_listening;
  // What Gloo's transport listens on for its peers: a network interface name ("eth0") wins over a host or address;
  // with neither, the address this machine reaches the store through (127.0.0.1 when the store is on loopback; on
  // a cluster the interface the route to the store's host takes). Not the hostname resolved, which is 127.0.1.1
  // or 127.0.0.1 on many machines and so unreachable from other machines.
  std::string bind_iface;
  std::string bind_host;
  // Keys in the store are "<prefix>/..." so that several groups can share one store; a group that is created
  // again needs a fresh prefix (or a fresh store), since keys are never deleted.
  std::string prefix = "tern";
  // Bounds joining, every collective and every wait for a peer.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
};

Expected<std::unique_ptr<Communicator>> gloo_communicator_create(const GlooOptions& options);

}  // namespace tern
