// A rendezvous key/value store over TCP, for the ranks of a tensor-parallel group in separate processes or machines
// to swap addresses before Gloo connects them (`--dist-init-addr HOST:PORT`; Debian's Gloo has no TCP store of its
// own). One process runs a TcpStoreServer, which holds the map on a thread of its own; every rank, the server's
// process included, talks to it through a TcpStore client (a gloo::rendezvous::Store).
//
//   auto server = TcpStoreServer::start("10.0.0.1", 29500);                        // the serving rank only
//   auto store = TcpStore::connect("10.0.0.1", 29500, std::chrono::seconds(60));   // every rank
//   TERN_TRY((*store)->set_value("addr/0", bytes));
//   TERN_ASSIGN_OR_RETURN(auto peer, (*store)->get_value("addr/1"));  // waits until rank 1 set it, at most 60 s
//
// Keys are never deleted: a second group sharing a store uses keys of its own (gloo::rendezvous::PrefixStore).
//
// The protocol, written by hand: a request is an op byte ('S' set, 'G' get, 'C' check), a u32 body length and the
// body; a reply is a status byte (0 ok, 1 missing, 2 refused), a u32 body length and the body. Integers are
// little-endian u32. Bodies: set = key length, key, value -> empty; get = key -> the value (or status missing);
// check = key count, then per key its length and bytes -> one byte per key, 1 if it is set. Keys are at most 4 KiB,
// values at most 64 MiB and the whole map at most 1 GiB; a message the server cannot parse (an unknown op, a length
// past the caps, a key running off its body) closes that connection and nothing else.
// There is no authentication: like torch's TCPStore, it is meant for the cluster's own network.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "core/error.h"

namespace tern {

inline constexpr size_t kStoreMaxKeyBytes = size_t{4} << 10;
inline constexpr size_t kStoreMaxValueBytes = size_t{64} << 20;
inline constexpr size_t kStoreMaxTotalBytes = size_t{1} << 30;
// The largest request body the server reads: a set of the largest key and value.
inline constexpr size_t kStoreMaxBodyBytes = kStoreMaxValueBytes + kStoreMaxKeyBytes + 4;

class TcpStoreServer {
 public:
  // Listens on host:port (an empty host or "0.0.0.0" listens on every interface; port 0 picks a free port, which
  // port() then reads back) and serves on a thread until destroyed.
  static Expected<std::unique_ptr<TcpStoreServer>> start(const std::string& host, int port);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }

 private:
  class Impl;
  explicit TcpStoreServer(std::unique_ptr<Impl> impl, int port);
  std::unique_ptr<Impl> impl_;
  int port_;
};

class TcpStore final : public gloo::rendezvous::Store {
 public:
  // Connects to the server at host:port, retrying until `timeout` has passed (the server may start after its
  // clients). `timeout` is also the deadline of every later call that takes none. A connection lost later is
  // tried again once, not waited for: a server gone is an error at once.
  static Expected<std::unique_ptr<TcpStore>> connect(const std::string& host, int port,
                                                     std::chrono::milliseconds timeout);
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  Expected<void> set_value(const std::string& key, std::span<const char> value);
  // Waits until `key` is set (at most `timeout`; the store's timeout by default), then returns its value.
  Expected<std::vector<char>> get_value(const std::string& key);
  Expected<std::vector<char>> get_value(const std::string& key, std::chrono::milliseconds timeout);
  // Waits until every key is set; past `timeout` the error names the keys still missing. (Waits look every few ms;
  // the reply to a look sent just before the deadline may come up to 1 s past it.)
  Expected<void> wait_for(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // Which of `keys` are set now, without waiting.
  Expected<std::vector<bool>> check(const std::vector<std::string>& keys);

  // This end's address of the connection to the server ("10.0.0.2"): the interface this machine reaches the
  // server's host through, so the one its peers can most likely reach it on.
  const std::string& local_address() const { return local_address_; }
  std::string server_address() const;
  std::chrono::milliseconds timeout() const { return timeout_; }

  // gloo::rendezvous::Store: the calls above, throwing gloo::IoException with the same message on failure.
  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

 private:
  using Clock = std::chrono::steady_clock;
  struct Reply {
    uint8_t status = 0;
    std::vector<char> body;
  };
  TcpStore(std::string host, int port, std::chrono::milliseconds timeout);
  // Connects if not connected: retrying until the deadline the first time (the server may not be up yet), once
  // after a connection was lost (a server gone is not waited for again).
  Expected<void> ensure_connected(Clock::time_point deadline, bool retry);
  // One request and its reply; on any failure the connection is closed (the next call connects again).
  Expected<Reply> request(uint8_t op, const std::vector<char>& body, Clock::time_point deadline);
  Expected<std::vector<bool>> check_until(const std::vector<std::string>& keys, Clock::time_point deadline);
  Expected<void> send_all(const char* data, size_t size, Clock::time_point deadline);
  Expected<void> recv_all(char* data, size_t size, Clock::time_point deadline);
  void disconnect();

  const std::string host_;
  const int port_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;  // one request at a time on the connection
  int fd_ = -1;
  std::string local_address_;
};

}  // namespace tern
