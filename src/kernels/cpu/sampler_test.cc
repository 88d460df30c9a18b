// Sampler tests. References are independent of sampler.cc: kept sets and penalised logits are worked out by hand
// from the definitions (vLLM's v1 sampler order: penalties, temperature, min_p, top_k, top_p; OpenAI's penalty
// formula; transformers'/vLLM's repetition penalty), probabilities and log_softmax are recomputed here in double,
// and the generator's known answers come from a separate Python transcription of xoshiro256** / splitmix64.
#include "kernels/cpu/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace tern {
namespace {

std::vector<float> random_row(size_t vocab, uint32_t seed, float stddev) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> row(vocab);
  for (float& x : row) x = normal(gen);
  return row;
}

std::vector<double> log_softmax_double(const std::vector<float>& logits) {
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max);
  std::vector<double> out;
  for (float x : logits) out.push_back(static_cast<double>(x) - max - std::log(sum));
  return out;
}

// The row's ids from the highest logit down, ties in id order.
std::vector<int32_t> ids_by_value(const std::vector<float>& row) {
  std::vector<int32_t> ids(row.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
  return ids;
}

SampledToken sample_ok(Sampler& sampler, const std::vector<float>& logits, const std::vector<int32_t>& prompt = {},
                       const std::vector<int32_t>& output = {}) {
  auto token = sampler.sample(logits, prompt, output);
  EXPECT_TRUE(token.has_value()) << (token ? "" : token.error().message);
  return token.value_or(SampledToken{});
}

std::string sample_error(Sampler& sampler, const std::vector<float>& logits, const std::vector<int32_t>& prompt = {},
                         const std::vector<int32_t>& output = {}) {
  auto token = sampler.sample(logits, prompt, output);
  EXPECT_FALSE(token.has_value());
  return token ? std::string() : token.error().message;
}

// --- Validation ---

std::string validate_error(SamplingParams p) {
  auto r = sampling_params_validate(p);
  return r ? std::string() : r.error().message;
}

TEST(SamplingParams, DefaultsAndBoundaryValuesAreValid) {
  EXPECT_TRUE(sampling_params_validate({}).has_value());
  for (SamplingParams p : {SamplingParams{.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 1.0f},
                           SamplingParams{.top_k = 1, .top_p = 1e-6f, .min_p = 0.0f, .repetition_penalty = 1e-3f},
                           SamplingParams{.presence_penalty = -2.0f, .frequency_penalty = 2.0f, .logprobs = 20},
                           SamplingParams{.presence_penalty = 2.0f, .frequency_penalty = -2.0f, .logprobs = 0}}) {
    EXPECT_TRUE(sampling_params_validate(p).has_value()) << validate_error(p);
  }
}

TEST(SamplingParams, EachOutOfRangeFieldIsNamed) {
  const float nan = std::nanf("");
  const struct {
    SamplingParams params;
    const char* name;
  } cases[] = {
      {{.temperature = -0.1f}, "temperature"},
      {{.temperature = nan}, "temperature"},
      {{.temperature = INFINITY}, "temperature"},
      {{.top_k = -2}, "top_k"},
      {{.top_p = 0.0f}, "top_p"},
      {{.top_p = 1.01f}, "top_p"},
      {{.top_p = nan}, "top_p"},
      {{.min_p = -0.01f}, "min_p"},
      {{.min_p = 1.5f}, "min_p"},
      {{.min_p = nan}, "min_p"},
      {{.repetition_penalty = 0.0f}, "repetition_penalty"},
      {{.repetition_penalty = -1.0f}, "repetition_penalty"},
      {{.repetition_penalty = nan}, "repetition_penalty"},
      {{.presence_penalty = 2.5f}, "presence_penalty"},
      {{.presence_penalty = -2.01f}, "presence_penalty"},
      {{.frequency_penalty = -3.0f}, "frequency_penalty"},
      {{.frequency_penalty = nan}, "frequency_penalty"},
      {{.logprobs = -1}, "logprobs"},
      {{.logprobs = 21}, "logprobs"},
  };
  for (const auto& c : cases) {
    const std::string message = validate_error(c.params);
    EXPECT_NE(message.find(c.name), std::string::npos)
        << "expected an error naming " << c.name << ", got '" << message << "'";
  }
}

TEST(Sampler, InvalidParamsAreReportedBySample) {
  Sampler sampler(SamplingParams{.top_p = 0.0f});
  EXPECT_NE(sample_error(sampler, {1.0f, 2.0f}).find("top_p"), std::string::npos);
}

// --- Greedy ---

TEST(Sampler, GreedyPicksTheArgmaxOfRandomRows) {
  for (float temperature : {0.0f, 9e-6f}) {
    Sampler sampler(SamplingParams{.temperature = temperature, .top_k = 3, .top_p = 0.5f, .seed = 1});
    for (uint32_t seed = 0; seed < 20; ++seed) {
      const std::vector<float> row = random_row(1000, seed, 3.0f);
      size_t expected = 0;
      for (size_t i = 0; i < row.size(); ++i) expected = row[i] > row[expected] ? i : expected;
      EXPECT_EQ(sample_ok(sampler, row).id, static_cast<int32_t>(expected)) << "row seed " << seed;
    }
  }
}

TEST(Sampler, GreedyTiesGoToTheLowestId) {
  Sampler sampler(SamplingParams{.temperature = 0.0f});
  EXPECT_EQ(sample_ok(sampler, {0.5f, 2.0f, -1.0f, 2.0f, 2.0f}).id, 1);
}

// --- Penalties, against hand-computed values ---

TEST(SamplingPenalties, MatchHandComputedValues) {
  // prompt {0, 1, 0}; output {2, 2, 4, 5}. repetition 2 on ids 0,1,2,4,5; then frequency 0.25 * count and
  // presence 0.5 on the output ids 2 (count 2), 4 (1), 5 (1).
  std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 0.0f, 1.0f};
  const SamplingParams params{.repetition_penalty = 2.0f, .presence_penalty = 0.5f, .frequency_penalty = 0.25f};
  ASSERT_TRUE(
      sampling_apply_penalties(params, logits, std::vector<int32_t>{0, 1, 0}, std::vector<int32_t>{2, 2, 4, 5}));
  const std::vector<float> expected = {
      1.0f,    // 2 / 2
      -2.0f,   // -1 * 2
      -0.75f,  // 0.5 / 2 - 0.25 * 2 - 0.5
      3.0f,    // untouched
      -4.75f,  // -2 * 2 - 0.25 - 0.5
      -0.75f,  // 0 * 2 - 0.25 - 0.5
      1.0f,    // untouched
  };
  EXPECT_EQ(logits, expected);
}

TEST(SamplingPenalties, RepetitionBelowOneBoostsAndPresenceIsOutputOnly) {
  std::vector<float> logits = {4.0f, -4.0f, 1.0f, 1.0f};
  const SamplingParams params{.repetition_penalty = 0.5f, .presence_penalty = -1.0f};
  // Prompt-only id 0 and 1 get the repetition penalty but not the presence penalty; output id 2 gets both.
  ASSERT_TRUE(sampling_apply_penalties(params, logits, std::vector<int32_t>{0, 1}, std::vector<int32_t>{2}));
  EXPECT_EQ(logits, (std::vector<float>{8.0f, -2.0f, 3.0f, 1.0f}));
}

TEST(SamplingPenalties, InactivePenaltiesLeaveTheRowAndIgnoreIds) {
  std::vector<float> logits = {0.25f, -0.5f};
  ASSERT_TRUE(sampling_apply_penalties({}, logits, std::vector<int32_t>{7}, std::vector<int32_t>{-3}));
  EXPECT_EQ(logits, (std::vector<float>{0.25f, -0.5f}));
}

TEST(SamplingPenalties, IdsOutsideTheVocabularyAreNamed) {
  std::vector<float> logits(10, 0.5f);
  const SamplingParams params{.repetition_penalty = 1.1f};
  auto r = sampling_apply_penalties(params, logits, std::vector<int32_t>{1, 10}, std::vector<int32_t>{});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().message, "prompt_ids[1] = 10 is outside the vocabulary [0, 10)");
  r = sampling_apply_penalties(params, logits, std::vector<int32_t>{}, std::vector<int32_t>{3, -1});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().message, "output_ids[1] = -1 is outside the vocabulary [0, 10)");
}

TEST(SamplingPenalties, OverflowIsAnErrorNotAnInfinity) {
  std::vector<float> logits = {3e38f, 1.0f};
  auto r = sampling_apply_penalties(SamplingParams{.repetition_penalty = 0.5f}, logits, std::vector<int32_t>{0},
                                    std::vector<int32_t>{});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().message, "logits at id 0 became +inf after the repetition_penalty");
}

TEST(Sampler, PenaltiesChangeTheGreedyChoice) {
  // Raw argmax is id 0 (3.0); repetition 2 on the prompt token 0 gives 1.5 < 2.0, so id 1 wins. With output
  // {1, 1} and frequency 0.4, id 1 also gets the repetition penalty and drops to 2.0 / 2 - 0.8 = 0.2, so id 2
  // (1.6) wins.
  const std::vector<float> row = {3.0f, 2.0f, 1.6f};
  Sampler repetition(SamplingParams{.temperature = 0.0f, .repetition_penalty = 2.0f});
  EXPECT_EQ(sample_ok(repetition, row, {0}, {}).id, 1);
  Sampler both(SamplingParams{.temperature = 0.0f, .repetition_penalty = 2.0f, .frequency_penalty = 0.4f});
  EXPECT_EQ(sample_ok(both, row, {0}, {1, 1}).id, 2);
}

// --- Filters, through the sampled distribution ---
//
// Seven tokens with probabilities 0.30 0.20 0.15 0.12 0.10 0.08 0.05 (sum 1), placed at shuffled ids so that the
// order of ids tells nothing; logits are log(p) + 1.7 (softmax ignores the offset). Each test names the kept set
// worked out by hand and checks 40000 draws: a token outside the set must never appear, and each kept token's
// count must lie within 5 standard deviations of the binomial mean N*q for its renormalised probability q. For a
// correct sampler a deviation beyond 5 sigma has probability < 6e-7 per token (normal approximation, N*q >= 2000
// here), so the ~70 checks fail by chance with probability < 5e-5; the fixed seed makes the run reproducible.
// 5 sigma is at most 0.0125 in probability, smaller than every difference between the sets and orders tested
// (renormalising or not, min_p before or after top_p, temperature before or after top_p).

constexpr double kRankProbability[7] = {0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05};
constexpr int32_t kRankId[7] = {3, 0, 6, 1, 5, 2, 4};  // id of the token with the r-th highest probability
constexpr int kDraws = 40000;

std::vector<float> ranked_row() {
  std::vector<float> row(7);
  for (int r = 0; r < 7; ++r) row[kRankId[r]] = static_cast<float>(std::log(kRankProbability[r]) + 1.7);
  return row;
}

// Expected distribution: p^(1/T) over the kept ranks, renormalised.
std::vector<double> expected_distribution(const std::vector<int>& kept_ranks, double temperature) {
  std::vector<double> q(7, 0.0);
  double total = 0.0;
  for (int r : kept_ranks) total += std::pow(kRankProbability[r], 1.0 / temperature);
  for (int r : kept_ranks) q[kRankId[r]] = std::pow(kRankProbability[r], 1.0 / temperature) / total;
  return q;
}

// Each id's count of kDraws within 5 sigma of its expected probability `q`, none outside the support.
void expect_counts(const std::vector<int>& counts, const std::vector<double>& q) {
  for (size_t id = 0; id < q.size(); ++id) {
    if (q[id] == 0.0) {
      EXPECT_EQ(counts[id], 0) << "id " << id << " is outside the kept set";
      continue;
    }
    const double mean = kDraws * q[id];
    const double sigma = std::sqrt(kDraws * q[id] * (1.0 - q[id]));
    EXPECT_LE(std::abs(counts[id] - mean), 5.0 * sigma)
        << "id " << id << ": count " << counts[id] << ", expected " << mean;
  }
}

void expect_distribution(const SamplingParams& params, const std::vector<int>& kept_ranks) {
  Sampler sampler(params);
  const std::vector<float> row = ranked_row();
  std::vector<int> counts(row.size(), 0);
  for (int i = 0; i < kDraws; ++i) {
    const int32_t id = sample_ok(sampler, row).id;
    ASSERT_TRUE(id >= 0 && id < static_cast<int32_t>(row.size())) << id;
    ++counts[id];
  }
  expect_counts(counts, expected_distribution(kept_ranks, params.temperature));
}

TEST(SamplerDistribution, PlainTemperatureOneFollowsSoftmax) {
  expect_distribution({.seed = 11}, {0, 1, 2, 3, 4, 5, 6});
}

TEST(SamplerDistribution, TemperatureTwoFlattens) {
  expect_distribution({.temperature = 2.0f, .seed = 12}, {0, 1, 2, 3, 4, 5, 6});
}

TEST(SamplerDistribution, TopKKeepsTheKMostProbable) {
  expect_distribution({.top_k = 3, .seed = 13}, {0, 1, 2});
}

TEST(SamplerDistribution, TopKOfOneIsTheArgmax) {
  expect_distribution({.top_k = 1, .seed = 14}, {0});
}

TEST(SamplerDistribution, TopPKeepsTheSmallestSetReachingP) {
  // Cumulative 0.30 0.50 0.65 0.77: 0.65 < 0.7 <= 0.77, so four tokens.
  expect_distribution({.top_p = 0.7f, .seed = 15}, {0, 1, 2, 3});
}

TEST(SamplerDistribution, TopPKeepsTheBestTokenEvenBelowP) {
  expect_distribution({.top_p = 0.01f, .seed = 16}, {0});
}

TEST(SamplerDistribution, MinPDropsTokensBelowAFractionOfTheBest) {
  // Threshold 0.3 * 0.30 = 0.09: 0.10 stays, 0.08 and 0.05 go.
  expect_distribution({.min_p = 0.3f, .seed = 17}, {0, 1, 2, 3, 4});
}

TEST(SamplerDistribution, MinPComesBeforeTopPAsInVllm) {
  // min_p 0.3 keeps five tokens (mass 0.87); top_p then sees 0.345 0.575 0.747: three tokens. Applying top_p to
  // the full distribution first would keep four.
  expect_distribution({.top_p = 0.7f, .min_p = 0.3f, .seed = 18}, {0, 1, 2});
}

TEST(SamplerDistribution, TopPIsRenormalisedAfterTopK) {
  // top_k 4 keeps mass 0.77; renormalised cumulative 0.390 0.649 0.844 reaches 0.8 at three tokens. On the
  // unrenormalised distribution (0.30 0.50 0.65 0.77) all four would stay.
  expect_distribution({.top_k = 4, .top_p = 0.8f, .seed = 19}, {0, 1, 2});
}

TEST(SamplerDistribution, TemperatureComesBeforeTopP) {
  // At T = 0.5 the probabilities become p^2 / 0.1858 = 0.484 0.215 0.121 0.078 ...; cumulative 0.821 < 0.85 <=
  // 0.898 keeps four tokens (at T = 1 top_p 0.85 would keep five).
  expect_distribution({.temperature = 0.5f, .top_p = 0.85f, .seed = 20}, {0, 1, 2, 3});
}

TEST(SamplerDistribution, TopKKeepsTiesWithTheKthLogit) {
  // Logits 2, 1, 1, 0: top_k 2 keeps every token whose logit reaches the 2nd largest (vLLM and transformers
  // mask only `logit < kth`), so ids 0, 1, 2 with probabilities e^2 : e : e.
  Sampler sampler(SamplingParams{.top_k = 2, .seed = 21});
  const std::vector<float> row = {2.0f, 1.0f, 1.0f, 0.0f};
  std::vector<int> counts(4, 0);
  for (int i = 0; i < kDraws; ++i) ++counts[sample_ok(sampler, row).id];
  const double e = std::exp(1.0), total = e * e + 2 * e;
  const double q[4] = {e * e / total, e / total, e / total, 0.0};
  EXPECT_EQ(counts[3], 0);
  for (int id = 0; id < 3; ++id) {
    const double sigma = std::sqrt(kDraws * q[id] * (1 - q[id]));
    EXPECT_LE(std::abs(counts[id] - kDraws * q[id]), 5 * sigma) << "id " << id;
  }
}

TEST(SamplerDistribution, TopKKeepsExactlyTheKHighestLogits) {
  // 3000 distinct random logits; at T = 1000 the kept tokens are nearly equiprobable (q ~ 1/k >= 1/1100), so
  // 20000 draws see each of them (a miss has probability < 1100 * e^-17) and the sampled set must equal the k
  // highest logits found by a full sort. k = 1000 and 1100 take the sampler's two selection paths.
  const std::vector<float> row = random_row(3000, 9, 2.0f);
  std::vector<float> sorted = row;
  std::sort(sorted.begin(), sorted.end(), std::greater<float>());
  for (int32_t k : {1000, 1100}) {
    std::vector<char> kept(row.size()), seen(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) kept[i] = row[i] >= sorted[k - 1];
    ASSERT_EQ(std::count(kept.begin(), kept.end(), 1), k);  // distinct values: exactly k
    Sampler sampler(SamplingParams{.temperature = 1000.0f, .top_k = k, .seed = 23});
    for (int i = 0; i < 20000; ++i) seen[sample_ok(sampler, row).id] = 1;
    EXPECT_EQ(seen, kept) << "top_k " << k;
  }
}

TEST(SamplerDistribution, TopPOnALargeVocabularyKeepsExactlyTheReferenceSet) {
  // 40000 tokens: 200 likely ones with logits in [5, 5.5], the rest in [-6, 0]. The reference kept set for
  // top_p 0.5 at T = 0.9 is recomputed in double by a full sort; it has ~90 tokens, more than the sampler's first
  // sort chunk. The likely tokens are nearly equiprobable (q >= ~0.009 each), so 3000 draws see every kept token
  // (a miss has probability < 90 * e^-27) and the set of sampled ids must equal the reference set exactly.
  const size_t vocab = 40000;
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> low(-6.0f, 0.0f), high(5.0f, 5.5f);
  std::vector<float> row(vocab);
  for (float& x : row) x = low(gen);
  for (int i = 0; i < 200; ++i) row[gen() % vocab] = high(gen);

  const float temperature = 0.9f, top_p = 0.5f;
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
  std::vector<double> weight(vocab);
  double total = 0.0;
  for (size_t i = 0; i < vocab; ++i) {
    weight[i] = std::exp((static_cast<double>(row[i]) - row[order[0]]) / temperature);
    total += weight[i];
  }
  std::vector<char> kept(vocab, 0);
  double cumulative = 0.0;
  size_t n_kept = 0;
  while (cumulative < top_p * total) {
    cumulative += weight[order[n_kept]];
    kept[order[n_kept]] = 1;
    ++n_kept;
  }
  ASSERT_GT(n_kept, 64u);
  ASSERT_GT(3000 * weight[order[n_kept - 1]] / cumulative, 27.0);

  Sampler sampler(SamplingParams{.temperature = temperature, .top_p = top_p, .seed = 22});
  std::vector<char> seen(vocab, 0);
  for (int i = 0; i < 3000; ++i) {
    const int32_t id = sample_ok(sampler, row).id;
    ASSERT_TRUE(kept[id]) << "id " << id << " is outside the top_p set";
    seen[id] = 1;
  }
  EXPECT_EQ(seen, kept);
}

// --- Seeds ---

TEST(SamplerRng, MatchesAnIndependentTranscription) {
  // Known answers from a Python transcription of splitmix64 seeding and xoshiro256** (Blackman & Vigna).
  SamplerRng zero(0);
  EXPECT_EQ(zero.next_u64(), 0x99ec5f36cb75f2b4ull);
  EXPECT_EQ(zero.next_u64(), 0xbf6e1f784956452aull);
  EXPECT_EQ(zero.next_u64(), 0x1a5f849d4933e6e0ull);
  EXPECT_EQ(zero.next_u64(), 0x6aa594f1262d2d2cull);
  SamplerRng forty_two(42);
  EXPECT_EQ(forty_two.next_u64(), 0x15780b2e0c2ec716ull);
  EXPECT_EQ(forty_two.next_u64(), 0x6104d9866d113a7eull);
  SamplerRng unit(1234567);
  EXPECT_EQ(unit.next_unit(), 0x1.851d0e1b1b000p-3);
  EXPECT_EQ(unit.next_unit(), 0x1.9405f0f579928p-4);
  EXPECT_EQ(unit.next_unit(), 0x1.15beaac046dd8p-4);
}

TEST(Sampler, DrawsAreTheInverseCdfOfOneUniformPerToken) {
  // Without filters the sampled id is the first whose cumulative softmax (in id order) exceeds the seed's next
  // uniform; this pins the token stream of a seed on every compiler.
  const std::vector<float> row = random_row(6, 3, 1.0f);
  const std::vector<double> logp = log_softmax_double(row);
  Sampler sampler(SamplingParams{.seed = 99});
  SamplerRng rng(99);
  for (int i = 0; i < 1000; ++i) {
    const double u = rng.next_unit();
    int32_t expected = 0;
    double cumulative = std::exp(logp[0]);
    while (u >= cumulative && expected < 5) cumulative += std::exp(logp[++expected]);
    ASSERT_EQ(sample_ok(sampler, row).id, expected) << "draw " << i << ", u = " << u;
  }
}

std::vector<int32_t> generate(const SamplingParams& params, int steps) {
  Sampler sampler(params);
  const std::vector<int32_t> prompt = {5, 17, 17, 300};
  std::vector<int32_t> output;
  for (int step = 0; step < steps; ++step) {
    const std::vector<float> row = random_row(512, static_cast<uint32_t>(step), 2.0f);
    output.push_back(sample_ok(sampler, row, prompt, output).id);
  }
  return output;
}

TEST(Sampler, SameSeedSameTokensOtherSeedOtherTokens) {
  SamplingParams params{.temperature = 1.3f,
                        .top_k = 200,
                        .top_p = 0.95f,
                        .min_p = 0.01f,
                        .repetition_penalty = 1.2f,
                        .presence_penalty = 0.3f,
                        .frequency_penalty = 0.2f,
                        .seed = 7};
  const std::vector<int32_t> first = generate(params, 100);
  EXPECT_EQ(generate(params, 100), first);
  params.seed = 8;
  EXPECT_NE(generate(params, 100), first);
  params.seed.reset();  // fresh random seeds: two runs agreeing on 100 draws from ~200 tokens is impossible
  EXPECT_NE(generate(params, 100), generate(params, 100));
}

// --- Non-finite rows ---

TEST(Sampler, NonFiniteLogitsAreAnErrorNamingTheFirstBadId) {
  for (SamplingParams params : {SamplingParams{.temperature = 0.0f}, SamplingParams{.top_k = 5, .seed = 1},
                                SamplingParams{.repetition_penalty = 1.3f, .seed = 1}}) {
    Sampler sampler(params);
    std::vector<float> row = random_row(1000, 4, 1.0f);
    row[123] = std::nanf("");
    row[500] = INFINITY;
    EXPECT_EQ(sample_error(sampler, row, {1}, {2}), "logits contain NaN at id 123");
    row[123] = 0.0f;
    EXPECT_EQ(sample_error(sampler, row, {1}, {2}), "logits contain +inf at id 500");
    row[7] = -INFINITY;
    EXPECT_EQ(sample_error(sampler, row, {1}, {2}), "logits contain -inf at id 7");
  }
  Sampler sampler(SamplingParams{});
  EXPECT_EQ(sample_error(sampler, {}), "logits row is empty");
}

// --- Logprobs ---

// Float log_softmax: the result's rounding (half an ulp, 6e-8 relative) plus the float exp terms of the
// normaliser (< 1.2e-7 relative on the sum, so absolute on its log); twice that as margin.
double logprob_tolerance(double reference) {
  return 5e-7 + 2e-7 * std::abs(reference);
}

TEST(Sampler, LogprobsAreTheRawLogSoftmax) {
  // Penalties, temperature and filters are active; the logprobs must still be those of the raw row (vLLM's
  // default logprobs_mode "raw_logprobs").
  const std::vector<float> row = random_row(5000, 8, 4.0f);
  const std::vector<double> reference = log_softmax_double(row);
  const std::vector<int32_t> by_value = ids_by_value(row);

  // The whole row is in the prompt, so the repetition penalty reshapes every logit the sampler sees.
  std::vector<int32_t> prompt(row.size());
  std::iota(prompt.begin(), prompt.end(), 0);
  Sampler sampler(SamplingParams{.temperature = 0.7f,
                                 .top_k = 50,
                                 .repetition_penalty = 3.0f,
                                 .frequency_penalty = 1.0f,
                                 .seed = 3,
                                 .logprobs = 5});
  const SampledToken token = sample_ok(sampler, row, prompt, {by_value[2]});
  EXPECT_NEAR(token.logprob, reference[token.id], logprob_tolerance(reference[token.id]));
  ASSERT_EQ(token.top_logprobs.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(token.top_logprobs[i].first, by_value[i]) << "rank " << i;
    const double expected = reference[by_value[i]];
    EXPECT_NEAR(token.top_logprobs[i].second, expected, logprob_tolerance(expected)) << "rank " << i;
  }
}

// A prompt token's logprob (vLLM's prompt_logprobs): the raw log_softmax at any id, not only a likely one, with the
// top ones; a non-finite logit or an id outside the row is an error.
TEST(Sampler, PromptTokenLogprobIsTheRawLogSoftmaxAtTheToken) {
  const std::vector<float> row = random_row(3000, 21, 5.0f);
  const std::vector<double> reference = log_softmax_double(row);
  const std::vector<int32_t> by_value = ids_by_value(row);
  for (const int32_t id : {by_value[0], by_value[1500], by_value[2999]}) {
    auto t = logits_token_logprob(row, id, 3);
    ASSERT_TRUE(t.has_value()) << t.error().message;
    EXPECT_EQ(t->id, id);
    EXPECT_NEAR(t->logprob, reference[id], logprob_tolerance(reference[id]));
    ASSERT_EQ(t->top_logprobs.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(t->top_logprobs[i].first, by_value[i]);
      EXPECT_NEAR(t->top_logprobs[i].second, reference[by_value[i]], logprob_tolerance(reference[by_value[i]]));
    }
  }
  auto none = logits_token_logprob(row, 7, 0);
  ASSERT_TRUE(none.has_value());
  EXPECT_TRUE(none->top_logprobs.empty());
  EXPECT_FALSE(logits_token_logprob(row, 3000, 1).has_value());
  std::vector<float> bad = row;
  bad[17] = std::nanf("");
  auto nan = logits_token_logprob(bad, 3, 1);
  ASSERT_FALSE(nan.has_value());
  EXPECT_NE(nan.error().message.find("id 17"), std::string::npos) << nan.error().message;
}

// logit_bias: a bias moves the choice (greedy: the argmax of logits + bias; -100 bans the best token), the
// logprobs stay the raw row's, an id outside the row is an error naming it, and the validation bounds the entries.
TEST(Sampler, LogitBiasMovesTheChoiceButNotTheLogprobs) {
  const std::vector<float> row = random_row(1000, 31, 3.0f);
  const std::vector<double> reference = log_softmax_double(row);
  const std::vector<int32_t> by_value = ids_by_value(row);
  Sampler banned(SamplingParams{.temperature = 0.0f, .logit_bias = {{by_value[0], -100.0f}}});
  const SampledToken second = sample_ok(banned, row, {}, {});
  EXPECT_EQ(second.id, by_value[1]);
  EXPECT_NEAR(second.logprob, reference[by_value[1]], logprob_tolerance(reference[by_value[1]]));
  // A low token lifted just past the best one by its bias.
  const int32_t low = by_value[700];
  const float lift = row[by_value[0]] - row[low] + 0.25f;
  Sampler lifted(SamplingParams{.temperature = 0.0f, .logit_bias = {{low, lift}}});
  EXPECT_EQ(sample_ok(lifted, row, {}, {}).id, low);
  // Sampling at temperature 1 with +100 on one token: that token every time.
  Sampler forced(SamplingParams{.seed = 9, .logit_bias = {{low, 100.0f}}});
  for (int i = 0; i < 20; ++i) EXPECT_EQ(sample_ok(forced, row, {}, {}).id, low);
  Sampler outside(SamplingParams{.temperature = 0.0f, .logit_bias = {{1000, 1.0f}}});
  auto bad = outside.sample(row, {}, {});
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("token id 1000"), std::string::npos) << bad.error().message;
  EXPECT_FALSE(sampling_params_validate(SamplingParams{.logit_bias = {{3, 100.5f}}}).has_value());
  EXPECT_FALSE(sampling_params_validate(SamplingParams{.logit_bias = {{-3, 1.0f}}}).has_value());
  SamplingParams many;
  for (int32_t id = 0; id <= static_cast<int32_t>(kSamplingMaxLogitBias); ++id) many.logit_bias.emplace_back(id, 1.0f);
  EXPECT_FALSE(sampling_params_validate(many).has_value());
}

// min_tokens' ban (SamplingParams::banned_ids): a banned id is never the token, greedy or drawn, also when a bias
// or a penalty would favour it, and the logprobs stay the raw row's; lifting the ban restores the choice.
TEST(Sampler, BannedIdsAreNeverSampled) {
  const std::vector<float> row = random_row(1000, 37, 3.0f);
  const std::vector<double> reference = log_softmax_double(row);
  const std::vector<int32_t> by_value = ids_by_value(row);
  Sampler greedy(SamplingParams{.temperature = 0.0f, .logit_bias = {{by_value[0], 100.0f}}});
  EXPECT_EQ(sample_ok(greedy, row, {}, {}).id, by_value[0]);
  greedy.set_banned_ids({by_value[0], by_value[1]});
  const SampledToken third = sample_ok(greedy, row, {}, {});
  EXPECT_EQ(third.id, by_value[2]);
  EXPECT_NEAR(third.logprob, reference[by_value[2]], logprob_tolerance(reference[by_value[2]]));
  greedy.set_banned_ids({});
  EXPECT_EQ(sample_ok(greedy, row, {}, {}).id, by_value[0]);
  // Drawn at temperature 2 with a repetition penalty on the banned ids' rivals: 500 draws, none banned.
  const std::vector<int32_t> banned(by_value.begin(), by_value.begin() + 5);
  Sampler drawn(SamplingParams{.temperature = 2.0f, .repetition_penalty = 1.5f, .seed = 4, .banned_ids = banned});
  const std::vector<int32_t> output{by_value[6], by_value[7], by_value[0]};
  for (int i = 0; i < 500; ++i) {
    const int32_t id = sample_ok(drawn, row, {}, output).id;
    EXPECT_EQ(std::find(banned.begin(), banned.end(), id), banned.end()) << id;
  }
  Sampler outside(SamplingParams{.temperature = 0.0f, .banned_ids = {1000}});
  auto bad = outside.sample(row, {}, {});
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("1000"), std::string::npos) << bad.error().message;
  EXPECT_FALSE(sampling_params_validate(SamplingParams{.banned_ids = {-1}}).has_value());
  Sampler all(SamplingParams{.temperature = 0.0f});
  all.set_banned_ids({0, 1, 2});
  EXPECT_FALSE(all.sample(std::vector<float>{1.0f, 2.0f, 3.0f}, {}, {}).has_value());
}

// banned_until: the ban holds for a row whose output is shorter than it and not for one that has reached it (a
// speculative verification's rows differ only in the drafts their output holds).
TEST(Sampler, BanLiftsOnceTheOutputReachesBannedUntil) {
  const std::vector<float> row = random_row(500, 41, 3.0f);
  const std::vector<int32_t> by_value = ids_by_value(row);
  Sampler greedy(SamplingParams{.temperature = 0.0f});
  greedy.set_banned_ids({by_value[0]}, 3);
  const std::vector<int32_t> output{by_value[9], by_value[8], by_value[7]};
  for (size_t n = 0; n < output.size(); ++n) {
    const std::vector<int32_t> shorter(output.begin(), output.begin() + static_cast<ptrdiff_t>(n));
    EXPECT_EQ(sample_ok(greedy, row, {}, shorter).id, by_value[1]) << n << " output tokens";
  }
  EXPECT_EQ(sample_ok(greedy, row, {}, output).id, by_value[0]);
  EXPECT_TRUE(sampling_ban_active(greedy.params(), 2));
  EXPECT_FALSE(sampling_ban_active(greedy.params(), 3));
  greedy.set_banned_ids({by_value[0]});  // until 0: always
  EXPECT_EQ(sample_ok(greedy, row, {}, output).id, by_value[1]);
  EXPECT_FALSE(sampling_params_validate(SamplingParams{.banned_ids = {1}, .banned_until = -1}).has_value());
}

TEST(Sampler, LogprobsOfGreedyTokensAndTieOrder) {
  const std::vector<float> row = {-3.0f, 1.5f, 0.25f, 1.5f, -40.0f, 0.25f};
  const std::vector<double> reference = log_softmax_double(row);
  Sampler sampler(SamplingParams{.temperature = 0.0f, .logprobs = 6});
  const SampledToken token = sample_ok(sampler, row);
  EXPECT_EQ(token.id, 1);
  EXPECT_NEAR(token.logprob, reference[1], logprob_tolerance(reference[1]));
  const std::vector<int32_t> order = {1, 3, 2, 5, 0, 4};  // descending, ties to the lower id
  ASSERT_EQ(token.top_logprobs.size(), order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    EXPECT_EQ(token.top_logprobs[i].first, order[i]);
    EXPECT_NEAR(token.top_logprobs[i].second, reference[order[i]], logprob_tolerance(reference[order[i]]));
  }
  Sampler no_logprobs(SamplingParams{.temperature = 0.0f});
  EXPECT_TRUE(sample_ok(no_logprobs, row).top_logprobs.empty());
}

}  // namespace
}  // namespace tern

namespace tern {
namespace {

// A device sampler reproduces sample() from next_draw(): the first value of the seeded stream for a random step,
// and the stream continues where sample() would continue it; a greedy step takes nothing.
TEST(Sampler, NextDrawIsTheValueSampleWouldTake) {
  SamplerRng stream(42);
  const double first = stream.next_unit(), second = stream.next_unit();
  Sampler random(SamplingParams{.temperature = 0.7f, .seed = 42});
  EXPECT_EQ(random.next_draw(), first);
  EXPECT_EQ(random.next_draw(), second);
  Sampler greedy(SamplingParams{.temperature = 0.0f, .seed = 42});
  EXPECT_EQ(greedy.next_draw(), 0.0);
}

// A Sampler of another seed given each draw of the first (give_draw, as a tensor-parallel front end's rank 0 samples)
// draws the first's tokens, penalties and top-p included; without the draws it does not; a draw given is used once.
TEST(Sampler, GivenDrawsReplayAnotherSamplersStream) {
  const SamplingParams params{.temperature = 0.9f, .top_p = 0.9f, .repetition_penalty = 1.3f, .seed = 7};
  SamplingParams other = params;
  other.seed = 1234;
  Sampler first(params), draws(params), replica(other), alone(other);
  const std::vector<int32_t> prompt{3, 5, 8};
  std::vector<int32_t> out;
  int differ = 0;
  for (uint32_t step = 0; step < 64; ++step) {
    const std::vector<float> row = random_row(300, 100 + step, 2.0f);
    const SampledToken want = first.sample(row, prompt, out).value();
    replica.give_draw(draws.next_draw());
    EXPECT_EQ(replica.sample(row, prompt, out).value().id, want.id) << "step " << step;
    differ += alone.sample(row, prompt, out).value().id != want.id;
    out.push_back(want.id);
  }
  EXPECT_GT(differ, 0) << "another seed must draw other tokens, or the test shows nothing";
  Sampler once(other), plain(other);
  once.give_draw(0.5);
  (void)once.next_draw();  // the given one
  EXPECT_EQ(once.next_draw(), plain.next_draw()) << "then the stream's own values";
}

}  // namespace
}  // namespace tern
