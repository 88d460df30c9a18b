// The DSA lightning indexer kernels against a double-precision host reference computed here from the same bf16 inputs
// (label gpu): indexer_prepare (LayerNorm with weight and bias, RoPE as GPT-J pairs and as NeoX halves on the first
// rope_dim values, keys into shuffled cache slots, padding slots untouched) and indexer_select (the scores in the
// workspace and the top-k) on ragged batches whose blocks are shuffled through the pool: GLM-5's shapes (32 heads of
// 128, rope 64, topk 2048) with sequences below, at and above topk and a prefill chunk continuing a cached prefix, the
// tiny fixture's (16 heads of 32, rope 16, topk 16), head counts that are not multiples of 16, head_dim 16..256, a
// 40k-token context, and exact ties (identical keys: the earlier ones must win).
// Inputs are fresh random non-zero bf16 values; outputs start poisoned (a bf16 NaN, -7 for the selection, NaN scores)
// and unused cache slots hold NaN, so a read of a wrong slot or an unwritten output shows.
//
// Tolerances. prepare: within 2^-8 + 2^-16 of the row's largest reference value (one bf16 rounding, fp32 math).
// Scores: within 4e-5 of B = sum_h |w_h| n_heads^-0.5 head_dim^-0.5 |q_h| |k_s|, which bounds every product the fp32
// dot products add (a wrong key, head or weight moves a score by about B / sqrt(head_dim)). Selection: every chosen key
// is a true top-k key and every other key is not, except where its double score lies within 1e-4 of the row's score
// range of the k-th score; the list ascending without duplicates; rows with n <= topk exactly 0..n-1 then -1. The
// tie cases compare the selection exactly (identical keys get bit-identical fp32 scores).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/formats.h"
#include "kernels/cuda/device_test_util.h"
#include "kernels/cuda/mla/indexer.h"

namespace tern {
namespace {

constexpr uint16_t kPoison = 0x7FBA;   // a NaN payload no arithmetic produces
constexpr uint16_t kNanBf16 = 0x7FC0;  // unused cache slots
constexpr int32_t kPoisonIndex = -7;
constexpr double kPrepareRel = 1.0 / 256 + 1.0 / 65536;
constexpr double kScoreRel = 4e-5;
constexpr double kSelectRel = 1e-4;
constexpr float kEps = 1e-6f;
constexpr double kTheta = 1e6;  // GLM-5's rope_theta

using cuda_test::download;
using cuda_test::upload;

std::vector<uint16_t> random_bf16(std::mt19937& rng, size_t n, float scale, float offset = 0.0f) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> out(n);
  for (auto& v : out) {
    const float x = scale * u(rng);
    v = float_to_bf16(offset + x + (x >= 0.0f ? 1e-3f : -1e-3f));
  }
  return out;
}

// As layers/rope.cc: inv_freq[i] = 1 / theta^(2i / rope_dim) in fp32.
std::vector<float> make_inv_freq(int64_t rope_dim) {
  std::vector<float> out;
  for (int64_t i = 0; i < rope_dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rope_dim);
    out.push_back(1.0f / std::pow(static_cast<float>(kTheta), exponent));
  }
  return out;
}

// The RoPE of a case: the table, the rotated dims (0: none), the pair layout and YaRN's attention factor.
struct CaseRope {
  std::vector<float> inv_freq;
  int64_t dim = 0;
  bool interleaved = true;
  float factor = 1.0f;
};

CaseRope case_rope(int64_t rope_dim, bool interleaved, float factor = 1.0f) {
  return {make_inv_freq(rope_dim), rope_dim, interleaved, factor};
}

// RoPE in double on the first rope.dim values, the angle float(position) * inv_freq[i] in fp32 as specified, cos and
// sin times the factor.
void ref_rope(double* v, const CaseRope& rope, int64_t position) {
  const int64_t half = rope.dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(static_cast<float>(position) * rope.inv_freq[i]);
    const double c = rope.factor * std::cos(angle), s = rope.factor * std::sin(angle);
    const int64_t ia = rope.interleaved ? 2 * i : i, ib = rope.interleaved ? 2 * i + 1 : i + half;
    const double a = v[ia], b = v[ib];
    v[ia] = a * c - b * s;
    v[ib] = b * c + a * s;
  }
}

struct Norm {
  std::vector<uint16_t> weight, bias;
};

// LayerNorm (biased variance) in double, then RoPE.
std::vector<double> ref_key(const uint16_t* raw, int64_t hd, const Norm& norm, const CaseRope& rope,
                            int64_t position) {
  std::vector<double> x(static_cast<size_t>(hd));
  double mean = 0.0;
  for (int64_t d = 0; d < hd; ++d) mean += (x[d] = bf16_to_float(raw[d]));
  mean /= static_cast<double>(hd);
  double var = 0.0;
  for (int64_t d = 0; d < hd; ++d) var += (x[d] - mean) * (x[d] - mean);
  const double inv = 1.0 / std::sqrt(var / static_cast<double>(hd) + static_cast<double>(kEps));
  for (int64_t d = 0; d < hd; ++d) {
    x[d] = (x[d] - mean) * inv * bf16_to_float(norm.weight[d]) + bf16_to_float(norm.bias[d]);
  }
  ref_rope(x.data(), rope, position);
  return x;
}

std::vector<double> ref_query(const uint16_t* raw, int64_t hd, const CaseRope& rope, int64_t position) {
  std::vector<double> x(static_cast<size_t>(hd));
  for (int64_t d = 0; d < hd; ++d) x[d] = bf16_to_float(raw[d]);
  ref_rope(x.data(), rope, position);
  return x;
}

// One row of head_dim values: written and within kPrepareRel of the row's largest reference value.
void expect_row(const uint16_t* got, const std::vector<double>& want, const std::string& what) {
  double row_max = 0.0;
  for (double w : want) row_max = std::max(row_max, std::fabs(w));
  for (size_t d = 0; d < want.size(); ++d) {
    ASSERT_NE(got[d], kPoison) << what << " dim " << d << " never written";
    const double g = bf16_to_float(got[d]);
    ASSERT_LE(std::fabs(g - want[d]), kPrepareRel * row_max)
        << what << " dim " << d << " got " << g << " want " << want[d];
  }
}

Norm make_norm(std::mt19937& rng, int64_t hd) {
  return {random_bf16(rng, static_cast<size_t>(hd), 0.5f, 1.0f), random_bf16(rng, static_cast<size_t>(hd), 0.3f)};
}

class CudaIndexer : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess) << "no CUDA device";
    ctx_ = std::make_unique<DeviceContext>(0);
  }
  std::unique_ptr<DeviceContext> ctx_;
};

// ---------------------------------------------------------------------------------------------------------------
// indexer_prepare

struct PrepareResult {
  std::vector<uint16_t> q_out, cache;
};

// indexer_prepare on raw rows (q [tokens, q_stride], k [tokens, k_stride]) into a cache of n_slots poisoned slots.
Expected<PrepareResult> run_prepare(const DeviceContext& ctx, const std::vector<uint16_t>& q, int64_t q_stride,
                                    const std::vector<uint16_t>& k, int64_t k_stride, const Norm& norm,
                                    const std::vector<int32_t>& positions, const CaseRope& rope,
                                    const std::vector<int32_t>& slots, int64_t n_blocks, int64_t block_size,
                                    int64_t n_heads, int64_t hd) {
  const int64_t tokens = static_cast<int64_t>(positions.size());
  const DeviceBuffer d_q = upload(q), d_k = upload(k), d_w = upload(norm.weight), d_b = upload(norm.bias);
  const DeviceBuffer d_pos = upload(positions), d_freq = upload(rope.inv_freq), d_slots = upload(slots);
  const size_t n_q = static_cast<size_t>(tokens * n_heads * hd),
               n_cache = static_cast<size_t>(n_blocks * block_size * hd);
  DeviceBuffer q_out = upload(std::vector<uint16_t>(n_q, kPoison));
  DeviceBuffer cache = upload(std::vector<uint16_t>(n_cache, kPoison));
  const IndexerPrepareArgs a{
      .q = d_q.as<uint16_t>(),
      .q_stride = q_stride,
      .q_out = q_out.as<uint16_t>(),
      .k = d_k.as<uint16_t>(),
      .k_stride = k_stride,
      .k_norm_weight = d_w.as<uint16_t>(),
      .k_norm_bias = d_b.as<uint16_t>(),
      .eps = kEps,
      .positions = d_pos.as<int32_t>(),
      .inv_freq = rope.dim > 0 ? d_freq.as<float>() : nullptr,
      .rope_dim = rope.dim,
      .attention_factor = rope.factor,
      .interleaved = rope.interleaved,
      .slot_mapping = d_slots.as<int32_t>(),
      .cache = {.k = cache.as<uint16_t>(), .n_blocks = n_blocks, .block_size = block_size, .head_dim = hd},
      .tokens = tokens,
      .n_heads = n_heads,
      .head_dim = hd};
  TERN_TRY(indexer_prepare(ctx, a));
  if (cudaError_t e = cudaStreamSynchronize(ctx.stream()); e != cudaSuccess) {
    return make_error("kernel failed: {}", cudaGetErrorString(e));
  }
  return PrepareResult{download<uint16_t>(q_out, n_q), download<uint16_t>(cache, n_cache)};
}

// q_out of every token and the key of every token with a slot in the pool against the double reference; every other
// slot still poisoned.
void check_prepare(const PrepareResult& got, const std::vector<uint16_t>& q, int64_t q_stride,
                   const std::vector<uint16_t>& k, int64_t k_stride, const Norm& norm,
                   const std::vector<int32_t>& positions, const CaseRope& rope, const std::vector<int32_t>& slots,
                   int64_t n_slots, int64_t n_heads, int64_t hd) {
  std::vector<bool> written(static_cast<size_t>(n_slots), false);
  for (size_t t = 0; t < positions.size(); ++t) {
    for (int64_t h = 0; h < n_heads; ++h) {
      const auto want = ref_query(&q[t * q_stride + h * hd], hd, rope, positions[t]);
      expect_row(&got.q_out[(t * n_heads + h) * hd], want, fmt::format("q token {} head {}", t, h));
      if (::testing::Test::HasFatalFailure()) return;
    }
    if (slots[t] < 0 || slots[t] >= n_slots) continue;
    written[slots[t]] = true;
    const auto want = ref_key(&k[t * k_stride], hd, norm, rope, positions[t]);
    expect_row(&got.cache[slots[t] * hd], want, fmt::format("k token {} slot {}", t, slots[t]));
    if (::testing::Test::HasFatalFailure()) return;
  }
  for (int64_t slot = 0; slot < n_slots; ++slot) {
    if (written[slot]) continue;
    for (int64_t d = 0; d < hd; ++d) ASSERT_EQ(got.cache[slot * hd + d], kPoison) << "slot " << slot << " was written";
  }
}

struct PrepareShape {
  int64_t tokens, n_heads, head_dim, rope_dim, block_size;
  bool interleaved;
  float attention_factor = 1.0f;  // YaRN's: cos and sin times it
};

TEST_F(CudaIndexer, PrepareMatchesDoubleReference) {
  const PrepareShape shapes[] = {
      {37, 32, 128, 64, 64, true}, {37, 32, 128, 64, 16, false},  // GLM-5, both layouts
      {9, 16, 32, 16, 16, true},   {9, 16, 32, 16, 4, false},     // the fixture
      {5, 20, 48, 16, 8, true},    {6, 64, 256, 256, 32, false},  // odd heads; rope over the whole head
      {4, 3, 16, 0, 1, true},                                     // no RoPE
      {11, 32, 128, 64, 64, true, 1.24f},                         // DeepSeek's yarn, mscale != mscale_all_dim
  };
  uint32_t seed = 100;
  for (const PrepareShape& s : shapes) {
    SCOPED_TRACE(fmt::format("tokens {} heads {} hd {} rope {} bs {} {} factor {}", s.tokens, s.n_heads, s.head_dim,
                             s.rope_dim, s.block_size, s.interleaved ? "interleaved" : "neox", s.attention_factor));
    std::mt19937 rng(++seed);
    const int64_t hd = s.head_dim, q_stride = s.n_heads * hd + 16, k_stride = hd + 24;
    const auto q = random_bf16(rng, static_cast<size_t>(s.tokens * q_stride), 2.0f);
    const auto k = random_bf16(rng, static_cast<size_t>(s.tokens * k_stride), 2.0f, 0.7f);  // a mean to remove
    const Norm norm = make_norm(rng, hd);
    const int64_t n_blocks = (s.tokens + s.block_size - 1) / s.block_size + 2, n_slots = n_blocks * s.block_size;
    std::vector<int32_t> slots(static_cast<size_t>(n_slots)), positions(static_cast<size_t>(s.tokens));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    slots.resize(static_cast<size_t>(s.tokens));
    if (s.tokens > 2) slots[1] = -1;                                         // a padding row
    if (s.tokens > 3) slots[3] = static_cast<int32_t>(n_slots + 5);          // past the pool: nothing written
    for (auto& p : positions) p = static_cast<int32_t>(rng() % (1u << 17));  // angles up to ~1.3e5 rad
    const CaseRope rope = case_rope(s.rope_dim, s.interleaved, s.attention_factor);
    auto got = run_prepare(*ctx_, q, q_stride, k, k_stride, norm, positions, rope, slots, n_blocks, s.block_size,
                           s.n_heads, hd);
    ASSERT_TRUE(got.has_value()) << got.error().message;
    check_prepare(*got, q, q_stride, k, k_stride, norm, positions, rope, slots, n_slots, s.n_heads, hd);
    if (HasFatalFailure()) return;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// indexer_select

struct Seq {
  int64_t past, n_q;
};

struct SelectCase {
  std::vector<Seq> seqs;
  int64_t n_heads, head_dim, rope_dim, topk, block_size;
  bool interleaved = true;
  int distinct = 0;   // direct inputs only: keys drawn from this many vectors (exact ties); 0: all random
  int64_t slack = 0;  // max_seq_len beyond the longest sequence (a bucket sized for longer contexts)
  int64_t topk_blocks = 0;  // IndexerSelectArgs::topk_blocks: 0 the rule, else forced
  std::string label() const {
    std::string s =
        fmt::format("heads {} hd {} rope {} topk {} bs {} {} distinct {} slack {} topk blocks {} seqs", n_heads,
                    head_dim, rope_dim, topk, block_size, interleaved ? "interleaved" : "neox", distinct, slack,
                    topk_blocks);
    for (const Seq& q : seqs) s += fmt::format(" {}+{}", q.past, q.n_q);
    return s;
  }
};

// The batch's paged layout: each sequence's blocks taken from a shuffled pool, one spare table column left -1.
struct Layout {
  int64_t tokens = 0, max_seq = 0, max_seq_len = 0, max_blocks = 0, n_blocks = 0, block_size = 0;
  std::vector<int32_t> tables, query_start{0}, seq_lens;
  int64_t slot(size_t seq, int64_t key) const {
    return int64_t{tables[seq * max_blocks + key / block_size]} * block_size + key % block_size;
  }
};

Layout make_layout(const SelectCase& c, std::mt19937& rng) {
  Layout l;
  l.block_size = c.block_size;
  for (const Seq& q : c.seqs) {
    l.tokens += q.n_q;
    l.query_start.push_back(static_cast<int32_t>(l.tokens));
    l.seq_lens.push_back(static_cast<int32_t>(q.past + q.n_q));
    l.max_seq = std::max(l.max_seq, q.past + q.n_q);
  }
  l.max_seq_len = l.max_seq + c.slack;
  l.max_blocks = (l.max_seq_len + c.block_size - 1) / c.block_size + 1;
  int64_t used = 0;
  for (int32_t len : l.seq_lens) used += (len + c.block_size - 1) / c.block_size;
  l.n_blocks = used + 3;
  std::vector<int32_t> perm(static_cast<size_t>(l.n_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  l.tables.assign(c.seqs.size() * static_cast<size_t>(l.max_blocks), -1);
  size_t next = 0;
  for (size_t i = 0; i < c.seqs.size(); ++i) {
    for (int64_t b = 0; b * c.block_size < l.seq_lens[i]; ++b) l.tables[i * l.max_blocks + b] = perm[next++];
  }
  return l;
}

struct SelectInputs {
  SelectCase c;
  Layout l;
  std::vector<uint16_t> q;        // [tokens, n_heads, head_dim], roped
  std::vector<uint16_t> weights;  // [tokens, w_stride]
  int64_t w_stride = 0;
  std::vector<uint16_t> pool;  // [n_blocks * block_size, head_dim]
};

std::vector<uint16_t> make_weights(const SelectCase& c, const Layout& l, std::mt19937& rng, int64_t& stride) {
  stride = c.n_heads + 5;
  return random_bf16(rng, static_cast<size_t>(l.tokens * stride), 1.0f);  // mixed signs, as weights_proj's output
}

// Roped queries and cached keys drawn directly (no prepare), keys from `distinct` vectors when c.distinct > 0.
SelectInputs direct_inputs(const SelectCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  SelectInputs in{.c = c, .l = make_layout(c, rng)};
  const int64_t hd = c.head_dim;
  in.q = random_bf16(rng, static_cast<size_t>(in.l.tokens * c.n_heads * hd), 1.0f);
  in.weights = make_weights(c, in.l, rng, in.w_stride);
  in.pool.assign(static_cast<size_t>(in.l.n_blocks * c.block_size * hd), kNanBf16);
  const auto classes = random_bf16(rng, static_cast<size_t>(std::max(c.distinct, 1) * hd), 1.0f);
  for (size_t i = 0; i < c.seqs.size(); ++i) {
    for (int64_t j = 0; j < in.l.seq_lens[i]; ++j) {
      uint16_t* dst = &in.pool[in.l.slot(i, j) * hd];
      if (c.distinct > 0) {
        const size_t cls = rng() % static_cast<uint32_t>(c.distinct);
        std::copy_n(&classes[cls * hd], hd, dst);
      } else {
        const auto fresh = random_bf16(rng, static_cast<size_t>(hd), 1.0f);
        std::copy_n(fresh.data(), hd, dst);
      }
    }
  }
  return in;
}

// Raw projections of every token of every sequence through indexer_prepare (checked against the double reference,
// with padding rows that write nothing), then the prepared queries of the new tokens and the prepared cache.
void prepared_inputs(const DeviceContext& ctx, const SelectCase& c, uint32_t seed, SelectInputs& in) {
  std::mt19937 rng(seed);
  in = SelectInputs{.c = c, .l = make_layout(c, rng)};
  const Layout& l = in.l;
  const int64_t hd = c.head_dim, q_stride = c.n_heads * hd + 16, k_stride = hd + 24;
  std::vector<int32_t> positions, slots;
  std::vector<int64_t> first;  // each sequence's first prepare row
  for (size_t i = 0; i < c.seqs.size(); ++i) {
    first.push_back(static_cast<int64_t>(positions.size()));
    for (int64_t j = 0; j < l.seq_lens[i]; ++j) {
      positions.push_back(static_cast<int32_t>(j));
      slots.push_back(static_cast<int32_t>(l.slot(i, j)));
    }
  }
  for (int pad = 0; pad < 3; ++pad) {  // padding rows: position 0, no slot
    positions.push_back(0);
    slots.push_back(-1);
  }
  const int64_t n_rows = static_cast<int64_t>(positions.size());
  const auto q = random_bf16(rng, static_cast<size_t>(n_rows * q_stride), 1.5f);
  const auto k = random_bf16(rng, static_cast<size_t>(n_rows * k_stride), 2.0f, 0.4f);
  const Norm norm = make_norm(rng, hd);
  const CaseRope rope = case_rope(c.rope_dim, c.interleaved);
  auto got = run_prepare(ctx, q, q_stride, k, k_stride, norm, positions, rope, slots, l.n_blocks, c.block_size,
                         c.n_heads, hd);
  ASSERT_TRUE(got.has_value()) << got.error().message;
  check_prepare(*got, q, q_stride, k, k_stride, norm, positions, rope, slots, l.n_blocks * c.block_size, c.n_heads,
                hd);
  if (::testing::Test::HasFatalFailure()) return;
  // Unused slots back to NaN (prepare's check saw them poisoned), so a wrong read shows in the scores.
  in.pool = got->cache;
  for (auto& v : in.pool) v = v == kPoison ? kNanBf16 : v;
  const int64_t width = c.n_heads * hd;
  in.q.resize(static_cast<size_t>(l.tokens * width));
  for (size_t i = 0; i < c.seqs.size(); ++i) {
    for (int64_t r = 0; r < c.seqs[i].n_q; ++r) {
      const int64_t src = first[i] + c.seqs[i].past + r, dst = l.query_start[i] + r;
      std::copy_n(&got->q_out[src * width], width, &in.q[dst * width]);
    }
  }
  in.weights = make_weights(c, l, rng, in.w_stride);
}

struct SelectResult {
  std::vector<int32_t> selected;
  std::vector<float> scores;  // [tokens, indexer_scores_ld(max_seq_len)]
};

Expected<SelectResult> run_select(const DeviceContext& ctx, const SelectInputs& in) {
  const SelectCase& c = in.c;
  const Layout& l = in.l;
  const DeviceBuffer q = upload(in.q), w = upload(in.weights), pool = upload(in.pool);
  const DeviceBuffer tables = upload(l.tables), starts = upload(l.query_start), lens = upload(l.seq_lens);
  const size_t n_sel = static_cast<size_t>(l.tokens * c.topk);
  DeviceBuffer selected = upload(std::vector<int32_t>(n_sel, kPoisonIndex));
  const size_t ws_bytes = indexer_select_workspace_bytes(l.tokens, l.max_seq_len);
  DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
  ws.fill(0xFF);  // NaN scores
  const IndexerSelectArgs a{
      .q = q.as<uint16_t>(),
      .weights = w.as<uint16_t>(),
      .weights_stride = in.w_stride,
      .cache = {.k = pool.as<uint16_t>(), .n_blocks = l.n_blocks, .block_size = c.block_size, .head_dim = c.head_dim},
      .block_tables = tables.as<int32_t>(),
      .max_blocks_per_seq = l.max_blocks,
      .query_start = starts.as<int32_t>(),
      .seq_lens = lens.as<int32_t>(),
      .n_seqs = static_cast<int64_t>(c.seqs.size()),
      .tokens = l.tokens,
      .n_heads = c.n_heads,
      .head_dim = c.head_dim,
      .topk = c.topk,
      .max_seq_len = l.max_seq_len,
      .workspace = ws.data(),
      .workspace_bytes = ws_bytes,
      .selected = selected.as<int32_t>(),
      .topk_blocks = c.topk_blocks};
  TERN_TRY(indexer_select(ctx, a));
  if (cudaError_t e = cudaStreamSynchronize(ctx.stream()); e != cudaSuccess) {
    return make_error("kernel failed: {}", cudaGetErrorString(e));
  }
  return SelectResult{download<int32_t>(selected, n_sel), download<float>(ws, ws_bytes / sizeof(float))};
}

// The reference selection: the topk best by (score descending, key ascending), listed ascending.
std::vector<int32_t> exact_selection(const std::vector<double>& sc, int64_t topk) {
  std::vector<int32_t> order(sc.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return sc[a] > sc[b]; });
  order.resize(static_cast<size_t>(topk));
  std::sort(order.begin(), order.end());
  return order;
}

// Every row of the batch: scores (rows with n > topk) and selection against the double reference.
void check_select(const SelectInputs& in, const SelectResult& got, bool exact_ties) {
  const SelectCase& c = in.c;
  const Layout& l = in.l;
  const int64_t hd = c.head_dim, ld = indexer_scores_ld(l.max_seq_len);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd)), head_weight = 1.0 / std::sqrt(double(c.n_heads));
  for (size_t i = 0; i < c.seqs.size(); ++i) {
    const int64_t len = l.seq_lens[i], n_q = c.seqs[i].n_q;
    if (n_q == 0) continue;
    std::vector<double> keys(static_cast<size_t>(len * hd)), key_norm(static_cast<size_t>(len));
    for (int64_t j = 0; j < len; ++j) {
      double sq = 0.0;
      for (int64_t d = 0; d < hd; ++d) {
        const double v = bf16_to_float(in.pool[l.slot(i, j) * hd + d]);
        keys[j * hd + d] = v;
        sq += v * v;
      }
      key_norm[j] = std::sqrt(sq);
    }
    for (int64_t r = 0; r < n_q; ++r) {
      const int64_t t = l.query_start[i] + r, pos = len - n_q + r, n = pos + 1;
      SCOPED_TRACE(fmt::format("sequence {} row {} (token {}, {} keys)", i, r, t, n));
      const int32_t* sel = &got.selected[t * c.topk];
      if (n <= c.topk) {
        for (int64_t e = 0; e < c.topk; ++e) ASSERT_EQ(sel[e], e < n ? e : -1) << "entry " << e;
        continue;
      }
      std::vector<double> q(static_cast<size_t>(c.n_heads * hd)), w(static_cast<size_t>(c.n_heads)),
          q_norm(static_cast<size_t>(c.n_heads));
      for (int64_t h = 0; h < c.n_heads; ++h) {
        double sq = 0.0;
        for (int64_t d = 0; d < hd; ++d) {
          const double v = bf16_to_float(in.q[(t * c.n_heads + h) * hd + d]);
          q[h * hd + d] = v;
          sq += v * v;
        }
        q_norm[h] = std::sqrt(sq);
        w[h] = bf16_to_float(in.weights[t * in.w_stride + h]) * head_weight;
      }
      std::vector<double> sc(static_cast<size_t>(n));
      for (int64_t s = 0; s < n; ++s) {
        double sum = 0.0, bound = 0.0;
        for (int64_t h = 0; h < c.n_heads; ++h) {
          const double* qh = &q[h * hd];
          const double* ks = &keys[s * hd];
          double dot = 0.0;
          for (int64_t d = 0; d < hd; ++d) dot += qh[d] * ks[d];
          sum += w[h] * std::max(dot * scale, 0.0);
          bound += std::fabs(w[h]) * scale * q_norm[h] * key_norm[s];
        }
        sc[s] = sum;
        const double g = got.scores[t * ld + s];
        ASSERT_LE(std::fabs(g - sum), kScoreRel * bound) << "score of key " << s << " got " << g << " want " << sum;
      }
      if (exact_ties) {
        const auto want = exact_selection(sc, c.topk);
        for (int64_t e = 0; e < c.topk; ++e) ASSERT_EQ(sel[e], want[e]) << "entry " << e;
        continue;
      }
      std::vector<double> sorted = sc;
      std::nth_element(sorted.begin(), sorted.begin() + (c.topk - 1), sorted.end(), std::greater<double>());
      const double kth = sorted[c.topk - 1];
      const auto [lo, hi] = std::minmax_element(sc.begin(), sc.end());
      const double tol = kSelectRel * (*hi - *lo);
      std::vector<char> chosen(static_cast<size_t>(n), 0);
      int64_t prev = -1;
      for (int64_t e = 0; e < c.topk; ++e) {
        ASSERT_GT(sel[e], prev) << "entry " << e << ": not ascending, a duplicate or unwritten";
        ASSERT_LT(sel[e], n) << "entry " << e << " is past the row's keys";
        chosen[sel[e]] = 1;
        prev = sel[e];
      }
      for (int64_t s = 0; s < n; ++s) {
        if (chosen[s]) {
          ASSERT_GE(sc[s], kth - tol) << "key " << s << " chosen with score " << sc[s] << " below the k-th " << kth;
        } else {
          ASSERT_LE(sc[s], kth + tol) << "key " << s << " left out with score " << sc[s] << " above the k-th " << kth;
        }
      }
    }
  }
}

// Keys of each token's row: its position + 1.
std::vector<int64_t> row_keys(const SelectInputs& in) {
  std::vector<int64_t> n(static_cast<size_t>(in.l.tokens));
  for (size_t i = 0; i < in.c.seqs.size(); ++i) {
    for (int64_t r = 0; r < in.c.seqs[i].n_q; ++r) {
      n[in.l.query_start[i] + r] = in.l.seq_lens[i] - in.c.seqs[i].n_q + r + 1;
    }
  }
  return n;
}

// Runs the case twice (the selection, and the scores of the rows that need them, must be the same bits) and checks it.
void select_and_check(const DeviceContext& ctx, const SelectInputs& in, bool exact_ties) {
  auto got = run_select(ctx, in);
  ASSERT_TRUE(got.has_value()) << got.error().message;
  auto again = run_select(ctx, in);
  ASSERT_TRUE(again.has_value()) << again.error().message;
  for (size_t e = 0; e < got->selected.size(); ++e) {
    ASSERT_EQ(got->selected[e], again->selected[e]) << "the selection is not repeatable: entry " << e;
  }
  const std::vector<int64_t> n = row_keys(in);
  const int64_t ld = indexer_scores_ld(in.l.max_seq_len);
  for (int64_t t = 0; t < in.l.tokens; ++t) {
    if (n[t] <= in.c.topk) continue;
    ASSERT_EQ(std::memcmp(&got->scores[t * ld], &again->scores[t * ld], static_cast<size_t>(n[t]) * sizeof(float)), 0)
        << "the scores of token " << t << " are not repeatable";
  }
  check_select(in, *got, exact_ties);
}

void check_prepared_case(const DeviceContext& ctx, const SelectCase& c, uint32_t seed) {
  SCOPED_TRACE(c.label() + fmt::format(" (prepared) seed {}", seed));
  SelectInputs in;
  prepared_inputs(ctx, c, seed, in);
  if (::testing::Test::HasFatalFailure()) return;
  select_and_check(ctx, in, false);
}

void check_direct_case(const DeviceContext& ctx, const SelectCase& c, uint32_t seed) {
  SCOPED_TRACE(c.label() + fmt::format(" (direct) seed {}", seed));
  select_and_check(ctx, direct_inputs(c, seed), c.distinct > 0);
}

// GLM-5: a padding-like first row, sequences below, at (n = topk) and just above topk, ~3000-4500 keys, and a
// prefill chunk of 192 rows continuing a cached prefix of 3300 tokens.
TEST_F(CudaIndexer, Glm5ShapesAfterPrepare) {
  const SelectCase c{.seqs = {{0, 1}, {1500, 1}, {2047, 1}, {2048, 1}, {3100, 1}, {4500, 2}, {3300, 192}},
                     .n_heads = 32,
                     .head_dim = 128,
                     .rope_dim = 64,
                     .topk = 2048,
                     .block_size = 64};
  check_prepared_case(*ctx_, c, 1001);
}

// The tiny fixture's shapes in both RoPE layouts, two block sizes, decode rows and prefill chunks.
TEST_F(CudaIndexer, FixtureShapesAfterPrepare) {
  const std::vector<Seq> seqs = {{0, 1}, {5, 1}, {15, 1}, {16, 1}, {40, 3}, {100, 1}, {20, 30}, {0, 50}, {7, 0}};
  uint32_t seed = 2000;
  for (bool interleaved : {true, false}) {
    for (int64_t bs : {16, 4}) {
      check_prepared_case(*ctx_,
                          {.seqs = seqs,
                           .n_heads = 16,
                           .head_dim = 32,
                           .rope_dim = 16,
                           .topk = 16,
                           .block_size = bs,
                           .interleaved = interleaved},
                          ++seed);
      if (HasFatalFailure()) return;
    }
  }
}

// Head counts that are not multiples of 16 (zero rows in the mma tiles), head_dim 16..256, block sizes 1..64, and a
// max_seq_len beyond the longest sequence.
TEST_F(CudaIndexer, HeadCountsAndHeadDims) {
  const std::vector<Seq> seqs = {{0, 1}, {63, 1}, {64, 1}, {300, 2}, {30, 70}, {1000, 4}, {0, 130}};
  struct Shape {
    int64_t n_heads, head_dim, topk, block_size, slack;
  };
  const Shape shapes[] = {{20, 64, 64, 16, 0}, {3, 48, 8, 8, 333},    {64, 256, 128, 32, 0},
                          {17, 16, 5, 1, 7},   {33, 128, 100, 64, 1}, {1, 112, 40, 2, 0}};
  uint32_t seed = 3000;
  for (const Shape& s : shapes) {
    check_direct_case(*ctx_,
                      {.seqs = seqs,
                       .n_heads = s.n_heads,
                       .head_dim = s.head_dim,
                       .rope_dim = 0,
                       .topk = s.topk,
                       .block_size = s.block_size,
                       .slack = s.slack},
                      ++seed);
    if (HasFatalFailure()) return;
  }
}

// A 40k-token context (20 radix digits of keys, many compaction chunks) next to short rows, at GLM-5's shapes.
TEST_F(CudaIndexer, LongContext) {
  check_direct_case(*ctx_,
                    {.seqs = {{40000, 2}, {9000, 1}, {0, 1}, {2100, 1}},
                     .n_heads = 32,
                     .head_dim = 128,
                     .rope_dim = 64,
                     .topk = 2048,
                     .block_size = 64,
                     .slack = 5000},
                    4001);
}

// The top-k over 1, 2, 4 and 8 blocks per row (a cluster; each block a slice of the keys): the same exact selection,
// with ties across slice boundaries (one class of keys: the earliest topk, from several slices; four classes), rows
// whose slices are partly or wholly past n, a 40k-key row (slices staged in shared memory or not, as the device's
// limit allows) and rows at and below topk.
TEST_F(CudaIndexer, TopkOverSeveralBlocksPerRow) {
  uint32_t seed = 6000;
  for (int64_t blocks : {1, 2, 4, 8}) {
    for (int distinct : {0, 4, 1}) {
      check_direct_case(*ctx_,
                        {.seqs = {{3000, 1}, {2500, 2}, {2048, 1}, {2047, 1}, {2052, 1}},
                         .n_heads = 32,
                         .head_dim = 128,
                         .rope_dim = 64,
                         .topk = 2048,
                         .block_size = 64,
                         .distinct = distinct,
                         .topk_blocks = blocks},
                        ++seed);
      if (HasFatalFailure()) return;
    }
    check_direct_case(*ctx_,
                      {.seqs = {{40000, 1}, {0, 1}, {9000, 1}},
                       .n_heads = 32,
                       .head_dim = 128,
                       .rope_dim = 64,
                       .topk = 2048,
                       .block_size = 64,
                       .slack = 300000,
                       .topk_blocks = blocks},
                      ++seed);
    if (HasFatalFailure()) return;
    check_direct_case(*ctx_,
                      {.seqs = {{60, 1}, {0, 40}, {100, 5}, {17, 1}},
                       .n_heads = 16,
                       .head_dim = 32,
                       .rope_dim = 16,
                       .topk = 16,
                       .block_size = 16,
                       .topk_blocks = blocks},
                      ++seed);
    if (HasFatalFailure()) return;
  }
}

// The rule's block counts: powers of two up to 8, never more blocks than SMs over the rows, slices of at least
// kIndexerTopkMinSliceKeys, one block when rows alone fill the SMs; and the shared-memory stage within the limit.
TEST(IndexerTopkRule, BlockCountsFitTheDevice) {
  for (int sms : {1, 84, 132, 188}) {
    DeviceProps props;
    props.num_sms = sms;
    props.shared_mem_per_block_optin = 101376 - 1024;  // the smallest of our targets (sm_120)
    for (int64_t tokens : {1, 3, 16, 64, 200, 4096}) {
      for (int64_t len : {2049, 8192, 16384, 32768, 131072, 202752}) {
        const int64_t b = indexer_topk_blocks(props, tokens, len);
        EXPECT_TRUE(b == 1 || b == 2 || b == 4 || b == 8) << b;
        if (b > 1) {
          EXPECT_LE(tokens * b, sms) << tokens << " rows, " << len << " keys";
          EXPECT_GE(len / b, kIndexerTopkMinSliceKeys) << tokens << " rows, " << len << " keys";
        }
        if (2 * tokens > sms) {
          EXPECT_EQ(b, 1) << tokens << " rows on " << sms << " SMs";
        }
        const size_t stage = indexer_topk_stage_bytes(props, len, b);
        EXPECT_TRUE(stage == 0 || (stage >= static_cast<size_t>((len + b - 1) / b) * 4 &&
                                   stage + 4096 <= props.shared_mem_per_block_optin));
      }
    }
  }
  DeviceProps h200;
  h200.num_sms = 132;
  h200.shared_mem_per_block_optin = 232448;
  EXPECT_EQ(indexer_topk_blocks(h200, 1, 131072), 8);  // one long row over eight SMs
  EXPECT_EQ(indexer_topk_blocks(h200, 1, 8192), 1);     // too short to split
}

// Keys drawn from a few identical vectors: the scores tie exactly within a class, and the k-th class must be taken
// from its earliest keys; with one class every row takes keys 0..topk-1.
TEST_F(CudaIndexer, ExactTiesTakeTheEarlierKeys) {
  uint32_t seed = 5000;
  for (int distinct : {4, 1}) {
    check_direct_case(*ctx_,
                      {.seqs = {{3000, 1}, {2500, 2}, {2048, 1}},
                       .n_heads = 32,
                       .head_dim = 128,
                       .rope_dim = 64,
                       .topk = 2048,
                       .block_size = 64,
                       .distinct = distinct},
                      ++seed);
    if (HasFatalFailure()) return;
  }
  for (int distinct : {3, 1}) {
    check_direct_case(*ctx_,
                      {.seqs = {{60, 1}, {0, 40}, {100, 5}},
                       .n_heads = 16,
                       .head_dim = 32,
                       .rope_dim = 16,
                       .topk = 16,
                       .block_size = 16,
                       .distinct = distinct},
                      ++seed);
    if (HasFatalFailure()) return;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Bad arguments

TEST_F(CudaIndexer, BadArgumentsAreErrors) {
  DeviceBuffer buf(1 << 20);
  auto* p = buf.as<uint16_t>();
  auto* i32 = buf.as<int32_t>();
  const PagedIndexerKeys cache{.k = p, .n_blocks = 4, .block_size = 16, .head_dim = 128};
  const IndexerSelectArgs good{.q = p,
                               .weights = p,
                               .weights_stride = 32,
                               .cache = cache,
                               .block_tables = i32,
                               .max_blocks_per_seq = 4,
                               .query_start = i32,
                               .seq_lens = i32,
                               .n_seqs = 1,
                               .tokens = 1,
                               .n_heads = 32,
                               .head_dim = 128,
                               .topk = 2048,
                               .max_seq_len = 64,
                               .workspace = buf.data(),
                               .workspace_bytes = buf.size_bytes(),
                               .selected = i32};
  auto expect_error = [&](IndexerSelectArgs a, const std::string& text) {
    auto r = indexer_select(*ctx_, a);
    ASSERT_FALSE(r.has_value()) << text;
    EXPECT_NE(r.error().message.find(text), std::string::npos) << r.error().message;
  };
  IndexerSelectArgs a = good;
  a.head_dim = 40;
  a.cache.head_dim = 40;
  expect_error(a, "head_dim=40 is not supported");
  a = good;
  a.n_heads = 65;
  expect_error(a, "n_heads=65 out of range");
  a = good;
  a.topk = 0;
  expect_error(a, "topk=0 out of range");
  a.topk = 2048;
  a.topk_blocks = 3;
  expect_error(a, "topk_blocks=3 must be");
  a.topk_blocks = 16;
  expect_error(a, "topk_blocks=16 must be");
  a = good;
  a.q = p + 1;
  expect_error(a, "q is not 16-byte aligned");
  a = good;
  a.cache.head_dim = 64;
  expect_error(a, "cache.head_dim=64 differs from head_dim=128");
  a = good;
  a.cache.block_size = 48;
  expect_error(a, "cache.block_size=48 must be a power of two");
  a = good;
  a.max_blocks_per_seq = 3;
  expect_error(a, "max_blocks_per_seq=3 must hold max_seq_len=64");
  a = good;
  a.workspace_bytes = 100;
  expect_error(a, "workspace must be 16-byte aligned and hold 256 bytes");
  a = good;
  a.weights_stride = 31;
  expect_error(a, "weights_stride=31 is below n_heads=32");
  a = good;
  a.selected = nullptr;
  expect_error(a, "selected is null");
  a = good;
  a.tokens = 0;
  EXPECT_TRUE(indexer_select(*ctx_, a).has_value()) << "zero tokens is a no-op";

  const IndexerPrepareArgs prep{.q = p,
                                .q_stride = 32 * 128,
                                .q_out = p,
                                .k = p,
                                .k_stride = 128,
                                .k_norm_weight = p,
                                .k_norm_bias = p,
                                .positions = i32,
                                .inv_freq = buf.as<float>(),
                                .rope_dim = 64,
                                .slot_mapping = i32,
                                .cache = cache,
                                .tokens = 1,
                                .n_heads = 32,
                                .head_dim = 128};
  auto expect_prep_error = [&](IndexerPrepareArgs b, const std::string& text) {
    auto r = indexer_prepare(*ctx_, b);
    ASSERT_FALSE(r.has_value()) << text;
    EXPECT_NE(r.error().message.find(text), std::string::npos) << r.error().message;
  };
  IndexerPrepareArgs b = prep;
  b.rope_dim = 63;
  expect_prep_error(b, "rope_dim=63 must be even");
  b = prep;
  b.q_stride = 100;
  expect_prep_error(b, "q_stride=100 is below the row's 4096 values");
  b = prep;
  b.k_norm_bias = nullptr;
  expect_prep_error(b, "k_norm_bias is null");
  b = prep;
  b.eps = 0.0f;
  expect_prep_error(b, "eps=0 must be positive");
  b = prep;
  b.tokens = 0;
  EXPECT_TRUE(indexer_prepare(*ctx_, b).has_value()) << "zero tokens is a no-op";
}

}  // namespace
}  // namespace tern
