// Argument structs and unchecked launchers of the Gated DeltaNet token mixer's kernels (docs/model-specs.md
// §2.4): the causal depthwise conv1d + SiLU over the q|k|v projection, and the gated delta rule (l2-normalised
// q/k, decay g and gate beta from the a/b projections, the fp32 recurrence). Activations are bf16 bit patterns, the
// math and the recurrent state fp32, with the semantics of the CPU path (kernels/cpu/gated_delta.h,
// layers/gated_deltanet.cc). The .cu side cannot include core/error.h (nvcc rejects fmt's consteval format strings),
// so validation lives in gated_delta.cc and callers use gated_delta.h.
#pragma once

#include <cstdint>

#include "kernels/cuda/device.h"

namespace tern {

// Sequences: s owns rows [query_start[s], query_start[s+1]); its states live in slot state_slot[s]; seq_past[s] is
// the number of tokens it processed before (0 = a new sequence: its states are taken as zero, whatever the slot
// holds). All metadata are device pointers. Preconditions the host cannot check without a synchronisation:
// query_start is non-decreasing from 0 to at most `tokens`, every run is at most max_query_len rows, the slots are
// valid and distinct within a call. Every sequence's slot holds its state after the call (a sequence with no rows
// keeps its state, or gets zeros when it is new). Slots named neither by state_slot nor by row_slots are never
// touched.
struct GdnSequences {
  const int32_t* query_start = nullptr;  // [n_seqs + 1]
  const int32_t* state_slot = nullptr;   // [n_seqs]
  const int32_t* seq_past = nullptr;     // [n_seqs]
  int64_t n_seqs = 0;
  int64_t tokens = 0;         // rows of the activations (query_start[n_seqs] <= tokens)
  int64_t max_query_len = 0;  // upper bound of query_start[s+1] - query_start[s]; picks the kernels' shapes
  // Speculative verification: null, or [n_seqs * max_rows] slots. Where row_slots[s * max_rows] >= 0, sequence s
  // is a verification and its states after each row t < min(len, max_rows) are also written to slot
  // row_slots[s * max_rows + t] of the same state buffers (the conv window and the recurrent state), so that any
  // prefix can be kept later. Those slots must be valid, distinct, and distinct from every state_slot of the call.
  // The sequence's own slot still gets its state after its last row. -1 in row_slots[s * max_rows]: not a verification.
  const int32_t* row_slots = nullptr;
  int64_t max_rows = 0;
};

// Causal depthwise conv1d + SiLU over each sequence's rows, continuing from and updating its conv state:
//   y[t, c] = silu(sum_j weight[c, j] * in[t - (kernel-1) + j, c]), in[< 0] from the state (zeros when new).
struct GdnConvArgs {
  const uint16_t* x = nullptr;  // [tokens, channels] bf16 (row stride x_stride elements)
  int64_t x_stride = 0;
  const float* weight = nullptr;   // [channels, kernel] fp32
  uint16_t* conv_state = nullptr;  // [n_slots, channels, kernel-1] bf16, oldest first (inputs are bf16, so exact)
  uint16_t* y = nullptr;           // [tokens, channels] bf16 = silu(conv); must not overlap x
  GdnSequences seqs;
  int64_t channels = 0;
  int64_t kernel = 0;
};

// Optional gated RMSNorm of the delta rule's output, per token and value head (the Gated DeltaNet's norm before its
// output projection), done by the recurrent kernel: y = bf16(o) * (1 / sqrt(mean(bf16(o)^2) + eps)) * weight *
// silu(z), with rms_norm's expressions (elementwise_launch.h, gated form). The head's value slices are one thread
// block cluster that sums the squares through distributed shared memory, so out gets the normed rows directly. The
// fp32 sum of squares runs in another order than rms_norm's, so a value may differ from rms_norm's in its last bit.
struct GdnGatedNorm {
  const uint16_t* gate = nullptr;    // z [tokens, Hv * dv] bf16 at gate_stride elements per token; null: no norm
  int64_t gate_stride = 0;           // >= Hv * dv
  const uint16_t* weight = nullptr;  // [dv] bf16
  float eps = 1e-6f;
};

// The gated delta rule: l2norm of q/k, q scale dk^-0.5, g = -exp(a_log) * softplus(a + dt_bias), beta = sigmoid(b),
// and per value head j (key head j / (Hv / Hk)): S = S * exp(g); delta = beta * (v - S^T k); S += k (x) delta;
// out = S^T q, from and into the state.
struct GdnDeltaRuleArgs {
  const uint16_t* qkv = nullptr;  // conv output [tokens, C] bf16: q [Hk*dk] | k [Hk*dk] | v [Hv*dv]
  int64_t qkv_stride = 0;         // row stride in elements (>= C)
  const uint16_t* a = nullptr;    // raw projections [tokens, Hv] bf16 (row stride ab_stride)
  const uint16_t* b = nullptr;
  int64_t ab_stride = 0;
  const float* a_log = nullptr;    // [Hv] fp32
  const float* dt_bias = nullptr;  // [Hv] fp32
  float* state = nullptr;          // [n_slots, Hv, dk, dv] fp32
  uint16_t* out = nullptr;         // [tokens, Hv, dv] bf16
  GdnSequences seqs;
  int64_t n_key_heads = 0;
  int64_t n_value_heads = 0;
  int64_t key_dim = 0;
  int64_t value_dim = 0;
  GdnGatedNorm norm;  // the recurrent kernel only
  // The chunked kernels' scratch of gdn_chunked_workspace_bytes(seqs.tokens, ...) bytes, 16-byte aligned (what they
  // pass from the first to the second kernel); the recurrent kernel needs none.
  float* workspace = nullptr;
  int64_t workspace_bytes = 0;
};

enum class GdnVariant {
  kAuto,       // recurrent for max_query_len <= kGdnRecurrentMaxQueryLen, chunked otherwise
  kRecurrent,  // tokens in order, the state in registers (decode; a correct fallback for any length)
  kChunked,    // chunks of 32/64 tokens in the WY form (prefill): two kernels through GdnDeltaRuleArgs::workspace
};

// Limits the kernels are built for (the launchers reject anything else).
inline constexpr int64_t kGdnMinConvKernel = 2;
inline constexpr int64_t kGdnMaxConvKernel = 8;
inline constexpr int64_t kGdnMaxConvChannels = int64_t{1} << 20;  // channel tiles stay within the grid's y limit
inline constexpr int64_t kGdnRecurrentMaxQueryLen = 16;  // kAuto: at most this many rows per sequence -> recurrent
inline constexpr int64_t kGdnValueSlice = 32;            // value columns per block; dv must be a multiple
bool gdn_head_dim_supported(int64_t dim);                // 32, 64 or 128

// Shared memory of the chunked kernel for a supported key_dim and a chunk of 32 or 64 rows, and the chunk length
// it uses on this device (64 where it fits, else 32; 0 if neither fits).
int64_t gdn_chunked_smem_bytes(int64_t key_dim, int64_t chunk);
int64_t gdn_chunked_chunk_len(const DeviceProps& props, int64_t key_dim);
// The workspace the chunked kernels need for `tokens` rows (tokens x (2 Hk dk + Hv (dk + dv + 65)) floats).
int64_t gdn_chunked_workspace_bytes(int64_t tokens, int64_t n_key_heads, int64_t n_value_heads, int64_t key_dim,
                                    int64_t value_dim);

// Unchecked launches on ctx.stream() for arguments the checked launchers have validated (n_seqs >= 1).
void gdn_conv1d_launch(const DeviceContext& ctx, const GdnConvArgs& args);
void gdn_delta_rule_launch_recurrent(const DeviceContext& ctx, const GdnDeltaRuleArgs& args);
void gdn_delta_rule_launch_chunked(const DeviceContext& ctx, const GdnDeltaRuleArgs& args);

}  // namespace tern
