// The elementwise ops of the model path in the registry, with bf16 activations:
//   rms_norm      dims {tokens, heads, dim, form, residual}: rows = tokens * heads of `dim` values (heads > 1 is a
//                 per-head q/k or GDN norm); form 0 plain w * x̂, 1 zero-centred (1 + w) * x̂, 2 gated w * x̂ *
//                 silu(z); residual 1 first forms h = x + residual and outputs [h | y] (2 * rows * dim values).
//   rope          dims {tokens, heads, head_dim, rotary_dim, interleaved, theta}: NeoX rotate-half (0) or
//                 interleaved pairs (1) on the first rotary_dim dims of each head, positions per token.
//   silu_mul      dims {tokens, inter}: y = silu(gate) * up over [tokens, 2 * inter] laid out [gate | up].
//   embedding     dims {tokens, vocab, hidden}: rows of a bf16 table by id.
//   residual_add  dims {tokens, hidden}: a + b.
// Harnesses draw fresh, non-zero, bf16-exact inputs from the seed and compute the reference in fp64 from the
// spec formulas (the RoPE angle in fp32, as transformers and layers/rope.cc form it). The CPU implementations
// ("cpu") run the CPU layers' fp32 math and output fp32.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "ops/registry.h"

namespace tern {

enum class RmsNormForm : int64_t { kPlain = 0, kZeroCentred = 1, kGated = 2 };

struct RmsNormInputs : OpInputs {
  int64_t rows = 0, dim = 0;
  RmsNormForm form = RmsNormForm::kPlain;
  bool residual = false;
  float eps = 1e-6f;
  std::vector<uint16_t> x, residual_in, gate;  // [rows, dim] bf16 (residual_in and gate only when used)
  std::vector<uint16_t> weight;                // [dim] bf16
};

struct RopeInputs : OpInputs {
  int64_t tokens = 0, n_heads = 0, head_dim = 0, rotary_dim = 0;
  bool interleaved = false;
  double theta = 0.0;
  std::vector<uint16_t> x;         // [tokens, n_heads, head_dim] bf16
  std::vector<int32_t> positions;  // [tokens]
};

struct SiluMulInputs : OpInputs {
  int64_t rows = 0, inter = 0;
  std::vector<uint16_t> gate_up;  // [rows, 2 * inter] bf16
};

struct EmbeddingInputs : OpInputs {
  int64_t tokens = 0, vocab = 0, hidden = 0;
  std::vector<int32_t> ids;     // [tokens], in range
  std::vector<uint16_t> table;  // [vocab, hidden] bf16
};

struct ResidualAddInputs : OpInputs {
  int64_t n = 0;
  std::vector<uint16_t> a, b;  // [n] bf16
};

// Adds the harnesses of the five ops and their CPU implementations ("cpu").
Expected<void> elementwise_register_cpu(Registry& registry);

// Case builders (label and dims in the layout above).
SelfTestCase rms_norm_case(int64_t tokens, int64_t heads, int64_t dim, RmsNormForm form, bool residual);
SelfTestCase rope_case(int64_t tokens, int64_t heads, int64_t head_dim, int64_t rotary_dim, bool interleaved,
                       int64_t theta);
SelfTestCase silu_mul_case(int64_t tokens, int64_t inter);
SelfTestCase embedding_case(int64_t tokens, int64_t vocab, int64_t hidden);
SelfTestCase residual_add_case(int64_t tokens, int64_t hidden);

// The fp32 reference angle of RoPE pair i at `position` (transformers' default init: fp32 inv_freq, fp32 product).
float rope_reference_angle(int64_t position, int64_t i, int64_t rotary_dim, double theta);

}  // namespace tern
