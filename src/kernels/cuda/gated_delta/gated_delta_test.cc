// The Gated DeltaNet kernels against the CPU path (kernels/cpu/gated_delta.h with layers/gated_deltanet.cc's fp32
// preparation, via ops/gdn_op.h) on fresh random bf16-exact inputs: ragged batches mixing new sequences (NaN in
// their slot) and continuing ones, every head shape, both delta-rule kernels, lengths up to 4096, prefill followed by
// decode steps continuing the same states, a slot outside the batch that must stay as it was, poisoned outputs with
// poisoned rows past the batch, speculative verification (row slots: the states after every row of a verified
// sequence, against the CPU path on each prefix), and bad arguments. Label: gpu.
//
// Tolerances. conv: y is bf16, so |y - ref| <= 2^-8 |ref| (round to nearest moves a value by at most half an ulp,
// 2^-8 relative) + 2^-16 max|ref| (fp32 sums of <= 8 products and expf, ~1e-7); the conv state is a copy of bf16
// inputs: exact. Delta rule: out is bf16: 2^-8 |ref| + 2^-10 max|out_ref|; the state is fp32: 2^-12 max|S_ref|.
// The fp32 terms cover the two fp32 computations differing in order (the chunked form sums over chunks and applies
// decays as exp of sums): each token adds rounding near 2^-24 sqrt(dk) of the state's scale, and the recurrence
// contracts (decay <= 1, I - beta k k^T has norm <= 1), so errors do not compound; over 4096 tokens a random walk of
// them stays below ~1e-5 of the scale, 20x under 2^-12. A wrong decay, key head, chunk boundary or missing state
// is off by O(1) of the scale. A row slot's state (speculative verification) has the state tolerance over its own
// slot's max|S_ref|, a row slot's conv window is exact.
#include "kernels/cuda/gated_delta/gated_delta.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/formats.h"
#include "kernels/cuda/device_test_util.h"
#include "ops/gdn_op.h"
#include "ops/harness_util.h"
#include "ops/registry.h"
#include "ops/verify.h"

namespace tern {
namespace {

constexpr uint16_t kPoison = kPoisonBf16Bits;
constexpr int64_t kSpareRows = 3;  // poisoned rows after the batch's rows, which no kernel may write

using cuda_test::download;
using cuda_test::upload;

// A sub-batch: sequence s of the inputs processes its rows [first[s], first[s] + count[s]).
struct Step {
  std::vector<int64_t> first, count;
};

// Gathers the rows of `step` into one contiguous call, as the engine does for a mixed batch.
struct StepBatch {
  GdnBatch batch;
  std::vector<int64_t> rows;  // source row of each call row
};

StepBatch step_batch(const GdnBatch& full, const Step& step) {
  StepBatch b;
  b.batch = GdnBatch{.query_start = {0}, .n_seqs = full.n_seqs, .n_slots = full.n_slots};
  for (int64_t s = 0; s < full.n_seqs; ++s) {
    for (int64_t i = 0; i < step.count[s]; ++i) b.rows.push_back(full.query_start[s] + step.first[s] + i);
    b.batch.query_start.push_back(static_cast<int32_t>(b.rows.size()));
    b.batch.state_slot.push_back(full.state_slot[s]);
    b.batch.seq_past.push_back(static_cast<int32_t>(full.seq_past[s] + step.first[s]));
    b.batch.max_query_len = std::max(b.batch.max_query_len, step.count[s]);
  }
  b.batch.tokens = static_cast<int64_t>(b.rows.size());
  return b;
}

template <class T>
std::vector<T> gather_rows(const std::vector<T>& src, int64_t stride, const std::vector<int64_t>& rows) {
  std::vector<T> out;
  for (int64_t r : rows) out.insert(out.end(), src.begin() + r * stride, src.begin() + (r + 1) * stride);
  return out;
}

struct DeviceMeta {
  DeviceBuffer query_start, state_slot, seq_past;
  GdnSequences seqs(const GdnBatch& b) const {
    return {.query_start = query_start.as<int32_t>(), .state_slot = state_slot.as<int32_t>(),
            .seq_past = seq_past.as<int32_t>(), .n_seqs = b.n_seqs, .tokens = b.tokens,
            .max_query_len = b.max_query_len};
  }
};
DeviceMeta meta_upload(const GdnBatch& b) {
  return {upload(b.query_start), upload(b.state_slot), upload(b.seq_past)};
}

// The chunked kernels' workspace for `tokens` rows of a case's shapes, poisoned (the kernels write before they read).
struct ChunkedWorkspace {
  int64_t bytes;
  DeviceBuffer buffer;
  ChunkedWorkspace(const GdnDeltaRuleInputs& in, int64_t tokens)
      : bytes(gdn_chunked_workspace_bytes(tokens, in.n_key_heads, in.n_value_heads, in.key_dim, in.value_dim)),
        buffer(upload(std::vector<uint32_t>(static_cast<size_t>(bytes / 4), kPoisonF32Bits))) {}
};

// Checks got against want with per-element |err| <= rel |want| + abs_of_max max|want|; NaN never passes. Returns
// the largest error / allowed.
double check_close(const std::vector<float>& got, const std::vector<float>& want, double rel, double abs_of_max,
                   const std::string& what) {
  EXPECT_EQ(got.size(), want.size()) << what;
  if (got.size() != want.size()) return 0.0;
  double ref_max = 0.0, worst = 0.0;
  for (float w : want) ref_max = std::max(ref_max, std::fabs(double(w)));
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double allowed = rel * std::fabs(double(want[i])) + abs_of_max * ref_max;
    const double err = std::fabs(double(got[i]) - want[i]);
    const bool ok = std::isfinite(got[i]) && err <= allowed;
    if (std::isfinite(got[i]) && allowed > 0) worst = std::max(worst, err / allowed);
    if (!ok && ++bad <= 5) ADD_FAILURE() << what << ": element " << i << " = " << got[i] << ", want " << want[i];
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " wrong";
  return worst;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rel, double abs_of_max,
                  const std::string& what) {
  const double worst = check_close(got, want, rel, abs_of_max, what);
  std::printf("%-64s max error / allowed = %.3f\n", what.c_str(), worst);
}

std::vector<float> widen_bf16(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(v[i]);
  return out;
}

class GdnKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
    ASSERT_GT(count, 0) << "no CUDA device";
    ctx_ = std::make_unique<DeviceContext>(0);
    ASSERT_TRUE(gdn_register_cpu(registry_).has_value());
  }
  template <class Inputs>
  Inputs make(const std::string& op, const SelfTestCase& c, uint64_t seed) {
    auto in = registry_.harness(op)->make_inputs(c, seed);
    EXPECT_TRUE(in.has_value());
    return static_cast<Inputs&>(**in);
  }

  // Runs the delta rule over `steps` in order on one device state; returns [out (all rows) | final state].
  std::vector<float> run_delta(const GdnDeltaRuleInputs& in, const std::vector<Step>& steps, GdnVariant variant) {
    const int64_t hv = in.n_value_heads, dv = in.value_dim;
    DeviceBuffer state = upload(in.state);
    const DeviceBuffer a_log = upload(in.a_log), dt_bias = upload(in.dt_bias);
    std::vector<float> out(static_cast<size_t>(in.batch.tokens * hv * dv), std::bit_cast<float>(kPoisonF32Bits));
    for (const Step& step : steps) {
      const StepBatch sb = step_batch(in.batch, step);
      const DeviceBuffer qkv = upload(gather_rows(in.qkv, in.qkv_stride, sb.rows));
      const DeviceBuffer a = upload(gather_rows(in.a, in.ab_stride, sb.rows));
      const DeviceBuffer b = upload(gather_rows(in.b, in.ab_stride, sb.rows));
      const DeviceMeta meta = meta_upload(sb.batch);
      const size_t out_count = static_cast<size_t>((sb.batch.tokens + kSpareRows) * hv * dv);
      DeviceBuffer dout = upload(std::vector<uint16_t>(out_count, kPoison));
      const ChunkedWorkspace ws(in, sb.batch.tokens);
      const GdnDeltaRuleArgs args{.qkv = qkv.as<uint16_t>(), .qkv_stride = in.qkv_stride, .a = a.as<uint16_t>(),
                                  .b = b.as<uint16_t>(), .ab_stride = in.ab_stride, .a_log = a_log.as<float>(),
                                  .dt_bias = dt_bias.as<float>(), .state = state.as<float>(),
                                  .out = dout.as<uint16_t>(), .seqs = meta.seqs(sb.batch),
                                  .n_key_heads = in.n_key_heads, .n_value_heads = hv, .key_dim = in.key_dim,
                                  .value_dim = dv, .workspace = ws.buffer.as<float>(), .workspace_bytes = ws.bytes};
      const auto status = gdn_delta_rule(*ctx_, args, variant);
      EXPECT_TRUE(status.has_value()) << (status ? "" : status.error().message);
      ctx_->synchronize();
      const std::vector<uint16_t> host = download<uint16_t>(dout, out_count);
      for (size_t r = 0; r < sb.rows.size(); ++r) {
        for (int64_t i = 0; i < hv * dv; ++i) {
          const uint16_t v = host[r * hv * dv + i];
          out[sb.rows[r] * hv * dv + i] = v == kPoison ? std::bit_cast<float>(kPoisonF32Bits) : bf16_to_float(v);
        }
      }
      for (size_t i = sb.rows.size() * hv * dv; i < out_count; ++i) {
        EXPECT_EQ(host[i], kPoison) << "a row past the batch was written";
      }
    }
    const std::vector<float> st = download<float>(state, in.state.size());
    out.insert(out.end(), st.begin(), st.end());
    return out;
  }

  void check_delta(const GdnDeltaRuleInputs& in, const std::vector<float>& got, const std::string& what) {
    const std::vector<float> want = gdn_delta_rule_cpu(in);
    const auto split = static_cast<std::ptrdiff_t>(in.batch.tokens * in.n_value_heads * in.value_dim);
    expect_close({got.begin(), got.begin() + split}, {want.begin(), want.begin() + split}, 0x1p-8, 0x1p-10,
                 what + " out");
    expect_close({got.begin() + split, got.end()}, {want.begin() + split, want.end()}, 0.0, 0x1p-12, what + " state");
  }

  std::unique_ptr<DeviceContext> ctx_;
  Registry registry_;
};

Step whole(const GdnBatch& b) {
  Step s;
  for (int64_t i = 0; i < b.n_seqs; ++i) {
    s.first.push_back(0);
    s.count.push_back(b.query_start[i + 1] - b.query_start[i]);
  }
  return s;
}

// Prefill of the first `prefill` rows (fewer if the sequence is shorter), then one row per sequence per step.
std::vector<Step> prefill_then_decode(const GdnBatch& b, int64_t prefill) {
  std::vector<Step> steps;
  Step first = whole(b);
  for (auto& c : first.count) c = std::min(c, prefill);
  steps.push_back(first);
  for (int64_t done = prefill;; ++done) {
    Step next;
    bool any = false;
    for (int64_t s = 0; s < b.n_seqs; ++s) {
      const int64_t len = b.query_start[s + 1] - b.query_start[s];
      next.first.push_back(std::min(done, len));
      next.count.push_back(done < len ? 1 : 0);
      any = any || done < len;
    }
    if (!any) break;
    steps.push_back(next);
  }
  return steps;
}

const char* variant_name(GdnVariant v) {
  return v == GdnVariant::kRecurrent ? "recurrent" : v == GdnVariant::kChunked ? "chunked" : "auto";
}

struct Heads {
  int64_t hk, hv, dk, dv;
};
constexpr Heads kHeadShapes[] = {{2, 2, 32, 32}, {1, 2, 64, 32}, {2, 8, 32, 64}, {1, 4, 128, 128},
                                 {2, 4, 64, 128}, {3, 3, 128, 64}};

TEST_F(GdnKernels, DeltaRuleMatchesCpuOnRaggedBatches) {
  uint64_t seed = 11;
  for (const GdnVariant v : {GdnVariant::kRecurrent, GdnVariant::kChunked}) {
    for (const Heads& h : kHeadShapes) {
      for (const auto& [n_seqs, max_len] : {std::pair<int64_t, int64_t>{7, 1}, {5, 37}, {3, 130}}) {
        const auto c = gdn_delta_rule_case(n_seqs, max_len, h.hk, h.hv, h.dk, h.dv);
        const auto in = make<GdnDeltaRuleInputs>("gdn_delta_rule", c, ++seed);
        check_delta(in, run_delta(in, {whole(in.batch)}, v), fmt::format("{} {}", variant_name(v), c.label));
      }
    }
  }
}

TEST_F(GdnKernels, DeltaRuleLongSequences) {
  for (const GdnVariant v : {GdnVariant::kChunked, GdnVariant::kRecurrent}) {
    for (const Heads& h : {Heads{1, 2, 128, 128}, Heads{1, 4, 32, 32}}) {
      const auto c = gdn_delta_rule_case(2, 4096, h.hk, h.hv, h.dk, h.dv);
      const auto in = make<GdnDeltaRuleInputs>("gdn_delta_rule", c, 77);
      check_delta(in, run_delta(in, {whole(in.batch)}, v), fmt::format("{} {}", variant_name(v), c.label));
    }
  }
}

// Prefill (auto picks chunked above 16 rows) then decode steps (auto picks recurrent) on the same states must
// match one CPU pass over all the rows.
TEST_F(GdnKernels, PrefillThenDecodeContinuesTheState) {
  for (const Heads& h : {Heads{2, 4, 128, 128}, Heads{1, 2, 32, 64}}) {
    for (const int64_t prefill : {5, 70}) {
      const auto c = gdn_delta_rule_case(4, 90, h.hk, h.hv, h.dk, h.dv);
      const auto in = make<GdnDeltaRuleInputs>("gdn_delta_rule", c, 200 + prefill);
      check_delta(in, run_delta(in, prefill_then_decode(in.batch, prefill), GdnVariant::kAuto),
                  fmt::format("prefill {} then decode, {}", prefill, c.label));
    }
  }
}

// conv over `steps` in order on one device conv state; returns [y | final conv state].
std::vector<float> run_conv(const DeviceContext& ctx, const GdnConvInputs& in, const std::vector<Step>& steps) {
  DeviceBuffer state = upload(in.conv_state);
  const DeviceBuffer w = upload(in.weight);
  std::vector<float> y(static_cast<size_t>(in.batch.tokens * in.channels), std::bit_cast<float>(kPoisonF32Bits));
  for (const Step& step : steps) {
    const StepBatch sb = step_batch(in.batch, step);
    const DeviceBuffer x = upload(gather_rows(in.x, in.x_stride, sb.rows));
    const DeviceMeta meta = meta_upload(sb.batch);
    const size_t count = static_cast<size_t>((sb.batch.tokens + kSpareRows) * in.channels);
    DeviceBuffer dy = upload(std::vector<uint16_t>(count, kPoison));
    const GdnConvArgs args{.x = x.as<uint16_t>(), .x_stride = in.x_stride, .weight = w.as<float>(),
                           .conv_state = state.as<uint16_t>(), .y = dy.as<uint16_t>(), .seqs = meta.seqs(sb.batch),
                           .channels = in.channels, .kernel = in.kernel};
    const auto status = gdn_conv1d(ctx, args);
    EXPECT_TRUE(status.has_value()) << (status ? "" : status.error().message);
    ctx.synchronize();
    const std::vector<uint16_t> host = download<uint16_t>(dy, count);
    for (size_t r = 0; r < sb.rows.size(); ++r) {
      for (int64_t c = 0; c < in.channels; ++c) {
        const uint16_t v = host[r * in.channels + c];
        y[sb.rows[r] * in.channels + c] = v == kPoison ? std::bit_cast<float>(kPoisonF32Bits) : bf16_to_float(v);
      }
    }
    for (size_t i = sb.rows.size() * in.channels; i < count; ++i) EXPECT_EQ(host[i], kPoison) << "row past the batch";
  }
  const std::vector<float> st = widen_bf16(download<uint16_t>(state, in.conv_state.size()));
  y.insert(y.end(), st.begin(), st.end());
  return y;
}

TEST_F(GdnKernels, ConvMatchesCpuOnRaggedBatchesAndContinues) {
  uint64_t seed = 300;
  for (const int64_t kernel : {2, 3, 4, 5, 8}) {
    for (const int64_t channels : {64, 1000, 36}) {
      // 1100 rows: a long prefill, 8 channels a thread (16-byte accesses) where the channels allow (not 36)
      for (const auto& [n_seqs, max_len] : {std::pair<int64_t, int64_t>{9, 1}, {5, 21}, {2, 300}, {2, 1100}}) {
        const auto c = gdn_conv_case(n_seqs, max_len, channels, kernel);
        const auto in = make<GdnConvInputs>("gdn_conv", c, ++seed);
        const std::vector<float> want = gdn_conv_cpu(in);
        const auto split = static_cast<std::ptrdiff_t>(in.batch.tokens * channels);
        for (const bool stepped : {false, true}) {
          const auto got = stepped ? run_conv(*ctx_, in, prefill_then_decode(in.batch, 2))
                                   : run_conv(*ctx_, in, {whole(in.batch)});
          const std::string what = c.label + (stepped ? " prefill 2 then decode" : "");
          expect_close({got.begin(), got.begin() + split}, {want.begin(), want.begin() + split}, 0x1p-8, 0x1p-16,
                       what + " y");
          expect_close({got.begin() + split, got.end()}, {want.begin() + split, want.end()}, 0.0, 0.0, what + " state");
        }
      }
    }
  }
}

TEST_F(GdnKernels, QwenShapesRun) {
  // Qwen3.5-397B's per-GPU shapes at tensor parallel 4 (Hk 4, Hv 16) and unsharded conv channels 12288.
  const auto conv = make<GdnConvInputs>("gdn_conv", gdn_conv_case(3, 64, 12288, 4), 5);
  const std::vector<float> want = gdn_conv_cpu(conv);
  const std::vector<float> got = run_conv(*ctx_, conv, {whole(conv.batch)});
  expect_close(got, want, 0x1p-8, 0x1p-16, "conv Qwen3.5 C=12288 (y | state)");
  const auto in = make<GdnDeltaRuleInputs>("gdn_delta_rule", gdn_delta_rule_case(3, 200, 4, 16, 128, 128), 6);
  check_delta(in, run_delta(in, {whole(in.batch)}, GdnVariant::kAuto), "auto Qwen3.5 Hk=4 Hv=16");
}

// ---------------------------------------------------------------------------------------------------------------
// Speculative verification (GdnSequences::row_slots): the states after every row of a verification in its row slots.

// A sequence of a verification batch: its rows, whether it continues a state (seq_past > 0), whether it is a
// verification.
struct VerifySeq {
  int64_t len;
  bool continues, verify;
};

// A mixed batch (a verification of 3 rows has decoy entries past its rows; kAuto takes the chunked kernel, 70 rows),
// a decode-only one (kAuto takes the recurrent kernel, the conv one token lane), and long verifications whose rows
// cross chunks (64 and 32 rows), one longer than max_rows.
struct VerifyCase {
  const char* name;
  std::vector<VerifySeq> seqs;
  int64_t max_rows;
};
const VerifyCase kVerifyCases[] = {
    {"mixed",
     {{3, true, true}, {40, true, false}, {1, true, true}, {5, false, true}, {2, false, false}, {5, true, true},
      {70, false, false}, {4, true, true}, {2, true, true}},
     5},
    {"decode",
     {{5, true, true}, {1, true, false}, {3, false, true}, {5, true, true}, {2, true, false}, {1, true, true}},
     5},
    {"long", {{70, true, true}, {75, false, true}, {20, true, false}, {66, true, true}}, 70},
};

enum class SlotKind { kOwn, kRow, kUntouched };  // a sequence's slot, a written row slot, a slot no kernel may write

// The batch of a VerifyCase with its slots in a shuffled order: each sequence's own slot, a verification's max_rows
// row slots (those past its rows are decoys the kernels must not write), and three slots named nowhere.
struct VerifyBatch {
  GdnBatch batch;
  std::vector<int32_t> row_slots;  // [n_seqs * max_rows]; -1 throughout for a sequence that is no verification
  int64_t max_rows = 0;
  std::vector<SlotKind> kind;  // [n_slots]
};

VerifyBatch verify_batch(const VerifyCase& c, uint64_t seed) {
  VerifyBatch v;
  v.max_rows = c.max_rows;
  GdnBatch& b = v.batch;
  b.n_seqs = static_cast<int64_t>(c.seqs.size());
  b.n_slots = b.n_seqs + 3;
  for (const VerifySeq& s : c.seqs) b.n_slots += s.verify ? c.max_rows : 0;
  std::vector<int32_t> order(static_cast<size_t>(b.n_slots));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  for (size_t i = order.size() - 1; i > 0; --i) std::swap(order[i], order[hash_bits(seed, 60, int64_t(i)) % (i + 1)]);
  size_t next = 0;
  v.kind.assign(order.size(), SlotKind::kUntouched);
  b.query_start = {0};
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    const VerifySeq& q = c.seqs[s];
    b.query_start.push_back(static_cast<int32_t>(b.query_start.back() + q.len));
    b.state_slot.push_back(order[next++]);
    v.kind[b.state_slot.back()] = SlotKind::kOwn;
    b.seq_past.push_back(q.continues ? static_cast<int32_t>(5 + s) : 0);
    b.max_query_len = std::max(b.max_query_len, q.len);
    for (int64_t t = 0; t < c.max_rows; ++t) {
      if (!q.verify) {
        v.row_slots.push_back(-1);
        continue;
      }
      v.row_slots.push_back(order[next++]);
      if (t < q.len) v.kind[v.row_slots.back()] = SlotKind::kRow;
    }
  }
  b.tokens = b.query_start.back();
  return v;
}

// Exact equality of two vectors' bit patterns (NaN payloads included), reporting the first mismatches.
template <class T>
void expect_same_bits(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) == 0) continue;
    if (++bad <= 5) ADD_FAILURE() << what << ": element " << i << " = " << got[i] << ", want " << want[i];
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " differ";
}

template <class T>
std::vector<T> slot_of(const std::vector<T>& states, int64_t slot, int64_t per_slot) {
  return {states.begin() + slot * per_slot, states.begin() + (slot + 1) * per_slot};
}

// The state of sequence s's slot after the first `rows` of its rows: the CPU path run on that prefix alone.
std::vector<float> delta_prefix_state(const GdnDeltaRuleInputs& in, int64_t s, int64_t rows) {
  const int64_t per_slot = in.n_value_heads * in.key_dim * in.value_dim;
  GdnDeltaRuleInputs p;
  p.n_key_heads = in.n_key_heads;
  p.n_value_heads = in.n_value_heads;
  p.key_dim = in.key_dim;
  p.value_dim = in.value_dim;
  p.qkv_stride = in.qkv_stride;
  p.ab_stride = in.ab_stride;
  p.qkv = in.qkv;
  p.a = in.a;
  p.b = in.b;
  p.a_log = in.a_log;
  p.dt_bias = in.dt_bias;
  p.state = slot_of(in.state, in.batch.state_slot[s], per_slot);
  const int32_t begin = in.batch.query_start[s];
  p.batch = GdnBatch{.query_start = {begin, static_cast<int32_t>(begin + rows)}, .state_slot = {0},
                     .seq_past = {in.batch.seq_past[s]}, .n_seqs = 1, .tokens = in.batch.tokens,
                     .max_query_len = rows, .n_slots = 1};
  const std::vector<float> out = gdn_delta_rule_cpu(p);
  return {out.end() - per_slot, out.end()};
}

// The conv state (window) of sequence s's slot after the first `rows` of its rows, by the CPU path on that prefix.
std::vector<float> conv_prefix_state(const GdnConvInputs& in, int64_t s, int64_t rows) {
  const int64_t per_slot = in.channels * (in.kernel - 1);
  GdnConvInputs p;
  p.channels = in.channels;
  p.kernel = in.kernel;
  p.x_stride = in.x_stride;
  p.x = in.x;
  p.weight = in.weight;
  p.conv_state = slot_of(in.conv_state, in.batch.state_slot[s], per_slot);
  const int32_t begin = in.batch.query_start[s];
  p.batch = GdnBatch{.query_start = {begin, static_cast<int32_t>(begin + rows)}, .state_slot = {0},
                     .seq_past = {in.batch.seq_past[s]}, .n_seqs = 1, .tokens = in.batch.tokens,
                     .max_query_len = rows, .n_slots = 1};
  const std::vector<float> out = gdn_conv_cpu(p);
  return {out.end() - per_slot, out.end()};
}

// Initial states of a verification batch: a continuing sequence's slot random (scale of a state), a new one's NaN
// (ignored), every other slot `poison`.
template <class T, class Random>
std::vector<T> verify_states(const VerifyBatch& v, int64_t per_slot, T poison, Random random) {
  std::vector<T> states(static_cast<size_t>(v.batch.n_slots * per_slot), poison);
  for (int64_t s = 0; s < v.batch.n_seqs; ++s) {
    const int64_t slot = v.batch.state_slot[s];
    for (int64_t i = 0; i < per_slot; ++i) {
      states[slot * per_slot + i] = random(v.batch.seq_past[s] != 0, slot * per_slot + i);
    }
  }
  return states;
}

struct VerifyDeltaRun {
  std::vector<uint16_t> out;  // [(tokens + kSpareRows) * Hv * dv] bf16 bits, the spare rows poisoned before
  std::vector<float> state;   // every slot after the call
};

// One gdn_delta_rule call over in.batch, with v's row slots or (rows false) without; the gated norm with `norm`.
VerifyDeltaRun run_verify_delta(const DeviceContext& ctx, const GdnDeltaRuleInputs& in, const VerifyBatch& v,
                                bool rows, GdnVariant variant, const GdnDeltaRuleNormInputs* norm) {
  const int64_t hv = in.n_value_heads, dv = in.value_dim;
  DeviceBuffer state = upload(in.state);
  const DeviceBuffer a_log = upload(in.a_log), dt_bias = upload(in.dt_bias);
  const DeviceBuffer qkv = upload(in.qkv), a = upload(in.a), b = upload(in.b);
  const DeviceBuffer gate = upload(norm ? norm->gate : std::vector<uint16_t>{});
  const DeviceBuffer weight = upload(norm ? norm->weight : std::vector<uint16_t>{});
  const DeviceBuffer row_slots = upload(v.row_slots);
  const DeviceMeta meta = meta_upload(in.batch);
  const size_t out_count = static_cast<size_t>((in.batch.tokens + kSpareRows) * hv * dv);
  DeviceBuffer dout = upload(std::vector<uint16_t>(out_count, kPoison));
  const ChunkedWorkspace ws(in, in.batch.tokens);
  GdnDeltaRuleArgs args{.qkv = qkv.as<uint16_t>(), .qkv_stride = in.qkv_stride, .a = a.as<uint16_t>(),
                        .b = b.as<uint16_t>(), .ab_stride = in.ab_stride, .a_log = a_log.as<float>(),
                        .dt_bias = dt_bias.as<float>(), .state = state.as<float>(), .out = dout.as<uint16_t>(),
                        .seqs = meta.seqs(in.batch), .n_key_heads = in.n_key_heads, .n_value_heads = hv,
                        .key_dim = in.key_dim, .value_dim = dv, .workspace = ws.buffer.as<float>(),
                        .workspace_bytes = ws.bytes};
  if (rows) {
    args.seqs.row_slots = row_slots.as<int32_t>();
    args.seqs.max_rows = v.max_rows;
  }
  if (norm != nullptr) {
    args.norm = GdnGatedNorm{.gate = gate.as<uint16_t>(), .gate_stride = norm->gate_stride,
                             .weight = weight.as<uint16_t>(), .eps = norm->eps};
  }
  const auto status = gdn_delta_rule(ctx, args, variant);
  EXPECT_TRUE(status.has_value()) << (status ? "" : status.error().message);
  ctx.synchronize();
  return {download<uint16_t>(dout, out_count), download<float>(state, in.state.size())};
}

// Runs in's batch without and with row slots and checks: the outputs and every sequence's own slot bit-identical
// between the two (and, without norm, close to the CPU path); the call without row slots leaving every other slot
// as it was; with them, each row slot finite and close to the CPU path's state after that prefix (the state
// tolerance of check_delta, over the slot's own max), and every decoy or unnamed slot bit-identical.
void check_verify_delta(const DeviceContext& ctx, const GdnDeltaRuleInputs& in, const VerifyBatch& v,
                        GdnVariant variant, const GdnDeltaRuleNormInputs* norm, const std::string& what) {
  const int64_t per_slot = in.n_value_heads * in.key_dim * in.value_dim;
  const VerifyDeltaRun plain = run_verify_delta(ctx, in, v, false, variant, norm);
  const VerifyDeltaRun with = run_verify_delta(ctx, in, v, true, variant, norm);
  expect_same_bits(with.out, plain.out, what + ": out with row slots vs without");
  const std::vector<float> want = gdn_delta_rule_cpu(in);
  const auto out_size = static_cast<std::ptrdiff_t>(in.batch.tokens * in.n_value_heads * in.value_dim);
  if (norm == nullptr) {
    expect_close(widen_bf16({plain.out.begin(), plain.out.begin() + out_size}), {want.begin(), want.begin() + out_size},
                 0x1p-8, 0x1p-10, what + ": out");
  }
  const std::vector<float> want_state(want.begin() + out_size, want.end());
  double worst_own = 0.0, worst_rows = 0.0;
  int64_t row_states = 0;
  for (int64_t slot = 0; slot < v.batch.n_slots; ++slot) {
    const std::string at = fmt::format("{}: slot {}", what, slot);
    const auto got = slot_of(with.state, slot, per_slot), before = slot_of(in.state, slot, per_slot);
    if (v.kind[slot] != SlotKind::kOwn) expect_same_bits(slot_of(plain.state, slot, per_slot), before, at + " (plain)");
    if (v.kind[slot] == SlotKind::kUntouched) expect_same_bits(got, before, at + " untouched");
    if (v.kind[slot] == SlotKind::kOwn) {
      expect_same_bits(got, slot_of(plain.state, slot, per_slot), at + " own state with row slots vs without");
      worst_own = std::max(worst_own, check_close(got, slot_of(want_state, slot, per_slot), 0.0, 0x1p-12,
                                                  at + " own state"));
    }
  }
  for (int64_t s = 0; s < v.batch.n_seqs; ++s) {
    if (v.row_slots[s * v.max_rows] < 0) continue;
    const int64_t len = v.batch.query_start[s + 1] - v.batch.query_start[s];
    for (int64_t t = 0; t < std::min(len, v.max_rows); ++t) {
      const int64_t slot = v.row_slots[s * v.max_rows + t];
      const std::string at = fmt::format("{}: seq {} row {} (slot {})", what, s, t, slot);
      const auto got = slot_of(with.state, slot, per_slot);
      EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float x) { return std::isfinite(x); })) << at;
      worst_rows = std::max(worst_rows, check_close(got, delta_prefix_state(in, s, t + 1), 0.0, 0x1p-12, at));
      ++row_states;
    }
  }
  std::printf("%-64s max error / allowed = %.3f\n", (what + ": own states").c_str(), worst_own);
  std::printf("%-64s max error / allowed = %.3f\n", fmt::format("{}: {} row states", what, row_states).c_str(),
              worst_rows);
}

// Rows, a and b from the harness (one sequence of the batch's length), the batch and its states from v.
template <class Inputs>
Inputs verify_delta_inputs(const Inputs& harness_in, const VerifyBatch& v, uint64_t seed) {
  Inputs in = harness_in;
  in.batch = v.batch;
  const int64_t per_slot = in.n_value_heads * in.key_dim * in.value_dim;
  in.state = verify_states<float>(v, per_slot, std::bit_cast<float>(kPoisonF32Bits), [&](bool continues, int64_t i) {
    return continues ? hash_uniform(seed, 61, i) - 0.5f : std::numeric_limits<float>::quiet_NaN();
  });
  return in;
}

TEST_F(GdnKernels, VerificationRowStatesMatchPrefixes) {
  uint64_t seed = 400;
  for (const VerifyCase& vc : kVerifyCases) {
    const bool long_rows = vc.max_rows > kGdnRecurrentMaxQueryLen;
    for (const Heads& h : long_rows ? std::vector<Heads>{{1, 2, 128, 64}, {1, 1, 32, 32}}
                                    : std::vector<Heads>{{2, 4, 128, 128}, {1, 2, 64, 32}}) {
      const VerifyBatch v = verify_batch(vc, ++seed);
      const auto c = gdn_delta_rule_case(1, v.batch.tokens, h.hk, h.hv, h.dk, h.dv);
      const auto in = verify_delta_inputs(make<GdnDeltaRuleInputs>("gdn_delta_rule", c, seed), v, seed);
      for (const GdnVariant variant : {GdnVariant::kRecurrent, GdnVariant::kChunked, GdnVariant::kAuto}) {
        check_verify_delta(*ctx_, in, v, variant, nullptr,
                           fmt::format("{} {} Hk={} Hv={} dk={} dv={}", variant_name(variant), vc.name, h.hk, h.hv,
                                       h.dk, h.dv));
      }
    }
  }
}

// An RTX PRO 6000 (sm_120) gives a block about 99 KB of shared memory: the chunked kernels then take 32-row chunks
// at dk 128 and the walk one buffer of what phase 2 reads (an H200 takes 64-row chunks and two). The same checks
// with this GPU's shared memory limited to that, so those shapes run here too.
TEST_F(GdnKernels, ChunkedKernelsWithAWorkstationBlackwellsSharedMemory) {
  ctx_->limit_shared_memory(101376);
  ASSERT_EQ(gdn_chunked_chunk_len(ctx_->props(), 128), 32);
  ASSERT_EQ(gdn_chunked_chunk_len(ctx_->props(), 64), 64);
  uint64_t seed = 900;
  for (const Heads& h : kHeadShapes) {
    const auto c = gdn_delta_rule_case(3, 130, h.hk, h.hv, h.dk, h.dv);
    const auto in = make<GdnDeltaRuleInputs>("gdn_delta_rule", c, ++seed);
    check_delta(in, run_delta(in, {whole(in.batch)}, GdnVariant::kChunked), "99 KB chunked " + c.label);
  }
  for (const Heads& h : {Heads{1, 2, 128, 64}, Heads{1, 1, 64, 32}}) {
    const VerifyBatch v = verify_batch(kVerifyCases[2], ++seed);
    const auto c = gdn_delta_rule_case(1, v.batch.tokens, h.hk, h.hv, h.dk, h.dv);
    const auto in = verify_delta_inputs(make<GdnDeltaRuleInputs>("gdn_delta_rule", c, seed), v, seed);
    check_verify_delta(*ctx_, in, v, GdnVariant::kChunked, nullptr,
                       fmt::format("99 KB chunked long Hk={} Hv={} dk={} dv={}", h.hk, h.hv, h.dk, h.dv));
  }
}

// The gated norm runs in the recurrent kernel (kAuto included, whatever the rows); its row states are the same.
TEST_F(GdnKernels, VerificationRowStatesWithGatedNorm) {
  uint64_t seed = 500;
  for (const VerifyCase& vc : {kVerifyCases[0], kVerifyCases[1]}) {
    for (const Heads& h : {Heads{2, 4, 128, 128}, Heads{1, 2, 64, 32}}) {
      const VerifyBatch v = verify_batch(vc, ++seed);
      const auto c = gdn_delta_rule_case(1, v.batch.tokens, h.hk, h.hv, h.dk, h.dv);
      const auto in = verify_delta_inputs(make<GdnDeltaRuleNormInputs>("gdn_delta_rule_norm", c, seed), v, seed);
      for (const GdnVariant variant : {GdnVariant::kRecurrent, GdnVariant::kAuto}) {
        check_verify_delta(*ctx_, in, v, variant, &in,
                           fmt::format("norm {} {} Hk={} Hv={} dk={} dv={}", variant_name(variant), vc.name, h.hk,
                                       h.hv, h.dk, h.dv));
      }
    }
  }
}

struct VerifyConvRun {
  std::vector<uint16_t> y;      // [(tokens + kSpareRows) * channels] bf16 bits
  std::vector<uint16_t> state;  // every slot after the call
};

VerifyConvRun run_verify_conv(const DeviceContext& ctx, const GdnConvInputs& in, const VerifyBatch& v, bool rows) {
  DeviceBuffer state = upload(in.conv_state);
  const DeviceBuffer w = upload(in.weight), x = upload(in.x), row_slots = upload(v.row_slots);
  const DeviceMeta meta = meta_upload(in.batch);
  const size_t count = static_cast<size_t>((in.batch.tokens + kSpareRows) * in.channels);
  DeviceBuffer dy = upload(std::vector<uint16_t>(count, kPoison));
  GdnConvArgs args{.x = x.as<uint16_t>(), .x_stride = in.x_stride, .weight = w.as<float>(),
                   .conv_state = state.as<uint16_t>(), .y = dy.as<uint16_t>(), .seqs = meta.seqs(in.batch),
                   .channels = in.channels, .kernel = in.kernel};
  if (rows) {
    args.seqs.row_slots = row_slots.as<int32_t>();
    args.seqs.max_rows = v.max_rows;
  }
  const auto status = gdn_conv1d(ctx, args);
  EXPECT_TRUE(status.has_value()) << (status ? "" : status.error().message);
  ctx.synchronize();
  return {download<uint16_t>(dy, count), download<uint16_t>(state, in.conv_state.size())};
}

// As check_verify_delta for the conv: y and the own windows bit-identical with and without row slots (and close to
// the CPU path), each row slot's window exactly the CPU path's after that prefix, the other slots untouched. Mixed
// and long batches run several token lanes per channel, the decode batch one.
TEST_F(GdnKernels, ConvVerificationRowWindowsMatchPrefixes) {
  uint64_t seed = 600;
  // A verification in the batch of a long prefill: 8 channels a thread where the channels allow (304, not 300).
  std::vector<VerifyCase> cases(std::begin(kVerifyCases), std::end(kVerifyCases));
  cases.push_back({"beside a long prefill", {{1100, true, false}, {4, true, true}, {3, false, true}}, 4});
  for (const VerifyCase& vc : cases) {
    for (const auto& [kernel, channels] : {std::pair<int64_t, int64_t>{2, 300}, {4, 304}, {8, 300}, {8, 304}}) {
      const VerifyBatch v = verify_batch(vc, ++seed);
      const int64_t per_slot = channels * (kernel - 1);  // 304: 8 channels a thread; 300: one
      GdnConvInputs in = make<GdnConvInputs>("gdn_conv", gdn_conv_case(1, v.batch.tokens, channels, kernel), seed);
      in.batch = v.batch;
      in.conv_state = verify_states<uint16_t>(v, per_slot, kPoison, [&](bool continues, int64_t i) {
        return continues ? hashed_bf16(seed, 62, i, 2.0f) : uint16_t{0x7FC0};
      });
      const std::string what = fmt::format("conv {} K={} channels={}", vc.name, kernel, channels);
      const VerifyConvRun plain = run_verify_conv(*ctx_, in, v, false);
      const VerifyConvRun with = run_verify_conv(*ctx_, in, v, true);
      expect_same_bits(with.y, plain.y, what + ": y with row slots vs without");
      const std::vector<float> want = gdn_conv_cpu(in);
      const auto y_size = static_cast<std::ptrdiff_t>(in.batch.tokens * channels);
      expect_close(widen_bf16({plain.y.begin(), plain.y.begin() + y_size}), {want.begin(), want.begin() + y_size},
                   0x1p-8, 0x1p-16, what + ": y");
      const std::vector<float> want_state(want.begin() + y_size, want.end());
      int64_t row_states = 0;
      for (int64_t slot = 0; slot < v.batch.n_slots; ++slot) {
        const std::string at = fmt::format("{}: slot {}", what, slot);
        const auto got = slot_of(with.state, slot, per_slot), before = slot_of(in.conv_state, slot, per_slot);
        const auto plain_slot = slot_of(plain.state, slot, per_slot);
        if (v.kind[slot] != SlotKind::kOwn) expect_same_bits(plain_slot, before, at + " (plain)");
        if (v.kind[slot] == SlotKind::kUntouched) expect_same_bits(got, before, at + " untouched");
        if (v.kind[slot] == SlotKind::kOwn) {
          expect_same_bits(got, plain_slot, at + " own window with row slots vs without");
          check_close(widen_bf16(got), slot_of(want_state, slot, per_slot), 0.0, 0.0, at + " own window");
        }
      }
      for (int64_t s = 0; s < v.batch.n_seqs; ++s) {
        if (v.row_slots[s * v.max_rows] < 0) continue;
        const int64_t len = v.batch.query_start[s + 1] - v.batch.query_start[s];
        for (int64_t t = 0; t < std::min(len, v.max_rows); ++t) {
          const int64_t slot = v.row_slots[s * v.max_rows + t];
          check_close(widen_bf16(slot_of(with.state, slot, per_slot)), conv_prefix_state(in, s, t + 1), 0.0, 0.0,
                      fmt::format("{}: seq {} row {} (slot {})", what, s, t, slot));
          ++row_states;
        }
      }
      std::printf("%s: %lld row windows checked (exact)\n", what.c_str(), static_cast<long long>(row_states));
    }
  }
}

TEST_F(GdnKernels, BadArgumentsAreErrors) {
  DeviceBuffer buf(1 << 16);
  const GdnSequences seqs{.query_start = buf.as<int32_t>(), .state_slot = buf.as<int32_t>(),
                          .seq_past = buf.as<int32_t>(), .n_seqs = 1, .tokens = 4, .max_query_len = 4};
  const GdnDeltaRuleArgs good{.qkv = buf.as<uint16_t>(), .qkv_stride = 2 * 32 + 32, .a = buf.as<uint16_t>(),
                              .b = buf.as<uint16_t>(), .ab_stride = 1, .a_log = buf.as<float>(),
                              .dt_bias = buf.as<float>(), .state = buf.as<float>(), .out = buf.as<uint16_t>(),
                              .seqs = seqs, .n_key_heads = 1, .n_value_heads = 1, .key_dim = 32, .value_dim = 32};
  auto expect_error = [&](GdnDeltaRuleArgs a, const std::string& message) {
    const auto r = gdn_delta_rule(*ctx_, a);
    ASSERT_FALSE(r.has_value()) << message;
    EXPECT_NE(r.error().message.find(message), std::string::npos) << r.error().message;
  };
  expect_error([&] { auto a = good; a.key_dim = 96; return a; }(), "key_dim=96 must be 32, 64 or 128");
  expect_error([&] { auto a = good; a.value_dim = 16; return a; }(), "value_dim=16");
  expect_error([&] { auto a = good; a.n_value_heads = 3; a.n_key_heads = 2; return a; }(), "n_value_heads=3");
  expect_error([&] { auto a = good; a.qkv_stride = 90; return a; }(), "qkv_stride=90 is less than");
  expect_error([&] { auto a = good; a.state = nullptr; return a; }(), "null pointer");
  expect_error([&] { auto a = good; a.seqs.max_query_len = 5; return a; }(), "max_query_len=5");
  expect_error([&] { auto a = good; a.seqs.seq_past = nullptr; return a; }(), "null sequence metadata");
  expect_error([&] { auto a = good; a.seqs.row_slots = buf.as<int32_t>(); return a; }(),
               "row_slots is set, so max_rows=0 must be in [1, ");
  expect_error([&] { auto a = good; a.seqs.row_slots = buf.as<int32_t>(); a.seqs.max_rows = -2; return a; }(),
               "max_rows=-2");
  {  // the chunked kernels without (or with too small) a workspace
    const auto r = gdn_delta_rule(*ctx_, good, GdnVariant::kChunked);
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("need a 16-byte aligned workspace of"), std::string::npos) << r.error().message;
    auto small = good;
    small.workspace = buf.as<float>();
    small.workspace_bytes = gdn_chunked_workspace_bytes(4, 1, 1, 32, 32) - 4;
    EXPECT_FALSE(gdn_delta_rule(*ctx_, small, GdnVariant::kChunked).has_value());
  }
  const GdnConvArgs conv{.x = buf.as<uint16_t>(), .x_stride = 64, .weight = buf.as<float>(),
                         .conv_state = buf.as<uint16_t>(), .y = buf.as<uint16_t>(), .seqs = seqs, .channels = 64,
                         .kernel = 4};
  auto c = conv;
  c.kernel = 9;
  auto r = gdn_conv1d(*ctx_, c);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("kernel=9 must be in [2, 8]"), std::string::npos) << r.error().message;
  c = conv;
  c.x_stride = 63;
  r = gdn_conv1d(*ctx_, c);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("x_stride=63 is less than channels=64"), std::string::npos);
  c = conv;
  c.seqs.row_slots = buf.as<int32_t>();
  r = gdn_conv1d(*ctx_, c);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("gdn_conv1d: row_slots is set, so max_rows=0"), std::string::npos)
      << r.error().message;
  // n_seqs == 0 is a no-op, even with null metadata.
  c = conv;
  c.seqs = GdnSequences{};
  EXPECT_TRUE(gdn_conv1d(*ctx_, c).has_value());
}

}  // namespace
}  // namespace tern
