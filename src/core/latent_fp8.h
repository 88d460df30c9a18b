// The FP8 form of MLA's latent cache (docs/model-specs.md §3.2): what one token's entry holds, as bytes, so that the
// CPU reference and every device store and read the same values. Per token, for kv_lora_rank values of c (a
// multiple of kLatentFp8Tile) and qk_rope_head_dim values of the roped k_pe:
//
//   bytes [0, L)              e4m3fn codes of c[i] / s[i / 128], rounded to nearest even, saturated to +-448
//   bytes [L, L + 4 L / 128)  the fp32 tile scales s[t] = max(amax(c[128 t .. 128 t + 127]) / 448, FLT_MIN),
//                             rounded up to a power of two for LatentFp8Scales::kPow2 (DeepSeek), as computed for
//                             kFp32 (GLM-5)
//   then 2 R bytes            k_pe as bf16 (not quantized)
//
// For GLM-5 and DeepSeek-V3 (L = 512, R = 64) that is the 656-byte entry of FlashMLA's sparse kernels and vLLM's
// fp8_ds_mla cache (1152 bytes in bf16). The division is an fp32 division, as the devices' kernels do it; a NaN in
// a tile makes its codes NaN (amax ignores it, so the tile's other values keep their scale).
#pragma once

#include <cstdint>

namespace tern {

inline constexpr int64_t kLatentFp8Tile = 128;  // values of c per scale

enum class LatentFp8Scales { kFp32, kPow2 };

// Bytes of one token's entry; kv_lora_rank must be a positive multiple of kLatentFp8Tile.
constexpr int64_t latent_fp8_bytes(int64_t kv_lora_rank, int64_t rope_dim) {
  return kv_lora_rank + 4 * (kv_lora_rank / kLatentFp8Tile) + 2 * rope_dim;
}

// One token: c [kv_lora_rank] and k_pe [rope_dim] into latent_fp8_bytes of `out`.
void latent_fp8_pack(const float* c, const float* k_pe, int64_t kv_lora_rank, int64_t rope_dim,
                     LatentFp8Scales scales, uint8_t* out);
// The values an entry holds, as every attention reads them: c[i] = bf16(e4m3(code i) * s[i / 128]), the product
// rounded to fp32 then to bf16 (nearest, ties to even), so that the keys enter the same bf16 tensor-core products as
// the bf16 cache's (FlashMLA and vLLM dequantize to bf16 too; with power-of-two scales nothing is rounded); k_pe
// from bf16.
void latent_fp8_unpack(const uint8_t* in, int64_t kv_lora_rank, int64_t rope_dim, float* c, float* k_pe);

}  // namespace tern
