// Gated DeltaNet primitives for one sequence (docs/model-specs.md §2.4), fp32, with the state carried
// between calls so prefill and decode are one recurrence.
#pragma once

#include <cstdint>

namespace tern {

// Causal depthwise conv over time followed by SiLU. x [t, channels] (row stride x_stride), weight [channels, kernel],
// state [channels, kernel-1]: the last kernel-1 inputs before x (oldest first, zeros for a new sequence); it is
// updated to the last kernel-1 inputs. y [t, channels] (contiguous).
void cpu_causal_conv1d_silu(const float* x, int64_t x_stride, int64_t t, int64_t channels, const float* weight,
                            int64_t kernel, float* state, float* y);

struct CpuGatedDeltaShape {
  int64_t n_tokens = 0;
  int64_t n_key_heads = 0;    // q/k heads; value head j uses key head j / (n_value_heads / n_key_heads)
  int64_t n_value_heads = 0;
  int64_t key_dim = 0;        // dk
  int64_t value_dim = 0;      // dv
};

// The recurrence per value head j and token t (q, k already l2-normalised, q scaled by dk^-0.5):
//   S = S * exp(g[t,j]);  delta = beta[t,j] * (v_t - S^T k_t);  S += k_t (x) delta;  out_t = S^T q_t
// q, k [t, n_key_heads, dk] with row stride qk_stride; v [t, n_value_heads, dv] with row stride v_stride;
// g, beta [t, n_value_heads]; state [n_value_heads, dk, dv]; out [t, n_value_heads, dv].
void cpu_gated_delta_rule(const CpuGatedDeltaShape& s, const float* q, const float* k, int64_t qk_stride,
                          const float* v, int64_t v_stride, const float* g, const float* beta, float* state,
                          float* out);

}  // namespace tern
