// GlooCommunicator against sums computed here in double: fresh random non-zero inputs (the seed is printed on a
// failure), outputs poisoned with NaN. Each rank is a thread creating its own communicator over 127.0.0.1; rank 0
// serves the store on a port the OS picks and hands it to the others. One test runs rank 1 in a second process (this
// binary again, as GlooChild.RankOne). Timeouts are generous except where a failure is the point, and no test
// asserts more about time than "well before a hang".
#include "dist/gloo_communicator.h"

#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <future>
#include <latch>
#include <limits>
#include <random>
#include <thread>

#include "dist/tcp_store.h"

extern char** environ;

namespace tern {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t fresh_seed() {
  return std::random_device{}();
}

std::vector<std::vector<float>> random_inputs(int world, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(0.5f, 2.0f);
  std::bernoulli_distribution sign(0.5);
  std::vector<std::vector<float>> in(static_cast<size_t>(world), std::vector<float>(n));
  for (auto& v : in)
    for (float& x : v) x = sign(rng) ? dist(rng) : -dist(rng);
  return in;
}

double sum_of(const std::vector<std::vector<float>>& in, size_t i) {
  double s = 0.0;
  for (const auto& v : in) s += v[i];
  return s;
}

GlooOptions options_for(int rank, int world, milliseconds timeout = std::chrono::seconds(60)) {
  GlooOptions o;
  o.rank = rank;
  o.world = world;
  o.store_host = "127.0.0.1";
  o.timeout = timeout;
  return o;
}

// Runs ranks `ranks` of a group of `world` as threads: each creates its communicator (rank 0, when among them,
// serves the store on port 0 and passes the port on) and then runs fn(comm, rank); every rank keeps its
// communicator until all are done, as a real group would. Returns each rank's result, creation's or fn's.
template <typename Fn>
std::vector<Expected<void>> on_ranks(int world, std::vector<int> ranks, milliseconds timeout, Fn fn,
                                     std::function<void(GlooOptions&)> tweak = {}) {
  std::promise<int> port_promise;
  std::shared_future<int> port = port_promise.get_future().share();
  std::once_flag port_set;
  auto set_port = [&](int p) { std::call_once(port_set, [&] { port_promise.set_value(p); }); };
  std::vector<Expected<void>> results(ranks.size());
  std::latch done(static_cast<std::ptrdiff_t>(ranks.size()));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] {
      const int r = ranks[i];
      GlooOptions o = options_for(r, world, timeout);
      if (tweak) tweak(o);
      if (r == 0) {
        o.serve_store = true;
        o.on_store_listening = set_port;
      } else {
        o.store_port = port.get();
      }
      std::unique_ptr<Communicator> comm;
      if (o.store_port < 0) {
        results[i] = make_error("rank 0 never listened");
      } else if (auto created = gloo_communicator_create(o); !created) {
        results[i] = tl::unexpected<Error>(created.error());
      } else {
        comm = std::move(*created);
        EXPECT_EQ(comm->rank(), r);
        EXPECT_EQ(comm->world(), world);
        results[i] = fn(comm, r);
      }
      if (r == 0) set_port(-1);  // creation failed before listening: let the others give up
      done.arrive_and_wait();
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

std::vector<int> all_ranks(int world) {
  std::vector<int> r(static_cast<size_t>(world));
  for (int i = 0; i < world; ++i) r[static_cast<size_t>(i)] = i;
  return r;
}

template <typename Fn>
std::vector<Expected<void>> on_all_ranks(int world, Fn fn) {
  return on_ranks(world, all_ranks(world), std::chrono::seconds(60), fn);
}

void expect_sum_and_same_bits(const std::vector<std::vector<float>>& in, const std::vector<std::vector<float>>& out) {
  const size_t world = in.size();
  for (size_t i = 0; i < in[0].size(); ++i) {
    ASSERT_NEAR(out[0][i], sum_of(in, i), 1e-5 * static_cast<double>(world)) << "element " << i;
    for (size_t r = 1; r < world; ++r) {
      ASSERT_EQ(std::bit_cast<uint32_t>(out[r][i]), std::bit_cast<uint32_t>(out[0][i])) << "rank " << r << " el " << i;
    }
  }
}

class Gloo : public testing::TestWithParam<int> {};

TEST_P(Gloo, AllReduceSumIsTheSumAndTheSameBitsOnEveryRank) {
  const int world = GetParam();
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::vector<std::vector<std::vector<float>>> in, out;
  for (const size_t n : {size_t{1}, size_t{7}, size_t{100003}}) {
    in.push_back(random_inputs(world, n, seed + static_cast<uint32_t>(n)));
    out.push_back(in.back());
  }
  const auto results = on_all_ranks(world, [&](std::unique_ptr<Communicator>& comm, int r) -> Expected<void> {
    for (auto& size : out) TERN_TRY(comm->all_reduce_sum(size[static_cast<size_t>(r)]));
    return {};
  });
  for (const auto& res : results) ASSERT_TRUE(res.has_value()) << res.error().message;
  for (size_t s = 0; s < in.size(); ++s) expect_sum_and_same_bits(in[s], out[s]);
}

TEST_P(Gloo, RepeatedAllReducesDoNotMixRounds) {
  const int world = GetParam();
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  constexpr int kRounds = 50;
  constexpr size_t kN = 64;
  std::vector<std::vector<std::vector<float>>> in, out;  // [round][rank][i]
  for (int round = 0; round < kRounds; ++round) {
    in.push_back(random_inputs(world, kN, seed + static_cast<uint32_t>(round)));
    out.push_back(in.back());
  }
  const auto results = on_all_ranks(world, [&](std::unique_ptr<Communicator>& comm, int r) -> Expected<void> {
    for (int round = 0; round < kRounds; ++round) TERN_TRY(comm->all_reduce_sum(out[round][static_cast<size_t>(r)]));
    return {};
  });
  for (const auto& res : results) ASSERT_TRUE(res.has_value()) << res.error().message;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    expect_sum_and_same_bits(in[round], out[round]);
  }
}

TEST_P(Gloo, AllGatherPutsEachRankInItsPlace) {
  const int world = GetParam();
  const size_t n = 33;
  const auto in = random_inputs(world, n, fresh_seed());
  std::vector<std::vector<float>> all(static_cast<size_t>(world), std::vector<float>(n * world, kNaN));
  const auto results = on_all_ranks(world, [&](std::unique_ptr<Communicator>& comm, int r) {
    return comm->all_gather(in[static_cast<size_t>(r)], all[static_cast<size_t>(r)]);
  });
  for (const auto& res : results) ASSERT_TRUE(res.has_value()) << res.error().message;
  for (int r = 0; r < world; ++r) {
    for (int s = 0; s < world; ++s) {
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(all[r][s * n + i], in[s][i]) << "rank " << r << " from " << s;
    }
  }
}

TEST_P(Gloo, BroadcastCopiesTheRootsBytesAndBarrierMeets) {
  const int world = GetParam();
  const int root = world - 1;  // not rank 0 whenever there are two ranks or more
  std::vector<std::vector<std::byte>> data(static_cast<size_t>(world), std::vector<std::byte>(1001, std::byte{0xAB}));
  std::mt19937 rng(fresh_seed());
  for (std::byte& b : data[root]) b = static_cast<std::byte>(rng() | 1);
  // Each way of choosing what Gloo listens on: the default (the address the store is reached from), an interface
  // by name, an address.
  const auto bind = [](GlooOptions& o) {
    if (o.rank % 3 == 1) o.bind_iface = "lo";
    if (o.rank % 3 == 2) o.bind_host = "127.0.0.1";
  };
  const auto results = on_ranks(
      world, all_ranks(world), std::chrono::seconds(60),
      [&](std::unique_ptr<Communicator>& comm, int r) -> Expected<void> {
        TERN_TRY(comm->broadcast(data[static_cast<size_t>(r)], root));
        EXPECT_NE(comm->describe().find("gloo tcp"), std::string::npos) << comm->describe();
        return comm->barrier();
      },
      bind);
  for (const auto& res : results) ASSERT_TRUE(res.has_value()) << res.error().message;
  for (int r = 0; r < world; ++r) EXPECT_EQ(data[r], data[root]) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Worlds, Gloo, testing::Values(1, 2, 3, 4));

TEST(GlooGroups, TwoGroupsShareOneStoreUnderTheirOwnPrefixes) {
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  ASSERT_TRUE(server.has_value()) << server.error().message;
  const auto in = random_inputs(4, 513, fresh_seed());  // group g, rank r: in[2 * g + r]
  auto out = in;
  std::vector<Expected<void>> results(4);
  std::vector<std::thread> threads;
  std::latch done(4);  // each keeps its communicator until all four are through
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      GlooOptions o = options_for(i % 2, 2);
      o.store_port = (*server)->port();
      o.prefix = i < 2 ? "group-a" : "group-b";
      auto comm = gloo_communicator_create(o);
      results[static_cast<size_t>(i)] =
          comm ? (*comm)->all_reduce_sum(out[static_cast<size_t>(i)]) : tl::unexpected<Error>(comm.error());
      done.arrive_and_wait();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const auto& res : results) ASSERT_TRUE(res.has_value()) << res.error().message;
  for (size_t g = 0; g < 2; ++g) {
    for (size_t i = 0; i < in[0].size(); ++i) {
      ASSERT_NEAR(out[2 * g][i], double{in[2 * g][i]} + in[2 * g + 1][i], 1e-5) << "group " << g << " el " << i;
      ASSERT_EQ(std::bit_cast<uint32_t>(out[2 * g][i]), std::bit_cast<uint32_t>(out[2 * g + 1][i]));
    }
  }
}

TEST(GlooFailures, ARankThatNeverShowsUpFailsTheOthersCreation) {
  const auto start = Clock::now();
  // Rank 2 of 3 never starts.
  const auto results =
      on_ranks(3, {0, 1}, milliseconds(1000), [](std::unique_ptr<Communicator>&, int) { return Expected<void>{}; });
  for (const auto& res : results) {
    ASSERT_FALSE(res.has_value());
    EXPECT_NE(res.error().message.find("rank(s) 2 did not join"), std::string::npos) << res.error().message;
    // Rank 0 gives up at its deadline; rank 1, a moment behind, may see the store go with it.
    EXPECT_TRUE(res.error().message.find("within 1000 ms") != std::string::npos ||
                res.error().message.find("before the store stopped answering") != std::string::npos)
        << res.error().message;
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(20));
}

TEST(GlooFailures, NoStoreServerFailsCreation) {
  int port = 0;
  {
    auto s = TcpStoreServer::start("127.0.0.1", 0);
    ASSERT_TRUE(s.has_value());
    port = (*s)->port();
  }  // nobody listens there now
  GlooOptions o = options_for(1, 2, milliseconds(500));
  o.store_port = port;
  const auto created = gloo_communicator_create(o);
  ASSERT_FALSE(created.has_value());
  EXPECT_NE(created.error().message.find("could not connect"), std::string::npos) << created.error().message;
  EXPECT_NE(created.error().message.find("rank 1"), std::string::npos) << created.error().message;
}

TEST(GlooFailures, APeerGoneMidRunFailsTheOthersNextCollective) {
  const auto start = Clock::now();
  std::promise<void> gone;
  std::shared_future<void> gone_future = gone.get_future().share();
  std::vector<std::string> errors(3);
  const auto results =
      on_ranks(3, all_ranks(3), milliseconds(2000), [&](std::unique_ptr<Communicator>& comm, int r) -> Expected<void> {
        std::vector<float> v(1000, 1.0f);
        TERN_TRY(comm->all_reduce_sum(v));
        if (r == 2) {
          comm.reset();  // rank 2's process goes away
          gone.set_value();
          return {};
        }
        gone_future.wait();
        auto next = comm->all_reduce_sum(v);
        if (next) return make_error("rank {}: an all_reduce_sum without rank 2 succeeded", r);
        errors[static_cast<size_t>(r)] = next.error().message;
        const auto later = comm->barrier();  // broken from then on, at once
        if (later || later.error().message.find("broken") == std::string::npos) {
          return make_error("rank {}: after a failure, barrier gave '{}'", r, later ? "ok" : later.error().message);
        }
        return {};
      });
  for (const auto& res : results) ASSERT_TRUE(res.has_value()) << res.error().message;
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find(fmt::format("all_reduce_sum on rank {}", r)), std::string::npos) << errors[r];
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(30));
}

TEST(GlooFailures, AnAddressToListenOnThatDoesNotExistIsAnError) {
  for (const bool by_iface : {false, true}) {
    GlooOptions o = options_for(0, 1, std::chrono::seconds(10));
    o.serve_store = true;
    (by_iface ? o.bind_iface : o.bind_host) = "no-such-host.invalid";
    const auto created = gloo_communicator_create(o);
    ASSERT_FALSE(created.has_value());
    EXPECT_NE(created.error().message.find("no-such-host.invalid"), std::string::npos) << created.error().message;
  }
}

TEST(GlooFailures, AllGatherOfTheWrongSizeIsRefusedAndBreaksTheCommunicator) {
  const auto results = on_all_ranks(1, [](std::unique_ptr<Communicator>& comm, int) -> Expected<void> {
    std::vector<float> mine(3, 1.0f), all(4, kNaN);
    const auto r = comm->all_gather(mine, all);
    if (r || r.error().message.find("3 elements gathered into 4") == std::string::npos) {
      return make_error("all_gather gave '{}'", r ? "ok" : r.error().message);
    }
    if (comm->barrier()) return make_error("barrier after a failure succeeded");
    return {};
  });
  ASSERT_TRUE(results[0].has_value()) << results[0].error().message;
}

// ---- Two processes: rank 0 here, rank 1 in a child running GlooChild.RankOne of this binary. ----

constexpr size_t kProcessN = 4099;

// What both processes run once created; rank 0 also receives rank 1's sum to compare its bits.
Expected<void> process_collectives(Communicator& comm, uint32_t seed) {
  const auto in = random_inputs(2, kProcessN, seed);
  std::vector<float> sum = in[static_cast<size_t>(comm.rank())];
  TERN_TRY(comm.all_reduce_sum(sum));
  for (size_t i = 0; i < kProcessN; ++i) {
    if (std::abs(sum[i] - sum_of(in, i)) > 1e-5) return make_error("rank {}: element {} is {}", comm.rank(), i, sum[i]);
  }
  std::vector<float> all(2 * kProcessN, kNaN);
  TERN_TRY(comm.all_gather(in[static_cast<size_t>(comm.rank())], all));
  for (size_t i = 0; i < 2 * kProcessN; ++i) {
    if (all[i] != in[i / kProcessN][i % kProcessN]) return make_error("rank {}: gathered {} wrong", comm.rank(), i);
  }
  std::vector<float> theirs = comm.rank() == 1 ? sum : std::vector<float>(kProcessN, kNaN);
  TERN_TRY(comm.broadcast(std::as_writable_bytes(std::span(theirs)), 1));
  for (size_t i = 0; i < kProcessN; ++i) {
    if (std::bit_cast<uint32_t>(theirs[i]) != std::bit_cast<uint32_t>(sum[i])) {
      return make_error("rank {}: element {} differs between the processes", comm.rank(), i);
    }
  }
  return comm.barrier();
}

TEST(GlooChild, RankOne) {
  const char* port = std::getenv("TERN_GLOO_TEST_PORT");
  const char* seed = std::getenv("TERN_GLOO_TEST_SEED");
  if (port == nullptr || seed == nullptr) GTEST_SKIP() << "the child of GlooProcesses.RankOneInAChildProcess";
  GlooOptions o = options_for(1, 2, std::chrono::seconds(30));
  o.store_port = std::atoi(port);
  auto comm = gloo_communicator_create(o);
  ASSERT_TRUE(comm.has_value()) << comm.error().message;
  const auto ran = process_collectives(**comm, static_cast<uint32_t>(std::strtoul(seed, nullptr, 10)));
  ASSERT_TRUE(ran.has_value()) << ran.error().message;
}

TEST(GlooProcesses, RankOneInAChildProcess) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  pid_t child = -1;
  GlooOptions o = options_for(0, 2, std::chrono::seconds(30));
  o.serve_store = true;
  o.on_store_listening = [&](int port) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    env.push_back(fmt::format("TERN_GLOO_TEST_PORT={}", port));
    env.push_back(fmt::format("TERN_GLOO_TEST_SEED={}", seed));
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe", filter = "--gtest_filter=GlooChild.RankOne";
    char* argv[] = {exe.data(), filter.data(), nullptr};
    if (posix_spawn(&child, exe.c_str(), nullptr, nullptr, argv, envp.data()) != 0) child = -1;
  };
  auto comm = gloo_communicator_create(o);
  ASSERT_GT(child, 0) << "could not start the child process";
  Expected<void> ran = comm ? process_collectives(**comm, seed) : tl::unexpected<Error>(comm.error());
  // Wait for the child (at most a minute, then end it: it is ours).
  int status = 0;
  pid_t waited = 0;
  for (const auto deadline = Clock::now() + std::chrono::seconds(60); Clock::now() < deadline;) {
    waited = waitpid(child, &status, WNOHANG);
    if (waited != 0) break;
    std::this_thread::sleep_for(milliseconds(20));
  }
  if (waited == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    FAIL() << "the child process did not finish";
  }
  ASSERT_TRUE(ran.has_value()) << ran.error().message;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
}

}  // namespace
}  // namespace tern
