// Random inputs of the op harnesses (ops/*_op.cc), counter-based: a value depends only on (seed, stream, index), so
// it is fresh for every seed and stream and the same whatever the order or the thread of generation (inputs of real
// model sizes, an lm_head's hundreds of millions of values, are generated in parallel).
//
// Every bf16 generator is scale * uniform(-1, 1) (plus a center) with a nudge of +-1e-3 whose sign comes from a hash
// bit, so that no value is exactly zero. The harnesses grew four forms of it; each keeps its own function here so
// that every existing case gets the same bits as before (a different expression can round differently, and a
// compiler that contracts a * b + c into an fma changes which forms agree):
//   hashed_bf16                 center + scale * (2u - 1) + nudge, the nudge's sign from the same hash
//                               (elementwise_op, gemm_op);
//   hashed_bf16_uncentred       scale * (2u - 1) + nudge, as hashed_bf16 at center 0 short of fma contraction
//                               (moe_op);
//   hashed_bf16_relative_nudge  scale * (2u - 1 + nudge): the nudge scales with the values (silu_gemv_op);
//   hashed_bf16_nudge_stream    scale * (2u - 1) + nudge, the nudge's sign from stream + 100 (gdn_op).
// attention_op draws from a seeded mt19937_64 instead and keeps its own generator.
#pragma once

#include <cstdint>
#include <vector>

#include "core/formats.h"

namespace tern {

// splitmix64's finaliser over the seed, the stream (in the top byte) and the index.
inline uint64_t hash_bits(uint64_t seed, uint64_t stream, int64_t i) {
  uint64_t z = (seed ^ (stream << 56)) + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The top 24 bits of a hash as a float in [0, 1), and the nudge its bit 0 picks.
inline float hash_unit(uint64_t z) {
  return static_cast<float>(z >> 40) * 0x1p-24f;
}
inline float hash_nudge(uint64_t z) {
  return z & 1 ? 1e-3f : -1e-3f;
}

// uniform [0, 1) of (seed, stream, i).
inline float hash_uniform(uint64_t seed, uint64_t stream, int64_t i) {
  return hash_unit(hash_bits(seed, stream, i));
}

// center + scale * uniform(-1, 1), nudged by 1e-3, as bf16 bits.
inline uint16_t hashed_bf16(uint64_t seed, uint64_t stream, int64_t i, float scale, float center = 0.0f) {
  const uint64_t z = hash_bits(seed, stream, i);
  return float_to_bf16(center + scale * (2.0f * hash_unit(z) - 1.0f) + hash_nudge(z));
}

// hashed_bf16 of indices 0 .. n - 1.
inline std::vector<uint16_t> hashed_bf16_vector(uint64_t seed, uint64_t stream, int64_t n, float scale,
                                                float center = 0.0f) {
  std::vector<uint16_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = hashed_bf16(seed, stream, i, scale, center);
  return out;
}

// scale * uniform(-1, 1), nudged by 1e-3, as bf16 bits.
inline uint16_t hashed_bf16_uncentred(uint64_t seed, uint64_t stream, int64_t i, float scale) {
  const uint64_t z = hash_bits(seed, stream, i);
  return float_to_bf16(scale * (2.0f * hash_unit(z) - 1.0f) + hash_nudge(z));
}

// uniform(-scale, scale) nudged by 1e-3 of the scale, as bf16 bits.
inline uint16_t hashed_bf16_relative_nudge(uint64_t seed, uint64_t stream, int64_t i, float scale) {
  const uint64_t z = hash_bits(seed, stream, i);
  return float_to_bf16(scale * (2.0f * hash_unit(z) - 1.0f + hash_nudge(z)));
}

// scale * uniform(-1, 1) nudged by 1e-3, the nudge's sign drawn from stream + 100, as bf16 bits.
inline uint16_t hashed_bf16_nudge_stream(uint64_t seed, uint64_t stream, int64_t i, float scale) {
  return float_to_bf16(scale * (2.0f * hash_uniform(seed, stream, i) - 1.0f) +
                       hash_nudge(hash_bits(seed, stream + 100, i)));
}

}  // namespace tern
