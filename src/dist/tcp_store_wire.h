// The wire format shared by TcpStoreServer and TcpStore (dist/tcp_store.h describes it), and the socket helpers
// both sides use. Internal to src/dist.
//
//   std::vector<char> frame{static_cast<char>(store_wire::kOpGet)};
//   store_wire::put_u32(frame, key.size());
#pragma once

#include <netdb.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <system_error>
#include <vector>

#include "core/error.h"

namespace tern::store_wire {

enum : uint8_t { kOpSet = 'S', kOpGet = 'G', kOpCheck = 'C' };
enum : uint8_t { kStatusOk = 0, kStatusMissing = 1, kStatusRefused = 2 };
inline constexpr size_t kHeaderBytes = 5;  // op or status, u32 body length

inline void put_u32(std::vector<char>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

inline uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

inline std::string errno_text(int err) {
  return std::system_category().message(err);
}

// getaddrinfo's list, freed on scope exit.
struct AddrList {
  addrinfo* head = nullptr;
  AddrList() = default;
  AddrList(const AddrList&) = delete;
  AddrList& operator=(const AddrList&) = delete;
  ~AddrList() {
    if (head != nullptr) freeaddrinfo(head);
  }
};

// host:port as TCP addresses; `passive` for listening (an empty host is then every interface).
inline Expected<void> resolve(const std::string& host, int port, bool passive, AddrList& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const std::string service = std::to_string(port);
  const int rv = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out.head);
  if (rv != 0) return make_error("cannot resolve '{}': {}", host, gai_strerror(rv));
  return {};
}

}  // namespace tern::store_wire
