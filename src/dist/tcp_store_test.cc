// TcpStoreServer and TcpStore over 127.0.0.1, the port chosen by the OS: values round-trip, a wait sees a key set
// later by another client, deadlines end in errors naming the keys, malformed requests close only their own
// connection. No timing is asserted tighter than "well within the deadline plus a grace of seconds".
#include "dist/tcp_store.h"

#include <arpa/inet.h>
#include <gloo/common/error.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>

namespace tern {
namespace {

using std::chrono::milliseconds;

std::unique_ptr<TcpStoreServer> serve() {
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  EXPECT_TRUE(server.has_value()) << server.error().message;
  EXPECT_GT((*server)->port(), 0);
  return std::move(*server);
}

std::unique_ptr<TcpStore> client(int port, milliseconds timeout = std::chrono::seconds(30)) {
  auto store = TcpStore::connect("127.0.0.1", port, timeout);
  EXPECT_TRUE(store.has_value()) << store.error().message;
  return store ? std::move(*store) : nullptr;
}

std::vector<char> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

// A raw TCP connection to the server, to send what no TcpStore would.
int raw_connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

// True when the server closes the connection (recv returns 0 or an error) within 10 s.
bool closed_by_server(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 10000) <= 0) return false;
  char c;
  return ::recv(fd, &c, 1, 0) <= 0;
}

TEST(TcpStore, SetThenGetReturnsTheValueToEveryClient) {
  auto server = serve();
  auto a = client(server->port());
  auto b = client(server->port());
  EXPECT_EQ(a->local_address(), "127.0.0.1");
  ASSERT_TRUE(a->set_value("k", bytes("value one")).has_value());
  std::vector<char> binary(70000);
  for (size_t i = 0; i < binary.size(); ++i) binary[i] = static_cast<char>(i * 131 + 7);
  ASSERT_TRUE(a->set_value("binary", binary).has_value());
  ASSERT_TRUE(a->set_value("empty", {}).has_value());
  auto got = b->get_value("k");
  ASSERT_TRUE(got.has_value()) << got.error().message;
  EXPECT_EQ(*got, bytes("value one"));
  EXPECT_EQ(*b->get_value("binary"), binary);
  EXPECT_TRUE(b->get_value("empty")->empty());
  // Set again: the new value wins.
  ASSERT_TRUE(b->set_value("k", bytes("two")).has_value());
  EXPECT_EQ(*a->get_value("k"), bytes("two"));
  auto present = a->check({"k", "nope", "binary"});
  ASSERT_TRUE(present.has_value()) << present.error().message;
  EXPECT_EQ(*present, (std::vector<bool>{true, false, true}));
}

TEST(TcpStore, WaitSeesAKeySetLaterByAnotherClient) {
  auto server = serve();
  auto waiter = client(server->port());
  auto setter = client(server->port());
  std::thread later([&] {
    std::this_thread::sleep_for(milliseconds(200));
    EXPECT_TRUE(setter->set_value("late/1", bytes("x")).has_value());
    EXPECT_TRUE(setter->set_value("late/2", bytes("y")).has_value());
  });
  const auto waited = waiter->wait_for({"late/1", "late/2"}, std::chrono::seconds(30));
  EXPECT_TRUE(waited.has_value()) << waited.error().message;
  later.join();
  // get() blocks the same way (gloo::rendezvous::Store's interface).
  std::thread later2([&] {
    std::this_thread::sleep_for(milliseconds(100));
    setter->set(std::string("late/3"), bytes("z"));
  });
  EXPECT_EQ(waiter->get("late/3"), bytes("z"));
  later2.join();
}

TEST(TcpStore, GetPastTheDeadlineNamesTheKey) {
  auto server = serve();
  auto store = client(server->port());
  ASSERT_TRUE(store->set_value("there", bytes("1")).has_value());
  const auto start = std::chrono::steady_clock::now();
  const auto got = store->get_value("never/set", milliseconds(300));
  ASSERT_FALSE(got.has_value());
  EXPECT_NE(got.error().message.find("'never/set'"), std::string::npos) << got.error().message;
  EXPECT_NE(got.error().message.find("still missing"), std::string::npos) << got.error().message;
  const auto waited = store->wait_for({"there", "gone/a", "gone/b"}, milliseconds(300));
  ASSERT_FALSE(waited.has_value());
  EXPECT_NE(waited.error().message.find("'gone/a', 'gone/b'"), std::string::npos) << waited.error().message;
  EXPECT_EQ(waited.error().message.find("'there'"), std::string::npos) << waited.error().message;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  // Through Gloo's interface the same failure is a gloo::IoException.
  EXPECT_THROW(store->wait({"gone/a"}, milliseconds(100)), gloo::IoException);
  // The connection is still good.
  EXPECT_EQ(*store->get_value("there"), bytes("1"));
}

TEST(TcpStore, ConnectRetriesUntilTheServerStarts) {
  // Find a free port, let it go, and start the server there only after the client has begun to connect.
  int port = 0;
  { port = serve()->port(); }
  std::unique_ptr<TcpStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(milliseconds(300));
    auto started = TcpStoreServer::start("127.0.0.1", port);
    ASSERT_TRUE(started.has_value()) << started.error().message;
    server = std::move(*started);
  });
  auto store = TcpStore::connect("127.0.0.1", port, std::chrono::seconds(30));
  starter.join();
  ASSERT_TRUE(store.has_value()) << store.error().message;
  EXPECT_TRUE((*store)->set_value("k", bytes("v")).has_value());
}

TEST(TcpStore, ConnectingToNothingFailsAtTheDeadline) {
  int port = 0;
  { port = serve()->port(); }  // free now, and nobody listens on it
  const auto start = std::chrono::steady_clock::now();
  auto store = TcpStore::connect("127.0.0.1", port, milliseconds(300));
  ASSERT_FALSE(store.has_value());
  EXPECT_NE(store.error().message.find("could not connect"), std::string::npos) << store.error().message;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(TcpStore, MalformedRequestsCloseOnlyTheirConnection) {
  auto server = serve();
  auto good = client(server->port());
  ASSERT_TRUE(good->set_value("before", bytes("1")).has_value());
  const std::vector<std::string> garbage = {
      std::string("\xFF\0\0\0\0", 5),                      // unknown op
      std::string("G\xFF\xFF\xFF\xFF", 5),                 // body length past the cap
      std::string("S\x02\0\0\0xx", 7),                     // set body too short for its key length
      std::string("S\x08\0\0\0\x10\0\0\0abcd", 13),        // key length runs off the body
      std::string("C\x08\0\0\0\x05\0\0\0\x01\0\0\0", 13),  // check: 5 keys announced, body ends
  };
  for (const std::string& g : garbage) {
    const int fd = raw_connect(server->port());
    ASSERT_EQ(::send(fd, g.data(), g.size(), MSG_NOSIGNAL), static_cast<ssize_t>(g.size()));
    EXPECT_TRUE(closed_by_server(fd)) << "message of " << g.size() << " bytes";
    ::close(fd);
  }
  // A key over 4 KiB is refused: by the client before sending, and by the server if sent anyway.
  EXPECT_FALSE(good->set_value(std::string(kStoreMaxKeyBytes + 1, 'k'), bytes("v")).has_value());
  {
    const int fd = raw_connect(server->port());
    std::string get(1, 'G');
    const uint32_t len = kStoreMaxKeyBytes + 1;
    for (int i = 0; i < 4; ++i) get.push_back(static_cast<char>((len >> (8 * i)) & 0xFF));
    get += std::string(len, 'k');
    ASSERT_EQ(::send(fd, get.data(), get.size(), MSG_NOSIGNAL), static_cast<ssize_t>(get.size()));
    EXPECT_TRUE(closed_by_server(fd));
    ::close(fd);
  }
  // A client that connects, sends half a header and leaves.
  {
    const int fd = raw_connect(server->port());
    ASSERT_EQ(::send(fd, "S\x01", 2, MSG_NOSIGNAL), 2);
    ::close(fd);
  }
  // The server kept serving the well-behaved client, and new ones.
  EXPECT_EQ(*good->get_value("before"), bytes("1"));
  ASSERT_TRUE(good->set_value("after", bytes("2")).has_value());
  EXPECT_EQ(*client(server->port())->get_value("after"), bytes("2"));
}

TEST(TcpStore, AServerGoneIsAnErrorNotAHang) {
  auto server = serve();
  auto store = client(server->port(), milliseconds(500));
  ASSERT_TRUE(store->set_value("k", bytes("v")).has_value());
  server.reset();
  const auto start = std::chrono::steady_clock::now();
  const auto got = store->get_value("k");
  ASSERT_FALSE(got.has_value());
  EXPECT_NE(got.error().message.find("tcp store 127.0.0.1:"), std::string::npos) << got.error().message;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(TcpStore, RefusesOutOfRangePorts) {
  EXPECT_FALSE(TcpStoreServer::start("127.0.0.1", 70000).has_value());
  EXPECT_FALSE(TcpStore::connect("127.0.0.1", 0, milliseconds(10)).has_value());
  const auto bad = TcpStoreServer::start("no-such-host.invalid", 0);
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("no-such-host.invalid"), std::string::npos) << bad.error().message;
}

}  // namespace
}  // namespace tern
