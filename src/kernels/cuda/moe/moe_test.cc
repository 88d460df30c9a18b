// The MoE kernels against the CPU (label gpu): routing against an fp64 softmax/top-k with torch.topk's tie rule,
// and against an fp64 DeepSeek-V3 / GLM-5 sigmoid routing (groups, correction bias, scaling) up to near-ties, the
// alignment against a host counting sort (exactly), the grouped GEMM against an fp64 product per permuted row
// (gemm_test_util.h's tolerance), and the whole block against layers/moe.h Moe::forward on the same weights. Every
// output buffer is poisoned first (0xFF bytes: -1 ids, NaN values), so an unwritten element fails.
#include "kernels/cuda/moe/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/formats.h"
#include "core/nvfp4.h"
#include "kernels/cuda/device_test_util.h"
#include "kernels/cuda/elementwise/elementwise.h"
#include "kernels/cuda/gemm/gemm_bf16.h"
#include "kernels/cuda/gemm/gemm_test_util.h"
#include "kernels/cuda/gemv/gemv_bf16.h"
#include "layers/moe.h"

namespace tern {
namespace {

// Buffers of at least 256 bytes, as poisoned().
template <class T>
DeviceBuffer upload(const std::vector<T>& host) {
  return cuda_test::upload(host, 256);
}

DeviceBuffer poisoned(size_t bytes) {
  DeviceBuffer b(std::max<size_t>(bytes, 256));
  b.fill(0xFF);
  return b;
}

using cuda_test::download;

// ---------------------------------------------------------------------------------------------------------------
// Host references

struct HostRouting {
  std::vector<int32_t> ids;   // [tokens, top_k]
  std::vector<double> weights;
};

// softmax in fp64, top-k by (probability desc, index asc), optional renormalisation (layers/moe.cc's rules).
HostRouting route_reference(const std::vector<uint16_t>& logits, int64_t stride, int64_t tokens, int64_t n_experts,
                            int64_t top_k, bool renormalize) {
  HostRouting r{std::vector<int32_t>(static_cast<size_t>(tokens * top_k)),
                std::vector<double>(static_cast<size_t>(tokens * top_k))};
  std::vector<double> p(static_cast<size_t>(n_experts));
  std::vector<int32_t> order(static_cast<size_t>(n_experts));
  for (int64_t t = 0; t < tokens; ++t) {
    double mx = -INFINITY, sum = 0.0;
    for (int64_t e = 0; e < n_experts; ++e) mx = std::max<double>(mx, bf16_to_float(logits[t * stride + e]));
    for (int64_t e = 0; e < n_experts; ++e) sum += (p[e] = std::exp(bf16_to_float(logits[t * stride + e]) - mx));
    for (double& v : p) v /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    double top_sum = 0.0;
    for (int64_t j = 0; j < top_k; ++j) top_sum += p[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      r.ids[t * top_k + j] = order[j];
      r.weights[t * top_k + j] = renormalize ? p[order[j]] / top_sum : p[order[j]];
    }
  }
  return r;
}

struct HostAlign {
  std::vector<int32_t> offsets, sorted_pairs, pair_row;
};

// A stable counting sort of the pairs by id - expert_begin; ids outside [expert_begin, expert_begin + n_experts)
// go to a last bucket.
HostAlign align_reference(const std::vector<int32_t>& ids, int64_t n_experts, int64_t expert_begin = 0) {
  auto bucket = [&](int32_t id) {
    const int64_t local = id - expert_begin;
    return static_cast<int32_t>(local >= 0 && local < n_experts ? local : n_experts);
  };
  HostAlign a{std::vector<int32_t>(static_cast<size_t>(n_experts + 2), 0), std::vector<int32_t>(ids.size()),
              std::vector<int32_t>(ids.size())};
  for (int32_t id : ids) ++a.offsets[bucket(id) + 1];
  for (int64_t e = 0; e <= n_experts; ++e) a.offsets[e + 1] += a.offsets[e];
  std::vector<int32_t> next(a.offsets.begin(), a.offsets.end() - 1);
  for (size_t pair = 0; pair < ids.size(); ++pair) {
    const int32_t row = next[bucket(ids[pair])]++;
    a.sorted_pairs[row] = static_cast<int32_t>(pair);
    a.pair_row[pair] = row;
  }
  a.offsets.pop_back();  // [n_experts + 1]
  return a;
}

// MoeAlignArgs::decode_passes from the contract in moe_launch.h: for each expert in index order its rows in
// consecutive ranges of kMoeDecodePassRows, {expert, begin, end, 0}, then {-1, 0, 0, 0} up to the slot count.
std::vector<int32_t> passes_reference(const std::vector<int32_t>& offsets, int64_t rows, int64_t n_experts) {
  std::vector<int32_t> passes;
  for (int64_t e = 0; e < n_experts; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += kMoeDecodePassRows) {
      const int64_t end = std::min<int64_t>(r + kMoeDecodePassRows, offsets[e + 1]);
      passes.insert(passes.end(), {static_cast<int32_t>(e), static_cast<int32_t>(r), static_cast<int32_t>(end), 0});
    }
  }
  const auto slots = static_cast<size_t>(moe_decode_pass_slots(rows, n_experts));
  EXPECT_LE(passes.size(), 4 * slots) << "more passes than moe_decode_pass_slots allows";
  while (passes.size() < 4 * slots) passes.insert(passes.end(), {-1, 0, 0, 0});
  return passes;
}

// k distinct experts per token. skew: expert `hot` is every token's first choice and only the lower half of the
// experts is ever picked, so some experts are empty and one takes a row of every token.
std::vector<int32_t> random_ids(int64_t tokens, int64_t top_k, int64_t n_experts, bool skew, std::mt19937& rng) {
  std::vector<int32_t> ids;
  const int64_t pool = skew ? std::max(top_k, n_experts / 2) : n_experts;
  const int32_t hot = static_cast<int32_t>(pool / 3);
  std::vector<int32_t> experts(static_cast<size_t>(pool));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    if (skew) std::iter_swap(experts.begin(), std::find(experts.begin(), experts.end(), hot));
    ids.insert(ids.end(), experts.begin(), experts.begin() + top_k);
  }
  return ids;
}

// ---------------------------------------------------------------------------------------------------------------
// Route

struct RouteCase {
  int64_t tokens, n_experts, top_k;
  bool renormalize, coarse;  // coarse: logits on a grid of quarters, so many probabilities tie exactly
};

// [tokens, n_experts + 3] logits; the padding columns would win every selection if they were read.
std::vector<uint16_t> random_logits(const RouteCase& c, std::mt19937& rng) {
  const int64_t stride = c.n_experts + 3;
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<uint16_t> logits(static_cast<size_t>(c.tokens * stride));
  for (int64_t i = 0; i < c.tokens * stride; ++i) {
    const float v = dist(rng);
    logits[i] = i % stride >= c.n_experts ? float_to_bf16(100.0f)
                                          : float_to_bf16(c.coarse ? std::round(v * 2.0f) / 4.0f : v);
  }
  return logits;
}

void check_route(const DeviceContext& ctx, const RouteCase& c, std::mt19937& rng) {
  const int64_t stride = c.n_experts + 3;
  const std::vector<uint16_t> logits = random_logits(c, rng);
  const DeviceBuffer d_logits = upload(logits);
  const size_t pairs = static_cast<size_t>(c.tokens * c.top_k);
  const DeviceBuffer ids = poisoned(pairs * 4), weights = poisoned(pairs * 4);
  ASSERT_TRUE(moe_route(ctx, {.logits = d_logits.as<uint16_t>(), .logits_stride = stride, .topk_ids = ids.as<int32_t>(),
                              .topk_weights = weights.as<float>(), .tokens = c.tokens, .n_experts = c.n_experts,
                              .top_k = c.top_k, .renormalize = c.renormalize})
                  .has_value());
  ctx.synchronize();
  const auto got_ids = download<int32_t>(ids, pairs);
  const auto got_w = download<float>(weights, pairs);
  const HostRouting want = route_reference(logits, stride, c.tokens, c.n_experts, c.top_k, c.renormalize);
  int bad = 0;
  for (size_t i = 0; i < pairs && bad < 5; ++i) {
    // fp32 softmax against fp64: a 512-term sum, expf and two divisions stay within a few 2^-24 relative.
    const bool ok = got_ids[i] == want.ids[i] && std::fabs(got_w[i] - want.weights[i]) <= 4e-6 * want.weights[i];
    if (!ok) {
      ++bad;
      ADD_FAILURE() << "T=" << c.tokens << " E=" << c.n_experts << " k=" << c.top_k << " pair " << i << ": got ("
                    << got_ids[i] << ", " << got_w[i] << "), want (" << want.ids[i] << ", " << want.weights[i] << ")";
    }
  }
}

TEST(MoeRoute, MatchesSoftmaxTopK) {
  DeviceContext ctx;
  std::mt19937 rng(2001);
  const RouteCase cases[] = {{1, 8, 2, true, false},     {37, 8, 2, false, true},     {1000, 256, 8, true, false},
                             {1000, 256, 8, true, true}, {3, 512, 10, true, false},   {37, 512, 10, false, true},
                             {37, 64, 1, false, false},  {37, 64, 1, true, true},     {5, 40, 32, true, true},
                             {1000, 128, 4, false, true}};
  for (const RouteCase& c : cases) check_route(ctx, c, rng);
}

// ---------------------------------------------------------------------------------------------------------------
// Align

void check_align(const DeviceContext& ctx, const std::vector<int32_t>& ids, int64_t tokens, int64_t top_k,
                 int64_t n_experts, int64_t expert_begin = 0) {
  const size_t pairs = ids.size();
  const DeviceBuffer d_ids = upload(ids);
  const DeviceBuffer offsets = poisoned(static_cast<size_t>(n_experts + 1) * 4);
  const DeviceBuffer sorted = poisoned(pairs * 4), pair_row = poisoned(pairs * 4);
  const size_t ws_bytes = moe_align_workspace_bytes(tokens, top_k, n_experts);
  const DeviceBuffer ws = poisoned(ws_bytes);
  const size_t pass_ints = 4 * static_cast<size_t>(moe_decode_pass_slots(tokens * top_k, n_experts));
  const DeviceBuffer passes = poisoned(std::max<size_t>(pass_ints * 4, 16));
  ASSERT_TRUE(moe_align(ctx, {.topk_ids = d_ids.as<int32_t>(), .tokens = tokens, .top_k = top_k,
                              .n_experts = n_experts, .expert_begin = expert_begin,
                              .expert_offsets = offsets.as<int32_t>(), .sorted_pairs = sorted.as<int32_t>(),
                              .pair_row = pair_row.as<int32_t>(), .workspace = ws.data(), .workspace_bytes = ws_bytes,
                              .decode_passes = passes.as<int32_t>()})
                  .has_value());
  ctx.synchronize();
  const HostAlign want = align_reference(ids, n_experts, expert_begin);
  const std::string what = "T=" + std::to_string(tokens) + " k=" + std::to_string(top_k) + " E=" +
                           std::to_string(n_experts) + " from " + std::to_string(expert_begin);
  EXPECT_EQ(download<int32_t>(offsets, static_cast<size_t>(n_experts + 1)), want.offsets) << what;
  EXPECT_EQ(download<int32_t>(sorted, pairs), want.sorted_pairs) << what;
  EXPECT_EQ(download<int32_t>(pair_row, pairs), want.pair_row) << what;
  EXPECT_EQ(download<int32_t>(passes, pass_ints), passes_reference(want.offsets, tokens * top_k, n_experts))
      << what << " decode passes";
}

TEST(MoeAlign, StableCountingSortByExpert) {
  DeviceContext ctx;
  std::mt19937 rng(2002);
  struct Case {
    int64_t tokens, top_k, n_experts;
    bool skew;
  };
  const Case cases[] = {{1, 2, 8, false},     {3, 8, 256, false},      {37, 8, 256, true},    {1000, 8, 256, false},
                        {1000, 8, 256, true}, {1000, 10, 512, false},  {8192, 10, 512, true}, {8192, 8, 256, false},
                        {37, 1, 64, false},   {1, 32, 512, false},     {100, 1, 1, false},
                        // one block's 2048 pairs, and 8 past them (the three-launch sort with a short last block)
                        {256, 8, 256, false}, {257, 8, 256, true}};
  for (const Case& c : cases) {
    check_align(ctx, random_ids(c.tokens, c.top_k, c.n_experts, c.skew, rng), c.tokens, c.top_k, c.n_experts);
  }
  check_align(ctx, {}, 0, 4, 16);  // no tokens: all-zero offsets
}

// One expert-parallel rank's buckets: experts [begin, begin + n) of ids drawn from all of them; the other ranks'
// pairs fill the rows after the last bucket, in pair order. One block and the three-launch sort, a share smaller
// than top_k, and the first and last ranks' shares.
TEST(MoeAlign, OneRanksShareOfTheExperts) {
  DeviceContext ctx;
  std::mt19937 rng(2025);
  struct Case {
    int64_t tokens, top_k, n_experts, begin, count;
  };
  for (const Case& c : {Case{1, 8, 256, 64, 32}, Case{37, 8, 256, 64, 32}, Case{1000, 8, 256, 224, 32},
                        Case{257, 8, 256, 0, 32}, Case{8192, 10, 512, 128, 128}, Case{5, 2, 8, 3, 1},
                        Case{300, 2, 8, 7, 1}}) {
    check_align(ctx, random_ids(c.tokens, c.top_k, c.n_experts, false, rng), c.tokens, c.top_k, c.count, c.begin);
  }
}

// Out-of-range ids (bad input) stay memory-safe: they fill the rows after the last expert, in pair order.
TEST(MoeAlign, OutOfRangeIdsGoAfterTheLastExpert) {
  DeviceContext ctx;
  std::mt19937 rng(2003);
  std::vector<int32_t> ids = random_ids(37, 4, 64, false, rng);
  ids[5] = -1;
  ids[17] = 64;
  ids[100] = 1 << 30;
  check_align(ctx, ids, 37, 4, 64);
  std::vector<int32_t> many = random_ids(1000, 4, 64, false, rng);  // the sort over several blocks
  many[7] = -3;
  many[2500] = 64;
  many[3999] = -1;
  check_align(ctx, many, 1000, 4, 64);
}

// ---------------------------------------------------------------------------------------------------------------
// Route and align in one launch

// The outputs of routing and alignment, poisoned.
struct RoutingBuffers {
  DeviceBuffer ids, weights, offsets, sorted_pairs, pair_row, passes, workspace;
  bool with_passes = false;  // align() asks for the decode pass list
  size_t workspace_bytes = 0;  // moe_align's, for more pairs than one block sorts

  RoutingBuffers(int64_t pairs, int64_t n_experts, bool with_passes = false, size_t workspace_bytes = 0)
      : ids(poisoned(static_cast<size_t>(pairs) * 4)),
        weights(poisoned(static_cast<size_t>(pairs) * 4)),
        offsets(poisoned(static_cast<size_t>(n_experts + 1) * 4)),
        sorted_pairs(poisoned(static_cast<size_t>(pairs) * 4)),
        pair_row(poisoned(static_cast<size_t>(pairs) * 4)),
        passes(poisoned(std::max<size_t>(16 * static_cast<size_t>(moe_decode_pass_slots(pairs, n_experts)), 16))),
        workspace(poisoned(std::max<size_t>(workspace_bytes, 4))),
        with_passes(with_passes),
        workspace_bytes(workspace_bytes) {}
  MoeRouteArgs route(const DeviceBuffer& logits, const RouteCase& c) const {
    return {.logits = logits.as<uint16_t>(),
            .logits_stride = c.n_experts + 3,
            .topk_ids = ids.as<int32_t>(),
            .topk_weights = weights.as<float>(),
            .tokens = c.tokens,
            .n_experts = c.n_experts,
            .top_k = c.top_k,
            .renormalize = c.renormalize};
  }
  MoeAlignArgs align(const RouteCase& c) const {
    return {.topk_ids = ids.as<int32_t>(),
            .tokens = c.tokens,
            .top_k = c.top_k,
            .n_experts = c.n_experts,
            .expert_offsets = offsets.as<int32_t>(),
            .sorted_pairs = sorted_pairs.as<int32_t>(),
            .pair_row = pair_row.as<int32_t>(),
            .workspace = workspace_bytes > 0 ? workspace.data() : nullptr,
            .workspace_bytes = workspace_bytes,
            .decode_passes = with_passes ? passes.as<int32_t>() : nullptr};
  }
};

// moe_route_align against moe_route + moe_align (every output bit for bit) and against the host routing and sort.
void check_route_align(const DeviceContext& ctx, const RouteCase& c, std::mt19937& rng) {
  const size_t pairs = static_cast<size_t>(c.tokens * c.top_k), n_off = static_cast<size_t>(c.n_experts + 1);
  const std::vector<uint16_t> logits = random_logits(c, rng);
  const DeviceBuffer d_logits = upload(logits);
  const RoutingBuffers two(c.tokens * c.top_k, c.n_experts), one(c.tokens * c.top_k, c.n_experts);
  // With the pass list (at up to 32 pairs the block kernel instead of the warp kernel).
  const RoutingBuffers listed(c.tokens * c.top_k, c.n_experts, true);
  ASSERT_TRUE(moe_route(ctx, two.route(d_logits, c)).has_value());
  ASSERT_TRUE(moe_align(ctx, two.align(c)).has_value());
  auto status = moe_route_align(ctx, one.route(d_logits, c), one.align(c));
  ASSERT_TRUE(status.has_value()) << status.error().message;
  status = moe_route_align(ctx, listed.route(d_logits, c), listed.align(c));
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();
  const std::string what = "T=" + std::to_string(c.tokens) + " E=" + std::to_string(c.n_experts) +
                           " k=" + std::to_string(c.top_k) + (c.coarse ? " ties" : "");
  const auto ids = download<int32_t>(one.ids, pairs);
  const auto weights = download<float>(one.weights, pairs);
  const auto offsets = download<int32_t>(one.offsets, n_off);
  const auto sorted = download<int32_t>(one.sorted_pairs, pairs);
  const auto pair_row = download<int32_t>(one.pair_row, pairs);
  EXPECT_EQ(ids, download<int32_t>(two.ids, pairs)) << what;
  EXPECT_EQ(download<uint32_t>(one.weights, pairs), download<uint32_t>(two.weights, pairs)) << what << " weight bits";
  EXPECT_EQ(offsets, download<int32_t>(two.offsets, n_off)) << what;
  EXPECT_EQ(sorted, download<int32_t>(two.sorted_pairs, pairs)) << what;
  EXPECT_EQ(pair_row, download<int32_t>(two.pair_row, pairs)) << what;

  const HostRouting want = route_reference(logits, c.n_experts + 3, c.tokens, c.n_experts, c.top_k, c.renormalize);
  EXPECT_EQ(ids, want.ids) << what;
  for (size_t i = 0; i < pairs; ++i) {
    // check_route's bound
    EXPECT_LE(std::fabs(weights[i] - want.weights[i]), 4e-6 * want.weights[i]) << what << " pair " << i;
  }
  const HostAlign want_align = align_reference(want.ids, c.n_experts);
  EXPECT_EQ(offsets, want_align.offsets) << what;
  EXPECT_EQ(sorted, want_align.sorted_pairs) << what;
  EXPECT_EQ(pair_row, want_align.pair_row) << what;

  EXPECT_EQ(download<int32_t>(listed.ids, pairs), ids) << what << " with passes";
  EXPECT_EQ(download<uint32_t>(listed.weights, pairs), download<uint32_t>(one.weights, pairs))
      << what << " with passes";
  EXPECT_EQ(download<int32_t>(listed.offsets, n_off), offsets) << what << " with passes";
  EXPECT_EQ(download<int32_t>(listed.sorted_pairs, pairs), sorted) << what << " with passes";
  EXPECT_EQ(download<int32_t>(listed.pair_row, pairs), pair_row) << what << " with passes";
  const int64_t rows = c.tokens * c.top_k;
  EXPECT_EQ(download<int32_t>(listed.passes, 4 * static_cast<size_t>(moe_decode_pass_slots(rows, c.n_experts))),
            passes_reference(want_align.offsets, rows, c.n_experts))
      << what << " decode passes";
}

// Decode token counts over the routing shapes of check_route, up to the one-block limit (64 tokens x top-32 = 2048
// pairs), coarse logits for exact ties; and no tokens (all-zero offsets).
TEST(MoeRouteAlign, MatchesTwoKernelsAndHost) {
  DeviceContext ctx;
  std::mt19937 rng(2011);
  struct Shape {
    int64_t n_experts, top_k;
    bool renormalize, coarse;
  };
  for (const Shape& s : {Shape{8, 2, true, false}, Shape{256, 8, true, false}, Shape{256, 8, true, true},
                         Shape{512, 10, false, true}, Shape{64, 1, true, false}, Shape{40, 32, true, true}}) {
    // Up to 32 pairs the warp kernel sorts (its warps route a token each, up to 8, then more per warp: 32 tokens
    // of top-1); past that the block does, up to 8 tokens; past 8 tokens route's and align's launches. 4 and 5
    // tokens of top-8 sit on either side of the first bound, 8 and 9 of the second.
    for (int64_t tokens : {1, 2, 4, 5, 7, 8, 9, 32, 64}) {
      check_route_align(ctx, {tokens, s.n_experts, s.top_k, s.renormalize, s.coarse}, rng);
    }
  }
  const RouteCase none{0, 16, 4, true, false};
  const DeviceBuffer logits = poisoned(256);
  const RoutingBuffers out(0, 16);
  ASSERT_TRUE(moe_route_align(ctx, out.route(logits, none), out.align(none)).has_value());
  ctx.synchronize();
  EXPECT_EQ(download<int32_t>(out.offsets, 17), std::vector<int32_t>(17, 0));
}

// ---------------------------------------------------------------------------------------------------------------
// Sigmoid routing (DeepSeek-V3 / GLM-5)

struct SigmoidShape {
  const char* name;
  int64_t n_experts, top_k, n_group, topk_group;
  float routed_scaling;
  bool renormalize;
};

// GLM-5 (one group), DeepSeek-V3 (4 of 8 groups of 32: one register of every lane per group) and the tiny GLM-5
// fixture; then groups that are not 32 experts (16 of 4, 4 of 16, 8 of 1: a worth of one value), the most groups
// (32, one kept), raw (not renormalised) weights and other scalings.
const SigmoidShape kSigmoidShapes[] = {
    {"GLM-5", 256, 8, 1, 1, 2.5f, true},         {"DeepSeek-V3", 256, 8, 8, 4, 2.5f, true},
    {"fixture", 8, 2, 1, 1, 2.5f, true},         {"16 groups of 4", 64, 6, 16, 4, 1.0f, true},
    {"4 groups of 16", 64, 8, 4, 2, 1.5f, false}, {"8 groups of 1", 8, 3, 8, 5, 1.0f, true},
    {"32 groups of 16", 512, 10, 32, 1, 2.5f, true}};

// Two fp64 choice values (or group worths) this close may come out in either order from fp32 arithmetic: within
// 1e-5 of each other, relative to the larger and at least 1 (a score lies in (0, 1), so its fp32 rounding is
// absolute, about 1e-7).
bool sigmoid_near(double a, double b) { return std::fabs(a - b) <= 1e-5 * std::max({std::fabs(a), std::fabs(b), 1.0}); }

// layers/moe.cc's route_sigmoid for one token in fp64, from its bf16 logits and the fp32 correction bias (empty:
// none). kept[0] and ids[0] are the reference's groups and experts; where the last kept and the first dropped group
// are worth near the same, kept[1] and ids[1] are the selection with those two swapped, which fp32 may reach as well.
// near_tie: a near but unequal pair at either edge of the selection (equal values come from equal inputs, which
// every implementation orders alike).
struct SigmoidToken {
  std::vector<double> score, choice;  // [n_experts]
  std::vector<std::vector<bool>> kept;
  std::vector<std::vector<int32_t>> ids;  // top_k, in descending choice order (ties: lower index)
  bool near_tie = false;
};

SigmoidToken sigmoid_reference(const uint16_t* logits, const std::vector<float>& bias, const SigmoidShape& s) {
  const int64_t n = s.n_experts, per_group = n / s.n_group, tg = s.topk_group;
  SigmoidToken r{std::vector<double>(static_cast<size_t>(n)), std::vector<double>(static_cast<size_t>(n)), {}, {},
                 false};
  for (int64_t e = 0; e < n; ++e) {
    r.score[e] = 1.0 / (1.0 + std::exp(-double(bf16_to_float(logits[e]))));
    r.choice[e] = r.score[e] + (bias.empty() ? 0.0 : double(bias[e]));
  }
  std::vector<double> worth(static_cast<size_t>(s.n_group));
  for (int64_t g = 0; g < s.n_group; ++g) {
    std::vector<double> members(r.choice.begin() + g * per_group, r.choice.begin() + (g + 1) * per_group);
    std::sort(members.begin(), members.end(), std::greater<>());
    worth[g] = members[0] + (per_group > 1 ? members[1] : 0.0);
  }
  std::vector<int32_t> groups(static_cast<size_t>(s.n_group));
  std::iota(groups.begin(), groups.end(), 0);
  std::stable_sort(groups.begin(), groups.end(), [&](int32_t a, int32_t b) { return worth[a] > worth[b]; });
  std::vector<bool> kept(static_cast<size_t>(s.n_group), false);
  for (int64_t g = 0; g < tg; ++g) kept[groups[g]] = true;
  r.kept.push_back(kept);
  if (tg < s.n_group && sigmoid_near(worth[groups[tg - 1]], worth[groups[tg]])) {
    r.near_tie = worth[groups[tg - 1]] != worth[groups[tg]];
    kept[groups[tg - 1]] = false;
    kept[groups[tg]] = true;
    r.kept.push_back(kept);
  }
  for (const std::vector<bool>& k : r.kept) {
    std::vector<int32_t> candidates;
    for (int64_t e = 0; e < n; ++e) {
      if (k[e / per_group]) candidates.push_back(static_cast<int32_t>(e));
    }
    std::stable_sort(candidates.begin(), candidates.end(),
                     [&](int32_t a, int32_t b) { return r.choice[a] > r.choice[b]; });
    if (r.ids.empty() && static_cast<int64_t>(candidates.size()) > s.top_k) {
      const double last = r.choice[candidates[s.top_k - 1]], next = r.choice[candidates[s.top_k]];
      r.near_tie = r.near_tie || (last != next && sigmoid_near(last, next));
    }
    candidates.resize(static_cast<size_t>(s.top_k));
    r.ids.push_back(std::move(candidates));
  }
  return r;
}

// "" when one token's choices (ids and weights in selection order) are the reference's selection v up to near-ties:
// distinct experts of v's kept groups, each with a choice value near that of the reference's expert at its place
// (so two near-equal experts may swap, in order or across the k-th place); each weight the expert's unbiased score,
// over the chosen experts' score sum when renormalised, times the scaling (the fp32 sigmoid, sum and division stay
// within a few 2^-24 relative). Else what differs.
std::string sigmoid_mismatch(const SigmoidToken& ref, size_t v, const int32_t* ids, const float* weights,
                             const SigmoidShape& s) {
  const int64_t k = s.top_k, per_group = s.n_experts / s.n_group;
  std::ostringstream why;
  double sum = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t id = ids[j], want = ref.ids[v][j];
    if (id < 0 || id >= s.n_experts || std::count(ids, ids + k, id) != 1 || !ref.kept[v][id / per_group]) {
      why << "place " << j << ": expert " << id << " is out of range, repeated or in a dropped group";
      return why.str();
    }
    if (!sigmoid_near(ref.choice[id], ref.choice[want])) {
      why << "place " << j << ": expert " << id << " (choice " << ref.choice[id] << "), want " << want << " (choice "
          << ref.choice[want] << ")";
      return why.str();
    }
    sum += ref.score[id];
  }
  for (int64_t j = 0; j < k; ++j) {
    const double score = ref.score[ids[j]];
    const double want = (s.renormalize ? score / sum : score) * s.routed_scaling;
    if (!(std::fabs(weights[j] - want) <= 4e-6 * std::fabs(want))) {
      why << "place " << j << ": weight " << weights[j] << " of expert " << ids[j] << ", want " << want;
      return why.str();
    }
  }
  return "";
}

// Random non-zero bf16 logits, N(0, 2), in rows of n_experts + 3: the padding would win every selection if read.
std::vector<uint16_t> nonzero_logits(int64_t tokens, int64_t n_experts, std::mt19937& rng) {
  const int64_t stride = n_experts + 3;
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<uint16_t> logits(static_cast<size_t>(tokens * stride));
  for (int64_t i = 0; i < tokens * stride; ++i) {
    if (i % stride >= n_experts) {
      logits[i] = float_to_bf16(100.0f);
      continue;
    }
    do {
      logits[i] = float_to_bf16(dist(rng));
    } while ((logits[i] & 0x7FFF) == 0);
  }
  return logits;
}

// U(-scale, scale) per expert; empty (no bias) for scale 0.
std::vector<float> random_bias(int64_t n_experts, float scale, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> bias;
  for (int64_t e = 0; scale > 0.0f && e < n_experts; ++e) bias.push_back(dist(rng));
  return bias;
}

MoeRouteArgs sigmoid_route_args(const RoutingBuffers& b, const DeviceBuffer& logits, const DeviceBuffer* bias,
                                const SigmoidShape& s, int64_t tokens) {
  MoeRouteArgs r = b.route(logits, {tokens, s.n_experts, s.top_k, s.renormalize, false});
  r.sigmoid = true;
  r.n_group = s.n_group;
  r.topk_group = s.topk_group;
  r.routed_scaling = s.routed_scaling;
  r.correction_bias = bias != nullptr ? bias->as<float>() : nullptr;
  return r;
}

// moe_route with sigmoid routing against the fp64 reference, token by token, and (up to the one-block limit)
// moe_route_align against moe_route + moe_align, every output bit for bit, its sort also against the host's.
// Adds to `changed` the tokens whose chosen experts the bias changed (against the reference without it).
void check_sigmoid_route(const DeviceContext& ctx, const SigmoidShape& s, int64_t tokens, float bias_scale,
                         std::mt19937& rng, int64_t& changed) {
  const int64_t stride = s.n_experts + 3, k = s.top_k, pairs = tokens * k, n_off = s.n_experts + 1;
  const std::vector<uint16_t> logits = nonzero_logits(tokens, s.n_experts, rng);
  const std::vector<float> bias = random_bias(s.n_experts, bias_scale, rng);
  const DeviceBuffer d_logits = upload(logits), d_bias = upload(bias);
  const DeviceBuffer* bias_ptr = bias.empty() ? nullptr : &d_bias;
  // moe_route + moe_align sorts past one block's pairs too (three launches with a workspace).
  const RoutingBuffers two(pairs, s.n_experts, false, moe_align_workspace_bytes(tokens, k, s.n_experts));
  const RoutingBuffers one(pairs, s.n_experts);
  const RouteCase c{tokens, s.n_experts, k, s.renormalize, false};
  auto status = moe_route(ctx, sigmoid_route_args(two, d_logits, bias_ptr, s, tokens));
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ASSERT_TRUE(moe_align(ctx, two.align(c)).has_value());
  const bool fused = pairs <= kMoeRouteAlignMaxPairs;
  if (fused) {
    status = moe_route_align(ctx, sigmoid_route_args(one, d_logits, bias_ptr, s, tokens), one.align(c));
    ASSERT_TRUE(status.has_value()) << status.error().message;
  }
  ctx.synchronize();
  const std::string what = std::string(s.name) + " T=" + std::to_string(tokens) +
                           (bias.empty() ? " no bias" : " bias +-" + std::to_string(bias_scale));
  const auto ids = download<int32_t>(two.ids, static_cast<size_t>(pairs));
  const auto weights = download<float>(two.weights, static_cast<size_t>(pairs));
  int bad = 0;
  int64_t swapped = 0, near_groups = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const SigmoidToken ref = sigmoid_reference(&logits[t * stride], bias, s);
    std::string why;
    for (size_t v = 0; v < ref.kept.size(); ++v) {
      why = sigmoid_mismatch(ref, v, &ids[t * k], &weights[t * k], s);
      if (why.empty()) break;
    }
    if (!why.empty() && ++bad <= 5) ADD_FAILURE() << what << " token " << t << ": " << why;
    swapped += !std::equal(ref.ids[0].begin(), ref.ids[0].end(), &ids[t * k]);
    near_groups += ref.kept.size() > 1;
    if (!bias.empty()) {
      std::vector<int32_t> biased = ref.ids[0], plain = sigmoid_reference(&logits[t * stride], {}, s).ids[0];
      std::sort(biased.begin(), biased.end());
      std::sort(plain.begin(), plain.end());
      changed += biased != plain;
    }
  }
  if (fused) {
    EXPECT_EQ(download<int32_t>(one.ids, static_cast<size_t>(pairs)), ids) << what;
    EXPECT_EQ(download<uint32_t>(one.weights, static_cast<size_t>(pairs)),
              download<uint32_t>(two.weights, static_cast<size_t>(pairs)))
        << what << " weight bits";
    const HostAlign al = align_reference(ids, s.n_experts);
    EXPECT_EQ(download<int32_t>(one.offsets, static_cast<size_t>(n_off)), al.offsets) << what;
    EXPECT_EQ(download<int32_t>(one.sorted_pairs, static_cast<size_t>(pairs)), al.sorted_pairs) << what;
    EXPECT_EQ(download<int32_t>(one.pair_row, static_cast<size_t>(pairs)), al.pair_row) << what;
  }
  std::printf("sigmoid route %-40s order differs from fp64 at %ld tokens (near-ties), groups near-tied at %ld\n",
              what.c_str(), long(swapped), long(near_groups));
}

// Every shape at token counts one warp routes and sorts (1, 4 at top-8), the one block does (5, 64) and moe_route
// alone does (1000), without a bias, with a small one and with one of about the scores' spread at the top; with a
// bias, some token's experts must differ from the unbiased choice, or the bias was not tested.
TEST(MoeRoute, SigmoidMatchesGroupedTopK) {
  DeviceContext ctx;
  std::mt19937 rng(2014);
  for (const SigmoidShape& s : kSigmoidShapes) {
    int64_t changed = 0;
    for (int64_t tokens : {1, 4, 5, 64, 1000}) {
      for (float bias_scale : {0.0f, 0.01f, 0.1f}) check_sigmoid_route(ctx, s, tokens, bias_scale, rng, changed);
    }
    EXPECT_GT(changed, 0) << s.name << ": the correction bias never changed a choice";
  }
}

// fp32 logits (the fp32 router of DeepSeek-V3 / GLM-5) holding the same bf16-exact values as bf16 logits route to the
// same bits, through moe_route and the fused launch, with the same row stride; softmax routing refuses them.
TEST(MoeRoute, SigmoidFp32LogitsRouteAsTheirBf16Values) {
  DeviceContext ctx;
  std::mt19937 rng(2016);
  for (const SigmoidShape& s : kSigmoidShapes) {
    for (int64_t tokens : {1, 5, 300}) {
      const int64_t stride = s.n_experts + 3, k = s.top_k, pairs = tokens * k;
      const std::vector<uint16_t> logits = nonzero_logits(tokens, s.n_experts, rng);
      std::vector<float> wide(logits.size());
      for (size_t i = 0; i < logits.size(); ++i) wide[i] = bf16_to_float(logits[i]);
      const std::vector<float> bias = random_bias(s.n_experts, 0.1f, rng);
      const DeviceBuffer d_logits = upload(logits), d_wide = upload(wide), d_bias = upload(bias);
      const RoutingBuffers a(pairs, s.n_experts), b(pairs, s.n_experts);
      const RouteCase c{tokens, s.n_experts, k, s.renormalize, false};
      ASSERT_TRUE(moe_route(ctx, sigmoid_route_args(a, d_logits, &d_bias, s, tokens)).has_value());
      MoeRouteArgs f = sigmoid_route_args(b, d_logits, &d_bias, s, tokens);
      f.logits = nullptr;
      f.logits_f32 = d_wide.as<float>();
      ASSERT_EQ(f.logits_stride, stride);
      auto status = pairs <= kMoeRouteAlignMaxPairs ? moe_route_align(ctx, f, b.align(c)) : moe_route(ctx, f);
      ASSERT_TRUE(status.has_value()) << status.error().message;
      ctx.synchronize();
      EXPECT_EQ(download<int32_t>(b.ids, static_cast<size_t>(pairs)), download<int32_t>(a.ids, static_cast<size_t>(pairs)))
          << s.name << " T=" << tokens;
      EXPECT_EQ(download<uint32_t>(b.weights, static_cast<size_t>(pairs)),
                download<uint32_t>(a.weights, static_cast<size_t>(pairs)))
          << s.name << " T=" << tokens << " weight bits";
      f.sigmoid = false;
      f.n_group = f.topk_group = 1;
      f.routed_scaling = 1.0f;
      f.correction_bias = nullptr;
      status = moe_route(ctx, f);
      ASSERT_FALSE(status.has_value());
      EXPECT_NE(status.error().message.find("fp32 logits are for sigmoid routing"), std::string::npos)
          << status.error().message;
    }
  }
}

// NaN logits (one, and a whole token's): the ids stay k distinct experts in range, from moe_route and the fused
// launches alike.
TEST(MoeRoute, SigmoidNanLogitsStayInRange) {
  DeviceContext ctx;
  std::mt19937 rng(2015);
  for (const SigmoidShape& s : {kSigmoidShapes[0], kSigmoidShapes[1]}) {
    const int64_t tokens = 3, stride = s.n_experts + 3, k = s.top_k, pairs = tokens * k;
    std::vector<uint16_t> logits = nonzero_logits(tokens, s.n_experts, rng);
    logits[5] = 0x7FC0;
    for (int64_t e = 0; e < s.n_experts; ++e) logits[stride + e] = 0x7FC0;
    const std::vector<float> bias = random_bias(s.n_experts, 0.1f, rng);
    const DeviceBuffer d_logits = upload(logits), d_bias = upload(bias);
    const RoutingBuffers two(pairs, s.n_experts), one(pairs, s.n_experts);
    const RouteCase c{tokens, s.n_experts, k, s.renormalize, false};
    ASSERT_TRUE(moe_route(ctx, sigmoid_route_args(two, d_logits, &d_bias, s, tokens)).has_value());
    ASSERT_TRUE(moe_route_align(ctx, sigmoid_route_args(one, d_logits, &d_bias, s, tokens), one.align(c)).has_value());
    ctx.synchronize();
    for (const RoutingBuffers* b : {&two, &one}) {
      const auto ids = download<int32_t>(b->ids, static_cast<size_t>(pairs));
      for (int64_t t = 0; t < tokens; ++t) {
        std::vector<int32_t> mine(ids.begin() + t * k, ids.begin() + (t + 1) * k);
        std::sort(mine.begin(), mine.end());
        EXPECT_TRUE(mine.front() >= 0 && mine.back() < s.n_experts &&
                    std::adjacent_find(mine.begin(), mine.end()) == mine.end())
            << s.name << " token " << t << ": ids not k distinct experts in range";
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Grouped GEMM

constexpr int64_t kFp8Block = 128;  // rows and columns of a block-wise FP8 scale block (docs/model-specs.md §1.7)
int64_t fp8_scale_cols(int64_t k) { return (k + kFp8Block - 1) / kFp8Block; }

const char* format_name(MoeWeightFormat f) {
  return f == MoeWeightFormat::kBf16 ? "bf16" : f == MoeWeightFormat::kNvfp4 ? "nvfp4" : "fp8";
}

// All experts' weights of one projection [E][n][k] on the host (the reference's dequantized view) and the device.
struct ExpertWeights {
  MoeWeightFormat format;
  int64_t n_experts, n, k;
  std::vector<std::vector<float>> dequant;  // [E][n * k]; empty for an expert no case reads (make_routed_nvfp4)
  std::vector<uint16_t> bf16;               // [E][n][k]
  std::vector<uint8_t> packed, scales;      // NVFP4 [E][n][k/2], [E][n][k/16]; FP8 codes [E][n][k] in packed
  std::vector<float> global_scales;         // [E]
  std::vector<float> row_scales;            // FP8 [E][n][ceil(k/128)]
  DeviceBuffer d_bf16, d_packed, d_scales, d_global, d_row_scales;

  MoeExpertWeights view() const {
    return {.format = format, .n_experts = n_experts, .n = n, .k = k, .bf16 = d_bf16.as<uint16_t>(),
            .bf16_expert_stride = n * k, .packed = d_packed.as<uint8_t>(),
            .packed_expert_stride = format == MoeWeightFormat::kFp8 ? n * k : n * k / 2,
            .scales = d_scales.as<uint8_t>(), .scales_expert_stride = n * k / 16,
            .global_scales = d_global.as<float>(), .row_scales = d_row_scales.as<float>(),
            .row_scales_expert_stride = n * fp8_scale_cols(k)};
  }
  // Experts [first, first + count) only, as one expert-parallel rank holds them.
  MoeExpertWeights view(int64_t first, int64_t count) const {
    MoeExpertWeights v = view();
    v.n_experts = count;
    if (v.bf16 != nullptr) v.bf16 += first * v.bf16_expert_stride;
    if (v.packed != nullptr) v.packed += first * v.packed_expert_stride;
    if (v.scales != nullptr) v.scales += first * v.scales_expert_stride;
    if (v.global_scales != nullptr) v.global_scales += first;
    if (v.row_scales != nullptr) v.row_scales += first * v.row_scales_expert_stride;
    return v;
  }
};

// Block-wise FP8 quantization of one [n, k] weight as DeepSeek-V3's checkpoints are made: each 128 x 128 block
// (partial at the bottom and right edges) gets scale = amax / 448 and codes e4m3(w / scale). Appends the codes and
// the scales expanded to one per row and block column (the device layout) and returns the dequantized weight
// e4m3 * scale in fp32, as the CPU path computes it.
std::vector<float> fp8_quantize_append(const std::vector<float>& m, int64_t n, int64_t k, std::vector<uint8_t>& codes,
                                       std::vector<float>& row_scales) {
  const int64_t cols = fp8_scale_cols(k), block_rows = (n + kFp8Block - 1) / kFp8Block;
  std::vector<float> scale(static_cast<size_t>(block_rows * cols));
  for (int64_t br = 0; br < block_rows; ++br) {
    for (int64_t bc = 0; bc < cols; ++bc) {
      float amax = 0.0f;
      for (int64_t r = br * kFp8Block; r < std::min(n, (br + 1) * kFp8Block); ++r) {
        for (int64_t c = bc * kFp8Block; c < std::min(k, (bc + 1) * kFp8Block); ++c) {
          amax = std::max(amax, std::fabs(m[r * k + c]));
        }
      }
      scale[br * cols + bc] = amax > 0.0f ? amax / 448.0f : 1.0f;
    }
  }
  std::vector<float> dequant(m.size());
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const float s = scale[(r / kFp8Block) * cols + c / kFp8Block];
      const uint8_t code = float_to_e4m3(m[r * k + c] / s);
      codes.push_back(code);
      dequant[r * k + c] = e4m3_to_float(code) * s;
    }
    for (int64_t bc = 0; bc < cols; ++bc) row_scales.push_back(scale[(r / kFp8Block) * cols + bc]);
  }
  return dequant;
}

// N(0, 1) * scale, times 2^U(-spread, spread) per 128 x 128 block, so the blocks' FP8 scales differ as widely;
// rounded to bf16, as the checkpoints' weights were before quantization.
std::vector<float> fp8_random_weight(int64_t n, int64_t k, float scale, float spread, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_real_distribution<float> block_exp(-spread, spread);
  const int64_t cols = fp8_scale_cols(k);
  std::vector<float> factor(static_cast<size_t>((n + kFp8Block - 1) / kFp8Block * cols));
  for (float& f : factor) f = scale * std::exp2(block_exp(rng));
  std::vector<float> m(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      m[r * k + c] = bf16_to_float(float_to_bf16(dist(rng) * factor[(r / kFp8Block) * cols + c / kFp8Block]));
    }
  }
  return m;
}

// N(0, 1) * row_scale per row; NVFP4 rows also get a factor 2^U(-spread, spread) so block scales cover a wide e4m3
// range, FP8 blocks such a factor each (fp8_random_weight). Each expert of an NVFP4 projection has its own global
// scale (ModelOpt's per-expert weight_scale_2).
ExpertWeights make_expert_weights(MoeWeightFormat format, int64_t n_experts, int64_t n, int64_t k, float row_scale,
                                  std::mt19937& rng, float spread = 6.0f) {
  ExpertWeights w{.format = format, .n_experts = n_experts, .n = n, .k = k};
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_real_distribution<float> row_exp(-spread, spread);
  for (int64_t e = 0; e < n_experts; ++e) {
    if (format == MoeWeightFormat::kFp8) {
      w.dequant.push_back(
          fp8_quantize_append(fp8_random_weight(n, k, row_scale, spread, rng), n, k, w.packed, w.row_scales));
      continue;
    }
    std::vector<float> m(static_cast<size_t>(n * k));
    for (int64_t r = 0; r < n; ++r) {
      const float s = format == MoeWeightFormat::kNvfp4 ? row_scale * std::exp2(row_exp(rng)) : row_scale;
      for (int64_t c = 0; c < k; ++c) m[r * k + c] = bf16_to_float(float_to_bf16(dist(rng) * s));
    }
    if (format == MoeWeightFormat::kBf16) {
      for (float v : m) w.bf16.push_back(float_to_bf16(v));
      w.dequant.push_back(std::move(m));
    } else {
      const Nvfp4Matrix q = nvfp4_quantize_weight(m, n, k);
      w.packed.insert(w.packed.end(), q.packed.begin(), q.packed.end());
      w.scales.insert(w.scales.end(), q.block_scales.begin(), q.block_scales.end());
      w.global_scales.push_back(q.global_scale);
      w.dequant.push_back(nvfp4_dequantize(q));
    }
  }
  w.d_bf16 = upload(w.bf16);
  w.d_packed = upload(w.packed);
  w.d_scales = upload(w.scales);
  w.d_global = upload(w.global_scales);
  w.d_row_scales = upload(w.row_scales);
  return w;
}

// NVFP4 experts of which only `used` carry weights (as make_expert_weights makes them, row spread 2^+-6); every
// other expert has NaN block scales and a NaN global scale, so a kernel that reads a wrong expert writes NaN. Lets
// the full 256-expert shapes run without quantizing and keeping all of them on the host.
ExpertWeights make_routed_nvfp4(int64_t n_experts, int64_t n, int64_t k, const std::vector<int32_t>& used,
                                std::mt19937& rng) {
  ExpertWeights w{.format = MoeWeightFormat::kNvfp4, .n_experts = n_experts, .n = n, .k = k};
  w.dequant.resize(static_cast<size_t>(n_experts));
  w.global_scales.assign(static_cast<size_t>(n_experts), NAN);
  const size_t packed_bytes = static_cast<size_t>(n * k / 2), scale_bytes = static_cast<size_t>(n * k / 16);
  w.d_packed = DeviceBuffer(packed_bytes * n_experts);
  w.d_scales = DeviceBuffer(scale_bytes * n_experts);
  w.d_packed.fill(0x77);  // e2m1 6.0 everywhere
  w.d_scales.fill(0xFF);  // e4m3 NaN
  for (int32_t e : used) {
    const Nvfp4Matrix q = nvfp4_quantize_weight(gemm_test::random_row_scaled(n, k, rng), n, k);
    TERN_CUDA_CHECK(
        cudaMemcpy(w.d_packed.as<uint8_t>() + e * packed_bytes, q.packed.data(), packed_bytes, cudaMemcpyHostToDevice));
    TERN_CUDA_CHECK(cudaMemcpy(w.d_scales.as<uint8_t>() + e * scale_bytes, q.block_scales.data(), scale_bytes,
                               cudaMemcpyHostToDevice));
    w.global_scales[e] = q.global_scale;
    w.dequant[e] = nvfp4_dequantize(q);
  }
  w.d_global = upload(w.global_scales);
  return w;
}

// make_routed_nvfp4's FP8 counterpart: only `used` carry weights (make_expert_weights' FP8, block spread 2^+-6);
// every other expert has codes of 1.0 and NaN row scales, so a kernel that reads a wrong expert writes NaN.
ExpertWeights make_routed_fp8(int64_t n_experts, int64_t n, int64_t k, const std::vector<int32_t>& used,
                              std::mt19937& rng) {
  ExpertWeights w{.format = MoeWeightFormat::kFp8, .n_experts = n_experts, .n = n, .k = k};
  w.dequant.resize(static_cast<size_t>(n_experts));
  const auto code_bytes = static_cast<size_t>(n * k), scale_count = static_cast<size_t>(n * fp8_scale_cols(k));
  w.d_packed = DeviceBuffer(code_bytes * n_experts);
  w.d_row_scales = DeviceBuffer(scale_count * sizeof(float) * n_experts);
  w.d_packed.fill(0x38);      // e4m3 1.0 everywhere
  w.d_row_scales.fill(0xFF);  // fp32 NaN
  for (int32_t e : used) {
    std::vector<uint8_t> codes;
    std::vector<float> scales;
    w.dequant[e] = fp8_quantize_append(fp8_random_weight(n, k, 1.0f, 6.0f, rng), n, k, codes, scales);
    TERN_CUDA_CHECK(
        cudaMemcpy(w.d_packed.as<uint8_t>() + e * code_bytes, codes.data(), code_bytes, cudaMemcpyHostToDevice));
    TERN_CUDA_CHECK(cudaMemcpy(w.d_row_scales.as<float>() + e * scale_count, scales.data(), scale_count * sizeof(float),
                               cudaMemcpyHostToDevice));
  }
  return w;
}

// The experts a routing uses, ascending.
std::vector<int32_t> distinct(std::vector<int32_t> ids) {
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

const char* variant_name(MoeGemmVariant v) {
  switch (v) {
    case MoeGemmVariant::kDecode: return "decode";
    case MoeGemmVariant::kPrefill: return "prefill";
    case MoeGemmVariant::kPrefillMma: return "prefill-mma";
    case MoeGemmVariant::kAuto: break;
  }
  return "auto";
}

struct GemmCase {
  int64_t tokens, top_k;
  bool gather, skew;
  int64_t col0 = 0, ldy_extra = 0;  // write columns [col0, col0 + n) of rows ldy = col0 + n + ldy_extra wide
  int token_tiles = 0;               // MoeGemmArgs::decode_token_tiles
  bool passes = false;               // MoeGemmArgs::decode_passes from the host's pass list
  int rs_shape = -1;                 // >= 0: the register-sourced prefill kernel in that shape (moe_launch.h)
};

// FP8 weights through moe_gemm's prefill variant (moe.cc's rule for kAuto): the prefill kernel rounds each
// e4m3 * scale (fp32) to bf16 once and then runs as with bf16 weights, so its reference takes those bf16 weights,
// with the bf16 tolerance. The decode kernel applies the scales to fp32 sums, so its reference takes e4m3 * scale.
bool fp8_prefill_rounds(const ExpertWeights& w, MoeGemmVariant v, int64_t rows, int64_t top_k) {
  const bool decode =
      v == MoeGemmVariant::kDecode || (v == MoeGemmVariant::kAuto && rows <= kMoeDecodeMaxTokens * top_k);
  return w.format == MoeWeightFormat::kFp8 && !decode;
}

// fp64 product of every permuted row with its expert's weight: [rows, w.n], x read at src(r) (gather: token rows).
// act (optional, as x_silu_mul reads x): x holds [gate | up] rows of 2k and the input is silu(gate) * up in fp64.
// bf16_weights: each weight rounded to bf16 first (fp8_prefill_rounds).
gemm_test::Reference expert_reference(const ExpertWeights& w, const std::vector<uint16_t>& x, int64_t ldx,
                                      const HostAlign& al, bool gather, int64_t top_k, bool act = false,
                                      bool bf16_weights = false) {
  const int64_t rows = static_cast<int64_t>(al.sorted_pairs.size()), n = w.n, k = w.k;
  gemm_test::Reference ref{std::vector<double>(static_cast<size_t>(rows * n)),
                           std::vector<double>(static_cast<size_t>(rows * n))};
  std::vector<double> in(static_cast<size_t>(k));
  std::vector<float> rounded;
  for (int64_t e = 0; e < w.n_experts; ++e) {
    const float* we = al.offsets[e] < al.offsets[e + 1] ? w.dequant[static_cast<size_t>(e)].data() : nullptr;
    if (bf16_weights && we != nullptr) {
      rounded.resize(static_cast<size_t>(n * k));
      for (int64_t i = 0; i < n * k; ++i) rounded[i] = bf16_to_float(float_to_bf16(we[i]));
      we = rounded.data();
    }
    for (int64_t r = al.offsets[e]; r < al.offsets[e + 1]; ++r) {
      const int64_t src = gather ? al.sorted_pairs[r] / top_k : r;
      for (int64_t q = 0; q < k; ++q) {
        const double g = bf16_to_float(x[src * ldx + q]);
        in[q] = act ? g / (1.0 + std::exp(-g)) * bf16_to_float(x[src * ldx + k + q]) : g;
      }
      for (int64_t j = 0; j < n; ++j) {
        const float* wr = we + j * k;
        double s = 0, a = 0;
        for (int64_t q = 0; q < k; ++q) {
          const double p = in[q] * wr[q];
          s += p;
          a += std::fabs(p);
        }
        ref.y[r * n + j] = s;
        ref.abs[r * n + j] = a;
      }
    }
  }
  return ref;
}

// Columns [col0, col0 + n) of y [rows, ldy] as [rows, n].
std::vector<uint16_t> y_columns(const std::vector<uint16_t>& y, int64_t rows, int64_t ldy, int64_t col0, int64_t n) {
  std::vector<uint16_t> got(static_cast<size_t>(rows * n));
  for (int64_t r = 0; r < rows; ++r) std::copy_n(&y[r * ldy + col0], n, &got[r * n]);
  return got;
}

// Elements of y [rows, ldy] outside the column windows [lo, hi) that are no longer poison.
int64_t written_outside(const std::vector<uint16_t>& y, int64_t rows, int64_t ldy,
                        const std::vector<std::pair<int64_t, int64_t>>& windows) {
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < ldy; ++j) {
      const bool inside =
          std::any_of(windows.begin(), windows.end(), [&](auto w) { return j >= w.first && j < w.second; });
      bad += !inside && y[r * ldy + j] != gemm_test::kPoison;
    }
  }
  return bad;
}

std::string gemm_name(const ExpertWeights& w, MoeGemmVariant variant, int64_t tokens, int64_t top_k) {
  return std::string(format_name(w.format)) + " " + variant_name(variant) +
         " E=" + std::to_string(w.n_experts) + " n=" + std::to_string(w.n) + " k=" + std::to_string(w.k) +
         " T=" + std::to_string(tokens) + " top" + std::to_string(top_k);
}

// Runs one grouped GEMM on the routing `ids` and checks every written element and that the rest of y is untouched.
void check_gemm_ids(const DeviceContext& ctx, const ExpertWeights& w, const GemmCase& c, MoeGemmVariant variant,
                    const std::vector<int32_t>& ids, std::mt19937& rng) {
  const int64_t rows = c.tokens * c.top_k, n = w.n, k = w.k, ldx = k + 8;
  const HostAlign al = align_reference(ids, w.n_experts);
  const int64_t x_rows = c.gather ? c.tokens : rows;
  const std::vector<uint16_t> x = gemm_test::random_bf16(static_cast<size_t>(x_rows * ldx), rng);
  const DeviceBuffer d_x = upload(x), d_off = upload(al.offsets), d_sorted = upload(al.sorted_pairs);
  const DeviceBuffer d_passes = upload(passes_reference(al.offsets, rows, w.n_experts));
  const int64_t ldy = c.col0 + n + c.ldy_extra;
  const DeviceBuffer d_y = poisoned(static_cast<size_t>(rows * ldy) * 2);
  const MoeGemmArgs args{.x = d_x.as<uint16_t>(),
                         .ldx = ldx,
                         .sorted_pairs = d_sorted.as<int32_t>(),
                         .top_k = c.top_k,
                         .gather = c.gather,
                         .expert_offsets = d_off.as<int32_t>(),
                         .w = w.view(),
                         .y = d_y.as<uint16_t>() + c.col0,
                         .ldy = ldy,
                         .rows = rows,
                         .decode_token_tiles = c.token_tiles,
                         .decode_passes = c.passes ? d_passes.as<int32_t>() : nullptr};
  if (c.rs_shape >= 0) {
    if (!moe_gemm_prefill_rs_fits(ctx, args)) GTEST_SKIP() << "no register-sourced prefill kernel on this GPU";
    moe_gemm_launch_prefill_rs(ctx, args, c.rs_shape);
  } else {
    const auto status = moe_gemm(ctx, args, variant);
    ASSERT_TRUE(status.has_value()) << status.error().message;
  }
  ctx.synchronize();
  const auto y = download<uint16_t>(d_y, static_cast<size_t>(rows * ldy));
  EXPECT_EQ(written_outside(y, rows, ldy, {{c.col0, c.col0 + n}}), 0)
      << "columns outside [col0, col0 + n) were written";
  const bool bf16_w = fp8_prefill_rounds(w, variant, rows, c.top_k);
  gemm_test::check_gemm(y_columns(y, rows, ldy, c.col0, n),
                        expert_reference(w, x, ldx, al, c.gather, c.top_k, false, bf16_w), rows, n,
                        gemm_name(w, variant, c.tokens, c.top_k) + (c.skew ? " skewed" : "") +
                            (c.token_tiles > 0 ? " tiles=" + std::to_string(c.token_tiles) : "") +
                            (c.passes ? " passes" : "") +
                            (c.rs_shape >= 0 ? " rs shape " + std::to_string(c.rs_shape) : ""));
}

// The same on a fresh random routing (skew: see random_ids).
void check_gemm(const DeviceContext& ctx, const ExpertWeights& w, const GemmCase& c, MoeGemmVariant variant,
                std::mt19937& rng) {
  check_gemm_ids(ctx, w, c, variant, random_ids(c.tokens, c.top_k, w.n_experts, c.skew, rng), rng);
}

void check_gemm_shapes(MoeWeightFormat format) {
  DeviceContext ctx;
  std::mt19937 rng(format == MoeWeightFormat::kBf16 ? 2004 : format == MoeWeightFormat::kNvfp4 ? 2005 : 2017);
  const MoeGemmVariant variants[] = {MoeGemmVariant::kDecode, MoeGemmVariant::kPrefill, MoeGemmVariant::kPrefillMma,
                                     MoeGemmVariant::kAuto};
  struct Shape {
    int64_t n_experts, n, k, top_k;
  };
  // The test fixture; n odd and k off every tile (k % 32 != 0 takes NVFP4's 8-byte loads); a 35B-like gate_up.
  for (const Shape& s : {Shape{8, 32, 64, 2}, Shape{64, 271, 784, 8}, Shape{256, 1024, 2048, 8}}) {
    const ExpertWeights w = make_expert_weights(format, s.n_experts, s.n, s.k, 1.0f, rng);
    for (int64_t tokens : {1, 3, 37, 1000}) {
      if (s.n_experts == 256 && tokens == 1000) continue;  // the host reference would take minutes
      for (MoeGemmVariant v : variants) check_gemm(ctx, w, {tokens, s.top_k, true, false}, v, rng);
    }
  }
  // Ragged loads (half the experts empty, one in every token), ungathered input, and a column window of a wider y.
  const ExpertWeights w = make_expert_weights(format, 16, 130, 256, 1.0f, rng);
  for (MoeGemmVariant v : variants) {
    check_gemm(ctx, w, {1000, 4, true, true}, v, rng);
    check_gemm(ctx, w, {37, 4, false, true, 0, 6}, v, rng);
    check_gemm(ctx, w, {300, 2, true, false, 130, 0}, v, rng);  // the up half of a [rows, 2n] buffer
  }
  // The decode kernel with each x-row tile width forced: one 8-row tile over experts of many rows (several passes
  // over the same weight) and two tiles at a few tokens.
  for (const int tiles : {1, 2}) {
    check_gemm(ctx, w, {37, 4, true, true, 0, 0, tiles}, MoeGemmVariant::kDecode, rng);
    check_gemm(ctx, w, {3, 4, true, false, 0, 0, tiles}, MoeGemmVariant::kDecode, rng);
  }
  // The pass list: the hot expert's 37 and 300 rows as 5 and 38 passes side by side, gathered or not, a column
  // window, and few tokens (one pass per expert); kAuto at 300 tokens is the prefill kernel, which ignores it.
  for (MoeGemmVariant v : {MoeGemmVariant::kDecode, MoeGemmVariant::kAuto}) {
    check_gemm(ctx, w, {37, 4, true, true, 0, 0, 0, true}, v, rng);
    check_gemm(ctx, w, {300, 2, false, true, 130, 0, 1, true}, v, rng);
    check_gemm(ctx, w, {3, 4, true, false, 0, 0, 0, true}, v, rng);
  }
}

// The NVFP4 prefill kernel with the weight in registers (what kPrefill takes on sm_90a where k % 128 == 0): 64- and 128-token
// tiles, an odd n (a partial 128-row block), ragged and empty experts, ungathered input, a column window of a wider
// y (with an odd row pitch, so stored an element at a time) and the 35B's gate_up shape.
TEST(MoeGemm, Nvfp4RegisterSourcedPrefill) {
  DeviceContext ctx;
  std::mt19937 rng(2041);
  for (const auto& [n_experts, n, k, top_k] : {std::tuple{8, 32, 128, 2}, std::tuple{64, 271, 768, 8},
                                             std::tuple{256, 1024, 2048, 8}}) {
    const ExpertWeights w = make_expert_weights(MoeWeightFormat::kNvfp4, n_experts, n, k, 1.0f, rng);
    for (int64_t tokens : {3, 37, 600}) {
      if (n_experts == 256 && tokens == 600) continue;  // the host reference would take minutes
      check_gemm(ctx, w, {tokens, top_k, true, false}, MoeGemmVariant::kPrefill, rng);
    }
  }
  const ExpertWeights w = make_expert_weights(MoeWeightFormat::kNvfp4, 16, 130, 256, 1.0f, rng);
  check_gemm(ctx, w, {1000, 4, true, true}, MoeGemmVariant::kPrefill, rng);
  check_gemm(ctx, w, {37, 4, false, true, 0, 6}, MoeGemmVariant::kPrefill, rng);
  check_gemm(ctx, w, {300, 2, true, false, 130, 0}, MoeGemmVariant::kPrefill, rng);
  check_gemm(ctx, w, {300, 2, true, false, 130, 1}, MoeGemmVariant::kPrefill, rng);  // ldy odd: no pair stores
  // Every shape moe_bench --rs-shapes times, whichever the launcher takes: a 768-k shape with a partial weight block,
  // ragged experts, ungathered x and a column window with an odd row pitch.
  const int n_shapes = static_cast<int>(moe_gemm_prefill_rs_shapes().size());
  ASSERT_GT(n_shapes, 0);
  const ExpertWeights w2 = make_expert_weights(MoeWeightFormat::kNvfp4, 64, 271, 768, 1.0f, rng);
  for (int shape = 0; shape < n_shapes; ++shape) {
    check_gemm(ctx, w2, {37, 8, true, false, 0, 0, 0, false, shape}, MoeGemmVariant::kPrefill, rng);
    check_gemm(ctx, w2, {600, 8, true, false, 0, 0, 0, false, shape}, MoeGemmVariant::kPrefill, rng);
    check_gemm(ctx, w, {1000, 4, true, true, 0, 0, 0, false, shape}, MoeGemmVariant::kPrefill, rng);
    check_gemm(ctx, w, {300, 2, false, false, 130, 1, 0, false, shape}, MoeGemmVariant::kPrefill, rng);
  }
}

TEST(MoeGemm, Bf16BothVariants) { check_gemm_shapes(MoeWeightFormat::kBf16); }
TEST(MoeGemm, Nvfp4BothVariants) { check_gemm_shapes(MoeWeightFormat::kNvfp4); }
TEST(MoeGemm, Fp8BothVariants) { check_gemm_shapes(MoeWeightFormat::kFp8); }

// Block-wise FP8 at the edges of its 128 x 128 scale blocks and of the kernels' steps: n = 200 and k = 208 (a partial
// block in both directions; k % 64 = 16: a partial decode step, whose scale every lane must still apply, k % 32 = 16:
// a partial prefill step), n = 48 and k = 144 (less than one block of rows, one block and 16 columns), and k = 2048
// with n = 384 (whole blocks: on sm_90a kPrefill takes the wgmma kernel's FP8 tiles, kPrefillMma the mma.sync one).
// Every variant at 1, 5, 16 (two x-row tiles at decode) and 300 tokens, and the decode kernel on skewed permuted rows.
TEST(MoeGemm, Fp8PartialScaleBlocks) {
  DeviceContext ctx;
  std::mt19937 rng(2018);
  const MoeGemmVariant variants[] = {MoeGemmVariant::kDecode, MoeGemmVariant::kPrefill, MoeGemmVariant::kPrefillMma,
                                     MoeGemmVariant::kAuto};
  struct Shape {
    int64_t n_experts, n, k, top_k;
  };
  for (const Shape& s : {Shape{64, 200, 208, 8}, Shape{8, 48, 144, 2}, Shape{32, 384, 2048, 4}}) {
    const ExpertWeights w = make_expert_weights(MoeWeightFormat::kFp8, s.n_experts, s.n, s.k, 1.0f, rng);
    for (int64_t tokens : {1, 5, 16, 300}) {
      for (MoeGemmVariant v : variants) check_gemm(ctx, w, {tokens, s.top_k, true, false}, v, rng);
    }
    check_gemm(ctx, w, {37, s.top_k, false, true, 0, 6}, MoeGemmVariant::kDecode, rng);  // permuted rows, skewed
  }
}

// On an H100/H200 (compute capability 9.0; tern's builds carry sm_90a code) the prefill variant must take the wgmma
// kernel where the shapes allow it, so the tests above checked it there rather than a silent fallback.
TEST(MoeGemm, PrefillUsesWgmmaOnHopper) {
  DeviceContext ctx;
  if (ctx.props().cc_major != 9 || ctx.props().cc_minor != 0) GTEST_SKIP() << "not a compute capability 9.0 GPU";
  const DeviceBuffer x(4096);
  MoeGemmArgs a{.x = x.as<uint16_t>(), .ldx = 2048, .w = {.format = MoeWeightFormat::kNvfp4, .n_experts = 8,
                                                            .n = 512, .k = 2048}};
  EXPECT_TRUE(moe_gemm_prefill_sm90_fits(ctx, a));
  EXPECT_TRUE(moe_gemm_prefill_rs_fits(ctx, a));  // NVFP4, k % 128 == 0: the weight in registers
  a.w.k = 192;  // a multiple of 64 only: the kernel with the weight tile in shared memory
  EXPECT_TRUE(moe_gemm_prefill_sm90_fits(ctx, a));
  EXPECT_FALSE(moe_gemm_prefill_rs_fits(ctx, a));
  a.w.k = 784;  // not a multiple of 64: the mma.sync kernel
  EXPECT_FALSE(moe_gemm_prefill_sm90_fits(ctx, a));
  a.w.k = 2048;
  a.w.format = MoeWeightFormat::kFp8;  // FP8 weight tiles too, in shared memory
  EXPECT_TRUE(moe_gemm_prefill_sm90_fits(ctx, a));
  EXPECT_FALSE(moe_gemm_prefill_rs_fits(ctx, a));
  a.w.k = 208;
  EXPECT_FALSE(moe_gemm_prefill_sm90_fits(ctx, a));
}

// MoeGemmArgs::w2 on the routing `ids`: w into columns [0, w.n) and w2 into [y2_offset, y2_offset + w2.n) of
// y [rows, ldy] in one call, each against its fp64 product, nothing else written.
void check_gemm_pair(const DeviceContext& ctx, const ExpertWeights& w, const ExpertWeights& w2,
                     const std::vector<int32_t>& ids, int64_t top_k, int64_t y2_offset, int64_t ldy,
                     MoeGemmVariant variant, std::mt19937& rng, bool passes = false) {
  const int64_t rows = static_cast<int64_t>(ids.size()), tokens = rows / top_k, ldx = w.k + 8;
  const HostAlign al = align_reference(ids, w.n_experts);
  const std::vector<uint16_t> x = gemm_test::random_bf16(static_cast<size_t>(tokens * ldx), rng);
  const DeviceBuffer d_x = upload(x), d_off = upload(al.offsets), d_sorted = upload(al.sorted_pairs);
  const DeviceBuffer d_passes = upload(passes_reference(al.offsets, rows, w.n_experts));
  const DeviceBuffer d_y = poisoned(static_cast<size_t>(rows * ldy) * 2);
  const auto status = moe_gemm(ctx,
                               {.x = d_x.as<uint16_t>(),
                                .ldx = ldx,
                                .sorted_pairs = d_sorted.as<int32_t>(),
                                .top_k = top_k,
                                .gather = true,
                                .expert_offsets = d_off.as<int32_t>(),
                                .w = w.view(),
                                .y = d_y.as<uint16_t>(),
                                .ldy = ldy,
                                .rows = rows,
                                .w2 = w2.view(),
                                .y2_offset = y2_offset,
                                .decode_passes = passes ? d_passes.as<int32_t>() : nullptr},
                               variant);
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();
  const auto y = download<uint16_t>(d_y, static_cast<size_t>(rows * ldy));
  EXPECT_EQ(written_outside(y, rows, ldy, {{0, w.n}, {y2_offset, y2_offset + w2.n}}), 0)
      << "columns outside both projections were written";
  const std::string what =
      gemm_name(w, variant, tokens, top_k) + " +w2 n=" + std::to_string(w2.n) + (passes ? " passes" : "");
  const bool bf16_w = fp8_prefill_rounds(w, variant, rows, top_k);
  gemm_test::check_gemm(y_columns(y, rows, ldy, 0, w.n), expert_reference(w, x, ldx, al, true, top_k, false, bf16_w),
                        rows, w.n, what + " (w)");
  gemm_test::check_gemm(y_columns(y, rows, ldy, y2_offset, w2.n),
                        expert_reference(w2, x, ldx, al, true, top_k, false, bf16_w), rows, w2.n, what + " (w2)");
}

// Gate and up as two stacks (NVFP4: each expert of each with its own global scale) in one launch, at 1, 2, 7 and
// 64 tokens: the fixture, then n, n2 and k off every tile and step (k % 32 != 0 takes NVFP4's 8-byte loads) with
// a gap between the two column windows; then the 35B shape (two [512, 2048] stacks) with only routed experts set.
TEST(MoeGemm, SecondProjectionInTheSameLaunch) {
  DeviceContext ctx;
  std::mt19937 rng(2008);
  const MoeGemmVariant variants[] = {MoeGemmVariant::kDecode, MoeGemmVariant::kAuto, MoeGemmVariant::kPrefill,
                                     MoeGemmVariant::kPrefillMma};
  struct Shape {
    int64_t n_experts, n, n2, k, top_k, gap;
  };
  for (MoeWeightFormat f : {MoeWeightFormat::kBf16, MoeWeightFormat::kNvfp4}) {
    for (const Shape& s : {Shape{8, 32, 32, 64, 2, 0}, Shape{64, 136, 120, 784, 8, 3}}) {
      const ExpertWeights w = make_expert_weights(f, s.n_experts, s.n, s.k, 1.0f, rng);
      const ExpertWeights w2 = make_expert_weights(f, s.n_experts, s.n2, s.k, 1.0f, rng);
      for (int64_t tokens : {1, 2, 7, 64}) {
        for (MoeGemmVariant v : variants) {
          check_gemm_pair(ctx, w, w2, random_ids(tokens, s.top_k, s.n_experts, false, rng), s.top_k, s.n + s.gap,
                          s.n + s.gap + s.n2 + s.gap, v, rng);
        }
      }
      // The decode pass list (moe_forward's launch past 8 tokens), a hot expert in every token.
      check_gemm_pair(ctx, w, w2, random_ids(64, s.top_k, s.n_experts, true, rng), s.top_k, s.n + s.gap,
                      s.n + s.gap + s.n2 + s.gap, MoeGemmVariant::kDecode, rng, true);
    }
  }
  for (int64_t tokens : {1, 2, 7}) {
    const std::vector<int32_t> ids = random_ids(tokens, 8, 256, false, rng);
    const ExpertWeights gate = make_routed_nvfp4(256, 512, 2048, distinct(ids), rng);
    const ExpertWeights up = make_routed_nvfp4(256, 512, 2048, distinct(ids), rng);
    for (MoeGemmVariant v : {MoeGemmVariant::kDecode, MoeGemmVariant::kAuto}) {
      check_gemm_pair(ctx, gate, up, ids, 8, 512, 1024, v, rng);
    }
  }
}

// MoeGemmArgs::x_silu_mul on permuted [gate | up] rows (ldx = 2k, as moe_forward's gate_up buffer) and the routing
// `ids`: the decode kernel's y must equal, bit for bit, silu_mul followed by the same decode GEMM on its output,
// and match the fp64 product of silu(gate) * up. Against fp64 the act's bf16 rounding (relative 2^-9, plus the
// fp32 silu's few ulp) adds at most 2^-9 S to gemm_test's bound; dropping a 16-k block still moves y by about
// 16 S / k, at least 2^-7 S here.
void check_gemm_silu(const DeviceContext& ctx, const ExpertWeights& w, const std::vector<int32_t>& ids, int64_t top_k,
                     std::mt19937& rng, int token_tiles = 0, bool passes = false) {
  const int64_t rows = static_cast<int64_t>(ids.size()), n = w.n, k = w.k;
  const HostAlign al = align_reference(ids, w.n_experts);
  const DeviceBuffer d_passes = upload(passes_reference(al.offsets, rows, w.n_experts));
  const std::vector<uint16_t> gate_up = gemm_test::random_bf16(static_cast<size_t>(rows * 2 * k), rng);
  const DeviceBuffer d_gu = upload(gate_up), d_off = upload(al.offsets);
  const DeviceBuffer act = poisoned(static_cast<size_t>(rows * k) * 2);
  const DeviceBuffer y_fused = poisoned(static_cast<size_t>(rows * n) * 2);
  const DeviceBuffer y_split = poisoned(static_cast<size_t>(rows * n) * 2);
  const MoeGemmArgs base{.x = d_gu.as<uint16_t>(),
                         .ldx = 2 * k,
                         .top_k = top_k,
                         .expert_offsets = d_off.as<int32_t>(),
                         .w = w.view(),
                         .y = y_fused.as<uint16_t>(),
                         .ldy = n,
                         .rows = rows,
                         .x_silu_mul = true,
                         .decode_token_tiles = token_tiles,
                         .decode_passes = passes ? d_passes.as<int32_t>() : nullptr};
  auto status = moe_gemm(ctx, base, MoeGemmVariant::kDecode);
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ASSERT_TRUE(
      silu_mul(ctx, {.gate_up = d_gu.as<uint16_t>(), .y = act.as<uint16_t>(), .rows = rows, .inter = k}).has_value());
  MoeGemmArgs split = base;
  split.x = act.as<uint16_t>();
  split.ldx = k;
  split.y = y_split.as<uint16_t>();
  split.x_silu_mul = false;
  status = moe_gemm(ctx, split, MoeGemmVariant::kDecode);
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();
  const auto got = download<uint16_t>(y_fused, static_cast<size_t>(rows * n));
  const std::string what =
      gemm_name(w, MoeGemmVariant::kDecode, rows / top_k, top_k) + " silu(x)" + (passes ? " passes" : "");
  EXPECT_EQ(got, download<uint16_t>(y_split, static_cast<size_t>(rows * n)))
      << what << ": differs from silu_mul + GEMM";
  const gemm_test::Reference ref = expert_reference(w, gate_up, 2 * k, al, false, top_k, true);
  int64_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = bf16_to_float(got[i]), err = std::fabs(g - ref.y[i]);
    const double allowed = gemm_test::kRelTol * std::fabs(ref.y[i]) + (gemm_test::kAbsTol + 0x1p-9) * ref.abs[i];
    if (std::isfinite(g)) worst = std::max(worst, err / allowed);
    if ((!std::isfinite(g) || err > allowed) && ++bad <= 5) {
      ADD_FAILURE() << what << ": y[" << i / n << "," << i % n << "] = " << g << ", reference " << ref.y[i]
                    << " (allowed error " << allowed << ")";
    }
  }
  std::printf("%-48s max error / allowed = %.3f\n", what.c_str(), worst);
}

// The down projection with SiLU-and-mul folded in, at 1, 2, 7 and 64 tokens: the fixture (at 64 tokens each expert
// takes several 16-row passes, so the act rows are restaged), n and k off every tile and step (k % 32 != 0: NVFP4's
// 8-byte loads), a skewed routing, and the 35B down shape ([2048, 512]; NVFP4 with only the routed experts set).
TEST(MoeGemm, SiluMulFoldedIntoTheDecodeKernel) {
  DeviceContext ctx;
  std::mt19937 rng(2010);
  struct Shape {
    int64_t n_experts, n, k, top_k;
    bool skew;
  };
  for (MoeWeightFormat f : {MoeWeightFormat::kBf16, MoeWeightFormat::kNvfp4}) {
    for (const Shape& s : {Shape{8, 32, 64, 2, false}, Shape{64, 136, 784, 8, false}, Shape{16, 130, 256, 4, true},
                           Shape{16, 2048, 512, 8, false}}) {
      const ExpertWeights w = make_expert_weights(f, s.n_experts, s.n, s.k, 1.0f, rng);
      for (int64_t tokens : {1, 2, 7, 64}) {
        check_gemm_silu(ctx, w, random_ids(tokens, s.top_k, s.n_experts, s.skew, rng), s.top_k, rng);
      }
      // One 8-row tile per pass at 64 tokens: more passes, each restaging its act rows; the same passes from the
      // pass list, each in its own blocks.
      check_gemm_silu(ctx, w, random_ids(64, s.top_k, s.n_experts, s.skew, rng), s.top_k, rng, 1);
      check_gemm_silu(ctx, w, random_ids(64, s.top_k, s.n_experts, s.skew, rng), s.top_k, rng, 0, true);
    }
  }
  for (int64_t tokens : {1, 2, 7}) {
    const std::vector<int32_t> ids = random_ids(tokens, 8, 256, false, rng);
    check_gemm_silu(ctx, make_routed_nvfp4(256, 2048, 512, distinct(ids), rng), ids, 8, rng);
  }
}

// MoeGemmArgs::route: one token's gate/up launch that routes the token itself, against moe_route_align followed by
// the same launch on its offsets. Every output must be the same bits: the routing (ids, weight bits, offsets,
// sorted_pairs, pair_row) and y, whose columns are also checked against the fp64 product, and nothing outside
// them written. Routing shapes as MoeRouteAlign's (coarse logits tie exactly), one with a NaN logit (every
// probability NaN: the k lowest indices win, with NaN weights), and Qwen3.5-35B-A3B's gate and up stacks with only
// the routed experts set.
void check_route_in_launch(const DeviceContext& ctx, const RouteCase& c, const ExpertWeights& w,
                           const ExpertWeights& w2, std::vector<uint16_t> logits, std::mt19937& rng) {
  const int64_t k = c.top_k, ldx = w.k + 8, ldy = w.n + w2.n, n_off = c.n_experts + 1;
  const std::vector<uint16_t> x = gemm_test::random_bf16(static_cast<size_t>(ldx), rng);
  const DeviceBuffer d_x = upload(x), d_logits = upload(logits);
  const RoutingBuffers two(k, c.n_experts), one(k, c.n_experts);
  const DeviceBuffer y_two = poisoned(static_cast<size_t>(k * ldy) * 2),
                     y_one = poisoned(static_cast<size_t>(k * ldy) * 2);
  MoeGemmArgs args{.x = d_x.as<uint16_t>(),
                   .ldx = ldx,
                   .sorted_pairs = two.sorted_pairs.as<int32_t>(),
                   .top_k = k,
                   .gather = true,
                   .expert_offsets = two.offsets.as<int32_t>(),
                   .w = w.view(),
                   .y = y_two.as<uint16_t>(),
                   .ldy = ldy,
                   .rows = k,
                   .w2 = w2.view(),
                   .y2_offset = w.n};
  ASSERT_TRUE(moe_route_align(ctx, two.route(d_logits, c), two.align(c)).has_value());
  auto status = moe_gemm(ctx, args, MoeGemmVariant::kDecode);
  ASSERT_TRUE(status.has_value()) << status.error().message;
  args.sorted_pairs = nullptr;
  args.expert_offsets = nullptr;
  args.y = y_one.as<uint16_t>();
  args.route = one.route(d_logits, c);
  args.align = one.align(c);
  status = moe_gemm(ctx, args, MoeGemmVariant::kAuto);
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();

  const std::string what = gemm_name(w, MoeGemmVariant::kDecode, 1, k) + " routed in the launch" +
                           (c.coarse ? " ties" : "") + (c.renormalize ? "" : " raw weights");
  const auto ids = download<int32_t>(one.ids, static_cast<size_t>(k));
  EXPECT_EQ(ids, download<int32_t>(two.ids, static_cast<size_t>(k))) << what;
  EXPECT_EQ(download<uint32_t>(one.weights, static_cast<size_t>(k)),
            download<uint32_t>(two.weights, static_cast<size_t>(k)))
      << what << " weight bits";
  EXPECT_EQ(download<int32_t>(one.offsets, static_cast<size_t>(n_off)),
            download<int32_t>(two.offsets, static_cast<size_t>(n_off)))
      << what;
  EXPECT_EQ(download<int32_t>(one.sorted_pairs, static_cast<size_t>(k)),
            download<int32_t>(two.sorted_pairs, static_cast<size_t>(k)))
      << what;
  EXPECT_EQ(download<int32_t>(one.pair_row, static_cast<size_t>(k)),
            download<int32_t>(two.pair_row, static_cast<size_t>(k)))
      << what;
  const auto y = download<uint16_t>(y_one, static_cast<size_t>(k * ldy));
  EXPECT_EQ(y, download<uint16_t>(y_two, static_cast<size_t>(k * ldy))) << what << ": y differs from route + GEMM";

  const HostRouting want = route_reference(logits, c.n_experts + 3, 1, c.n_experts, k, c.renormalize);
  EXPECT_EQ(ids, want.ids) << what;
  const HostAlign al = align_reference(want.ids, c.n_experts);
  gemm_test::check_gemm(y_columns(y, k, ldy, 0, w.n), expert_reference(w, x, ldx, al, true, k), k, w.n, what + " (w)");
  gemm_test::check_gemm(y_columns(y, k, ldy, w.n, w2.n), expert_reference(w2, x, ldx, al, true, k), k, w2.n,
                        what + " (w2)");
}

TEST(MoeGemm, RoutesOneTokenInTheLaunch) {
  DeviceContext ctx;
  std::mt19937 rng(2012);
  struct Shape {
    int64_t n_experts, top_k;
    bool renormalize, coarse;
  };
  for (MoeWeightFormat f : {MoeWeightFormat::kBf16, MoeWeightFormat::kNvfp4}) {
    for (const Shape& s :
         {Shape{8, 2, true, false}, Shape{256, 8, true, false}, Shape{256, 8, true, true}, Shape{512, 10, false, true},
          Shape{64, 1, true, false}, Shape{40, 32, true, true}, Shape{33, 4, false, false}}) {
      const RouteCase c{1, s.n_experts, s.top_k, s.renormalize, s.coarse};
      const ExpertWeights w = make_expert_weights(f, s.n_experts, 32, 64, 1.0f, rng);
      const ExpertWeights w2 = make_expert_weights(f, s.n_experts, 24, 64, 1.0f, rng);
      check_route_in_launch(ctx, c, w, w2, random_logits(c, rng), rng);
    }
  }
  const RouteCase nan_case{1, 64, 4, true, false};
  std::vector<uint16_t> logits = random_logits(nan_case, rng);
  logits[17] = 0x7FC0;
  const ExpertWeights w = make_expert_weights(MoeWeightFormat::kBf16, 64, 32, 64, 1.0f, rng);
  check_route_in_launch(ctx, nan_case, w, w, logits, rng);

  const RouteCase model{1, 256, 8, true, false};
  logits = random_logits(model, rng);
  const std::vector<int32_t> used = distinct(route_reference(logits, 259, 1, 256, 8, true).ids);
  const ExpertWeights gate = make_routed_nvfp4(256, 512, 2048, used, rng);
  const ExpertWeights up = make_routed_nvfp4(256, 512, 2048, used, rng);
  check_route_in_launch(ctx, model, gate, up, logits, rng);
}

// Qwen3.5-35B-A3B's expert GEMMs at decode sizes (256 experts, top-8, hidden 2048, moe_intermediate 512): gate_up
// [1024, 2048] on gathered token rows and down [2048, 512] on permuted rows, T = 1 and 8, through the decode kernel
// and kAuto. Only the routed experts carry weights (make_routed_nvfp4). Then a ragged shape that takes the same
// 32-row warp tiles on a 132-SM GPU: n and k off the tile and step sizes, experts with 0 rows.
TEST(MoeGemm, Nvfp4DecodeModelShapes) {
  DeviceContext ctx;
  std::mt19937 rng(2007);
  struct Shape {
    int64_t n_experts, n, k, top_k;
    bool gather;
  };
  for (const Shape& s :
       {Shape{256, 1024, 2048, 8, true}, Shape{256, 2048, 512, 8, false}, Shape{64, 1000, 672, 8, true}}) {
    for (int64_t tokens : {1, 8}) {
      const std::vector<int32_t> ids = random_ids(tokens, s.top_k, s.n_experts, false, rng);
      const ExpertWeights w = make_routed_nvfp4(s.n_experts, s.n, s.k, distinct(ids), rng);
      for (MoeGemmVariant v : {MoeGemmVariant::kDecode, MoeGemmVariant::kAuto}) {
        check_gemm_ids(ctx, w, {tokens, s.top_k, s.gather, false}, v, ids, rng);
      }
    }
  }
}

// FP8 experts in the decode kernel's fused forms, as SecondProjectionInTheSameLaunch, SiluMulFoldedIntoTheDecodeKernel
// and RoutesOneTokenInTheLaunch check bf16 and NVFP4: gate and up as two stacks with their own block scales in one
// launch (w2, whose blocks read the second projection's codes and scales) at 1, 5, 16 and 64 tokens and through
// every variant; the down projection with SiLU-and-mul folded in (act rows in shared memory) at 1, 5, 16 and 64
// tokens and with one x-row tile forced; one token routed in the launch. Shapes: the fixture, n and k off the 128 x
// 128 blocks and the 64-k steps (k = 208, 784; n = 200, 136, 120) with a gap between the two column windows.
TEST(MoeGemm, Fp8FusedDecodeLaunches) {
  DeviceContext ctx;
  std::mt19937 rng(2019);
  const MoeGemmVariant variants[] = {MoeGemmVariant::kDecode, MoeGemmVariant::kAuto, MoeGemmVariant::kPrefill,
                                     MoeGemmVariant::kPrefillMma};
  constexpr MoeWeightFormat kFp8 = MoeWeightFormat::kFp8;
  struct PairShape {
    int64_t n_experts, n, n2, k, top_k, gap;
  };
  for (const PairShape& s : {PairShape{8, 32, 32, 64, 2, 0}, PairShape{64, 136, 120, 784, 8, 3},
                             PairShape{16, 200, 72, 208, 4, 5}}) {
    const ExpertWeights w = make_expert_weights(kFp8, s.n_experts, s.n, s.k, 1.0f, rng);
    const ExpertWeights w2 = make_expert_weights(kFp8, s.n_experts, s.n2, s.k, 1.0f, rng);
    for (int64_t tokens : {1, 5, 16, 64}) {
      for (MoeGemmVariant v : variants) {
        check_gemm_pair(ctx, w, w2, random_ids(tokens, s.top_k, s.n_experts, false, rng), s.top_k, s.n + s.gap,
                        s.n + s.gap + s.n2 + s.gap, v, rng);
      }
    }
  }
  struct SiluShape {
    int64_t n_experts, n, k, top_k;
    bool skew;
  };
  for (const SiluShape& s : {SiluShape{8, 32, 64, 2, false}, SiluShape{64, 136, 784, 8, false},
                             SiluShape{16, 200, 208, 4, true}}) {
    const ExpertWeights w = make_expert_weights(kFp8, s.n_experts, s.n, s.k, 1.0f, rng);
    for (int64_t tokens : {1, 5, 16, 64}) {
      check_gemm_silu(ctx, w, random_ids(tokens, s.top_k, s.n_experts, s.skew, rng), s.top_k, rng);
    }
    check_gemm_silu(ctx, w, random_ids(64, s.top_k, s.n_experts, s.skew, rng), s.top_k, rng, 1);
  }
  for (const RouteCase& c : {RouteCase{1, 8, 2, true, false}, RouteCase{1, 256, 8, true, true},
                             RouteCase{1, 33, 4, false, false}}) {
    const ExpertWeights w = make_expert_weights(kFp8, c.n_experts, 32, 208, 1.0f, rng);
    const ExpertWeights w2 = make_expert_weights(kFp8, c.n_experts, 24, 208, 1.0f, rng);
    check_route_in_launch(ctx, c, w, w2, random_logits(c, rng), rng);
  }
}

// GLM-5-FP8's routed experts at decode (256 experts, top-8, hidden 6144, moe_intermediate 2048): gate and up as two
// [2048, 6144] stacks in one launch on gathered token rows, and down [6144, 2048] with SiLU-and-mul folded in, at 1
// and 2 tokens, only the routed experts set (make_routed_fp8). A stack's codes pass 2^31 bytes, so the expert
// offsets must be 64-bit.
TEST(MoeGemm, Fp8DecodeModelShapes) {
  DeviceContext ctx;
  std::mt19937 rng(2020);
  constexpr int64_t kExperts = 256, kTopK = 8, kHidden = 6144, kInter = 2048;
  for (int64_t tokens : {1, 2}) {
    const std::vector<int32_t> ids = random_ids(tokens, kTopK, kExperts, false, rng);
    const ExpertWeights gate = make_routed_fp8(kExperts, kInter, kHidden, distinct(ids), rng);
    const ExpertWeights up = make_routed_fp8(kExperts, kInter, kHidden, distinct(ids), rng);
    for (MoeGemmVariant v : {MoeGemmVariant::kDecode, MoeGemmVariant::kAuto}) {
      check_gemm_pair(ctx, gate, up, ids, kTopK, kInter, 2 * kInter, v, rng);
    }
    const ExpertWeights down = make_routed_fp8(kExperts, kHidden, kInter, distinct(ids), rng);
    check_gemm_silu(ctx, down, ids, kTopK, rng);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The combine folded into the shared expert's down projection (gemv_bf16_silu_mul_moe_combine)

// m tokens of top_k pairs on random distinct experts: the fused launch against gemv_bf16_silu_mul into shared_out
// followed by moe_combine (every bit, and nothing of y past n written), and against the block's fp64 value. Against
// fp64 the bf16 act (2^-9 relative per term), the shared output's rounding (2^-9) and y's own add up to about
// 2^-8 of the summed magnitudes; leaving out one expert's term moves y by about its own magnitude. gated = false:
// no shared gate, the shared expert added unweighted (DeepSeek-V3 / GLM-5). `experts`: only the pairs of these
// experts are summed (expert parallelism: one rank's); the others' expert_out rows are poison, so a pair of theirs
// summed makes y NaN.
void check_combine_gemv(const DeviceContext& ctx, int64_t m, int64_t top_k, int64_t n, int64_t k, bool gated,
                        std::mt19937& rng, std::pair<int32_t, int32_t> experts = {0, INT32_MAX}) {
  const int64_t n_experts = 64, pairs = m * top_k, ldx = 2 * k + 8, gate_stride = 3, ldy = n + 5;
  const std::vector<int32_t> ids = random_ids(m, top_k, n_experts, false, rng);
  const HostAlign al = align_reference(ids, n_experts);
  const std::vector<uint16_t> gate_up = gemm_test::random_bf16(static_cast<size_t>(m * ldx), rng);
  const std::vector<uint16_t> w = gemm_test::random_bf16(static_cast<size_t>(n * k), rng);
  std::vector<uint16_t> expert_out = gemm_test::random_bf16(static_cast<size_t>(pairs * n), rng);
  const auto mine = [&](int64_t pair) { return ids[pair] >= experts.first && ids[pair] < experts.second; };
  for (int64_t pair = 0; pair < pairs; ++pair) {
    if (!mine(pair)) std::fill_n(&expert_out[al.pair_row[pair] * n], n, uint16_t{0x7FC0});  // NaN
  }
  const std::vector<uint16_t> gates = gemm_test::random_bf16(static_cast<size_t>(m * gate_stride), rng);
  std::uniform_real_distribution<float> unit(0.05f, 1.0f);
  std::vector<float> weights(static_cast<size_t>(pairs));
  for (float& v : weights) v = unit(rng) / static_cast<float>(top_k);
  const DeviceBuffer d_gu = upload(gate_up), d_w = upload(w), d_eo = upload(expert_out), d_gates = upload(gates);
  const DeviceBuffer d_ids = upload(ids), d_rows = upload(al.pair_row), d_weights = upload(weights);
  const DeviceBuffer shared = poisoned(static_cast<size_t>(m * n) * 2);
  const DeviceBuffer y_two = poisoned(static_cast<size_t>(m * ldy) * 2),
                     y_one = poisoned(static_cast<size_t>(m * ldy) * 2);
  const GemmBf16Args args{
      .x = d_gu.as<uint16_t>(), .w = d_w.as<uint16_t>(), .y = shared.as<uint16_t>(), .m = m, .n = n, .k = k, .ldy = n};
  ASSERT_TRUE(gemv_bf16_silu_mul(ctx, args, ldx).has_value());
  const MoeCombineArgs comb{.expert_out = d_eo.as<uint16_t>(),
                            .pair_row = d_rows.as<int32_t>(),
                            .topk_ids = d_ids.as<int32_t>(),
                            .topk_weights = d_weights.as<float>(),
                            .shared_out = shared.as<uint16_t>(),
                            .shared_gate = gated ? d_gates.as<uint16_t>() : nullptr,
                            .shared_gate_stride = gate_stride,
                            .y = y_two.as<uint16_t>(),
                            .tokens = m,
                            .top_k = top_k,
                            .hidden = n,
                            .expert_begin = experts.first,
                            .expert_end = experts.second};
  // moe_combine writes rows of hidden; y_two is read back at ldy = n for it.
  ASSERT_TRUE(moe_combine(ctx, comb).has_value());
  GemmBf16Args fused = args;
  fused.y = y_one.as<uint16_t>();
  fused.ldy = ldy;
  const auto status = gemv_bf16_silu_mul_moe_combine(ctx, fused, ldx, comb);
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();
  const std::string what = "combine in the GEMV: T=" + std::to_string(m) + " top" + std::to_string(top_k) +
                           " n=" + std::to_string(n) + " k=" + std::to_string(k) + (gated ? "" : " ungated") +
                           (experts.second == INT32_MAX ? "" : " experts [" + std::to_string(experts.first) + ", " +
                                                                   std::to_string(experts.second) + ")");
  const auto got = download<uint16_t>(y_one, static_cast<size_t>(m * ldy));
  const auto want = download<uint16_t>(y_two, static_cast<size_t>(m * n));
  EXPECT_EQ(y_columns(got, m, ldy, 0, n), want) << what << ": differs from gemv_bf16_silu_mul + moe_combine";
  EXPECT_EQ(written_outside(got, m, ldy, {{0, n}}), 0) << what << ": columns past n written";

  int64_t bad = 0;
  for (int64_t t = 0; t < m; ++t) {
    std::vector<double> act(static_cast<size_t>(k));
    for (int64_t c = 0; c < k; ++c) {
      const double g = bf16_to_float(gate_up[t * ldx + c]), u = bf16_to_float(gate_up[t * ldx + k + c]);
      act[c] = g / (1.0 + std::exp(-g)) * u;
    }
    const double sig =
        gated ? 1.0 / (1.0 + std::exp(-static_cast<double>(bf16_to_float(gates[t * gate_stride])))) : 1.0;
    for (int64_t col = 0; col < n; ++col) {
      double shared_v = 0.0, shared_abs = 0.0, routed = 0.0, routed_abs = 0.0;
      for (int64_t c = 0; c < k; ++c) {
        const double p = act[c] * bf16_to_float(w[col * k + c]);
        shared_v += p;
        shared_abs += std::fabs(p);
      }
      for (int64_t j = 0; j < top_k; ++j) {
        if (!mine(t * top_k + j)) continue;
        const double v = weights[t * top_k + j] * bf16_to_float(expert_out[al.pair_row[t * top_k + j] * n + col]);
        routed += v;
        routed_abs += std::fabs(v);
      }
      const double ref = routed + sig * shared_v, g = bf16_to_float(got[t * ldy + col]);
      const double allowed = 0x1p-8 * (routed_abs + sig * shared_abs + std::fabs(ref));
      if ((!std::isfinite(g) || std::fabs(g - ref) > allowed) && ++bad <= 5) {
        ADD_FAILURE() << what << ": y[" << t << "," << col << "] = " << g << ", reference " << ref << " (allowed "
                      << allowed << ")";
      }
    }
  }
}

TEST(MoeCombine, FoldedIntoTheSharedExpertGemv) {
  DeviceContext ctx;
  std::mt19937 rng(2013);
  struct Shape {
    int64_t m, top_k, n, k;
  };
  // Qwen3.5-35B-A3B's shared expert down ([2048, 512], top-8) at 1 and 2 tokens; top-1 and top-32; a k of
  // one chunk beyond 64, and every row count up to the GEMV's eight; each with the shared expert gated and
  // unweighted.
  for (const Shape& s : {Shape{1, 8, 2048, 512}, Shape{2, 8, 2048, 512}, Shape{1, 1, 200, 64}, Shape{3, 32, 136, 72},
                         Shape{8, 4, 96, 136}, Shape{5, 10, 1000, 48}}) {
    for (bool gated : {true, false}) check_combine_gemv(ctx, s.m, s.top_k, s.n, s.k, gated, rng);
  }
  // One expert-parallel rank's experts of the 64: [16, 32) (some tokens have none of theirs there), and an empty
  // share of a top-1 token.
  for (const Shape& s : {Shape{1, 8, 2048, 512}, Shape{8, 4, 96, 136}, Shape{3, 32, 136, 72}}) {
    for (bool gated : {true, false}) check_combine_gemv(ctx, s.m, s.top_k, s.n, s.k, gated, rng, {16, 32});
  }
  check_combine_gemv(ctx, 1, 1, 200, 64, true, rng, {64, 65});
}

// ---------------------------------------------------------------------------------------------------------------
// The whole block against layers/moe.h

struct BlockShape {
  int64_t hidden, inter, n_experts, top_k, shared_inter;  // shared_inter 0: no shared expert
};

// Router rows are one-hot (a power of two at one column), so x . router^T is exact in bf16 on both sides and the
// GPU (bf16 logits, as transformers computes them) picks the CPU's experts (fp32 logits); the last expert repeats
// expert 1's row, an exact tie that both must give to expert 1. Row E is the shared expert gate, also one-hot so
// its sigmoid sees the same input on both sides.
std::vector<uint16_t> make_router(const BlockShape& s, std::mt19937& rng) {
  const int64_t h = s.hidden, rows = s.n_experts + 1;
  std::vector<uint16_t> r(static_cast<size_t>(rows * h), float_to_bf16(0.0f));
  std::uniform_int_distribution<int> col(0, static_cast<int>(h - 1)), exp2(-1, 1);
  for (int64_t e = 0; e < rows; ++e) r[e * h + col(rng)] = float_to_bf16(std::ldexp(1.0f, exp2(rng)));
  if (s.n_experts > 2) std::copy_n(&r[1 * h], h, &r[(s.n_experts - 1) * h]);
  return r;
}

CpuMatrix cpu_view(const ExpertWeights& w, int64_t e, int64_t row0, int64_t rows) {
  CpuMatrix m{.rows = rows, .cols = w.k};
  if (w.format == MoeWeightFormat::kBf16) {
    m.format = CpuWeightFormat::kBf16;
    m.data = &w.bf16[static_cast<size_t>((e * w.n + row0) * w.k)];
  } else if (w.format == MoeWeightFormat::kFp8) {
    m.format = CpuWeightFormat::kFp8Block128;
    m.data = &w.packed[static_cast<size_t>((e * w.n + row0) * w.k)];
    m.row_block_scales = &w.row_scales[static_cast<size_t>((e * w.n + row0) * fp8_scale_cols(w.k))];
  } else {
    m.format = CpuWeightFormat::kNvfp4;
    m.data = &w.packed[static_cast<size_t>((e * w.n + row0) * w.k / 2)];
    m.block_scales = &w.scales[static_cast<size_t>((e * w.n + row0) * w.k / 16)];
    m.global_scale = w.global_scales[e];
  }
  return m;
}

// How moe_forward runs: the token counts, the GEMM variant, and whether gate and up come as two stacks
// (MoeForwardArgs::up; NVFP4: each quantized on its own, so every expert has two global scales).
// Sigmoid routing (DeepSeek-V3 / GLM-5) for check_block: the groups, the scaling, a correction bias of
// U(-bias_scale, bias_scale) (0: none), and the shared expert added unweighted (no gate), as both models add theirs.
struct BlockSigmoid {
  int64_t n_group = 1, topk_group = 1;
  float routed_scaling = 2.5f, bias_scale = 0.1f;
};

struct BlockRun {
  std::vector<int64_t> tokens = {1, 3, 37, 1000};
  MoeGemmVariant variant = MoeGemmVariant::kAuto;
  bool split = false;
  std::optional<BlockSigmoid> sigmoid;  // none: softmax routing, the shared expert behind sigmoid(its gate)
  // Expert parallelism over this many ranks: rank r's moe_forward holds experts [r E / ranks, (r + 1) E / ranks)
  // (MoeForwardArgs::expert_begin) and is checked against Moe::forward holding the same ones (MoeWeights::
  // first_expert); the shared expert is rank 0's. The ranks' outputs summed are the block's.
  int64_t expert_ranks = 1;
};

// With sigmoid routing, x rows whose routing has a near-tie (sigmoid_reference) are drawn again: Moe::forward and the
// GPU compute the choice values in fp32 with different exp functions, so only a clear selection must agree. The
// router's rows are one-hot, so the logits are x's values times powers of two, exact in bf16.
void redraw_sigmoid_near_ties(std::vector<uint16_t>& x, const std::vector<uint16_t>& router, int64_t h,
                              const std::vector<float>& bias, const SigmoidShape& shape, std::mt19937& rng) {
  const int64_t tokens = static_cast<int64_t>(x.size()) / h;
  std::vector<uint16_t> logits(static_cast<size_t>(shape.n_experts));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int attempt = 0;; ++attempt) {
      for (int64_t e = 0; e < shape.n_experts; ++e) {
        double l = 0.0;
        for (int64_t j = 0; j < h; ++j) l += double(bf16_to_float(x[t * h + j])) * bf16_to_float(router[e * h + j]);
        logits[e] = float_to_bf16(static_cast<float>(l));
      }
      if (!sigmoid_reference(logits.data(), bias, shape).near_tie) break;
      ASSERT_LT(attempt, 100) << "no x row without a near-tie in its routing";
      const std::vector<uint16_t> row = gemm_test::random_bf16(static_cast<size_t>(h), rng);
      std::copy(row.begin(), row.end(), x.begin() + t * h);
    }
  }
}

void check_block(const DeviceContext& ctx, const BlockShape& s, MoeWeightFormat format, std::mt19937& rng,
                 const BlockRun& run = {}) {
  const int64_t h = s.hidden, inter = s.inter, e_count = s.n_experts;
  const std::vector<uint16_t> router = make_router(s, rng);
  // gate/up and down scaled by 1/sqrt(fan-in) keep every intermediate O(1). NVFP4 gate_up is quantized per expert
  // as one [2I, H] matrix: gate and up share weight_scale_2, as ModelOpt exports them.
  // (NVFP4 rows spread over 2^+-1 only: the block's intermediates stay O(1), as a trained model's do.)
  const ExpertWeights gate_up =
      make_expert_weights(format, e_count, (run.split ? 1 : 2) * inter, h, 1.0f / std::sqrt(float(h)), rng, 1.0f);
  const ExpertWeights up = run.split
                               ? make_expert_weights(format, e_count, inter, h, 1.0f / std::sqrt(float(h)), rng, 1.0f)
                               : ExpertWeights{.format = format, .n_experts = 0, .n = 0, .k = 0};
  const ExpertWeights down = make_expert_weights(format, e_count, h, inter, 1.0f / std::sqrt(float(inter)), rng, 1.0f);
  const int64_t si = std::max<int64_t>(s.shared_inter, 8);
  const ExpertWeights shared_gu = make_expert_weights(MoeWeightFormat::kBf16, 1, 2 * si, h, 1.0f / std::sqrt(float(h)), rng);
  const ExpertWeights shared_down = make_expert_weights(MoeWeightFormat::kBf16, 1, h, si, 1.0f / std::sqrt(float(si)), rng);

  // Sigmoid routing: the shared expert has no gate (its router column is computed but must not be read), and a
  // correction bias that repeats expert 1's for the last expert keeps make_router's exact tie.
  const BlockSigmoid sig = run.sigmoid.value_or(BlockSigmoid{});
  const bool gated = !run.sigmoid;
  std::vector<float> bias = run.sigmoid ? random_bias(e_count, sig.bias_scale, rng) : std::vector<float>{};
  if (e_count > 2 && !bias.empty()) bias[e_count - 1] = bias[1];
  const SigmoidShape sig_shape{"block", e_count, s.top_k, sig.n_group, sig.topk_group, sig.routed_scaling, true};
  // The CPU block of experts [first, first + count), with the shared expert or without.
  const auto cpu_block = [&](int64_t first, int64_t count, bool with_shared) {
  MoeWeights cpu_w{.router = Linear("router", {.format = CpuWeightFormat::kBf16, .rows = e_count, .cols = h,
                                               .data = router.data()})};
  cpu_w.first_expert = first;
  for (int64_t e = first; e < first + count; ++e) {
    cpu_w.experts.push_back({Linear("gate", cpu_view(gate_up, e, 0, inter)),
                             Linear("up", run.split ? cpu_view(up, e, 0, inter) : cpu_view(gate_up, e, inter, inter)),
                             Linear("down", cpu_view(down, e, 0, h))});
  }
  if (with_shared && s.shared_inter > 0) {
    cpu_w.shared_expert = std::make_unique<Mlp>(MlpWeights{Linear("sg", cpu_view(shared_gu, 0, 0, si)),
                                                           Linear("su", cpu_view(shared_gu, 0, si, si)),
                                                           Linear("sd", cpu_view(shared_down, 0, 0, h))});
    if (gated) {
      cpu_w.shared_expert_gate = Linear("gate", {.format = CpuWeightFormat::kBf16, .rows = 1, .cols = h,
                                                 .data = &router[static_cast<size_t>(e_count * h)]});
    }
  }
  cpu_w.correction_bias = bias;
  return Moe(MoeShape{.top_k = s.top_k,
                      .renormalize = true,
                      .sigmoid = !gated,
                      .n_group = sig.n_group,
                      .topk_group = sig.topk_group,
                      .routed_scaling = gated ? 1.0f : sig.routed_scaling,
                      .shared_gate = gated},
             std::move(cpu_w));
  };
  const int64_t ranks = run.expert_ranks, local = e_count / ranks;
  ASSERT_EQ(e_count % ranks, 0);
  std::vector<Moe> cpu;
  for (int64_t r = 0; r < ranks; ++r) cpu.push_back(cpu_block(r * local, local, r == 0));
  const DeviceBuffer d_router = upload(router), d_bias = upload(bias);

  for (int64_t tokens : run.tokens) {
    std::vector<uint16_t> x = gemm_test::random_bf16(static_cast<size_t>(tokens * h), rng);
    if (run.sigmoid) {
      redraw_sigmoid_near_ties(x, router, h, bias, sig_shape, rng);
      if (::testing::Test::HasFatalFailure()) return;
    }
    const std::vector<float> xf = gemm_test::bf16_to_floats(x);

    // GPU: router (+ shared gate column) and shared expert with the dense kernels, then the routed part.
    const DeviceBuffer d_x = upload(x);
    const DeviceBuffer logits = poisoned(static_cast<size_t>(tokens * (e_count + 1)) * 2);
    ASSERT_TRUE(gemm_bf16(ctx, {.x = d_x.as<uint16_t>(), .w = d_router.as<uint16_t>(), .y = logits.as<uint16_t>(),
                                .m = tokens, .n = e_count + 1, .k = h}).has_value());
    const DeviceBuffer s_gu = poisoned(static_cast<size_t>(tokens * 2 * si) * 2);
    const DeviceBuffer s_act = poisoned(static_cast<size_t>(tokens * si) * 2);
    const DeviceBuffer s_out = poisoned(static_cast<size_t>(tokens * h) * 2);
    if (s.shared_inter > 0) {
      ASSERT_TRUE(gemm_bf16(ctx, {.x = d_x.as<uint16_t>(), .w = shared_gu.d_bf16.as<uint16_t>(),
                                  .y = s_gu.as<uint16_t>(), .m = tokens, .n = 2 * si, .k = h}).has_value());
      ASSERT_TRUE(silu_mul(ctx, {.gate_up = s_gu.as<uint16_t>(), .y = s_act.as<uint16_t>(), .rows = tokens,
                                 .inter = si}).has_value());
      ASSERT_TRUE(gemm_bf16(ctx, {.x = s_act.as<uint16_t>(), .w = shared_down.d_bf16.as<uint16_t>(),
                                  .y = s_out.as<uint16_t>(), .m = tokens, .n = h, .k = si}).has_value());
    }
    for (int64_t r = 0; r < ranks; ++r) {
      const size_t ws_bytes = moe_forward_workspace_bytes(tokens, s.top_k, e_count, inter, h);
      const DeviceBuffer ws = poisoned(ws_bytes), d_y = poisoned(static_cast<size_t>(tokens * h) * 2);
      const bool shared = s.shared_inter > 0 && r == 0;
      std::vector<float> want(static_cast<size_t>(tokens * h));
      cpu[r].forward(xf.data(), want.data(), tokens, "", nullptr);
      const auto status = moe_forward(ctx, {.x = d_x.as<uint16_t>(),
                                            .router_logits = logits.as<uint16_t>(),
                                            .logits_stride = e_count + 1,
                                            .tokens = tokens,
                                            .hidden = h,
                                            .inter = inter,
                                            .n_experts = e_count,
                                            .top_k = s.top_k,
                                            .expert_begin = r * local,
                                            .sigmoid = !gated,
                                            .n_group = sig.n_group,
                                            .topk_group = sig.topk_group,
                                            .routed_scaling = gated ? 1.0f : sig.routed_scaling,
                                            .correction_bias = bias.empty() ? nullptr : d_bias.as<float>(),
                                            .gate_up = gate_up.view(r * local, local),
                                            .up = run.split ? up.view(r * local, local) : MoeExpertWeights{},
                                            .down = down.view(r * local, local),
                                            .shared_out = shared ? s_out.as<uint16_t>() : nullptr,
                                            .shared_gate = shared && gated ? logits.as<uint16_t>() + e_count : nullptr,
                                            .shared_gate_stride = e_count + 1,
                                            .y = d_y.as<uint16_t>(),
                                            .workspace = ws.data(),
                                            .workspace_bytes = ws_bytes,
                                            .variant = run.variant});
      ASSERT_TRUE(status.has_value()) << status.error().message;
      ctx.synchronize();
      const auto got = download<uint16_t>(d_y, static_cast<size_t>(tokens * h));

      // Tolerance per token row: 2^-6 of the row's largest |y|. The GPU rounds gate/up, the activation, each expert's
      // output and the shared expert's to bf16 (2^-9 relative each, random in sign), so a row's error is about
      // 2^-8.7 of its rms and its largest error about 2^-8.5 of its largest value; a dropped or misweighted expert
      // (>= 1/top_k of the row) or a missing shared expert is several times the bound.
      int bad = 0;
      double worst = 0;
      for (int64_t t = 0; t < tokens; ++t) {
        double row_max = 0;
        for (int64_t d = 0; d < h; ++d) row_max = std::max(row_max, std::fabs(double(want[t * h + d])));
        const double allowed = 0x1p-6 * row_max;
        for (int64_t d = 0; d < h; ++d) {
          const double g = bf16_to_float(got[t * h + d]), err = std::fabs(g - want[t * h + d]);
          if (std::isfinite(g)) worst = std::max(worst, err / allowed);
          if ((!std::isfinite(g) || err > allowed) && ++bad <= 5) {
            ADD_FAILURE() << "y[" << t << "," << d << "] = " << g << ", Moe::forward " << want[t * h + d]
                          << " (allowed " << allowed << ")";
          }
        }
      }
      const std::string routing = gated ? "" : " sigmoid " + std::to_string(sig.topk_group) + "/" +
                                                   std::to_string(sig.n_group) + (bias.empty() ? "" : " +bias");
      const std::string rank = ranks == 1 ? "" : " rank " + std::to_string(r) + "/" + std::to_string(ranks);
      std::printf("block %s %s%s%s%s H=%ld I=%ld E=%ld top%ld shared=%ld T=%ld: max error / allowed = %.3f\n",
                  format_name(format), variant_name(run.variant), run.split ? " split" : "", routing.c_str(),
                  rank.c_str(), long(h), long(inter), long(e_count), long(s.top_k), long(s.shared_inter), long(tokens),
                  worst);
      EXPECT_EQ(bad, 0) << tokens << " tokens" << rank;
    }
  }
}

TEST(MoeBlock, MatchesCpuMoeForward) {
  DeviceContext ctx;
  std::mt19937 rng(2006);
  // The test fixture, a 35B-like block (256 experts, top-8) and a 397B-like one (512 experts, top-10), smaller
  // hidden sizes so the CPU reference stays fast.
  const BlockShape shapes[] = {{64, 32, 8, 2, 32}, {512, 128, 256, 8, 128}, {256, 64, 512, 10, 0}};
  for (MoeWeightFormat f : {MoeWeightFormat::kBf16, MoeWeightFormat::kNvfp4}) {
    for (const BlockShape& s : shapes) check_block(ctx, s, f, rng);
  }
}

// The decode paths of moe_forward (kAuto at these token counts and kDecode) against Moe::forward: gate and up
// together or as two stacks (then one launch), with and without the shared expert; and the same blocks through
// kPrefill, whose launches stay separate.
TEST(MoeBlock, DecodePathsMatchCpuMoeForward) {
  DeviceContext ctx;
  std::mt19937 rng(2009);
  const BlockShape shapes[] = {{64, 32, 8, 2, 32}, {512, 128, 256, 8, 128}, {256, 64, 64, 4, 0}};
  for (MoeWeightFormat f : {MoeWeightFormat::kBf16, MoeWeightFormat::kNvfp4}) {
    for (const BlockShape& s : shapes) {
      for (MoeGemmVariant v : {MoeGemmVariant::kAuto, MoeGemmVariant::kDecode, MoeGemmVariant::kPrefill}) {
        for (bool split : {false, true}) {
          if (v == MoeGemmVariant::kDecode && !split) continue;  // the same launches as kAuto here
          check_block(ctx, s, f, rng, {.tokens = {1, 2, 7, 64}, .variant = v, .split = split});
        }
      }
    }
  }
}

// Sigmoid routing (DeepSeek-V3 / GLM-5) through moe_forward against Moe::forward with the same routing, correction
// bias and scaling, the shared expert added unweighted: the tiny GLM-5 fixture, a GLM-5-like block (256 experts,
// one group, top-8) with and without a bias, DeepSeek-V3's 4 of 8 groups with and without a shared expert; at the
// default token counts, then the decode paths (one token: moe_route_align, not the gate/up launch, routes it) and
// kPrefill at decode token counts.
TEST(MoeBlock, SigmoidRoutingMatchesCpuMoeForward) {
  DeviceContext ctx;
  std::mt19937 rng(2016);
  struct Case {
    BlockShape shape;
    BlockSigmoid sigmoid;
  };
  const Case cases[] = {{{64, 32, 8, 2, 32}, {1, 1, 2.5f, 0.1f}},
                        {{512, 128, 256, 8, 128}, {1, 1, 2.5f, 0.1f}},
                        {{512, 128, 256, 8, 128}, {1, 1, 2.5f, 0.0f}},
                        {{256, 64, 256, 8, 64}, {8, 4, 2.5f, 0.1f}},
                        {{256, 64, 256, 8, 0}, {8, 4, 2.5f, 0.1f}}};
  for (MoeWeightFormat f : {MoeWeightFormat::kBf16, MoeWeightFormat::kNvfp4}) {
    for (const Case& c : cases) check_block(ctx, c.shape, f, rng, {.sigmoid = c.sigmoid});
  }
  for (const Case& c : {cases[0], cases[1], cases[3]}) {
    for (MoeGemmVariant v : {MoeGemmVariant::kAuto, MoeGemmVariant::kDecode, MoeGemmVariant::kPrefill}) {
      check_block(ctx, c.shape, MoeWeightFormat::kNvfp4, rng,
                  {.tokens = {1, 2, 7, 64}, .variant = v, .split = v == MoeGemmVariant::kDecode, .sigmoid = c.sigmoid});
    }
  }
}

// Block-wise FP8 experts (W8A16; the CPU layer takes the same codes and per-row block scales) through moe_forward:
// the shapes of MatchesCpuMoeForward at its token counts, the decode paths and kPrefill at decode token counts (gate
// and up together and as two stacks), and the sigmoid routing of GLM-5-FP8 and DeepSeek-V3, the FP8 checkpoints'
// models, with and without a shared expert.
// Expert parallelism: each rank's moe_forward over its share of the experts (MoeForwardArgs::expert_begin; the
// router's choice among all of them) against Moe::forward over the same share; a rank's output has only its experts'
// terms (and rank 0's the shared expert), so a row none of whose experts it holds must be exactly 0. Shares of 4, 2
// and 1 expert of the fixture's 8 (one fewer than top-2), 32 of a 35B-like 256 (top-8), 128 of a 397B-like 512,
// one group of GLM-5-like grouped sigmoid routing each; at prefill and decode token counts.
TEST(MoeBlock, ExpertParallelRanksMatchCpuMoeForward) {
  DeviceContext ctx;
  std::mt19937 rng(2024);
  for (MoeWeightFormat f : {MoeWeightFormat::kBf16, MoeWeightFormat::kNvfp4}) {
    for (int64_t ranks : {2, 4, 8}) check_block(ctx, {64, 32, 8, 2, 32}, f, rng, {.expert_ranks = ranks});
    check_block(ctx, {512, 128, 256, 8, 128}, f, rng, {.expert_ranks = 8});
    check_block(ctx, {256, 64, 512, 10, 0}, f, rng, {.expert_ranks = 4});
    check_block(ctx, {256, 64, 256, 8, 64}, f, rng, {.sigmoid = BlockSigmoid{8, 4, 2.5f, 0.1f}, .expert_ranks = 8});
    for (MoeGemmVariant v : {MoeGemmVariant::kAuto, MoeGemmVariant::kDecode, MoeGemmVariant::kPrefill}) {
      check_block(ctx, {512, 128, 256, 8, 128}, f, rng,
                  {.tokens = {1, 2, 7, 64}, .variant = v, .split = v == MoeGemmVariant::kDecode, .expert_ranks = 8});
    }
  }
  check_block(ctx, {512, 128, 256, 8, 128}, MoeWeightFormat::kFp8, rng, {.expert_ranks = 4});
}

TEST(MoeBlock, Fp8MatchesCpuMoeForward) {
  DeviceContext ctx;
  std::mt19937 rng(2021);
  constexpr MoeWeightFormat kFp8 = MoeWeightFormat::kFp8;
  for (const BlockShape& s : {BlockShape{64, 32, 8, 2, 32}, BlockShape{512, 128, 256, 8, 128},
                              BlockShape{256, 64, 512, 10, 0}}) {
    check_block(ctx, s, kFp8, rng);
  }
  for (const BlockShape& s : {BlockShape{64, 32, 8, 2, 32}, BlockShape{256, 64, 64, 4, 0}}) {
    for (MoeGemmVariant v : {MoeGemmVariant::kAuto, MoeGemmVariant::kDecode, MoeGemmVariant::kPrefill}) {
      for (bool split : {false, true}) {
        if (v == MoeGemmVariant::kDecode && !split) continue;  // the same launches as kAuto here
        check_block(ctx, s, kFp8, rng, {.tokens = {1, 2, 7, 64}, .variant = v, .split = split});
      }
    }
  }
  check_block(ctx, {512, 128, 256, 8, 128}, kFp8, rng, {.sigmoid = BlockSigmoid{1, 1, 2.5f, 0.1f}});
  check_block(ctx, {256, 64, 256, 8, 0}, kFp8, rng, {.sigmoid = BlockSigmoid{8, 4, 2.5f, 0.1f}});
  check_block(ctx, {256, 64, 256, 8, 64}, kFp8, rng,
              {.tokens = {1, 2, 7, 64}, .variant = MoeGemmVariant::kDecode, .split = true,
               .sigmoid = BlockSigmoid{8, 4, 2.5f, 0.1f}});
}

// ---------------------------------------------------------------------------------------------------------------
// Bad arguments

template <class F>
void expect_error(F&& call, const std::string& text) {
  const Expected<void> r = call();
  ASSERT_FALSE(r.has_value()) << "expected an error containing '" << text << "'";
  EXPECT_NE(r.error().message.find(text), std::string::npos) << r.error().message;
}

TEST(MoeKernels, BadArgumentsAreErrors) {
  DeviceContext ctx;
  DeviceBuffer buf(1 << 16);
  const auto* u16 = buf.as<uint16_t>();
  auto* i32 = buf.as<int32_t>();
  const MoeRouteArgs route{.logits = u16, .logits_stride = 8, .topk_ids = i32, .topk_weights = buf.as<float>(),
                           .tokens = 1, .n_experts = 8, .top_k = 2};
  expect_error([&] { auto a = route; a.top_k = 9; return moe_route(ctx, a); }, "top_k=9 is more than n_experts=8");
  expect_error([&] { auto a = route; a.n_experts = 513; a.logits_stride = 513; return moe_route(ctx, a); },
               "n_experts=513 must be in [1, 512]");
  expect_error([&] { auto a = route; a.logits_stride = 7; return moe_route(ctx, a); }, "logits_stride=7");
  expect_error([&] { auto a = route; a.topk_ids = nullptr; return moe_route(ctx, a); }, "topk_ids is null");
  // Sigmoid routing's groups, scaling and bias; softmax routing takes their defaults.
  const MoeRouteArgs sigmoid = [&] {
    auto a = route;
    a.sigmoid = true;
    a.n_group = 4;
    a.topk_group = 2;
    a.routed_scaling = 2.5f;
    a.correction_bias = buf.as<float>();
    return a;
  }();
  ASSERT_TRUE(moe_route(ctx, [&] { auto a = sigmoid; a.tokens = 0; return a; }()).has_value());
  expect_error([&] { auto a = sigmoid; a.n_group = 3; return moe_route(ctx, a); },
               "n_experts=8 is not a multiple of n_group=3");
  expect_error([&] { auto a = sigmoid; a.n_group = 0; return moe_route(ctx, a); }, "n_group=0 must be in [1, 32]");
  expect_error(
      [&] {
        auto a = sigmoid;
        a.n_experts = a.logits_stride = 128;
        a.n_group = 64;
        return moe_route(ctx, a);
      },
      "n_group=64 must be in [1, 32]");
  expect_error([&] { auto a = sigmoid; a.topk_group = 5; return moe_route(ctx, a); },
               "topk_group=5 must be in [1, n_group=4]");
  expect_error([&] { auto a = sigmoid; a.top_k = 5; return moe_route(ctx, a); },
               "top_k=5 is more than the 4 experts of the topk_group=2 kept groups of 2");
  expect_error([&] { auto a = sigmoid; a.routed_scaling = NAN; return moe_route(ctx, a); },
               "routed_scaling=nan must be finite");
  expect_error(
      [&] {
        auto a = sigmoid;
        a.correction_bias = reinterpret_cast<const float*>(buf.as<uint16_t>() + 1);
        return moe_route(ctx, a);
      },
      "correction_bias is not 4-byte aligned");
  expect_error([&] { auto a = route; a.n_group = 2; return moe_route(ctx, a); }, "are sigmoid routing's");
  expect_error([&] { auto a = route; a.correction_bias = buf.as<float>(); return moe_route(ctx, a); },
               "are sigmoid routing's");
  expect_error([&] { auto a = route; a.routed_scaling = 2.5f; return moe_route(ctx, a); }, "are sigmoid routing's");

  const MoeExpertWeights w{.format = MoeWeightFormat::kBf16, .n_experts = 4, .n = 16, .k = 64, .bf16 = u16,
                           .bf16_expert_stride = 16 * 64};
  const MoeGemmArgs gemm{.x = u16, .ldx = 64, .sorted_pairs = i32, .top_k = 2, .gather = true, .expert_offsets = i32,
                         .w = w, .y = buf.as<uint16_t>(), .ldy = 16, .rows = 4};
  expect_error([&] { auto a = gemm; a.w.k = 40; return moe_gemm(ctx, a); }, "k=40 must be a positive multiple of 16");
  expect_error([&] { auto a = gemm; a.decode_token_tiles = 3; return moe_gemm(ctx, a); }, "decode_token_tiles=3");
  expect_error([&] { auto a = gemm; a.decode_passes = i32 + 1; return moe_gemm(ctx, a); },
               "decode_passes is not 16-byte aligned");
  expect_error([&] { auto a = gemm; a.decode_passes = i32; a.decode_token_tiles = 2; return moe_gemm(ctx, a); },
               "not with decode_token_tiles=2");
  expect_error([&] { auto a = gemm; a.x = u16 + 1; return moe_gemm(ctx, a); }, "x is not 16-byte aligned");
  expect_error([&] { auto a = gemm; a.ldx = 56; return moe_gemm(ctx, a); }, "ldx=56 must be a multiple of 8");
  expect_error([&] { auto a = gemm; a.sorted_pairs = nullptr; return moe_gemm(ctx, a); }, "sorted_pairs (needed to gather)");
  expect_error([&] { auto a = gemm; a.w.bf16_expert_stride = 100; return moe_gemm(ctx, a); }, "bf16_expert_stride=100");
  expect_error([&] { auto a = gemm; a.w.format = MoeWeightFormat::kNvfp4; return moe_gemm(ctx, a); },
               "packed weight is null");
  // Block-wise FP8: 16-byte aligned codes at a stride of whole 16-byte rows, 4-byte aligned per-row scales.
  const MoeExpertWeights w8{.format = MoeWeightFormat::kFp8, .n_experts = 4, .n = 16, .k = 64,
                            .packed = buf.as<uint8_t>(), .packed_expert_stride = 16 * 64,
                            .row_scales = buf.as<float>(), .row_scales_expert_stride = 16};
  const MoeGemmArgs fp8 = [&] {
    auto a = gemm;
    a.w = w8;
    return a;
  }();
  ASSERT_TRUE(moe_gemm(ctx, [&] { auto a = fp8; a.rows = 0; return a; }()).has_value());
  expect_error([&] { auto a = fp8; a.w.row_scales = nullptr; return moe_gemm(ctx, a); },
               "moe_gemm: fp8 row_scales is null");
  expect_error([&] { auto a = fp8; a.w.k = 72; return moe_gemm(ctx, a); }, "k=72 must be a positive multiple of 16");
  expect_error([&] { auto a = fp8; a.w.packed = nullptr; return moe_gemm(ctx, a); }, "fp8 codes (packed) is null");
  expect_error([&] { auto a = fp8; a.w.packed = buf.as<uint8_t>() + 8; return moe_gemm(ctx, a); },
               "fp8 codes (packed) is not 16-byte aligned");
  expect_error(
      [&] {
        auto a = fp8;
        a.w.row_scales = reinterpret_cast<const float*>(buf.as<uint8_t>() + 2);
        return moe_gemm(ctx, a);
      },
      "fp8 row_scales is not 4-byte aligned");
  expect_error([&] { auto a = fp8; a.w.packed_expert_stride = 16 * 64 + 8; return moe_gemm(ctx, a); },
               "packed_expert_stride=1032 of the fp8 codes must be a multiple of 16 and at least n*k=1024");
  expect_error([&] { auto a = fp8; a.w.row_scales_expert_stride = 15; return moe_gemm(ctx, a); },
               "row_scales_expert_stride=15 must be at least n*ceil(k/128)=16");
  expect_error(
      [&] {
        auto a = fp8;
        a.w2 = w;
        a.y2_offset = 16;
        a.ldy = 32;
        return moe_gemm(ctx, a);
      },
      "w2 (4 experts, k=64, bf16) must have w's 4 experts, k=64 and format (fp8)");
  expect_error(
      [&] {
        auto a = fp8;
        a.w2 = w8;
        a.w2.row_scales = nullptr;
        a.y2_offset = 16;
        a.ldy = 32;
        return moe_gemm(ctx, a);
      },
      "moe_gemm: w2: fp8 row_scales is null");
  const MoeGemmArgs pair = [&] {
    auto a = gemm;
    a.w2 = w;
    a.y2_offset = 16;
    a.ldy = 32;
    return a;
  }();
  ASSERT_TRUE(moe_gemm(ctx,
                       [&] {
                         auto a = pair;
                         a.rows = 0;
                         return a;
                       }())
                  .has_value());
  expect_error(
      [&] {
        auto a = pair;
        a.w2.k = 32;
        return moe_gemm(ctx, a);
      },
      "w2 (4 experts, k=32, bf16) must have w's");
  expect_error(
      [&] {
        auto a = pair;
        a.w2.format = MoeWeightFormat::kNvfp4;
        return moe_gemm(ctx, a);
      },
      "w2: packed weight is null");
  expect_error(
      [&] {
        auto a = pair;
        a.y2_offset = 8;
        return moe_gemm(ctx, a);
      },
      "y2_offset=8 must be in [n=16, ldy - w2.n=16]");
  expect_error(
      [&] {
        auto a = pair;
        a.ldy = 24;
        return moe_gemm(ctx, a);
      },
      "y2_offset=16 must be in [n=16, ldy - w2.n=8]");
  const MoeGemmArgs silu = [&] {
    auto a = gemm;
    a.gather = false;
    a.ldx = 128;
    a.x_silu_mul = true;
    return a;
  }();
  ASSERT_TRUE(moe_gemm(
                  ctx,
                  [&] {
                    auto a = silu;
                    a.rows = 0;
                    return a;
                  }(),
                  MoeGemmVariant::kDecode)
                  .has_value());
  expect_error([&] { return moe_gemm(ctx, silu, MoeGemmVariant::kPrefill); }, "x_silu_mul needs the decode variant");
  expect_error(
      [&] {
        auto a = silu;
        a.ldx = 120;
        return moe_gemm(ctx, a);
      },
      "ldx=120 must be at least 2k=128 with x_silu_mul");

  const MoeCombineArgs comb{.expert_out = u16, .pair_row = i32, .topk_ids = i32, .topk_weights = buf.as<float>(),
                            .y = buf.as<uint16_t>(), .tokens = 1, .top_k = 2, .hidden = 64};
  expect_error([&] { auto a = comb; a.hidden = 12; return moe_combine(ctx, a); }, "hidden=12 must be a positive multiple of 8");
  expect_error([&] { auto a = comb; a.expert_begin = a.expert_end = 3; return moe_combine(ctx, a); },
               "experts [3, 3) are empty");
  expect_error([&] { auto a = comb; a.shared_gate = u16; return moe_combine(ctx, a); },
               "shared_out (needed with shared_gate)");
  // A shared expert without a gate is added unweighted (no launch at no tokens).
  ASSERT_TRUE(moe_combine(ctx, [&] { auto a = comb; a.shared_out = u16; a.tokens = 0; return a; }()).has_value());
  expect_error([&] {
    return moe_align(ctx, {.topk_ids = i32, .tokens = 1, .top_k = 2, .n_experts = 0, .expert_offsets = i32,
                           .sorted_pairs = i32, .pair_row = i32});
  }, "n_experts=0");
  expect_error([&] {
    return moe_align(ctx, {.topk_ids = i32, .tokens = 1, .top_k = 2, .n_experts = 8, .expert_offsets = i32,
                           .sorted_pairs = i32, .pair_row = i32, .decode_passes = i32 + 2});
  }, "decode_passes is not 16-byte aligned");
  const MoeAlignArgs align{.topk_ids = i32,
                           .tokens = 1,
                           .top_k = 2,
                           .n_experts = 8,
                           .expert_offsets = i32 + 64,
                           .sorted_pairs = i32 + 128,
                           .pair_row = i32 + 192};
  expect_error(
      [&] {
        auto a = align;
        a.topk_ids = i32 + 8;
        return moe_route_align(ctx, route, a);
      },
      "align must sort the route's topk_ids");
  expect_error(
      [&] {
        auto a = align;
        a.tokens = 2;
        return moe_route_align(ctx, route, a);
      },
      "align must sort the route's topk_ids");
  // An expert-parallel share past the router's experts, or starting before them.
  expect_error(
      [&] {
        auto a = align;
        a.n_experts = 4;
        a.expert_begin = 6;
        return moe_route_align(ctx, route, a);
      },
      "experts [6, 10) are not within the router's 8");
  expect_error([&] { auto a = align; a.expert_begin = -1; return moe_align(ctx, a); }, "experts [-1, 7)");
  expect_error(
      [&] {
        auto r = route;
        auto a = align;
        r.tokens = a.tokens = 129;
        r.top_k = a.top_k = 16;
        r.n_experts = a.n_experts = r.logits_stride = 16;
        return moe_route_align(ctx, r, a);
      },
      "tokens * top_k = 2064 is more than the 2048 pairs");

  // Routing in the launch: one token's pairs, the decode kernel, a consistent route and align over w's experts.
  const MoeGemmArgs routed = [&] {
    auto a = gemm;
    a.rows = 2;
    a.route = route;
    a.route.n_experts = a.align.n_experts = 4;
    a.align = align;
    a.align.n_experts = 4;
    return a;
  }();
  expect_error([&] { return moe_gemm(ctx, routed, MoeGemmVariant::kPrefill); },
               "routing in the launch needs the decode variant, one token");
  expect_error(
      [&] {
        auto a = routed;
        a.rows = 4;
        a.route.tokens = a.align.tokens = 2;
        return moe_gemm(ctx, a);
      },
      "route.tokens = 1, rows = top_k = route.top_k; got 2, 4, 2, 2");
  expect_error(
      [&] {
        auto a = routed;
        a.route.n_experts = a.align.n_experts = 8;
        return moe_gemm(ctx, a);
      },
      "route has 8 experts, the weights 4");
  expect_error(
      [&] {
        auto a = routed;
        a.align.topk_ids = i32 + 8;
        return moe_gemm(ctx, a);
      },
      "moe_gemm: align must sort the route's topk_ids");
  expect_error(
      [&] {
        auto a = routed;
        a.route.sigmoid = true;
        return moe_gemm(ctx, a);
      },
      "routing in the launch is softmax only");

  // moe_forward checks the routing mode before anything runs, at no tokens too.
  const MoeForwardArgs forward{.x = u16, .router_logits = u16, .logits_stride = 8, .tokens = 0, .hidden = 64,
                               .inter = 16, .n_experts = 4, .top_k = 2, .sigmoid = true, .n_group = 2,
                               .topk_group = 1, .gate_up = {.n_experts = 4, .n = 32, .k = 64},
                               .down = {.n_experts = 4, .n = 64, .k = 16}, .y = buf.as<uint16_t>(),
                               .workspace = buf.data(), .workspace_bytes = 1 << 16};
  ASSERT_TRUE(moe_forward(ctx, forward).has_value());
  expect_error([&] { auto a = forward; a.top_k = 3; return moe_forward(ctx, a); },
               "moe_forward: top_k=3 is more than the 2 experts of the topk_group=1 kept groups of 2");
  // Expert parallelism: the weights' experts from expert_begin must lie within the router's.
  expect_error([&] { auto a = forward; a.expert_begin = 1; return moe_forward(ctx, a); },
               "moe_forward: experts [1, 5) are not within the router's 4");
  expect_error([&] { auto a = forward; a.down.n_experts = 2; return moe_forward(ctx, a); },
               "down weights are [2][64][16], want [4][64][16]");
}

TEST(MoeCombine, FoldedCombineBadArgumentsAreErrors) {
  DeviceContext ctx;
  DeviceBuffer buf(1 << 16);
  const GemmBf16Args args{
      .x = buf.as<uint16_t>(), .w = buf.as<uint16_t>(), .y = buf.as<uint16_t>(), .m = 1, .n = 64, .k = 64, .ldy = 64};
  const MoeCombineArgs c{.expert_out = buf.as<uint16_t>(),
                         .pair_row = buf.as<int32_t>(),
                         .topk_ids = buf.as<int32_t>(),
                         .topk_weights = buf.as<float>(),
                         .shared_gate = buf.as<uint16_t>(),
                         .tokens = 1,
                         .top_k = 8,
                         .hidden = 64};
  auto call = [&](const MoeCombineArgs& a, int64_t ldx = 128) {
    return gemv_bf16_silu_mul_moe_combine(ctx, args, ldx, a);
  };
  expect_error(
      [&] {
        auto a = c;
        a.top_k = 33;
        return call(a);
      },
      "top_k=33 must be in [1, 32]");
  expect_error(
      [&] {
        auto a = c;
        a.pair_row = nullptr;
        return call(a);
      },
      "pair_row is null");
  expect_error(
      [&] {
        auto a = c;
        a.shared_gate_stride = 0;
        return call(a);
      },
      "shared_gate_stride=0 must be positive");
  expect_error(
      [&] {
        auto a = c;
        a.hidden = 32;
        return call(a);
      },
      "the combine's 1 tokens x hidden 32 are not the product's m=1 x n=64");
  expect_error([&] { return call(c, 120); }, "ldx=120 is less than 2k=128");
}

}  // namespace
}  // namespace tern
