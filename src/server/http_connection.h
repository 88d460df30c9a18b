// One HTTP connection under tern's own keep-alive loop, in place of cpp-httplib 0.11's. The library reads each
// request through a fresh stream whose read-ahead buffer dies with it (pipelined requests after the first were
// lost), gives handlers no way to see the socket (a non-streamed request could not notice its client leaving), has
// no total deadline (a client trickling its headers held a thread as long as it liked) and no bound on a line's
// length before it ends. `ConnectionServer` overrides the library's per-socket hook and runs the loop with a
// `Connection`, which keeps its buffer across requests and bounds every request's reading:
//   - a total read deadline from the request's first byte to its body's last (then 408 and close);
//   - at most `max_head_bytes` of request line and headers (then 431), at most the body budget the pre-routing
//     handler sets after the headers (then 413);
//   - close after the response when a handler asks (a refused body is never read; HTTP/1.0 close-delimited bodies).
// Handlers reach their connection through `Connection::current()` (thread per connection). docs/server.md.
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace tern {

struct ConnectionLimits {
  std::chrono::milliseconds request_read_timeout{30000};  // first byte of a request to the last of its body
  std::chrono::milliseconds keep_alive_timeout{5000};     // idle wait for the next request
  std::chrono::milliseconds write_timeout{30000};         // for each write to make progress
  size_t max_head_bytes = 64 << 10;                       // request line and headers
  size_t keep_alive_max_count = 100;                      // requests on one connection
};

class Connection final : public httplib::Stream {
 public:
  // Why reading the current request stopped early, if it did.
  enum class Failure { kNone, kTimeout, kHeadTooLarge, kBodyTooLarge };

  // `stopping` turns true when the server shuts down: reads and waits then end within 100 ms.
  Connection(int fd, const ConnectionLimits& limits, std::function<bool()> stopping);

  // The connection the calling thread is serving (nullptr outside a handler).
  static Connection* current();

  bool is_readable() const override;
  bool is_writable() const override;
  ssize_t read(char* ptr, size_t size) override;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  int socket() const override { return fd_; }

  // Waits up to the keep-alive timeout for a request's first byte (buffered or on the socket); false when the
  // peer closed, the wait ran out or `stopping()` turned true.
  bool wait_for_request();
  // Starts the next request's budgets and deadline.
  void begin_request();
  // The headers are read: from now on at most `max_bytes` more may be read for this request (its body), exactly
  // that many when `exact` (a Content-Length), fewer for a chunked body.
  void begin_body(size_t max_bytes, bool exact);
  // The request announced a body that nobody read (a request refused before its body): the connection cannot
  // carry another request after it.
  bool body_unread() const { return in_body_ && budget_ > 0 && (exact_ || budget_ == body_budget_); }
  Failure failure() const { return failure_; }
  bool wrote_response() const { return bytes_written_ > 0; }

  // The client closed its end or the socket failed (checked without blocking; buffered pipelined bytes or unread
  // data on the socket do not count as closed).
  bool peer_closed() const;

  // Close after the current response (and say so in its Connection header).
  void close_after_response() { close_ = true; }
  bool closing() const { return close_; }

  // Answers 408 with `json_body` if nothing was written for the current request yet (its request line timed out,
  // which the library ends silently).
  void write_timeout_response(const std::string& json_body);
  // Stops sending, then reads and discards what the client still sends for a moment, so that closing with unread
  // data does not reset the connection before the client has read the response.
  void linger();

 private:
  bool wait(short events, std::chrono::milliseconds timeout) const;
  ssize_t fill();

  int fd_;
  ConnectionLimits limits_;
  std::function<bool()> stopping_;
  std::vector<char> buffer_;
  size_t buffer_begin_ = 0, buffer_end_ = 0;
  std::chrono::steady_clock::time_point deadline_;
  size_t budget_ = 0;  // bytes this request may still read
  bool in_body_ = false;
  bool exact_ = false;
  size_t body_budget_ = 0;
  Failure failure_ = Failure::kNone;
  size_t bytes_written_ = 0;
  bool close_ = false;
};

// cpp-httplib's Server with tern's connection loop (see above).
class ConnectionServer final : public httplib::Server {
 public:
  ConnectionServer(ConnectionLimits limits, std::string timeout_body)
      : limits_(limits), timeout_body_(std::move(timeout_body)) {}

 private:
  bool process_and_close_socket(socket_t sock) override;

  ConnectionLimits limits_;
  std::string timeout_body_;  // the 408's body when a request line times out
};

}  // namespace tern
