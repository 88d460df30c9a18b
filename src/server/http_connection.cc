#include "server/http_connection.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

namespace tern {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

thread_local Connection* t_current = nullptr;

constexpr size_t kBufferSize = 16 << 10;

void address_of(const sockaddr_storage& addr, std::string& ip, int& port) {
  char text[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(addr);
    inet_ntop(AF_INET, &a.sin_addr, text, sizeof(text));
    port = ntohs(a.sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(addr);
    inet_ntop(AF_INET6, &a.sin6_addr, text, sizeof(text));
    port = ntohs(a.sin6_port);
  }
  ip = text;
}

int millis_until(Clock::time_point t) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, INT_MAX));
}

}  // namespace

Connection::Connection(int fd, const ConnectionLimits& limits, std::function<bool()> stopping)
    : fd_(fd), limits_(limits), stopping_(std::move(stopping)), buffer_(kBufferSize) {}

Connection* Connection::current() { return t_current; }

bool Connection::wait(short events, std::chrono::milliseconds timeout) const {
  pollfd p{fd_, events, 0};
  for (;;) {
    const int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(timeout.count(), INT_MAX)));
    if (n < 0 && errno == EINTR) continue;
    return n > 0;
  }
}

bool Connection::is_readable() const {
  return buffer_begin_ < buffer_end_ || wait(POLLIN, std::chrono::milliseconds(millis_until(deadline_)));
}

bool Connection::is_writable() const { return wait(POLLOUT, limits_.write_timeout) && !peer_closed(); }

bool Connection::peer_closed() const {
  pollfd p{fd_, static_cast<short>(POLLIN | POLLRDHUP), 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

ssize_t Connection::fill() {
  for (;;) {
    if (stopping_()) return -1;
    const int left = millis_until(deadline_);
    pollfd p{fd_, POLLIN, 0};
    const int ready = left > 0 ? ::poll(&p, 1, std::min(left, 100)) : 0;
    if ((ready < 0 && errno == EINTR) || (ready == 0 && left > 100)) continue;
    if (ready == 0) {
      failure_ = Failure::kTimeout;
      return -1;
    }
    if (ready < 0) return -1;
    const ssize_t n = ::recv(fd_, buffer_.data(), buffer_.size(), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n;
    buffer_begin_ = 0;
    buffer_end_ = static_cast<size_t>(n);
    return n;
  }
}

ssize_t Connection::read(char* ptr, size_t size) {
  if (failure_ != Failure::kNone) return -1;
  if (size == 0) return 0;
  if (budget_ == 0) {
    failure_ = in_body_ ? Failure::kBodyTooLarge : Failure::kHeadTooLarge;
    return -1;
  }
  if (buffer_begin_ == buffer_end_) {
    const ssize_t n = fill();
    if (n <= 0) return n;
  }
  const size_t k = std::min({size, budget_, buffer_end_ - buffer_begin_});
  std::memcpy(ptr, buffer_.data() + buffer_begin_, k);
  buffer_begin_ += k;
  budget_ -= k;
  return static_cast<ssize_t>(k);
}

ssize_t Connection::write(const char* ptr, size_t size) {
  if (!wait(POLLOUT, limits_.write_timeout)) return -1;
  for (;;) {
    const ssize_t n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n > 0) bytes_written_ += static_cast<size_t>(n);
    return n;
  }
}

void Connection::get_remote_ip_and_port(std::string& ip, int& port) const {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) address_of(addr, ip, port);
}

void Connection::get_local_ip_and_port(std::string& ip, int& port) const {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) address_of(addr, ip, port);
}

bool Connection::wait_for_request() {
  if (buffer_begin_ < buffer_end_) return true;  // pipelined: the next request is already here
  const auto until = Clock::now() + limits_.keep_alive_timeout;
  while (!stopping_()) {
    const int left = millis_until(until);
    if (left == 0) return false;
    pollfd p{fd_, POLLIN, 0};
    const int n = ::poll(&p, 1, std::min(left, 50));
    if (n < 0 && errno != EINTR) return false;
    if (n > 0) {
      // Readable: data, or the peer's end of stream (then the request line's read sees it and the loop ends).
      return (p.revents & (POLLERR | POLLNVAL)) == 0;
    }
  }
  return false;
}

void Connection::begin_request() {
  deadline_ = Clock::now() + limits_.request_read_timeout;
  budget_ = limits_.max_head_bytes;
  in_body_ = false;
  failure_ = Failure::kNone;
  bytes_written_ = 0;
}

void Connection::begin_body(size_t max_bytes, bool exact) {
  budget_ = body_budget_ = max_bytes;
  in_body_ = true;
  exact_ = exact;
}

void Connection::write_timeout_response(const std::string& json_body) {
  if (wrote_response()) return;
  const std::string response = "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nContent-Length: " +
                               std::to_string(json_body.size()) + "\r\nConnection: close\r\n\r\n" + json_body;
  for (size_t sent = 0; sent < response.size();) {
    const ssize_t n = write(response.data() + sent, response.size() - sent);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

void Connection::linger() {
  ::shutdown(fd_, SHUT_WR);
  const auto until = Clock::now() + 1s;
  size_t drained = 0;
  char sink[4096];
  while (drained < (size_t{1} << 20)) {
    pollfd p{fd_, POLLIN, 0};
    const int left = millis_until(until);
    if (left == 0 || ::poll(&p, 1, left) <= 0) return;
    const ssize_t n = ::recv(fd_, sink, sizeof(sink), 0);
    if (n <= 0) return;
    drained += static_cast<size_t>(n);
  }
}

bool ConnectionServer::process_and_close_socket(socket_t sock) {
  Connection conn(sock, limits_, [this] { return svr_sock_ == INVALID_SOCKET; });
  t_current = &conn;
  bool abnormal = false;
  for (size_t count = limits_.keep_alive_max_count; count > 0; --count) {
    if (!conn.wait_for_request()) break;
    conn.begin_request();
    bool closed_by_request = false;
    const bool ok = process_request(conn, count == 1, closed_by_request, nullptr);
    if (conn.failure() == Connection::Failure::kTimeout) conn.write_timeout_response(timeout_body_);
    abnormal = conn.failure() != Connection::Failure::kNone || conn.closing();
    if (!ok || closed_by_request || abnormal) break;
  }
  t_current = nullptr;
  if (abnormal) conn.linger();
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return true;
}

}  // namespace tern
