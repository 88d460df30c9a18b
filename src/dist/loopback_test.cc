// LoopbackGroup against sums computed here on one thread, in double: fresh random non-zero inputs, every rank on its
// own thread, outputs poisoned with NaN before each collective.
#include "dist/loopback.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <thread>

namespace tern {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Runs fn(rank) on `world` threads and returns each rank's result.
template <typename Fn>
std::vector<Expected<void>> on_ranks(int world, Fn fn) {
  std::vector<Expected<void>> results(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { results[static_cast<size_t>(r)] = fn(r); });
  for (std::thread& t : threads) t.join();
  return results;
}

std::vector<std::vector<float>> random_inputs(int world, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(0.5f, 2.0f);
  std::bernoulli_distribution sign(0.5);
  std::vector<std::vector<float>> in(static_cast<size_t>(world), std::vector<float>(n));
  for (auto& v : in) for (float& x : v) x = sign(rng) ? dist(rng) : -dist(rng);
  return in;
}

class Loopback : public testing::TestWithParam<int> {};

TEST_P(Loopback, AllReduceSumIsTheSumAndTheSameBitsOnEveryRank) {
  const int world = GetParam();
  for (const size_t n : {size_t{1}, size_t{7}, size_t{4099}}) {
    const auto in = random_inputs(world, n, static_cast<uint32_t>(n * 31 + world));
    auto data = in;
    LoopbackGroup group(world);
    const auto results = on_ranks(world, [&](int r) { return group.rank(r).all_reduce_sum(data[r]); });
    for (const auto& res : results) ASSERT_TRUE(res.has_value()) << res.error().message;
    for (size_t i = 0; i < n; ++i) {
      double want = 0.0;
      for (int r = 0; r < world; ++r) want += in[r][i];
      EXPECT_NEAR(data[0][i], want, 1e-5 * world) << "element " << i;
      for (int r = 1; r < world; ++r) {
        EXPECT_EQ(std::bit_cast<uint32_t>(data[r][i]), std::bit_cast<uint32_t>(data[0][i])) << "rank " << r;
      }
    }
  }
}

TEST_P(Loopback, RepeatedCollectivesDoNotMixRounds) {
  const int world = GetParam();
  const auto in = random_inputs(world, 64, 7);
  std::vector<std::vector<float>> sums(static_cast<size_t>(world));
  LoopbackGroup group(world);
  const auto results = on_ranks(world, [&](int r) -> Expected<void> {
    std::vector<float> acc(64, 0.0f);
    for (int round = 0; round < 50; ++round) {
      std::vector<float> v = in[r];
      for (float& x : v) x *= static_cast<float>(round + 1);
      TERN_TRY(group.rank(r).all_reduce_sum(v));
      for (size_t i = 0; i < v.size(); ++i) acc[i] += v[i];
    }
    sums[r] = acc;
    return {};
  });
  for (const auto& res : results) ASSERT_TRUE(res.has_value()) << res.error().message;
  for (size_t i = 0; i < 64; ++i) {
    double base = 0.0;
    for (int r = 0; r < world; ++r) base += in[r][i];
    EXPECT_NEAR(sums[0][i], base * (50.0 * 51.0 / 2.0), 1e-3 * std::abs(base) * 1275.0 + 1e-3);
  }
}

TEST_P(Loopback, AllGatherPutsEachRankInItsPlace) {
  const int world = GetParam();
  const size_t n = 33;
  const auto in = random_inputs(world, n, 11);
  std::vector<std::vector<float>> all(static_cast<size_t>(world), std::vector<float>(n * world, kNaN));
  LoopbackGroup group(world);
  const auto results = on_ranks(world, [&](int r) { return group.rank(r).all_gather(in[r], all[r]); });
  for (const auto& res : results) ASSERT_TRUE(res.has_value()) << res.error().message;
  for (int r = 0; r < world; ++r) {
    for (int s = 0; s < world; ++s) {
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(all[r][s * n + i], in[s][i]) << "rank " << r << " from " << s;
    }
  }
}

TEST_P(Loopback, BroadcastCopiesTheRootsBytes) {
  const int world = GetParam();
  const int root = world - 1;
  std::vector<std::vector<std::byte>> data(static_cast<size_t>(world), std::vector<std::byte>(100, std::byte{0xAB}));
  for (size_t i = 0; i < 100; ++i) data[root][i] = static_cast<std::byte>(i * 7 + 1);
  LoopbackGroup group(world);
  const auto results = on_ranks(world, [&](int r) { return group.rank(r).broadcast(data[r], root); });
  for (const auto& res : results) ASSERT_TRUE(res.has_value()) << res.error().message;
  for (int r = 0; r < world; ++r) EXPECT_EQ(data[r], data[root]) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Worlds, Loopback, testing::Values(1, 2, 3, 4));

TEST(LoopbackFailures, AMissingRankIsADeadlineErrorNamingIt) {
  LoopbackGroup group(3, std::chrono::milliseconds(200));
  std::vector<float> a(4, 1.0f), b(4, 2.0f);
  // Rank 2 never arrives.
  const auto results = on_ranks(2, [&](int r) { return group.rank(r).all_reduce_sum(r == 0 ? a : b); });
  for (const auto& res : results) {
    ASSERT_FALSE(res.has_value());
    EXPECT_NE(res.error().message.find("all_reduce_sum"), std::string::npos) << res.error().message;
    EXPECT_NE(res.error().message.find("for rank(s) 2"), std::string::npos) << res.error().message;
  }
  // Broken from then on, at once.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(group.rank(2).barrier().has_value());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100));
}

TEST(LoopbackFailures, AbortWakesTheWaitingRanksWithTheReason) {
  LoopbackGroup group(2, std::chrono::seconds(30));
  std::vector<float> a(4, 1.0f);
  Expected<void> waited;
  std::thread t([&] { waited = group.rank(0).all_reduce_sum(a); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto start = std::chrono::steady_clock::now();
  group.abort("rank 1 failed: out of memory");
  t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_FALSE(waited.has_value());
  EXPECT_NE(waited.error().message.find("rank 1 failed: out of memory"), std::string::npos) << waited.error().message;
}

TEST(LoopbackFailures, AllGatherOfTheWrongSizeIsRefused) {
  LoopbackGroup group(1);
  std::vector<float> mine(3, 1.0f), all(4, kNaN);
  const auto r = group.rank(0).all_gather(mine, all);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("3 elements gathered into 4"), std::string::npos) << r.error().message;
}

}  // namespace
}  // namespace tern
