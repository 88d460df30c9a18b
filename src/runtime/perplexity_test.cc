// Perplexity tests. The window plans are written out by hand from the protocol in perplexity.h; the NLL and KL
// expectations are closed forms of rows whose softmax is known (uniform rows, one boosted logit among equal ones),
// computed here in double from the float inputs, not taken from the code under test.
#include "runtime/perplexity.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

namespace tern {
namespace {

using Pairs = std::vector<std::pair<int64_t, int64_t>>;  // (window, target)

Pairs scored_pairs(const std::vector<PerplexityWindow>& windows) {
  Pairs pairs;
  for (size_t w = 0; w < windows.size(); ++w) {
    for (int64_t j = windows[w].first_target; j < windows[w].end; ++j) pairs.emplace_back(w, j);
  }
  return pairs;
}

TEST(PerplexityWindows, TenTokensContextFourStrideTwo) {
  // b = 0, 2, 4, 6; e = 4, 6, 8, 10; targets from max(prev_e, b + 1): 1, 4, 6, 8.
  auto windows = perplexity_windows(10, 4, 2);
  ASSERT_TRUE(windows.has_value()) << windows.error().message;
  ASSERT_EQ(windows->size(), 4u);
  const int64_t expected[4][3] = {{0, 4, 1}, {2, 6, 4}, {4, 8, 6}, {6, 10, 8}};
  for (size_t w = 0; w < 4; ++w) {
    EXPECT_EQ((*windows)[w].begin, expected[w][0]) << w;
    EXPECT_EQ((*windows)[w].end, expected[w][1]) << w;
    EXPECT_EQ((*windows)[w].first_target, expected[w][2]) << w;
  }
  const Pairs want = {{0, 1}, {0, 2}, {0, 3}, {1, 4}, {1, 5}, {2, 6}, {2, 7}, {3, 8}, {3, 9}};
  EXPECT_EQ(scored_pairs(*windows), want);
}

TEST(PerplexityWindows, LastWindowIsClippedToTheText) {
  // T = 11, N = 4, S = 3: b = 0, 3, 6, 9 -> e = 4, 7, 10, 11.
  auto windows = perplexity_windows(11, 4, 3);
  ASSERT_TRUE(windows.has_value());
  const Pairs want = {{0, 1}, {0, 2}, {0, 3}, {1, 4}, {1, 5}, {1, 6}, {2, 7}, {2, 8}, {2, 9}, {3, 10}};
  EXPECT_EQ(scored_pairs(*windows), want);
  EXPECT_EQ(windows->back().begin, 9);
  EXPECT_EQ(windows->back().end, 11);
}

TEST(PerplexityWindows, TextNoLongerThanTheContextIsOneWindow) {
  for (const int64_t t : {2, 5, 8}) {
    auto windows = perplexity_windows(t, 8, 4);
    ASSERT_TRUE(windows.has_value());
    ASSERT_EQ(windows->size(), 1u) << t;
    EXPECT_EQ((*windows)[0].begin, 0);
    EXPECT_EQ((*windows)[0].end, t);
    EXPECT_EQ((*windows)[0].first_target, 1);
  }
}

TEST(PerplexityWindows, EveryTargetOnceWhenTheStrideIsBelowTheContext) {
  for (int64_t t = 2; t <= 40; ++t) {
    for (int64_t n = 2; n <= 12; ++n) {
      for (int64_t s = 1; s < n; ++s) {
        auto windows = perplexity_windows(t, n, s);
        ASSERT_TRUE(windows.has_value());
        std::map<int64_t, int> count;
        for (size_t w = 0; w < windows->size(); ++w) {
          const PerplexityWindow& win = (*windows)[w];
          EXPECT_EQ(win.begin, static_cast<int64_t>(w) * s);
          EXPECT_EQ(win.end, std::min(win.begin + n, t));
          ASSERT_GE(win.first_target, win.begin + 1);  // row j - 1 - begin exists in the window
          for (int64_t j = win.first_target; j < win.end; ++j) ++count[j];
        }
        EXPECT_EQ(windows->back().end, t);
        ASSERT_EQ(count.size(), static_cast<size_t>(t - 1)) << t << " " << n << " " << s;
        EXPECT_EQ(count.begin()->first, 1);
        EXPECT_EQ(count.rbegin()->first, t - 1);
        for (const auto& [j, c] : count) EXPECT_EQ(c, 1) << "target " << j << " T " << t << " N " << n << " S " << s;
        if (windows->size() > 1) {
          EXPECT_LT(windows->at(windows->size() - 2).end, t);  // stops at the first e == T
        }
      }
    }
  }
}

TEST(PerplexityWindows, StrideEqualToTheContextSkipsEachWindowsFirstToken) {
  // T = 10, N = S = 4: windows [0, 4), [4, 8), [8, 10); tokens 4 and 8 have no row before them in their window.
  auto windows = perplexity_windows(10, 4, 4);
  ASSERT_TRUE(windows.has_value());
  const Pairs want = {{0, 1}, {0, 2}, {0, 3}, {1, 5}, {1, 6}, {1, 7}, {2, 9}};
  EXPECT_EQ(scored_pairs(*windows), want);
}

TEST(PerplexityWindows, BadValuesAreErrorsNamingThem) {
  auto context = perplexity_windows(10, 1, 1);
  ASSERT_FALSE(context.has_value());
  EXPECT_NE(context.error().message.find("context must be at least 2"), std::string::npos);
  for (const int64_t stride : {0, -1, 5}) {
    auto bad = perplexity_windows(10, 4, stride);
    ASSERT_FALSE(bad.has_value()) << stride;
    EXPECT_NE(bad.error().message.find("stride"), std::string::npos) << bad.error().message;
  }
  auto one = perplexity_windows(1, 4, 2);
  ASSERT_FALSE(one.has_value());
  EXPECT_NE(one.error().message.find("at least 2 tokens"), std::string::npos);
}

TEST(PerplexityMath, UniformRowsGiveLogOfTheVocabulary) {
  for (const int v : {1, 2, 7, 512, 151936}) {
    for (const float c : {0.0f, 3.5f, -20.0f}) {
      const std::vector<float> row(static_cast<size_t>(v), c);
      EXPECT_NEAR(token_nll(row, v - 1), std::log(static_cast<double>(v)), 1e-12) << v << " " << c;
    }
  }
}

TEST(PerplexityMath, LargeLogitsAreMaxSubtracted) {
  // exp(1000) overflows even a double: without subtracting the max this is inf - 1000.
  const std::vector<float> row = {1000.0f, 1000.0f};
  EXPECT_NEAR(token_nll(row, 0), std::log(2.0), 1e-12);
  const std::vector<float> low = {-1000.0f, -1000.0f, -1000.0f};
  EXPECT_NEAR(log_sum_exp(low), -1000.0 + std::log(3.0), 1e-9);
}

TEST(PerplexityMath, TwoPointRowsMatchTheSoftplusForm) {
  // softmax([0, d]) = [1 / (1 + e^d), e^d / (1 + e^d)]: -log p0 = log(1 + e^d), -log p1 = log(1 + e^-d).
  for (const float d : {0.25f, 1.0f, 3.0f, -7.5f}) {
    const std::vector<float> row = {0.0f, d};
    const double dd = static_cast<double>(d);
    EXPECT_NEAR(token_nll(row, 0), std::log1p(std::exp(dd)), 1e-12) << d;
    EXPECT_NEAR(token_nll(row, 1), std::log1p(std::exp(-dd)), 1e-12) << d;
  }
}

TEST(PerplexityMath, KlOfIdenticalRowsIsZero) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> row(1000);
  for (float& x : row) x = normal(rng);
  EXPECT_EQ(kl_divergence(row, row), 0.0);
  // A constant shift changes no probability.
  std::vector<float> shifted = row;
  for (float& x : shifted) x += 64.0f;  // rounded to float, so only nearly the same distribution
  EXPECT_NEAR(kl_divergence(row, shifted), 0.0, 1e-9);
}

TEST(PerplexityMath, KlOfTwoPointDistributionsMatchesTheClosedForm) {
  // P = softmax([0, a]) = [p, 1 - p] with p = 1 / (1 + e^a); Q likewise with b.
  // KL(P || Q) = p log(p / q) + (1 - p) log((1 - p) / (1 - q)).
  const std::pair<float, float> cases[] = {{0.0f, 1.0f}, {2.0f, -1.0f}, {5.0f, 0.5f}, {-3.0f, -3.5f}};
  for (const auto& [a, b] : cases) {
    const double p = 1.0 / (1.0 + std::exp(static_cast<double>(a)));
    const double q = 1.0 / (1.0 + std::exp(static_cast<double>(b)));
    const double want = p * std::log(p / q) + (1 - p) * std::log((1 - p) / (1 - q));
    EXPECT_NEAR(kl_divergence(std::vector<float>{0.0f, a}, std::vector<float>{0.0f, b}), want, 1e-12) << a << " " << b;
  }
  // KL is not symmetric: swapping the two gives the other closed form.
  const double p = 1.0 / (1.0 + std::exp(4.0)), q = 0.5;
  EXPECT_NEAR(kl_divergence(std::vector<float>{0.0f, 0.0f}, std::vector<float>{0.0f, 4.0f}),
              q * std::log(q / p) + (1 - q) * std::log((1 - q) / (1 - p)), 1e-12);
}

TEST(PerplexityMath, ArgmaxTakesTheFirstOfEqualMaxima) {
  EXPECT_EQ(argmax(std::vector<float>{1, 5, 2, 5}), 1);
  EXPECT_EQ(argmax(std::vector<float>{-1}), 0);
}

TEST(PerplexityMath, QuantileInterpolatesBetweenRanksAsNumpy) {
  std::vector<double> values(100);
  std::iota(values.begin(), values.end(), 1.0);  // 1..100
  std::shuffle(values.begin(), values.end(), std::mt19937(1));
  // numpy.percentile(range(1, 101), 99) == 99.01: position 0.99 * 99 = 98.01 between 99 and 100.
  EXPECT_NEAR(quantile(values, 0.99), 99.01, 1e-12);
  EXPECT_EQ(quantile(values, 0.0), 1.0);
  EXPECT_EQ(quantile(values, 1.0), 100.0);
  EXPECT_EQ(quantile({7.0}, 0.99), 7.0);
  EXPECT_EQ(quantile({}, 0.99), 0.0);
}

// A fake model of vocabulary 4 over tokens t_i = i % 4: each row puts logit `boost(r)` on the id after the row's
// own token ((t + 1) % 4, which is the next token) and 0 on the three others, r being the row's position in its
// window. Scoring with the wrong row of a window (or a window not started afresh) changes the NLL.
constexpr int64_t kVocab = 4;

std::vector<int32_t> cyclic_tokens(int64_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>(i % kVocab);
  return t;
}

struct FakeModel {
  std::function<float(int64_t r)> boost;
  std::function<int32_t(int32_t token, int64_t r)> boosted_id = [](int32_t token, int64_t) {
    return (token + 1) % kVocab;
  };
  std::vector<std::pair<int64_t, int64_t>> calls;
  std::vector<int32_t> tokens;

  WindowLogits callback() {
    return [this](int64_t b, int64_t e) -> Expected<std::vector<float>> {
      calls.emplace_back(b, e);
      std::vector<float> rows(static_cast<size_t>((e - b) * kVocab), 0.0f);
      for (int64_t r = 0; r < e - b; ++r) {
        rows[static_cast<size_t>(r * kVocab + boosted_id(tokens[static_cast<size_t>(b + r)], r))] = boost(r);
      }
      return rows;
    };
  }
};

// -log of the boosted id's probability when it has logit x and three others have 0: log(1 + 3 e^-x).
double boosted_nll(double x) {
  return std::log1p(3.0 * std::exp(-x));
}

TEST(PerplexityRun, ScoresTheProtocolsRowsOfEachFreshWindow) {
  const std::vector<int32_t> tokens = cyclic_tokens(10);
  FakeModel model{.boost = [](int64_t r) { return static_cast<float>(r + 1); }};
  model.tokens = tokens;
  auto result = perplexity_run(tokens, {.context = 4, .stride = 2, .vocab = kVocab}, model.callback(), nullptr);
  ASSERT_TRUE(result.has_value()) << result.error().message;
  const std::vector<std::pair<int64_t, int64_t>> calls = {{0, 4}, {2, 6}, {4, 8}, {6, 10}};
  EXPECT_EQ(model.calls, calls);
  // Targets 1, 2, 3 use rows 0, 1, 2 of window 0; every later window scores its rows 1 and 2 (targets b+2, b+3).
  const double f0 = boosted_nll(1), f1 = boosted_nll(2), f2 = boosted_nll(3);
  const double sum = f0 + 4 * f1 + 4 * f2;
  EXPECT_EQ(result->tokens, 10);
  EXPECT_EQ(result->scored, 9);
  EXPECT_EQ(result->windows, 4);
  EXPECT_NEAR(result->nll_sum, sum, 1e-12);
  EXPECT_NEAR(result->mean_nll, sum / 9, 1e-12);
  EXPECT_NEAR(result->perplexity, std::exp(sum / 9), 1e-12);
  EXPECT_FALSE(result->has_reference);
}

TEST(PerplexityRun, StrideEqualToContextAveragesOverTheScoredTargets) {
  const std::vector<int32_t> tokens = cyclic_tokens(10);
  FakeModel model{.boost = [](int64_t r) { return static_cast<float>(r + 1); }};
  model.tokens = tokens;
  auto result = perplexity_run(tokens, {.context = 4, .stride = 4, .vocab = kVocab}, model.callback(), nullptr);
  ASSERT_TRUE(result.has_value()) << result.error().message;
  // Windows [0, 4), [4, 8) and [8, 10): targets 1-3 and 5-7 use rows 0, 1, 2 (boosts 1, 2, 3), target 9 row 0.
  const double sum = 3 * boosted_nll(1) + 2 * boosted_nll(2) + 2 * boosted_nll(3);
  EXPECT_EQ(result->scored, 7);
  EXPECT_NEAR(result->mean_nll, sum / 7, 1e-12);
}

TEST(PerplexityRun, KlAgainstAReferenceMatchesTheClosedForm) {
  const std::vector<int32_t> tokens = cyclic_tokens(10);
  FakeModel model{.boost = [](int64_t r) { return static_cast<float>(r + 1); }};
  model.tokens = tokens;
  // The reference boosts by 2 everywhere, and at window position 0 boosts the id two after the token instead.
  FakeModel reference{.boost = [](int64_t) { return 2.0f; }};
  reference.boosted_id = [](int32_t token, int64_t r) { return (token + (r == 0 ? 2 : 1)) % kVocab; };
  reference.tokens = tokens;
  const WindowLogits ref = reference.callback();
  auto result = perplexity_run(tokens, {.context = 4, .stride = 2, .vocab = kVocab}, model.callback(), &ref);
  ASSERT_TRUE(result.has_value()) << result.error().message;
  EXPECT_EQ(reference.calls, model.calls);
  // A row with logit x on one id and 0 on three: that id has probability e^x / (e^x + 3), the others 1 / (e^x + 3).
  const auto hi = [](double x) { return std::exp(x) / (std::exp(x) + 3); };
  const auto lo = [](double x) { return 1 / (std::exp(x) + 3); };
  // Same boosted id: KL = P_hi log(P_hi / Q_hi) + 3 P_lo log(P_lo / Q_lo).
  const auto kl_same = [&](double q) { return hi(2) * std::log(hi(2) / hi(q)) + 3 * lo(2) * std::log(lo(2) / lo(q)); };
  // Different ids: P's boosted id has Q_lo, Q's boosted id has P_lo, the other two have lo under both.
  const double kl_row0 =
      hi(2) * std::log(hi(2) / lo(1)) + lo(2) * std::log(lo(2) / hi(1)) + 2 * lo(2) * std::log(lo(2) / lo(1));
  // Scored rows: window 0 rows 0, 1, 2 (boosts 1, 2, 3); windows 1-3 rows 1, 2 (boosts 2, 3).
  std::vector<double> kls = {kl_row0, kl_same(2), kl_same(3)};
  for (int w = 1; w < 4; ++w) {  // push_back: GCC 12 at -O3 warns (falsely) on insert of an initializer list here
    kls.push_back(kl_same(2));
    kls.push_back(kl_same(3));
  }
  double sum = 0;
  for (const double k : kls) sum += k;
  EXPECT_NEAR(kl_same(2), 0.0, 1e-15);  // identical rows
  EXPECT_NEAR(result->kl.mean, sum / 9, 1e-12);
  EXPECT_NEAR(result->kl.max, std::max(kl_row0, kl_same(3)), 1e-12);
  std::vector<double> sorted = kls;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NEAR(result->kl.p99, sorted[7] + 0.92 * (sorted[8] - sorted[7]), 1e-12);  // position 0.99 * 8 = 7.92
  EXPECT_EQ(result->top1_matches, 8);
  EXPECT_NEAR(result->top1_agreement, 8.0 / 9.0, 1e-15);
  // The reference's own NLL: the target is its boosted id except at window 0's row 0, where it has 1 / (e^2 + 3).
  const double ref_sum = -std::log(lo(2)) + 8 * boosted_nll(2);
  EXPECT_NEAR(result->reference_mean_nll, ref_sum / 9, 1e-12);
  EXPECT_NEAR(result->reference_perplexity, std::exp(ref_sum / 9), 1e-12);
  EXPECT_TRUE(result->has_reference);
}

TEST(PerplexityRun, NonFiniteLogitNamesTheWindowAndPosition) {
  const std::vector<int32_t> tokens = cyclic_tokens(10);
  for (const float poison : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    FakeModel model{.boost = [](int64_t r) { return static_cast<float>(r + 1); }};
    model.tokens = tokens;
    const WindowLogits clean = model.callback();
    // Window 2 is tokens [4, 8); its row 1 is the row after token 5.
    const WindowLogits poisoned = [&](int64_t b, int64_t e) -> Expected<std::vector<float>> {
      auto rows = clean(b, e);
      if (b == 4) (*rows)[1 * kVocab + 2] = poison;
      return rows;
    };
    int windows_done = 0;
    PerplexityOptions options{.context = 4, .stride = 2, .vocab = kVocab};
    options.progress = [&](size_t, size_t) { ++windows_done; };
    auto result = perplexity_run(tokens, options, poisoned, nullptr);
    ASSERT_FALSE(result.has_value());
    EXPECT_EQ(result.error().kind, PerplexityFailure::kNonFinite);
    const std::string& m = result.error().message;
    EXPECT_NE(m.find("token position 5"), std::string::npos) << m;
    EXPECT_NE(m.find("window 2 (tokens [4, 8))"), std::string::npos) << m;
    EXPECT_EQ(windows_done, 2);  // windows 0 and 1 only
    // The same poison in the reference is named as the reference's.
    auto in_reference = perplexity_run(tokens, {.context = 4, .stride = 2, .vocab = kVocab}, clean, &poisoned);
    ASSERT_FALSE(in_reference.has_value());
    EXPECT_EQ(in_reference.error().kind, PerplexityFailure::kNonFinite);
    EXPECT_EQ(in_reference.error().message.rfind("reference", 0), 0u) << in_reference.error().message;
  }
}

TEST(PerplexityRun, BadInputAndModelFailuresAreTold) {
  const std::vector<int32_t> tokens = cyclic_tokens(6);
  FakeModel model{.boost = [](int64_t) { return 1.0f; }};
  model.tokens = tokens;
  auto bad_stride = perplexity_run(tokens, {.context = 4, .stride = 5, .vocab = kVocab}, model.callback(), nullptr);
  ASSERT_FALSE(bad_stride.has_value());
  EXPECT_EQ(bad_stride.error().kind, PerplexityFailure::kBadInput);
  EXPECT_TRUE(model.calls.empty());
  const std::vector<int32_t> outside = {1, 2, 4};
  auto oov = perplexity_run(outside, {.context = 4, .stride = 2, .vocab = kVocab}, model.callback(), nullptr);
  ASSERT_FALSE(oov.has_value());
  EXPECT_EQ(oov.error().kind, PerplexityFailure::kBadInput);
  EXPECT_NE(oov.error().message.find("token 4 at position 2"), std::string::npos) << oov.error().message;
  const WindowLogits failing = [](int64_t, int64_t) -> Expected<std::vector<float>> { return make_error("boom"); };
  auto failed = perplexity_run(tokens, {.context = 4, .stride = 2, .vocab = kVocab}, failing, nullptr);
  ASSERT_FALSE(failed.has_value());
  EXPECT_EQ(failed.error().kind, PerplexityFailure::kModel);
  EXPECT_NE(failed.error().message.find("boom"), std::string::npos);
  const WindowLogits short_rows = [](int64_t, int64_t) -> Expected<std::vector<float>> {
    return std::vector<float>(3, 0.0f);
  };
  auto wrong_size = perplexity_run(tokens, {.context = 4, .stride = 2, .vocab = kVocab}, short_rows, nullptr);
  ASSERT_FALSE(wrong_size.has_value());
  EXPECT_EQ(wrong_size.error().kind, PerplexityFailure::kModel);
}

}  // namespace
}  // namespace tern
