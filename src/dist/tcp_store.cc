#include "dist/tcp_store.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <gloo/common/error.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <thread>
#include <utility>

#include "dist/tcp_store_wire.h"

namespace tern {

using store_wire::AddrList, store_wire::errno_text, store_wire::get_u32, store_wire::kHeaderBytes, store_wire::kOpCheck,
    store_wire::kOpGet, store_wire::kOpSet, store_wire::kStatusMissing, store_wire::kStatusOk,
    store_wire::kStatusRefused, store_wire::put_u32, store_wire::resolve;

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A look at the keys sent just before the deadline may take this long past it for its reply, so that a wait ends
// naming the keys still missing rather than with a timed-out read.
constexpr milliseconds kReplyGrace(1000);

// Milliseconds left until `deadline`, rounded up, never negative (poll's timeout).
int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

std::string ip_of(const sockaddr_storage& addr) {
  char buf[INET6_ADDRSTRLEN] = {};
  const void* src = addr.ss_family == AF_INET6
                        ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6&>(addr).sin6_addr)
                        : static_cast<const void*>(&reinterpret_cast<const sockaddr_in&>(addr).sin_addr);
  return inet_ntop(addr.ss_family, src, buf, sizeof(buf)) != nullptr ? std::string(buf) : std::string();
}

// One attempt at a TCP connection to host:port, bounded by the deadline; returns the socket (non-blocking).
Expected<int> connect_once(const std::string& host, int port, Clock::time_point deadline) {
  AddrList addrs;
  TERN_TRY(resolve(host, port, false, addrs));
  std::string last = "no address";
  for (addrinfo* ai = addrs.head; ai != nullptr; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last = errno_text(errno);
      continue;
    }
    int err = ::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const int rv = ::poll(&p, 1, ms_left(deadline));
      socklen_t len = sizeof(err);
      if (rv <= 0) {
        err = rv == 0 ? ETIMEDOUT : errno;
      } else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
        err = errno;
      }
    }
    if (err != 0) {
      last = errno_text(err);
      ::close(fd);
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
  }
  return make_error("{}", last);
}

}  // namespace

// ---- The client. ----

TcpStore::TcpStore(std::string host, int port, milliseconds timeout)
    : host_(std::move(host)), port_(port), timeout_(timeout) {}

TcpStore::~TcpStore() {
  disconnect();
}

Expected<std::unique_ptr<TcpStore>> TcpStore::connect(const std::string& host, int port, milliseconds timeout) {
  if (port <= 0 || port > 65535) return make_error("tcp store: port {} is outside 1..65535", port);
  std::unique_ptr<TcpStore> store(new TcpStore(host, port, timeout));
  std::lock_guard lock(store->mu_);
  TERN_TRY(store->ensure_connected(Clock::now() + timeout, true));
  return store;
}

std::string TcpStore::server_address() const {
  return fmt::format("{}:{}", host_, port_);
}

void TcpStore::disconnect() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Expected<void> TcpStore::ensure_connected(Clock::time_point deadline, bool retry) {
  if (fd_ >= 0) return {};
  const auto start = Clock::now();
  for (;;) {
    auto fd = connect_once(host_, port_, deadline);
    if (fd) {
      fd_ = *fd;
      sockaddr_storage local{};
      socklen_t len = sizeof(local);
      if (local_address_.empty() && getsockname(fd_, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
        local_address_ = ip_of(local);
      }
      return {};
    }
    if (!retry) {
      return make_error("tcp store {}: lost the connection and cannot reconnect: {}", server_address(),
                        fd.error().message);
    }
    // Refused or unreachable: the server may not be up yet.
    if (Clock::now() + milliseconds(50) >= deadline) {
      return make_error("tcp store {}: could not connect in {} ms: {}", server_address(),
                        std::chrono::duration_cast<milliseconds>(Clock::now() - start).count(), fd.error().message);
    }
    std::this_thread::sleep_for(milliseconds(50));
  }
}

Expected<void> TcpStore::send_all(const char* data, size_t size, Clock::time_point deadline) {
  while (size > 0) {
    pollfd p{fd_, POLLOUT, 0};
    const int rv = ::poll(&p, 1, ms_left(deadline));
    if (rv < 0 && errno == EINTR) continue;
    if (rv <= 0) return make_error("{}", rv == 0 ? "timed out sending" : errno_text(errno));
    const ssize_t n = ::send(fd_, data, size, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return make_error("send: {}", errno_text(errno));
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return {};
}

Expected<void> TcpStore::recv_all(char* data, size_t size, Clock::time_point deadline) {
  while (size > 0) {
    pollfd p{fd_, POLLIN, 0};
    const int rv = ::poll(&p, 1, ms_left(deadline));
    if (rv < 0 && errno == EINTR) continue;
    if (rv <= 0) return make_error("{}", rv == 0 ? "timed out waiting for the reply" : errno_text(errno));
    const ssize_t n = ::recv(fd_, data, size, 0);
    if (n == 0) return make_error("the server closed the connection");
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return make_error("recv: {}", errno_text(errno));
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return {};
}

Expected<TcpStore::Reply> TcpStore::request(uint8_t op, const std::vector<char>& body, Clock::time_point deadline) {
  std::lock_guard lock(mu_);
  TERN_TRY(ensure_connected(deadline, false));
  std::vector<char> header{static_cast<char>(op)};
  put_u32(header, static_cast<uint32_t>(body.size()));
  Reply reply;
  auto exchanged = [&]() -> Expected<void> {
    TERN_TRY(send_all(header.data(), header.size(), deadline));
    TERN_TRY(send_all(body.data(), body.size(), deadline));
    char head[kHeaderBytes];
    TERN_TRY(recv_all(head, sizeof(head), deadline));
    reply.status = static_cast<uint8_t>(head[0]);
    const uint32_t len = get_u32(head + 1);
    if (reply.status > kStatusRefused || len > kStoreMaxBodyBytes) {
      return make_error("malformed reply (status {}, {} bytes)", reply.status, len);
    }
    reply.body.resize(len);
    return recv_all(reply.body.data(), len, deadline);
  }();
  if (!exchanged) {
    disconnect();  // the stream may be out of step; the next request connects afresh
    return wrap_error(exchanged.error(), fmt::format("tcp store {}", server_address()));
  }
  return reply;
}

namespace {

Expected<void> check_key(const std::string& key) {
  if (key.size() > kStoreMaxKeyBytes) {
    return make_error("tcp store: a key of {} bytes (at most {})", key.size(), kStoreMaxKeyBytes);
  }
  return {};
}

std::string key_list(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size() && i < 8; ++i) out += fmt::format("{}'{}'", i == 0 ? "" : ", ", keys[i]);
  if (keys.size() > 8) out += fmt::format(" and {} more", keys.size() - 8);
  return out;
}

}  // namespace

Expected<void> TcpStore::set_value(const std::string& key, std::span<const char> value) {
  TERN_TRY(check_key(key));
  if (value.size() > kStoreMaxValueBytes) {
    return make_error("tcp store: key '{}' given a value of {} bytes (at most {})", key, value.size(),
                      kStoreMaxValueBytes);
  }
  std::vector<char> body;
  body.reserve(4 + key.size() + value.size());
  put_u32(body, static_cast<uint32_t>(key.size()));
  body.insert(body.end(), key.begin(), key.end());
  body.insert(body.end(), value.begin(), value.end());
  TERN_ASSIGN_OR_RETURN(const Reply reply, request(kOpSet, body, Clock::now() + timeout_));
  if (reply.status != kStatusOk) {
    return make_error("tcp store {}: setting '{}' refused: {}", server_address(), key,
                      std::string(reply.body.begin(), reply.body.end()));
  }
  return {};
}

Expected<std::vector<char>> TcpStore::get_value(const std::string& key) {
  return get_value(key, timeout_);
}

Expected<std::vector<char>> TcpStore::get_value(const std::string& key, milliseconds timeout) {
  TERN_TRY(check_key(key));
  const std::vector<char> body(key.begin(), key.end());
  const auto deadline = Clock::now() + timeout;
  for (milliseconds backoff(1);; backoff = std::min(backoff * 2, milliseconds(50))) {
    TERN_ASSIGN_OR_RETURN(Reply reply, request(kOpGet, body, deadline + kReplyGrace));
    if (reply.status == kStatusOk) return std::move(reply.body);
    if (Clock::now() >= deadline) {
      return make_error("tcp store {}: waited {} ms for key(s) {}, still missing", server_address(), timeout.count(),
                        key_list({key}));
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
  }
}

Expected<std::vector<bool>> TcpStore::check(const std::vector<std::string>& keys) {
  return check_until(keys, Clock::now() + timeout_);
}

Expected<std::vector<bool>> TcpStore::check_until(const std::vector<std::string>& keys, Clock::time_point deadline) {
  std::vector<char> body;
  put_u32(body, static_cast<uint32_t>(keys.size()));
  for (const std::string& key : keys) {
    TERN_TRY(check_key(key));
    put_u32(body, static_cast<uint32_t>(key.size()));
    body.insert(body.end(), key.begin(), key.end());
  }
  if (body.size() > kStoreMaxBodyBytes) return make_error("tcp store: {} keys checked at once", keys.size());
  TERN_ASSIGN_OR_RETURN(const Reply reply, request(kOpCheck, body, deadline));
  if (reply.status != kStatusOk || reply.body.size() != keys.size()) {
    return make_error("tcp store {}: malformed reply to a check of {} keys", server_address(), keys.size());
  }
  std::vector<bool> present(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) present[i] = reply.body[i] != 0;
  return present;
}

Expected<void> TcpStore::wait_for(const std::vector<std::string>& keys, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (milliseconds backoff(1);; backoff = std::min(backoff * 2, milliseconds(50))) {
    TERN_ASSIGN_OR_RETURN(const std::vector<bool> present, check_until(keys, deadline + kReplyGrace));
    std::vector<std::string> missing;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!present[i]) missing.push_back(keys[i]);
    }
    if (missing.empty()) return {};
    if (Clock::now() >= deadline) {
      return make_error("tcp store {}: waited {} ms for key(s) {}, still missing", server_address(), timeout.count(),
                        key_list(missing));
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
  }
}

void TcpStore::set(const std::string& key, const std::vector<char>& data) {
  if (auto r = set_value(key, data); !r) throw gloo::IoException(r.error().message);
}

std::vector<char> TcpStore::get(const std::string& key) {
  auto r = get_value(key, timeout_);
  if (!r) throw gloo::IoException(r.error().message);
  return std::move(*r);
}

void TcpStore::wait(const std::vector<std::string>& keys) {
  wait(keys, timeout_);
}

void TcpStore::wait(const std::vector<std::string>& keys, const milliseconds& timeout) {
  if (auto r = wait_for(keys, timeout); !r) throw gloo::IoException(r.error().message);
}

}  // namespace tern
