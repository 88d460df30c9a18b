// The Gated DeltaNet harnesses and CPU implementations through the registry: hand-computed values, the CPU path
// against the fp64 spec on ragged batches, and injected faults (a state not carried, a missing decay, the wrong
// key head, an untouched slot overwritten, a skipped row) that must each be rejected.
#include "ops/gdn_op.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>

#include "core/formats.h"

namespace tern {
namespace {

std::vector<SelfTestCase> conv_cases() {
  return {gdn_conv_case(1, 1, 40, 4),       gdn_conv_case(5, 1, 96, 4),  gdn_conv_case(4, 9, 64, 4),
          gdn_conv_case(3, 2, 33, 8),       gdn_conv_case(3, 17, 16, 2), gdn_conv_case(1, 4, 40, 4, true),
          gdn_conv_case(5, 4, 24, 4, true)};
}

std::vector<SelfTestCase> delta_cases() {
  return {gdn_delta_rule_case(1, 1, 1, 1, 32, 32),        gdn_delta_rule_case(6, 1, 2, 4, 32, 64),
          gdn_delta_rule_case(4, 23, 2, 2, 32, 32),       gdn_delta_rule_case(3, 40, 1, 4, 64, 32),
          gdn_delta_rule_case(2, 9, 2, 4, 128, 128),      gdn_delta_rule_case(1, 4, 1, 2, 32, 32, true),
          gdn_delta_rule_case(5, 5, 2, 4, 32, 64, true)};
}

TEST(GdnOp, CpuImplementationsPassTheirSelfTest) {
  Registry r;
  ASSERT_TRUE(gdn_register_cpu(r).has_value());
  for (const auto& [op, cases] : {std::pair{"gdn_conv", conv_cases()}, std::pair{"gdn_delta_rule", delta_cases()}}) {
    auto s = registry_select(r, op, cpu_device_describe(), cases, {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(s->chosen, "cpu") << op << ": " << s->candidates.front().reason;
    std::printf("%-15s cpu: max error %.3g (bound %.3g)\n", op, s->candidates.front().max_error,
                s->candidates.front().bound);
  }
}

GdnBatch one_new_sequence(int32_t len) {
  return GdnBatch{.query_start = {0, len}, .state_slot = {0}, .seq_past = {0}, .n_seqs = 1, .tokens = len,
                  .max_query_len = len, .n_slots = 1};
}

std::vector<uint16_t> bf16s(std::initializer_list<float> v) {
  std::vector<uint16_t> out;
  for (float f : v) out.push_back(float_to_bf16(f));
  return out;
}

TEST(GdnOp, ReferencesMatchHandComputedValues) {
  Registry r;
  ASSERT_TRUE(gdn_register_cpu(r).has_value());
  // conv, kernel 2, one channel, new sequence: y0 = silu(1 * 1), y1 = silu(0.5 * 1 + 1 * 2); the state keeps x1.
  GdnConvInputs c;
  c.batch = one_new_sequence(2);
  c.channels = 1, c.kernel = 2, c.x_stride = 1;
  c.x = bf16s({1.0f, 2.0f});
  c.weight = {0.5f, 1.0f};
  c.conv_state = bf16s({7.0f});  // ignored: the sequence is new
  auto silu = [](double x) { return x / (1.0 + std::exp(-x)); };
  for (const auto& y : {r.harness("gdn_conv")->reference(c), gdn_conv_cpu(c)}) {
    ASSERT_EQ(y.size(), 3u);
    EXPECT_NEAR(y[0], silu(1.0), 1e-6);
    EXPECT_NEAR(y[1], silu(2.5), 1e-6);
    EXPECT_EQ(y[2], 2.0f);
  }
  // delta rule, dk 2, dv 1. Token 0: q = k = [1, 0], v = 2, b = 0 (beta 1/2): S = k * beta * v = [1, 0]^T,
  // o = S^T q * 2^-1/2. Token 1: a = 0, dt_bias = 0, A_log = 0: g = -log 2, decay 1/2; k = [0, 1] is orthogonal to
  // S, v = 0, so delta = 0; q = [1, 1] normalised and scaled = [1/2, 1/2]: o = 1/2 * 1/2.
  GdnDeltaRuleInputs d;
  d.batch = one_new_sequence(2);
  d.n_key_heads = d.n_value_heads = 1, d.key_dim = 2, d.value_dim = 1, d.qkv_stride = 5, d.ab_stride = 1;
  d.qkv = bf16s({1, 0, 1, 0, 2, /**/ 1, 1, 0, 1, 0});
  d.a = bf16s({0, 0});
  d.b = bf16s({0, 0});
  d.a_log = {0.0f};
  d.dt_bias = {0.0f};
  d.state = {5.0f, 5.0f};  // ignored: the sequence is new
  for (const auto& o : {r.harness("gdn_delta_rule")->reference(d), gdn_delta_rule_cpu(d)}) {
    ASSERT_EQ(o.size(), 4u);
    EXPECT_NEAR(o[0], 1.0 / std::sqrt(2.0), 1e-5);
    EXPECT_NEAR(o[1], 0.25, 1e-5);
    EXPECT_NEAR(o[2], 0.5, 1e-5);  // S after: the decayed [1, 0]^T
    EXPECT_NEAR(o[3], 0.0, 1e-6);
  }
}

// Wraps the CPU implementation of `op` and corrupts its inputs or output in one way.
Implementation broken(const Registry& r, const std::string& op, std::string name,
                      std::function<void(OpInputs&)> corrupt_inputs, std::function<void(std::vector<float>&)> corrupt_out) {
  const Implementation* cpu = r.implementations(op).front();
  return Implementation{
      .op = op, .name = std::move(name), .priority = 10, .tolerance = cpu->tolerance,
      .run = [run = cpu->run, op, corrupt_inputs, corrupt_out](const OpInputs& base) -> Expected<RunOutput> {
        std::unique_ptr<OpInputs> copy;
        if (op == "gdn_conv") copy = std::make_unique<GdnConvInputs>(static_cast<const GdnConvInputs&>(base));
        if (op == "gdn_delta_rule_norm") {
          copy = std::make_unique<GdnDeltaRuleNormInputs>(static_cast<const GdnDeltaRuleNormInputs&>(base));
        }
        if (op == "gdn_delta_rule") {
          copy = std::make_unique<GdnDeltaRuleInputs>(static_cast<const GdnDeltaRuleInputs&>(base));
        }
        if (corrupt_inputs) corrupt_inputs(*copy);
        TERN_ASSIGN_OR_RETURN(RunOutput out, run(*copy));
        if (corrupt_out) corrupt_out(out.values);
        return out;
      },
  };
}

GdnBatch& op_batch(OpInputs& b) {
  if (auto* conv = dynamic_cast<GdnConvInputs*>(&b)) return conv->batch;
  return static_cast<GdnDeltaRuleInputs&>(b).batch;
}

struct CpuFault {
  std::string op, name, expected_reason;
  std::function<void(OpInputs&)> corrupt_inputs;
  std::function<void(std::vector<float>&)> corrupt_out;
};

std::vector<CpuFault> cpu_faults() {
  auto all_new = [](OpInputs& b) {
    auto& batch = op_batch(b);
    std::fill(batch.seq_past.begin(), batch.seq_past.end(), 0);
  };
  return {
      {"gdn_conv", "state-not-carried", "exceeds the tolerance", all_new, nullptr},
      {"gdn_conv", "row-skipped", "never written", nullptr,
       [](std::vector<float>& v) { v[3] = std::bit_cast<float>(kPoisonF32Bits); }},
      {"gdn_conv", "unused-slot-zeroed", "exceeds the tolerance", nullptr,
       [](std::vector<float>& v) {  // slot 0 of 5 (channels 40, kernel 4): the first state after y
         std::fill(v.end() - 5 * 40 * 3, v.end() - 4 * 40 * 3, 0.0f);
       }},
      {"gdn_delta_rule", "state-not-carried", "exceeds the tolerance", all_new, nullptr},
      {"gdn_delta_rule", "no-decay", "exceeds the tolerance",
       [](OpInputs& b) { for (float& x : static_cast<GdnDeltaRuleInputs&>(b).a_log) x = -100.0f; }, nullptr},
      {"gdn_delta_rule", "key-heads-swapped", "exceeds the tolerance",
       [](OpInputs& b) {
         auto& in = static_cast<GdnDeltaRuleInputs&>(b);
         for (int64_t t = 0; t < in.batch.tokens; ++t) {  // swap k heads 0 and 1
           auto row = in.qkv.begin() + t * in.qkv_stride + in.n_key_heads * in.key_dim;
           std::swap_ranges(row, row + in.key_dim, row + in.key_dim);
         }
       },
       nullptr},
      {"gdn_delta_rule", "row-skipped", "never written", nullptr,
       [](std::vector<float>& v) { v[100] = std::bit_cast<float>(kPoisonF32Bits); }},
  };
}

TEST(GdnOp, InjectedFaultsAreRejected) {
  Registry r;
  ASSERT_TRUE(gdn_register_cpu(r).has_value());
  for (const CpuFault& f : cpu_faults()) ASSERT_TRUE(r.add(broken(r, f.op, f.name, f.corrupt_inputs, f.corrupt_out)).has_value());
  const std::vector<std::pair<std::string, SelfTestCase>> cases = {
      {"gdn_conv", gdn_conv_case(4, 5, 40, 4)}, {"gdn_delta_rule", gdn_delta_rule_case(4, 5, 2, 4, 32, 32)}};
  for (const auto& [op, c] : cases) {
    auto s = registry_select(r, op, cpu_device_describe(), std::span(&c, 1), {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(s->chosen, "cpu") << op;
    for (const CpuFault& f : cpu_faults()) {
      if (f.op != op) continue;
      const auto it = std::find_if(s->candidates.begin(), s->candidates.end(), [&](auto& k) { return k.name == f.name; });
      ASSERT_NE(it, s->candidates.end()) << f.name;
      EXPECT_EQ(it->status, CandidateStatus::kFailed) << op << " " << f.name;
      EXPECT_NE(it->reason.find(f.expected_reason), std::string::npos) << f.name << ": " << it->reason;
    }
  }
}

// A verification case: the even sequences' row slots get the state after each of their rows (checked here against
// the harness's own accounting of which slots exist), the odd sequences have none, and an implementation that runs
// the verification as a plain call (no row states) or puts each row's state in another row's slot is rejected.
TEST(GdnOp, VerificationCasesCheckEveryRowsState) {
  const GdnBatch b = gdn_batch_make(5, 4, 7, true);
  EXPECT_EQ(b.max_rows, 4);
  EXPECT_EQ(b.n_slots, 6 + 3 * 4);  // the sequences' 5, slot 0, and 4 row slots for each of sequences 0, 2, 4
  for (int64_t s = 0; s < b.n_seqs; ++s) {
    EXPECT_GT(b.seq_past[s], 0) << "a verification continues its sequence";
    EXPECT_EQ(b.row_slot(s, 0) >= 0, s % 2 == 0) << s;
  }
  EXPECT_EQ(b.row_slot(0, 4), -1) << "rows past max_rows have no slot";
  const GdnBatch plain = gdn_batch_make(5, 4, 7);
  EXPECT_TRUE(plain.row_slots.empty());
  EXPECT_EQ(plain.n_slots, 6);

  Registry r;
  ASSERT_TRUE(gdn_register_cpu(r).has_value());
  auto no_row_states = [](OpInputs& in) { op_batch(in).row_slots.clear(); };
  auto slots_shifted = [](OpInputs& in) {  // row t's state lands in row t - 1's slot (row 0's in the last)
    GdnBatch& batch = op_batch(in);
    for (int64_t s = 0; s < batch.n_seqs; ++s) {
      if (batch.row_slot(s, 0) < 0) continue;
      std::rotate(batch.row_slots.begin() + s * batch.max_rows, batch.row_slots.begin() + (s + 1) * batch.max_rows - 1,
                  batch.row_slots.begin() + (s + 1) * batch.max_rows);
    }
  };
  for (const std::string op : {"gdn_conv", "gdn_delta_rule"}) {
    ASSERT_TRUE(r.add(broken(r, op, "no-row-states", no_row_states, nullptr)).has_value());
    ASSERT_TRUE(r.add(broken(r, op, "slots-shifted", slots_shifted, nullptr)).has_value());
    const SelfTestCase c = op == "gdn_conv" ? gdn_conv_case(3, 4, 40, 4, true)
                                            : gdn_delta_rule_case(3, 4, 2, 4, 32, 32, true);
    auto s = registry_select(r, op, cpu_device_describe(), std::span(&c, 1), {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(s->chosen, "cpu") << op << ": " << s->candidate("cpu")->reason;
    for (const char* name : {"no-row-states", "slots-shifted"}) {
      const CandidateReport* k = s->candidate(name);
      ASSERT_NE(k, nullptr) << name;
      EXPECT_EQ(k->status, CandidateStatus::kFailed) << op << " " << name;
      EXPECT_NE(k->reason.find("exceeds the tolerance"), std::string::npos) << op << " " << name << ": " << k->reason;
    }
  }
  // A malformed flag is refused by the harness.
  SelfTestCase bad = gdn_conv_case(3, 4, 40, 4);
  bad.dims.push_back(2);
  EXPECT_FALSE(r.harness("gdn_conv")->make_inputs(bad, 1).has_value());
}

// The delta rule with the gated norm: the CPU path passes against fp64 on ragged batches, and a norm that drops the
// gate, the weight or the scale is rejected.
TEST(GdnOp, DeltaRuleNormCpuPassesAndFaultsAreRejected) {
  Registry r;
  ASSERT_TRUE(gdn_register_cpu(r).has_value());
  auto as = [](OpInputs& b) -> GdnDeltaRuleNormInputs& { return static_cast<GdnDeltaRuleNormInputs&>(b); };
  const std::vector<CpuFault> faults = {
      {"gdn_delta_rule_norm", "gate-ignored", "exceeds the tolerance",
       [&](OpInputs& b) { std::fill(as(b).gate.begin(), as(b).gate.end(), float_to_bf16(30.0f)); }, nullptr},
      {"gdn_delta_rule_norm", "weight-ignored", "exceeds the tolerance",
       [&](OpInputs& b) { std::fill(as(b).weight.begin(), as(b).weight.end(), float_to_bf16(1.0f)); }, nullptr},
      {"gdn_delta_rule_norm", "eps-huge", "exceeds the tolerance", [&](OpInputs& b) { as(b).eps = 1.0f; }, nullptr},
  };
  for (const CpuFault& f : faults) {
    ASSERT_TRUE(r.add(broken(r, f.op, f.name, f.corrupt_inputs, f.corrupt_out)).has_value());
  }
  auto s = registry_select(r, "gdn_delta_rule_norm", cpu_device_describe(), delta_cases(), {});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->chosen, "cpu") << s->candidate("cpu")->reason;
  EXPECT_GT(s->candidate("cpu")->max_error, 0.0) << "an fp32 result equal to fp64 everywhere is suspicious";
  for (const CpuFault& f : faults) {
    const CandidateReport* c = s->candidate(f.name);
    ASSERT_NE(c, nullptr) << f.name;
    EXPECT_EQ(c->status, CandidateStatus::kFailed) << f.name;
    EXPECT_NE(c->reason.find(f.expected_reason), std::string::npos) << f.name << ": " << c->reason;
  }
}

// The fp64 reference's norm, recomputed by hand for one row.
TEST(GdnOp, DeltaRuleNormReferenceNormsEachHeadRow) {
  Registry r;
  ASSERT_TRUE(gdn_register_cpu(r).has_value());
  const SelfTestCase c = gdn_delta_rule_case(2, 3, 1, 2, 32, 32);
  auto plain = r.harness("gdn_delta_rule")->make_inputs(c, 9);
  auto normed = r.harness("gdn_delta_rule_norm")->make_inputs(c, 9);
  ASSERT_TRUE(plain.has_value() && normed.has_value());
  const std::vector<float> o = r.harness("gdn_delta_rule")->reference(**plain);
  const std::vector<float> y = r.harness("gdn_delta_rule_norm")->reference(**normed);
  const auto& in = static_cast<const GdnDeltaRuleNormInputs&>(**normed);
  ASSERT_EQ(o.size(), y.size());
  const int64_t row = 3, dv = 32;  // token 1, head 1
  double sum = 0.0;
  for (int64_t e = 0; e < dv; ++e) sum += double(o[row * dv + e]) * o[row * dv + e];
  const double inv = 1.0 / std::sqrt(sum / dv + double(in.eps));
  for (int64_t e = 0; e < dv; ++e) {
    const double z = bf16_to_float(in.gate[1 * in.gate_stride + 1 * dv + e]);
    const double want = o[row * dv + e] * inv * bf16_to_float(in.weight[e]) * z / (1.0 + std::exp(-z));
    EXPECT_NEAR(y[row * dv + e], want, 1e-5 * std::fabs(want) + 1e-6) << e;
  }
  EXPECT_EQ(o.back(), y.back()) << "the states are the delta rule's";
}

TEST(GdnOp, BatchLayout) {
  const GdnBatch b = gdn_batch_make(5, 7, 3);
  ASSERT_EQ(b.query_start.size(), 6u);
  EXPECT_EQ(b.query_start[1], 7);  // sequence 0 has max_query_len rows
  for (int64_t s = 0; s < 5; ++s) {
    const int32_t len = b.query_start[s + 1] - b.query_start[s];
    EXPECT_GE(len, 1);
    EXPECT_LE(len, 7);
    EXPECT_EQ(b.state_slot[s], 5 - s);
    EXPECT_EQ(b.seq_past[s] == 0, s % 2 == 0);
  }
  EXPECT_EQ(b.n_slots, 6);
  EXPECT_EQ(b.tokens, b.query_start.back());
}

TEST(GdnOp, BadCasesAreErrors) {
  Registry r;
  ASSERT_TRUE(gdn_register_cpu(r).has_value());
  EXPECT_FALSE(r.harness("gdn_conv")->make_inputs(gdn_conv_case(1, 1, 8, 9), 1).has_value());
  EXPECT_FALSE(r.harness("gdn_conv")->make_inputs({"bad", {1, 1}}, 1).has_value());
  EXPECT_FALSE(r.harness("gdn_delta_rule")->make_inputs(gdn_delta_rule_case(1, 1, 3, 4, 32, 32), 1).has_value());
}

}  // namespace
}  // namespace tern
