// Argument structs and unchecked launchers of the elementwise kernels of the GPU model path (RMSNorm, RoPE,
// SiLU-and-mul, embedding lookup, residual add). Activations are bf16, the math inside is fp32, with the semantics
// of the CPU layers (layers/norms.h, layers/rope.h, layers/moe.h). The .cu side cannot include core/error.h (nvcc
// rejects fmt's consteval format strings), so validation lives in elementwise.cc and callers use elementwise.h.
#pragma once

#include <cstdint>

#include "kernels/cuda/device.h"

namespace tern {

// RMSNorm over rows of `dim` elements: y = (offset + w) * (h * rsqrt(mean(h^2) + eps)) [* silu(gate)], with
// offset 1 for the zero-centred form (Qwen3.5) and h = x, or h = x + residual (fp32 sum) when residual is set.
// Per-head norms (q/k norms, the GDN output norm) are rows = tokens * heads, dim = head_dim.
struct RmsNormArgs {
  const uint16_t* x = nullptr;         // [rows, dim] bf16
  const uint16_t* residual = nullptr;  // optional [rows, dim] bf16, added to x before the norm
  uint16_t* h_out = nullptr;           // with residual: [rows, dim] receives bf16(x + residual); may alias x/residual
  const uint16_t* gate = nullptr;      // optional bf16: y is multiplied by silu(gate), [rows, dim] unless gate_stride
  // Rows that are heads of tokens whose gates sit inside a wider projection output: row r's gate starts at
  // gate + (r / gate_heads) * gate_stride + (r % gate_heads) * dim. 0: dense [rows, dim].
  int64_t gate_stride = 0;
  int64_t gate_heads = 1;
  const uint16_t* weight = nullptr;    // [dim] bf16
  uint16_t* y = nullptr;               // [rows, dim] bf16 (row stride y_stride); may alias x at the same stride
  // Row stride of x when its rows sit inside a wider projection output (a multiple of 8, at least dim; not with a
  // residual, whose rows are dense). 0: dense [rows, dim]. y has its own stride, y_stride.
  int64_t x_stride = 0;
  int64_t y_stride = 0;  // row stride of y (a multiple of 8, at least dim; not with a residual). 0: dense [rows, dim].
  int64_t rows = 0;
  int64_t dim = 0;
  float eps = 1e-6f;
  bool zero_centred = false;
};

// Rotary embedding of the first rotary_dim dims of each head at the token's position; dims past rotary_dim pass
// through. NeoX pairs dim i with i + rotary_dim/2 (rotate_half); interleaved (GLM, DeepSeek) pairs 2i with 2i+1.
// angle = float(position) * inv_freq[i] in fp32, as layers/rope.cc computes it.
struct RopeArgs {
  const uint16_t* x = nullptr;          // [tokens, n_heads, head_dim] bf16
  uint16_t* y = nullptr;                // same shape; may alias x
  const int32_t* positions = nullptr;   // [tokens]
  const float* inv_freq = nullptr;      // [rotary_dim / 2] fp32 (rope_inv_freq() computes the default table)
  int64_t tokens = 0;
  int64_t n_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;
  bool interleaved = false;
  float attention_factor = 1.0f;  // cos and sin times this (YaRN's attention factor)
};

// y[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]  (the SwiGLU activation over a fused [gate | up] output).
struct SiluMulArgs {
  const uint16_t* gate_up = nullptr;  // [rows, gate_up_stride] bf16: gate in columns [0, inter), up in [inter, 2 inter)
  uint16_t* y = nullptr;              // [rows, inter] bf16
  int64_t rows = 0;
  int64_t inter = 0;
  int64_t gate_up_stride = 0;  // elements between rows of gate_up (a slice of a wider projection); 0: 2 * inter
};

// y[t] = table[ids[t]]. An id outside [0, vocab) gives a zero row and is reported through `bad`: the kernel keeps
// the smallest (token << 32 | uint32(id)) there; kEmbeddingNoBadId means every id was in range.
inline constexpr unsigned long long kEmbeddingNoBadId = ~0ull;
struct EmbeddingArgs {
  const int32_t* ids = nullptr;       // [tokens], each in [0, vocab)
  const uint16_t* table = nullptr;    // [table_rows, hidden] bf16: vocabulary rows [table_begin, table_begin + rows)
  uint16_t* y = nullptr;              // [tokens, hidden] bf16
  unsigned long long* bad = nullptr;  // one device word, reset to kEmbeddingNoBadId by the launcher
  int64_t tokens = 0;
  int64_t vocab = 0;
  int64_t hidden = 0;
  // A tensor-parallel rank's slice of the table: ids outside it get zero rows (the sum over the ranks is then every
  // row). table_rows -1: the table holds the whole vocabulary.
  int64_t table_begin = 0;
  int64_t table_rows = -1;
};

// y = a + b elementwise (fp32 sum rounded to bf16); y may alias a or b.
struct ResidualAddArgs {
  const uint16_t* a = nullptr;
  const uint16_t* b = nullptr;
  uint16_t* y = nullptr;
  int64_t n = 0;
};

// Limits the kernels are built for (the launchers reject anything beyond them).
inline constexpr int64_t kRmsNormMaxDim = 16384;   // 256 threads x 8 chunks x 8 values in registers
inline constexpr int64_t kRopeMaxRotaryDim = 1024; // cos/sin of one token in shared memory

// Unchecked launches on ctx.stream() for arguments the checked launchers have validated (counts >= 1).
void rms_norm_launch(const DeviceContext& ctx, const RmsNormArgs& args);
void rope_launch(const DeviceContext& ctx, const RopeArgs& args);
void silu_mul_launch(const DeviceContext& ctx, const SiluMulArgs& args);
void embedding_launch(const DeviceContext& ctx, const EmbeddingArgs& args);
void residual_add_launch(const DeviceContext& ctx, const ResidualAddArgs& args);

}  // namespace tern
