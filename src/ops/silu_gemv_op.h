// The SiLU-and-mul folded into the down projection of a dense MLP at decode, in the registry:
//   silu_mul_gemv  dims {N, K} or {N, K, M}: M rows (default 1: a decode step; a few: a speculative verification) of
//                  [gate | up] (2K bf16 values each), act = silu(gate) * up, and y[M, N] = act . W[N, K]^T with W
//                  bf16 as checkpoints store it (nn.Linear layout).
// The harness draws gate, up and W fresh from the seed (non-zero, bf16-exact; gates over +-6 as the silu_mul
// harness, W scaled by 1 / sqrt(K) so y stays near the act's scale) and computes the reference in fp64 from the
// formula, with the act unrounded. The CPU implementation ("cpu") runs the layers' fp32 silu and cpu_matmul.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "ops/registry.h"

namespace tern {

struct SiluGemvInputs : OpInputs {
  int64_t n = 0, k = 0, m = 1;
  std::vector<uint16_t> gate_up;  // [M, 2K] bf16: each row's gate in [0, K), up in [K, 2K)
  std::vector<uint16_t> w;        // [N, K] bf16
};

// Adds the harness and the CPU implementation ("cpu") to the registry.
Expected<void> silu_gemv_register_cpu(Registry& registry);

// A case {N, K} of one row, or {N, K, M} of M rows (label and dims in the layout above).
SelfTestCase silu_mul_gemv_case(int64_t n, int64_t k, int64_t m = 1);

}  // namespace tern
