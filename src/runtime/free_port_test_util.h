// Test-only: a loopback TCP port for a rendezvous store in tests that run several "nodes" in one process, and the
// options of a group of two such nodes.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "models/causal_lm.h"

namespace tern {

// A port nothing listens on now (the OS's pick, released at once).
inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  close(fd);
  return ntohs(a.sin_port);
}

// Two ranks on two nodes meeting at a free loopback port; node 0's options (a node 1 sets node_rank = 1).
inline ModelLoadOptions two_loopback_nodes(std::chrono::milliseconds join_timeout = std::chrono::seconds(30)) {
  ModelLoadOptions o;
  o.tensor_parallel_size = 2;
  o.nnodes = 2;
  o.dist_init_addr = "127.0.0.1:" + std::to_string(free_port());
  o.tp_join_timeout = join_timeout;
  return o;
}

}  // namespace tern
