// TcpStoreServer (dist/tcp_store.h): one thread polling the listening socket, a wake pipe and every connection.
#include "dist/tcp_store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <thread>
#include <unordered_map>
#include <utility>

#include "dist/tcp_store_wire.h"

namespace tern {

using store_wire::AddrList, store_wire::errno_text, store_wire::get_u32, store_wire::kHeaderBytes, store_wire::kOpCheck,
    store_wire::kOpGet, store_wire::kOpSet, store_wire::kStatusMissing, store_wire::kStatusOk,
    store_wire::kStatusRefused, store_wire::put_u32, store_wire::resolve;

namespace {

constexpr size_t kMaxConnections = 256;
constexpr size_t kReadChunk = size_t{256} << 10;

}  // namespace

class TcpStoreServer::Impl {
 public:
  Impl(int listen_fd, int wake_read, int wake_write)
      : listen_fd_(listen_fd), wake_read_(wake_read), wake_write_(wake_write), thread_([this] { run(); }) {}

  ~Impl() {
    const char byte = 0;
    while (::write(wake_write_, &byte, 1) < 0 && errno == EINTR) {
    }
    thread_.join();
    for (Conn& c : conns_) ::close(c.fd);
    ::close(listen_fd_);
    ::close(wake_read_);
    ::close(wake_write_);
  }

 private:
  struct Conn {
    int fd;
    std::vector<char> in;   // bytes read and not yet handled (at most one request plus one read)
    std::vector<char> out;  // the reply being written; nothing more is read until it is gone
    size_t out_pos = 0;
  };

  void run() {
    std::vector<pollfd> fds;
    for (;;) {
      fds.clear();
      fds.push_back({wake_read_, POLLIN, 0});
      fds.push_back({listen_fd_, static_cast<short>(conns_.size() < kMaxConnections ? POLLIN : 0), 0});
      for (const Conn& c : conns_) fds.push_back({c.fd, static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
      if (::poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        return;  // cannot happen with valid descriptors; clients then time out
      }
      if (fds[0].revents != 0) return;
      for (size_t i = 0; i < conns_.size(); ++i) {
        const short revents = fds[i + 2].revents;
        if (revents != 0 && !service(conns_[i], revents)) {
          ::close(conns_[i].fd);
          conns_[i].fd = -1;
        }
      }
      std::erase_if(conns_, [](const Conn& c) { return c.fd < 0; });
      if ((fds[1].revents & POLLIN) != 0) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
          const int one = 1;
          setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          conns_.push_back(Conn{fd, {}, {}, 0});
        }
      }
    }
  }

  // Reads or writes what the connection is ready for; false closes it (the peer left, or sent a malformed request).
  bool service(Conn& c, short revents) {
    if ((revents & (POLLERR | POLLNVAL)) != 0) return false;
    if (!c.out.empty()) {
      if ((revents & POLLOUT) == 0) return (revents & POLLHUP) == 0;
      const ssize_t n = ::send(c.fd, c.out.data() + c.out_pos, c.out.size() - c.out_pos, MSG_NOSIGNAL);
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
      c.out_pos += static_cast<size_t>(n);
      if (c.out_pos < c.out.size()) return true;
      c.out.clear();
      c.out_pos = 0;
      return handle_requests(c);  // a request may already be buffered
    }
    if ((revents & (POLLIN | POLLHUP)) == 0) return true;
    const size_t old = c.in.size();
    c.in.resize(old + kReadChunk);
    const ssize_t n = ::recv(c.fd, c.in.data() + old, kReadChunk, 0);
    c.in.resize(old + static_cast<size_t>(std::max<ssize_t>(n, 0)));
    if (n == 0) return false;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    return handle_requests(c);
  }

  // Handles the complete requests in c.in until a reply is waiting to be written.
  bool handle_requests(Conn& c) {
    size_t pos = 0;
    while (c.out.empty() && c.in.size() - pos >= kHeaderBytes) {
      const uint8_t op = static_cast<uint8_t>(c.in[pos]);
      const uint32_t len = get_u32(c.in.data() + pos + 1);
      if ((op != kOpSet && op != kOpGet && op != kOpCheck) || len > kStoreMaxBodyBytes) return false;
      if (c.in.size() - pos - kHeaderBytes < len) break;
      if (!handle(c, op, c.in.data() + pos + kHeaderBytes, len)) return false;
      pos += kHeaderBytes + len;
    }
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(pos));
    return true;
  }

  static void reply(Conn& c, uint8_t status, const char* body, size_t size) {
    c.out.push_back(static_cast<char>(status));
    put_u32(c.out, static_cast<uint32_t>(size));
    c.out.insert(c.out.end(), body, body + size);
  }

  bool handle(Conn& c, uint8_t op, const char* body, size_t size) {
    if (op == kOpGet) {
      if (size > kStoreMaxKeyBytes) return false;
      const auto it = map_.find(std::string(body, size));
      if (it == map_.end()) {
        reply(c, kStatusMissing, nullptr, 0);
      } else {
        reply(c, kStatusOk, it->second.data(), it->second.size());
      }
      return true;
    }
    if (size < 4) return false;
    const uint32_t first = get_u32(body);
    if (op == kOpSet) {
      if (first > kStoreMaxKeyBytes || first > size - 4 || size - 4 - first > kStoreMaxValueBytes) return false;
      std::string key(body + 4, first);
      std::vector<char> value(body + 4 + first, body + size);
      const auto it = map_.find(key);
      const size_t old = it == map_.end() ? 0 : it->first.size() + it->second.size();
      if (total_bytes_ - old + key.size() + value.size() > kStoreMaxTotalBytes) {
        const std::string why = fmt::format("the store is full ({} bytes)", total_bytes_);
        reply(c, kStatusRefused, why.data(), why.size());
        return true;
      }
      total_bytes_ += key.size() + value.size() - old;
      map_[std::move(key)] = std::move(value);
      reply(c, kStatusOk, nullptr, 0);
      return true;
    }
    // Check: a key count, then each key's length and bytes, filling the body exactly.
    if (first > (size - 4) / 4) return false;
    std::vector<char> present;
    present.reserve(first);
    size_t pos = 4;
    for (uint32_t i = 0; i < first; ++i) {
      if (size - pos < 4) return false;
      const uint32_t klen = get_u32(body + pos);
      pos += 4;
      if (klen > kStoreMaxKeyBytes || klen > size - pos) return false;
      present.push_back(map_.contains(std::string(body + pos, klen)) ? 1 : 0);
      pos += klen;
    }
    if (pos != size) return false;
    reply(c, kStatusOk, present.data(), present.size());
    return true;
  }

  const int listen_fd_, wake_read_, wake_write_;
  std::vector<Conn> conns_;
  std::unordered_map<std::string, std::vector<char>> map_;
  size_t total_bytes_ = 0;
  std::thread thread_;  // last: starts once everything above exists
};

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl, int port) : impl_(std::move(impl)), port_(port) {}

TcpStoreServer::~TcpStoreServer() = default;

Expected<std::unique_ptr<TcpStoreServer>> TcpStoreServer::start(const std::string& host, int port) {
  if (port < 0 || port > 65535) return make_error("tcp store: port {} is outside 0..65535", port);
  AddrList addrs;
  if (auto r = resolve(host, port, true, addrs); !r) return wrap_error(r.error(), "tcp store: cannot listen");
  std::string last = "no address";
  for (addrinfo* ai = addrs.head; ai != nullptr; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last = errno_text(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 128) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      last = errno_text(errno);
      ::close(fd);
      continue;
    }
    int wake[2];
    if (pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
      last = errno_text(errno);
      ::close(fd);
      break;
    }
    const int chosen = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6&>(bound).sin6_port
                                                         : reinterpret_cast<sockaddr_in&>(bound).sin_port);
    return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::make_unique<Impl>(fd, wake[0], wake[1]), chosen));
  }
  return make_error("tcp store: cannot listen on {}:{}: {}", host.empty() ? "*" : host, port, last);
}

}  // namespace tern
