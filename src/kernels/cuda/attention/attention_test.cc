// The paged attention kernels against the CPU reference (label gpu): paged_attention against cpu_attention_causal
// (kernels/cpu/attention.h) on ragged batches whose blocks are shuffled through the pool, every variant (prefill on
// wgmma where the device has it, and on mma.sync), every head dim, GQA groups 1..16, gated and not, contexts up to
// 32k; attention_prepare against the CPU layers' RmsNorm and Rope (layers/norms.h, layers/rope.h), including partial
// rotary, zero-centred norms and untouched cache slots.
// Inputs are fresh random non-zero bf16 values; outputs start poisoned, unused cache slots hold NaN so a read of a
// wrong slot shows in the output.
//
// Tolerance, per sequence relative to the largest reference output of that sequence: the bf16 rounding of the
// output is at most 2^-8 of an element. Decode keeps the probabilities to about 16 bits (a bf16 high part and a bf16
// remainder into the tensor cores; 2^-12 more covers them, the fp32 sums and exp2); prefill feeds them to the tensor
// cores as bf16, a second rounding of up to 2^-8 per term, so 2^-7.
// A wrong mask, scale, head mapping or block lookup moves outputs by far more on the short sequences of each batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "core/formats.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/attention/attention.h"
#include "kernels/cuda/device_test_util.h"
#include "kernels/cuda/elementwise/elementwise.h"
#include "layers/norms.h"
#include "layers/rope.h"

namespace tern {
namespace {

constexpr uint16_t kPoison = 0x7FBA;   // a NaN payload no arithmetic produces
constexpr uint16_t kNanBf16 = 0x7FC0;  // unused cache slots
constexpr double kDecodeRel = 1.0 / 256 + 1.0 / 4096;
constexpr double kPrefillRel = 1.0 / 128;

std::vector<uint16_t> random_bf16(std::mt19937& rng, size_t n, float scale) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> out(n);
  for (auto& v : out) {
    const float x = scale * u(rng);
    v = float_to_bf16(x + (x >= 0.0f ? 1e-3f : -1e-3f));
  }
  return out;
}

std::vector<float> widen(const uint16_t* p, size_t n) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(p[i]);
  return out;
}

using cuda_test::download;
using cuda_test::upload;

struct Seq {
  int64_t past, n_q;
};

struct Shape {
  std::vector<Seq> seqs;
  int64_t n_heads, n_kv_heads, head_dim, block_size;
  bool gated;
  std::string label() const {
    std::string s =
        fmt::format("heads {}/{} hd {} bs {}{} seqs", n_heads, n_kv_heads, head_dim, block_size, gated ? " gated" : "");
    for (const Seq& q : seqs) s += fmt::format(" {}+{}", q.past, q.n_q);
    return s;
  }
};

// A batch on the host: q (and gate), each sequence's k/v, the pools with the sequences' blocks shuffled.
struct Batch {
  Shape shape;
  int64_t tokens = 0, max_q = 0, max_seq = 0, max_blocks = 0, n_blocks = 0;
  std::vector<uint16_t> q, gate, k_pool, v_pool;
  std::vector<std::vector<uint16_t>> k, v;  // per sequence [seq_len, n_kv, hd]
  std::vector<int32_t> tables, query_start{0}, seq_lens;
};

Batch make_batch(const Shape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  Batch b{.shape = s};
  const int64_t row = s.n_kv_heads * s.head_dim;
  for (const Seq& q : s.seqs) {
    b.tokens += q.n_q;
    b.query_start.push_back(static_cast<int32_t>(b.tokens));
    b.seq_lens.push_back(static_cast<int32_t>(q.past + q.n_q));
    b.max_q = std::max(b.max_q, q.n_q);
    b.max_seq = std::max(b.max_seq, q.past + q.n_q);
    b.k.push_back(random_bf16(rng, static_cast<size_t>((q.past + q.n_q) * row), 1.0f));
    b.v.push_back(random_bf16(rng, static_cast<size_t>((q.past + q.n_q) * row), 1.0f));
  }
  // q at scale 2 spreads the scores over a few units, so softmax is neither flat nor one-hot.
  b.q = random_bf16(rng, static_cast<size_t>(b.tokens * s.n_heads * s.head_dim), 2.0f);
  if (s.gated) b.gate = random_bf16(rng, b.q.size(), 4.0f);
  b.max_blocks = (b.max_seq + s.block_size - 1) / s.block_size + 1;  // one spare column stays -1
  int64_t used = 0;
  for (const Seq& q : s.seqs) used += (q.past + q.n_q + s.block_size - 1) / s.block_size;
  b.n_blocks = used + 3;
  std::vector<int32_t> perm(static_cast<size_t>(b.n_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  b.k_pool.assign(static_cast<size_t>(b.n_blocks * s.block_size * row), kNanBf16);
  b.v_pool = b.k_pool;
  b.tables.assign(static_cast<size_t>(s.seqs.size() * b.max_blocks), -1);
  size_t next = 0;
  for (size_t i = 0; i < s.seqs.size(); ++i) {
    for (int64_t j = 0; j < b.seq_lens[i]; ++j) {
      if (j % s.block_size == 0) b.tables[i * b.max_blocks + j / s.block_size] = perm[next++];
      const int64_t slot = int64_t{b.tables[i * b.max_blocks + j / s.block_size]} * s.block_size + j % s.block_size;
      std::copy_n(&b.k[i][j * row], row, &b.k_pool[slot * row]);
      std::copy_n(&b.v[i][j * row], row, &b.v_pool[slot * row]);
    }
  }
  return b;
}

// cpu_attention_causal per sequence, then * sigmoid(gate) as layers/attention.cc.
std::vector<float> reference(const Batch& b) {
  const Shape& s = b.shape;
  const int64_t width = s.n_heads * s.head_dim;
  std::vector<float> out(static_cast<size_t>(b.tokens * width));
  for (size_t i = 0; i < s.seqs.size(); ++i) {
    if (s.seqs[i].n_q == 0) continue;
    const int64_t q0 = b.query_start[i];
    const std::vector<float> q = widen(&b.q[q0 * width], static_cast<size_t>(s.seqs[i].n_q * width));
    const std::vector<float> k = widen(b.k[i].data(), b.k[i].size()), v = widen(b.v[i].data(), b.v[i].size());
    const CpuAttentionShape cs{.n_queries = s.seqs[i].n_q,
                               .past = s.seqs[i].past,
                               .n_heads = s.n_heads,
                               .n_kv_heads = s.n_kv_heads,
                               .head_dim = s.head_dim,
                               .scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim))};
    cpu_attention_causal(cs, q.data(), k.data(), v.data(), &out[q0 * width]);
  }
  if (s.gated) {
    for (size_t i = 0; i < out.size(); ++i) out[i] *= 1.0f / (1.0f + std::exp(-bf16_to_float(b.gate[i])));
  }
  return out;
}

class CudaAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess) << "no CUDA device";
    ctx_ = std::make_unique<DeviceContext>(0);
  }

  // The kernel's output on the batch (bf16 widened; poison stays recognisable as kPoison bits).
  Expected<std::vector<uint16_t>> run(const Batch& b, AttentionVariant variant) {
    const Shape& s = b.shape;
    const DeviceBuffer q = upload(b.q), gate = upload(b.gate), kp = upload(b.k_pool), vp = upload(b.v_pool);
    const DeviceBuffer tables = upload(b.tables), starts = upload(b.query_start), lens = upload(b.seq_lens);
    const size_t n_out = static_cast<size_t>(b.tokens * s.n_heads * s.head_dim);
    DeviceBuffer out = upload(std::vector<uint16_t>(n_out, kPoison));
    const size_t ws_bytes = paged_attention_workspace_bytes(ctx_->props(), b.tokens, s.n_heads, s.head_dim, b.max_seq);
    DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
    const PagedAttentionArgs a{.q = q.as<uint16_t>(),
                               .gate = s.gated ? gate.as<uint16_t>() : nullptr,
                               .out = out.as<uint16_t>(),
                               .cache = {.k = kp.as<uint16_t>(),
                                         .v = vp.as<uint16_t>(),
                                         .n_blocks = b.n_blocks,
                                         .block_size = s.block_size,
                                         .n_kv_heads = s.n_kv_heads,
                                         .head_dim = s.head_dim},
                               .block_tables = tables.as<int32_t>(),
                               .max_blocks_per_seq = b.max_blocks,
                               .query_start = starts.as<int32_t>(),
                               .seq_lens = lens.as<int32_t>(),
                               .n_seqs = static_cast<int64_t>(s.seqs.size()),
                               .tokens = b.tokens,
                               .n_heads = s.n_heads,
                               .max_query_len = b.max_q,
                               .max_seq_len = b.max_seq,
                               .scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                               .workspace = ws.data(),
                               .workspace_bytes = ws_bytes};
    TERN_TRY(paged_attention(*ctx_, a, variant));
    if (cudaError_t e = cudaStreamSynchronize(ctx_->stream()); e != cudaSuccess) {
      return make_error("kernel failed: {}", cudaGetErrorString(e));
    }
    return download<uint16_t>(out, n_out);
  }

  // Every output element written, finite and within rel * (largest reference output of its sequence).
  void check(const Shape& shape, AttentionVariant variant, double rel, uint32_t seed) {
    SCOPED_TRACE(shape.label() + fmt::format(" variant {} seed {}", static_cast<int>(variant), seed));
    const Batch b = make_batch(shape, seed);
    auto got = run(b, variant);
    ASSERT_TRUE(got.has_value()) << got.error().message;
    const std::vector<float> want = reference(b);
    const int64_t width = shape.n_heads * shape.head_dim;
    for (size_t i = 0; i < shape.seqs.size(); ++i) {
      if (shape.seqs[i].n_q == 0) continue;
      const int64_t begin = b.query_start[i] * width, end = b.query_start[i + 1] * width;
      double ref_max = 0.0;
      for (int64_t e = begin; e < end; ++e) ref_max = std::max(ref_max, std::fabs(double(want[e])));
      for (int64_t e = begin; e < end; ++e) {
        ASSERT_NE((*got)[e], kPoison) << "element " << e << " never written (sequence " << i << ")";
        const float g = bf16_to_float((*got)[e]);
        ASSERT_TRUE(std::isfinite(g)) << "element " << e << " is " << g << " (sequence " << i << ")";
        ASSERT_LE(std::fabs(double(g) - want[e]), rel * ref_max)
            << "element " << e << " got " << g << " want " << want[e] << " (sequence " << i << ")";
      }
      EXPECT_GT(ref_max, 0.0);
    }
  }

  std::unique_ptr<DeviceContext> ctx_;
};

const std::vector<Seq> kDecodeSeqs = {{0, 1}, {37, 1}, {300, 1}, {1000, 2}, {15, 3}, {100, 0}, {5000, 1}, {4, 4}};
const std::vector<Seq> kPrefillSeqs = {{0, 100}, {50, 7}, {200, 130}, {0, 1}, {64, 64}, {13, 200}, {7, 0}, {3, 65}};

TEST_F(CudaAttention, DecodeMatchesCpuOnRaggedBatches) {
  uint32_t seed = 100;
  for (int64_t hd : {32, 64, 128, 256}) {
    for (int64_t group : {1, 2, 8}) {
      const Shape shape{kDecodeSeqs, 2 * group, 2, hd, 16, (hd + group) % 3 == 0};
      check(shape, AttentionVariant::kDecode, kDecodeRel, ++seed);
      check(shape, AttentionVariant::kAuto, kDecodeRel, ++seed);
    }
  }
}

TEST_F(CudaAttention, PrefillMatchesCpuOnRaggedBatches) {
  uint32_t seed = 200;
  for (int64_t hd : {32, 64, 128, 256}) {
    for (int64_t group : {1, 2, 8}) {
      const Shape shape{kPrefillSeqs, 2 * group, 2, hd, 16, (hd + group) % 3 != 0};
      check(shape, AttentionVariant::kPrefill, kPrefillRel, ++seed);
      check(shape, AttentionVariant::kPrefillMma, kPrefillRel, ++seed);
      check(shape, AttentionVariant::kAuto, kPrefillRel, ++seed);
    }
  }
}

// On an H100/H200 (compute capability 9.0; tern's builds carry sm_90a code) kPrefill must take the wgmma kernel for
// the head dims it has, so the prefill checks here test it rather than a silent fallback (kPrefillMma tests the
// mma.sync kernel on the same device).
TEST_F(CudaAttention, PrefillUsesWgmmaOnHopper) {
  if (ctx_->props().cc_major != 9 || ctx_->props().cc_minor != 0) GTEST_SKIP() << "not a compute capability 9.0 GPU";
  for (int64_t hd : {64, 128, 256}) EXPECT_TRUE(attention_prefill_sm90_fits(ctx_->props(), hd)) << hd;
  EXPECT_FALSE(attention_prefill_sm90_fits(ctx_->props(), 32));
}

// The wgmma kernel's 128-row tiles on rows that end inside a tile and keys past several K/V tiles (block size 32).
TEST_F(CudaAttention, WgmmaPrefillAcrossTiles) {
  if (!attention_prefill_sm90_fits(ctx_->props(), 128)) GTEST_SKIP() << "no wgmma prefill on this device";
  uint32_t seed = 700;
  for (int64_t hd : {64, 128, 256}) {
    check(Shape{{{0, 700}, {300, 129}, {5, 127}}, 4, 4, hd, 32, false}, AttentionVariant::kPrefill, kPrefillRel,
          ++seed);
  }
}

// Each variant also handles the other's batches (decode: many queries per sequence; prefill: one).
TEST_F(CudaAttention, EachVariantHandlesTheOthersBatches) {
  uint32_t seed = 300;
  for (int64_t hd : {64, 128}) {
    check(Shape{kPrefillSeqs, 8, 2, hd, 16, true}, AttentionVariant::kDecode, kDecodeRel, ++seed);
    check(Shape{kDecodeSeqs, 8, 2, hd, 16, false}, AttentionVariant::kPrefill, kPrefillRel, ++seed);
  }
}

TEST_F(CudaAttention, GroupOf16AndOtherBlockSizes) {
  uint32_t seed = 400;
  for (int64_t bs : {8, 32, 256}) {
    check(Shape{kDecodeSeqs, 16, 1, 128, bs, true}, AttentionVariant::kDecode, kDecodeRel, ++seed);
    check(Shape{kPrefillSeqs, 16, 1, 256, bs, false}, AttentionVariant::kPrefill, kPrefillRel, ++seed);
    check(Shape{{{9, 3}, {0, 70}}, 3, 3, 32, bs, true}, AttentionVariant::kPrefill, kPrefillRel, ++seed);
  }
}

TEST_F(CudaAttention, LongContextDecode) {
  check(Shape{{{32767, 1}, {20000, 4}, {8191, 1}}, 16, 2, 128, 16, false}, AttentionVariant::kDecode, kDecodeRel, 501);
  check(Shape{{{32000, 1}, {77, 1}}, 16, 1, 256, 16, true}, AttentionVariant::kDecode, kDecodeRel, 502);
  check(Shape{{{16384, 1}}, 4, 4, 64, 32, false}, AttentionVariant::kAuto, kDecodeRel, 503);
}

// Serving-sized decode steps: 96 rows of about 1k keys for Qwen3-8B's 32/8 heads of 128 (a few rows with 2..4
// queries, one empty sequence), 64 rows for Qwen3.5's 32/2 heads of 256 (group 16). Each row's key count differs,
// so the warps' chunk tails, the split ranges and the per-row positions are all exercised at the split counts the
// launch picks for large batches.
std::vector<Seq> large_batch(int64_t n_seqs, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Seq> seqs;
  for (int64_t i = 0; i < n_seqs; ++i) {
    const int64_t n_q = i % 16 == 5 ? 2 + static_cast<int64_t>(rng() % 3) : i == 40 ? 0 : 1;
    seqs.push_back({900 + static_cast<int64_t>(rng() % 250), n_q});
  }
  return seqs;
}

TEST_F(CudaAttention, LargeBatchDecode) {
  check(Shape{large_batch(96, 801), 32, 8, 128, 16, false}, AttentionVariant::kDecode, kDecodeRel, 802);
  check(Shape{large_batch(128, 803), 32, 8, 128, 16, true}, AttentionVariant::kAuto, kDecodeRel, 804);
  check(Shape{large_batch(64, 805), 32, 2, 256, 16, true}, AttentionVariant::kDecode, kDecodeRel, 806);
}

TEST_F(CudaAttention, LongPrefill) {
  check(Shape{{{0, 2048}, {4000, 300}}, 8, 2, 128, 16, true}, AttentionVariant::kPrefill, kPrefillRel, 601);
  check(Shape{{{0, 1500}, {700, 333}}, 16, 2, 256, 16, true}, AttentionVariant::kPrefill, kPrefillRel, 602);
  check(Shape{{{0, 2048}, {4000, 300}}, 8, 2, 128, 16, false}, AttentionVariant::kPrefillMma, kPrefillRel, 603);
}

// ---------------------------------------------------------------------------------------------------------------
// attention_prepare

struct PrepareShape {
  int64_t tokens, n_heads, n_kv_heads, head_dim, rotary_dim;
  bool norm, zero_centred, gated;
  float attention_factor = 1.0f;  // YaRN's: cos and sin times it
};

TEST_F(CudaAttention, PrepareMatchesCpuLayers) {
  const PrepareShape shapes[] = {
      {7, 4, 2, 64, 64, true, false, false},    {33, 8, 2, 256, 64, true, true, true},  // Qwen3.5: partial, (1+w)
      {5, 2, 1, 128, 128, false, false, false}, {9, 6, 3, 32, 16, true, false, true},
      {1, 16, 1, 128, 0, true, true, false},  // no RoPE
      {11, 8, 4, 128, 128, true, false, false, 1.1386294f},  // Qwen3 with yarn x4
      {6, 8, 2, 256, 64, true, true, true, 1.1386294f},      // Qwen3.5 with yarn x4
  };
  uint32_t seed = 700;
  for (const PrepareShape& s : shapes) {
    SCOPED_TRACE(fmt::format("T={} heads {}/{} hd {} rot {} norm {} zc {} gated {} factor {}", s.tokens, s.n_heads,
                             s.n_kv_heads, s.head_dim, s.rotary_dim, s.norm, s.zero_centred, s.gated,
                             s.attention_factor));
    std::mt19937 rng(++seed);
    const int64_t hd = s.head_dim, qw = s.n_heads * hd * (s.gated ? 2 : 1), kvw = s.n_kv_heads * hd;
    const int64_t stride = qw + 2 * kvw + 8;  // a fused qkv projection output with a padded row
    const std::vector<uint16_t> qkv = random_bf16(rng, static_cast<size_t>(s.tokens * stride), 2.0f);
    const std::vector<uint16_t> qw_bf = random_bf16(rng, hd, 0.5f), kw_bf = random_bf16(rng, hd, 0.5f);
    std::vector<uint16_t> q_weight = qw_bf, k_weight = kw_bf;
    if (!s.zero_centred) {  // plain weights sit around 1
      for (auto& w : q_weight) w = float_to_bf16(1.0f + bf16_to_float(w));
      for (auto& w : k_weight) w = float_to_bf16(1.0f + bf16_to_float(w));
    }
    const int64_t bs = 16, n_blocks = (s.tokens + bs - 1) / bs + 2, n_slots = n_blocks * bs;
    std::vector<int32_t> positions(s.tokens), slots(n_slots);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    slots.resize(s.tokens);
    if (s.tokens > 2) slots[1] = -1;  // a padding token: no cache write
    for (auto& p : positions) p = static_cast<int32_t>(rng() % (1u << 17));
    const std::vector<float> inv_freq = rope_inv_freq(std::max<int64_t>(s.rotary_dim, 2), 1e6);

    const DeviceBuffer d_qkv = upload(qkv), d_qw = upload(q_weight), d_kw = upload(k_weight);
    const DeviceBuffer d_pos = upload(positions), d_slots = upload(slots), d_freq = upload(inv_freq);
    DeviceBuffer q_out = upload(std::vector<uint16_t>(s.tokens * s.n_heads * hd, kPoison));
    DeviceBuffer gate_out = upload(std::vector<uint16_t>(s.tokens * s.n_heads * hd, kPoison));
    DeviceBuffer kc = upload(std::vector<uint16_t>(n_slots * kvw, kPoison)),
                 vc = upload(std::vector<uint16_t>(n_slots * kvw, kPoison));
    const uint16_t* base = d_qkv.as<uint16_t>();
    const AttentionPrepareArgs a{.q_proj = base,
                                 .q_proj_stride = stride,
                                 .k = base + qw,
                                 .v = base + qw + kvw,
                                 .kv_stride = stride,
                                 .q_norm_weight = s.norm ? d_qw.as<uint16_t>() : nullptr,
                                 .k_norm_weight = s.norm ? d_kw.as<uint16_t>() : nullptr,
                                 .eps = 1e-6f,
                                 .zero_centred = s.zero_centred,
                                 .positions = d_pos.as<int32_t>(),
                                 .inv_freq = d_freq.as<float>(),
                                 .rotary_dim = s.rotary_dim,
                                 .attention_factor = s.attention_factor,
                                 .slot_mapping = d_slots.as<int32_t>(),
                                 .q_out = q_out.as<uint16_t>(),
                                 .gate_out = s.gated ? gate_out.as<uint16_t>() : nullptr,
                                 .cache = {.k = kc.as<uint16_t>(),
                                           .v = vc.as<uint16_t>(),
                                           .n_blocks = n_blocks,
                                           .block_size = bs,
                                           .n_kv_heads = s.n_kv_heads,
                                           .head_dim = hd},
                                 .tokens = s.tokens,
                                 .n_heads = s.n_heads,
                                 .n_kv_heads = s.n_kv_heads,
                                 .head_dim = hd,
                                 .gated = s.gated};
    ASSERT_TRUE(attention_prepare(*ctx_, a).has_value());
    ctx_->synchronize();
    const auto got_q = download<uint16_t>(q_out, s.tokens * s.n_heads * hd);
    const auto got_gate = download<uint16_t>(gate_out, s.tokens * s.n_heads * hd);
    const auto got_k = download<uint16_t>(kc, n_slots * kvw), got_v = download<uint16_t>(vc, n_slots * kvw);

    // The CPU layers' fp32 math on the same bf16 inputs.
    const RmsNorm q_norm{.weight = widen(q_weight.data(), hd), .eps = 1e-6f, .zero_centred = s.zero_centred};
    const RmsNorm k_norm{.weight = widen(k_weight.data(), hd), .eps = 1e-6f, .zero_centred = s.zero_centred};
    const Rope rope(s.rotary_dim, 1e6, {.inv_freq = inv_freq, .attention_factor = s.attention_factor});
    // Per head row: within 2^-8 (+2^-16 for fp32 order, sincosf) of the row's largest value.
    auto expect_row = [&](const uint16_t* got, const float* want, const std::string& what) {
      double row_max = 0.0;
      for (int64_t d = 0; d < hd; ++d) row_max = std::max(row_max, std::fabs(double(want[d])));
      for (int64_t d = 0; d < hd; ++d) {
        ASSERT_NE(got[d], kPoison) << what << " dim " << d << " never written";
        ASSERT_LE(std::fabs(double(bf16_to_float(got[d])) - want[d]), (1.0 / 256 + 1.0 / 65536) * row_max)
            << what << " dim " << d << " got " << bf16_to_float(got[d]) << " want " << want[d];
      }
    };
    std::vector<bool> written(n_slots, false);
    for (int64_t t = 0; t < s.tokens; ++t) {
      const uint16_t* row = &qkv[t * stride];
      std::vector<float> q(s.n_heads * hd), k = widen(row + qw, kvw);
      for (int64_t h = 0; h < s.n_heads; ++h) {
        const uint16_t* src = row + h * hd * (s.gated ? 2 : 1);
        std::copy_n(widen(src, hd).data(), hd, &q[h * hd]);
        for (int64_t d = 0; d < hd && s.gated; ++d) {
          ASSERT_EQ(got_gate[(t * s.n_heads + h) * hd + d], src[hd + d]) << "gate t " << t << " h " << h;
        }
      }
      if (s.norm) {
        q_norm.forward(q.data(), s.n_heads, q.data());
        k_norm.forward(k.data(), s.n_kv_heads, k.data());
      }
      if (s.rotary_dim > 0) {
        rope.apply(q.data(), s.n_heads, hd, positions[t]);
        rope.apply(k.data(), s.n_kv_heads, hd, positions[t]);
      }
      for (int64_t h = 0; h < s.n_heads; ++h) {
        expect_row(&got_q[(t * s.n_heads + h) * hd], &q[h * hd], fmt::format("q t {} h {}", t, h));
      }
      if (slots[t] < 0) continue;
      written[slots[t]] = true;
      for (int64_t h = 0; h < s.n_kv_heads; ++h) {
        expect_row(&got_k[(slots[t] * s.n_kv_heads + h) * hd], &k[h * hd], fmt::format("k t {} h {}", t, h));
      }
      ASSERT_TRUE(std::equal(row + qw + kvw, row + qw + 2 * kvw, &got_v[slots[t] * kvw])) << "v t " << t;
    }
    for (int64_t slot = 0; slot < n_slots; ++slot) {
      if (written[slot]) continue;
      for (int64_t i = 0; i < kvw; ++i) {
        ASSERT_EQ(got_k[slot * kvw + i], kPoison) << "k slot " << slot << " was written";
        ASSERT_EQ(got_v[slot * kvw + i], kPoison) << "v slot " << slot << " was written";
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Bad arguments

TEST_F(CudaAttention, BadArgumentsAreErrors) {
  DeviceBuffer buf(1 << 16);
  auto* p = buf.as<uint16_t>();
  auto* i32 = buf.as<int32_t>();
  const PagedKvCache cache{.k = p, .v = p, .n_blocks = 4, .block_size = 16, .n_kv_heads = 2, .head_dim = 64};
  const PagedAttentionArgs good{.q = p,
                                .out = p,
                                .cache = cache,
                                .block_tables = i32,
                                .max_blocks_per_seq = 4,
                                .query_start = i32,
                                .seq_lens = i32,
                                .n_seqs = 1,
                                .tokens = 1,
                                .n_heads = 4,
                                .max_query_len = 1,
                                .max_seq_len = 64,
                                .scale = 0.125f,
                                .workspace = buf.data(),
                                .workspace_bytes = buf.size_bytes()};
  auto expect_error = [&](PagedAttentionArgs a, const std::string& text) {
    auto r = paged_attention(*ctx_, a);
    ASSERT_FALSE(r.has_value()) << text;
    EXPECT_NE(r.error().message.find(text), std::string::npos) << r.error().message;
  };
  PagedAttentionArgs a = good;
  a.q = nullptr;
  expect_error(a, "q is null");
  a = good;
  a.cache.head_dim = 96;
  expect_error(a, "cache.head_dim=96 is not supported");
  a = good;
  a.cache.block_size = 12;
  expect_error(a, "cache.block_size=12 must be a power of two");
  a = good;
  a.n_heads = 5;
  expect_error(a, "n_heads=5 must be a positive multiple of n_kv_heads=2");
  a = good;
  a.n_heads = 34;
  expect_error(a, "17 query heads per kv head exceed");
  a = good;
  a.out = p + 1;
  expect_error(a, "out is not 16-byte aligned");
  a = good;
  a.max_blocks_per_seq = 3;
  expect_error(a, "max_blocks_per_seq=3 must hold max_seq_len=64");
  a = good;
  a.scale = 0.0f;
  expect_error(a, "scale=0 must be positive");

  const AttentionPrepareArgs prep{.q_proj = p,
                                  .q_proj_stride = 256,
                                  .k = p,
                                  .v = p,
                                  .kv_stride = 128,
                                  .positions = i32,
                                  .inv_freq = buf.as<float>(),
                                  .rotary_dim = 64,
                                  .slot_mapping = i32,
                                  .q_out = p,
                                  .cache = cache,
                                  .tokens = 1,
                                  .n_heads = 4,
                                  .n_kv_heads = 2,
                                  .head_dim = 64};
  EXPECT_TRUE(attention_prepare(*ctx_, {.q_proj = p,
                                        .q_proj_stride = 256,
                                        .k = p,
                                        .v = p,
                                        .kv_stride = 128,
                                        .rotary_dim = 0,
                                        .slot_mapping = i32,
                                        .q_out = p,
                                        .cache = cache,
                                        .tokens = 0,
                                        .n_heads = 4,
                                        .n_kv_heads = 2,
                                        .head_dim = 64})
                  .has_value());
  auto expect_prep_error = [&](AttentionPrepareArgs b, const std::string& text) {
    auto r = attention_prepare(*ctx_, b);
    ASSERT_FALSE(r.has_value()) << text;
    EXPECT_NE(r.error().message.find(text), std::string::npos) << r.error().message;
  };
  AttentionPrepareArgs b = prep;
  b.gated = true;
  b.q_proj_stride = 512;
  expect_prep_error(b, "gate_out (gated) is null");
  b = prep;
  b.rotary_dim = 66;
  expect_prep_error(b, "rotary_dim=66 must be even and in [0, head_dim=64]");
  b = prep;
  b.q_proj_stride = 200;
  expect_prep_error(b, "q_proj_stride=200 is below the row's 256 values");
  b = prep;
  b.head_dim = 48;
  expect_prep_error(b, "head_dim=48 is not supported");
  b = prep;
  b.slot_mapping = nullptr;
  expect_prep_error(b, "slot_mapping is null");
}

}  // namespace
}  // namespace tern
