// The Gated DeltaNet ops of the model path in the registry (docs/model-specs.md §2.4), bf16 activations:
//   gdn_conv        dims {n_seqs, max_query_len, channels, kernel}: causal depthwise conv1d + SiLU over a ragged
//                   batch, continuing from and updating each sequence's conv state.
//                   Output: [y (tokens x channels) | conv state of every slot after the call (n_slots x channels x
//                   (kernel-1))].
//   gdn_delta_rule  dims {n_seqs, max_query_len, n_key_heads, n_value_heads, key_dim, value_dim}: l2norm of q/k, q
//                   scale, g and beta from a/b, and the recurrence over a ragged batch, from and into the state.
//                   Output: [out (tokens x Hv x dv) | state of every slot after the call (n_slots x Hv x dk x dv)].
//   gdn_delta_rule_norm  dims as gdn_delta_rule: the delta rule followed by the layer's gated RMSNorm of each token's
//                   head output, y = o * 1/sqrt(mean(o^2) + eps) * weight * silu(z), z a random gate row.
//                   Output: [y (tokens x Hv x dv) | states as gdn_delta_rule].
// The batch (gdn_batch_make): sequence 0 has max_query_len rows, the others 1..max_query_len drawn from the seed;
// odd sequences continue (seq_past > 0, a random state in their slot), even ones are new (their slot holds NaN,
// which must be ignored); slots are assigned in reverse and slot 0 belongs to no sequence, so it must come back
// unchanged. A verification case (a last dim of 1 after the op's dims: gdn_conv {.., kernel, 1}, gdn_delta_rule
// {.., value_dim, 1}) is a speculative verification as the model runs it: every sequence continues, the even ones
// are verifications whose state after each row also goes to a row slot of their own (GdnSequences::row_slots,
// max_rows = max_query_len), and the row slots a verification's rows do not reach must come back unchanged.
// Harnesses draw fresh, non-zero, bf16-exact inputs of realistic scale from the seed and compute the reference in
// fp64 from the spec formulas; the CPU implementations ("cpu") run kernels/cpu/gated_delta.h with the fp32
// preparation of layers/gated_deltanet.cc.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "ops/registry.h"

namespace tern {

struct GdnBatch {
  std::vector<int32_t> query_start;  // [n_seqs + 1]
  std::vector<int32_t> state_slot;   // [n_seqs]
  std::vector<int32_t> seq_past;     // [n_seqs]
  int64_t n_seqs = 0, tokens = 0, max_query_len = 0, n_slots = 0;
  // A verification case: [n_seqs * max_rows] as GdnSequences::row_slots (-1 first: not a verification); else empty.
  std::vector<int32_t> row_slots;
  int64_t max_rows = 0;
  // Where row t of sequence s leaves its state besides the sequence's slot, or -1.
  int32_t row_slot(int64_t s, int64_t t) const {
    if (row_slots.empty() || t >= max_rows || row_slots[s * max_rows] < 0) return -1;
    return row_slots[s * max_rows + t];
  }
};
GdnBatch gdn_batch_make(int64_t n_seqs, int64_t max_query_len, uint64_t seed, bool verify = false);

struct GdnConvInputs : OpInputs {
  GdnBatch batch;
  int64_t channels = 0, kernel = 0, x_stride = 0;
  std::vector<uint16_t> x;           // [tokens, x_stride] bf16 (columns past `channels` are padding)
  std::vector<float> weight;         // [channels, kernel]
  std::vector<uint16_t> conv_state;  // [n_slots, channels, kernel - 1] bf16, before the call
};

struct GdnDeltaRuleInputs : OpInputs {
  GdnBatch batch;
  int64_t n_key_heads = 0, n_value_heads = 0, key_dim = 0, value_dim = 0;
  int64_t qkv_stride = 0, ab_stride = 0;
  std::vector<uint16_t> qkv;            // [tokens, qkv_stride] bf16: q | k | v | padding
  std::vector<uint16_t> a, b;           // [tokens, ab_stride] bf16
  std::vector<float> a_log, dt_bias;    // [n_value_heads]
  std::vector<float> state;             // [n_slots, Hv, dk, dv], before the call
  int64_t width() const { return 2 * n_key_heads * key_dim + n_value_heads * value_dim; }
};

struct GdnDeltaRuleNormInputs : GdnDeltaRuleInputs {
  std::vector<uint16_t> gate;    // z [tokens, gate_stride] bf16
  int64_t gate_stride = 0;       // >= Hv * dv
  std::vector<uint16_t> weight;  // [dv] bf16
  float eps = 1e-6f;
};

// The CPU path's results in the op's output layout (used by the "cpu" implementations and the GPU kernel tests).
std::vector<float> gdn_conv_cpu(const GdnConvInputs& in);
std::vector<float> gdn_delta_rule_cpu(const GdnDeltaRuleInputs& in);

// Adds the harnesses of both ops and their CPU implementations ("cpu").
Expected<void> gdn_register_cpu(Registry& registry);

// `verify`: a speculative verification of max_query_len rows per sequence (the batch comment above); such a case is
// run by `--selftest fast` too (SelfTestCase::in_fast).
SelfTestCase gdn_conv_case(int64_t n_seqs, int64_t max_query_len, int64_t channels, int64_t kernel,
                           bool verify = false);
SelfTestCase gdn_delta_rule_case(int64_t n_seqs, int64_t max_query_len, int64_t n_key_heads, int64_t n_value_heads,
                                 int64_t key_dim, int64_t value_dim, bool verify = false);

// bf16 outputs next to fp32 states in one vector, judged against max|ref| of the whole vector (see gdn_op.cc).
inline constexpr Tolerance kGdnConvBf16Tolerance{.rel = 1.0 / 256 + 1.0 / 65536, .abs = 0.0};
inline constexpr Tolerance kGdnDeltaRuleBf16Tolerance{.rel = 1.0 / 256 + 1.0 / 1024, .abs = 0.0};
// The normed rows: o rounded to bf16 before the norm (2^-9 of y) and y rounded (2^-9) against an unrounded fp64
// reference, at most 2^-8 of the largest output; 2^-7 leaves a 2x margin and still rejects a missing gate, weight
// or scale by far.
inline constexpr Tolerance kGdnDeltaRuleNormBf16Tolerance{.rel = 1.0 / 128, .abs = 0.0};

}  // namespace tern
