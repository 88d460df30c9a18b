#include "core/latent_fp8.h"

#include <cfloat>
#include <cmath>
#include <cstring>

#include "core/formats.h"

namespace tern {

void latent_fp8_pack(const float* c, const float* k_pe, int64_t kv_lora_rank, int64_t rope_dim,
                     LatentFp8Scales scales, uint8_t* out) {
  const int64_t tiles = kv_lora_rank / kLatentFp8Tile;
  uint8_t* scale_bytes = out + kv_lora_rank;
  for (int64_t t = 0; t < tiles; ++t) {
    const float* tile = c + t * kLatentFp8Tile;
    float amax = 0.0f;
    for (int64_t i = 0; i < kLatentFp8Tile; ++i) amax = std::fmax(amax, std::fabs(tile[i]));  // fmax skips NaN
    float s = std::fmax(amax / 448.0f, FLT_MIN);
    if (scales == LatentFp8Scales::kPow2) s = ue8m0_to_float(float_to_ue8m0(s, Ue8m0Rounding::kUp));
    for (int64_t i = 0; i < kLatentFp8Tile; ++i) out[t * kLatentFp8Tile + i] = float_to_e4m3(tile[i] / s);
    std::memcpy(scale_bytes + 4 * t, &s, 4);
  }
  uint8_t* pe = scale_bytes + 4 * tiles;
  for (int64_t i = 0; i < rope_dim; ++i) {
    const uint16_t bits = float_to_bf16(k_pe[i]);
    std::memcpy(pe + 2 * i, &bits, 2);
  }
}

void latent_fp8_unpack(const uint8_t* in, int64_t kv_lora_rank, int64_t rope_dim, float* c, float* k_pe) {
  const int64_t tiles = kv_lora_rank / kLatentFp8Tile;
  const uint8_t* scale_bytes = in + kv_lora_rank;
  for (int64_t t = 0; t < tiles; ++t) {
    float s;
    std::memcpy(&s, scale_bytes + 4 * t, 4);
    for (int64_t i = 0; i < kLatentFp8Tile; ++i) {
      c[t * kLatentFp8Tile + i] = bf16_to_float(float_to_bf16(e4m3_to_float(in[t * kLatentFp8Tile + i]) * s));
    }
  }
  const uint8_t* pe = scale_bytes + 4 * tiles;
  for (int64_t i = 0; i < rope_dim; ++i) {
    uint16_t bits;
    std::memcpy(&bits, pe + 2 * i, 2);
    k_pe[i] = bf16_to_float(bits);
  }
}

}  // namespace tern
