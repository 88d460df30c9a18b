// The attention op of the model path in the registry, with bf16 activations:
//   attention  dims {n_seqs, query_len, past, n_heads, n_kv_heads, head_dim, gated}: a ragged batch of n_seqs
//              sequences, sequence i holding past + 7 * i cached tokens before its query_len new ones; each new
//              token attends causally (its position and everything before), softmax(q . k^T / sqrt(head_dim)) . v
//              with query head h reading kv head h / (n_heads / n_kv_heads), times sigmoid(gate) when gated = 1
//              (Qwen3.5). Output [tokens, n_heads, head_dim], tokens = n_seqs * query_len, sequences in order.
// The harness draws fresh, non-zero, bf16-exact q, k, v (and gate) from the seed and computes the reference in fp64
// from the formula. The CPU implementation ("cpu") runs kernels/cpu/attention.h's fp32 cpu_attention_causal and
// the gate as layers/attention.cc does, and outputs fp32.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "ops/registry.h"

namespace tern {

inline constexpr int64_t kAttentionCasePastStep = 7;  // sequence i holds past + 7 * i cached tokens

struct AttentionInputs : OpInputs {
  int64_t n_seqs = 0, query_len = 0, past = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  bool gated = false;
  float scale = 1.0f;             // 1 / sqrt(head_dim)
  std::vector<uint16_t> q, gate;  // [tokens, n_heads, head_dim] bf16 (gate only when gated)
  std::vector<uint16_t> k, v;     // the sequences' caches one after another: [sum of seq_len, n_kv_heads, head_dim]

  int64_t tokens() const { return n_seqs * query_len; }
  int64_t seq_past(int64_t s) const { return past + kAttentionCasePastStep * s; }
  int64_t seq_len(int64_t s) const { return seq_past(s) + query_len; }
  int64_t cache_begin(int64_t s) const;  // first cache row of sequence s
};

// Adds the harness of "attention" and its CPU implementation ("cpu").
Expected<void> attention_register_cpu(Registry& registry);

// Case builder (label and dims in the layout above).
SelfTestCase attention_case(int64_t n_seqs, int64_t query_len, int64_t past, int64_t n_heads, int64_t n_kv_heads,
                            int64_t head_dim, bool gated);

}  // namespace tern
