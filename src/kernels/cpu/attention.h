// Causal softmax attention for one sequence over its cache, in fp32 as transformers' eager attention computes it:
// probs = softmax(q . k^T * scale) over keys 0..past+t (query t sits at position past+t), out = probs . v.
// Grouped-query: query head h reads key/value head h / (n_heads / n_kv_heads).
#pragma once

#include <cstdint>

namespace tern {

struct CpuAttentionShape {
  int64_t n_queries = 0;   // new tokens t
  int64_t past = 0;        // tokens already in the cache before them
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  float scale = 1.0f;
};

// q [n_queries, n_heads, head_dim]; k, v [past + n_queries, n_kv_heads, head_dim]; out [n_queries, n_heads, head_dim].
void cpu_attention_causal(const CpuAttentionShape& s, const float* q, const float* k, const float* v, float* out);

}  // namespace tern
