// Multi-head latent attention in the weight-absorbed form: the pre-attention step (latent norm, RoPE, cache write)
// and the attention over the paged latent cache; contracts in mla_launch.h.
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mla/mla_launch.h"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/ptx.cuh"

namespace tern {
namespace {

using cuda_common::bf16_to_f32;
using cuda_common::f32_to_bf16;
using cuda_common::warp_sum;

// The two values of a RoPE pair slot j < rope_dim / 2: interleaved (2j, 2j + 1) or NeoX halves (j, j + rope_dim/2).
__device__ __forceinline__ void rope_pair(int j, int half, bool interleaved, int& lo, int& hi) {
  lo = interleaved ? 2 * j : j;
  hi = interleaved ? 2 * j + 1 : j + half;
}

// ---------------------------------------------------------------------------------------------------------------
// mla_prepare. One block per token: sin/cos of its position once into shared memory, the latent's sum of squares
// reduced over the block, then the normed c, the roped k_pe and every head's roped q_pe written.

constexpr int kPrepareThreads = 256;

__host__ __device__ constexpr int64_t fp8_entry_bytes(int64_t lora, int64_t rope) {
  return lora + 4 * (lora / kLatentFp8Tile) + 2 * rope;
}
static_assert(fp8_entry_bytes(512, 64) == latent_fp8_bytes(512, 64));

// c's FP8 part of one token's entry (core/latent_fp8.h), one warp per 128-value tile: the tile's amax (fmaxf skips a
// NaN, as the host packer's fmax), s = max(amax / 448, FLT_MIN), rounded up to a power of two with `pow2`, then each
// code e4m3(c / s) with an fp32 division, nearest even, saturated to +-448 (a NaN stays NaN).
template <class Latent>
__device__ __forceinline__ void write_fp8_latent(const Latent& latent, int lora, bool pow2, uint8_t* dst) {
  constexpr int kPerLane = static_cast<int>(kLatentFp8Tile) / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int tile = warp; tile < lora / kLatentFp8Tile; tile += kPrepareThreads / 32) {
    float v[kPerLane], amax = 0.0f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      v[k] = latent(tile * static_cast<int>(kLatentFp8Tile) + lane + 32 * k);
      amax = fmaxf(amax, fabsf(v[k]));
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    float s = fmaxf(amax / 448.0f, FLT_MIN);
    if (pow2) {  // s is a positive normal number: a power of two unless it has mantissa bits, then the next one up
      const uint32_t bits = __float_as_uint(s);
      if ((bits & 0x7FFFFFu) != 0) s = __uint_as_float((bits & 0x7F800000u) + 0x800000u);
    }
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      dst[tile * kLatentFp8Tile + lane + 32 * k] =
          static_cast<uint8_t>(__nv_cvt_float_to_fp8(v[k] / s, __NV_SATFINITE, __NV_E4M3));
    }
    if (lane == 0) reinterpret_cast<float*>(dst + lora)[tile] = s;
  }
}

__global__ void __launch_bounds__(kPrepareThreads) mla_prepare_kernel(const MlaPrepareArgs a) {
  ptx::grid_dependency_begin();
  __shared__ float cos_s[kMlaMaxRopeDim / 2], sin_s[kMlaMaxRopeDim / 2];
  __shared__ float warp_sums[kPrepareThreads / 32];
  const int64_t t = blockIdx.x;
  const int lora = static_cast<int>(a.cache.kv_lora_rank), rope = static_cast<int>(a.cache.rope_dim);
  const int half = rope / 2, width = lora + rope, tid = threadIdx.x;
  const float position = static_cast<float>(a.positions[t]);
  for (int i = tid; i < half; i += kPrepareThreads) {
    cuda_common::rope_cos_sin(position * a.inv_freq[i], a.attention_factor, &cos_s[i], &sin_s[i]);
  }
  const uint16_t* kv = a.kv_a + t * a.kv_a_stride;
  float sum = 0.0f;
  for (int i = tid; i < lora; i += kPrepareThreads) {
    const float v = bf16_to_f32(kv[i]);
    sum += v * v;
  }
  sum = warp_sum(sum);
  if (tid % 32 == 0) warp_sums[tid / 32] = sum;
  __syncthreads();  // also publishes cos_s / sin_s
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kPrepareThreads / 32; ++w) total += warp_sums[w];
  const float inv = 1.0f / sqrtf(total / static_cast<float>(lora) + a.eps);
  const float offset = a.zero_centred ? 1.0f : 0.0f;
  const int64_t slot = a.slot_mapping[t];
  auto latent = [&](int i) { return bf16_to_f32(kv[i]) * inv * (offset + bf16_to_f32(a.kv_norm_weight[i])); };
  if (slot >= 0 && slot < a.cache.n_blocks * a.cache.block_size) {
    uint16_t* pe;
    if (a.cache.dtype == LatentCacheDtype::kFp8) {
      uint8_t* dst = static_cast<uint8_t*>(a.cache.data) + slot * fp8_entry_bytes(lora, rope);
      write_fp8_latent(latent, lora, a.cache.pow2_scales, dst);
      pe = reinterpret_cast<uint16_t*>(dst + lora + 4 * (lora / kLatentFp8Tile));
    } else {
      uint16_t* dst = static_cast<uint16_t*>(a.cache.data) + slot * width;
      for (int i = tid; i < lora; i += kPrepareThreads) dst[i] = f32_to_bf16(latent(i));
      pe = dst + lora;
    }
    for (int j = tid; j < half; j += kPrepareThreads) {
      int lo, hi;
      rope_pair(j, half, a.interleaved, lo, hi);
      const float x0 = bf16_to_f32(kv[lora + lo]), x1 = bf16_to_f32(kv[lora + hi]);
      pe[lo] = f32_to_bf16(x0 * cos_s[j] - x1 * sin_s[j]);
      pe[hi] = f32_to_bf16(x1 * cos_s[j] + x0 * sin_s[j]);
    }
  }
  const int64_t q_head = a.nope_dim + rope;
  for (int64_t idx = tid; idx < a.n_heads * half; idx += kPrepareThreads) {
    const int64_t h = idx / half;
    const int j = static_cast<int>(idx % half);
    int lo, hi;
    rope_pair(j, half, a.interleaved, lo, hi);
    const uint16_t* src = a.q + t * a.q_stride + h * q_head + a.nope_dim;
    uint16_t* dst = a.q_latent + (t * a.n_heads + h) * width + lora;
    const float x0 = bf16_to_f32(src[lo]), x1 = bf16_to_f32(src[hi]);
    dst[lo] = f32_to_bf16(x0 * cos_s[j] - x1 * sin_s[j]);
    dst[hi] = f32_to_bf16(x1 * cos_s[j] + x0 * sin_s[j]);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// mla_attention on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate; sm_80 and later, and within
// sm_120's shared memory). Block (query row, group of kMlaHeadsPerBlock = 16 heads, key range), eight warps. The
// heads of a token all read the same latent keys (MQA-like), so they are the M dimension of the products, as in
// FlashMLA. The block loads tiles of kMlaKeysPerTile latent rows into shared memory with cp.async, two tiles deep
// (the next tile lands while this one is computed); rows are padded to an odd count of 16-byte chunks, so ldmatrix's
// eight row reads fall in distinct banks.
//   Scores S [16 heads x 32 keys] = Q K^T: the width's k16 steps are dealt to the warps (warp w: steps w, w + 8, ...),
//   each holding its steps' query fragments in registers for the whole range; each warp's partial S for all 32 keys
//   goes to shared memory, where they are added once in warp order (every warp needs all of S next).
//   Online softmax per head row in fp32, the scale applied to the summed score. Each probability enters the
//   product as two bf16 terms (its rounding and the rounding of the rest), about 16 significant bits, and l sums
//   the same terms, so the output is the weighted mean of the weights used.
//   Output O [16 x lora] += P [16 x 32] C [32 x lora]: the 16-column pairs of n8 tiles are dealt to the warps
//   (warp w: pairs w, w + 8, ...), C's fragments read by ldmatrix.trans from the same key rows.
// With several key ranges (split-K) each block leaves (m, l, o) per head in the workspace and mla_combine_kernel
// merges them.

constexpr int kAttnWarps = 8;
constexpr int kAttnThreads = kAttnWarps * 32;
constexpr int kMaxQStepsPerWarp =
    static_cast<int>((kMlaMaxLoraRank + kMlaMaxRopeDim) / 16 + kAttnWarps - 1) / kAttnWarps;
constexpr int kMaxOutPairsPerWarp = static_cast<int>(kMlaMaxLoraRank / 16 + kAttnWarps - 1) / kAttnWarps;
constexpr int kScoreTiles = kMlaKeysPerTile / 8;  // n8 tiles of S
constexpr int kCombineWarps = 4;
constexpr int kCombineThreads = kCombineWarps * 32;
constexpr int kCombineColumns = 4 * 32;  // output columns of a combine block: four per lane
static_assert(kMlaHeadsPerBlock == 16 && kMlaKeysPerTile == 32, "one m16 tile of heads, two k16 steps of keys");

__host__ __device__ constexpr int64_t key_row_words(int64_t width) {
  const int64_t quads = (width / 2 + 3) / 4;
  return 4 * (quads % 2 == 1 ? quads : quads + 1);
}

struct AttnParams {
  MlaAttentionArgs a;
  int splits;
  int tiles_per_split;
};

// An FP8 latent (kv_lora_rank kFp8Lora) reaches shared memory as the bf16 row the products read, eight threads per
// key row, each with a 64-code run of one 128-value tile and an eighth of k_pe: fetched from global memory into
// registers when the tile before it starts (the loads land while that tile is computed), widened into the row after
// it, so the widening needs no syncs of its own and the loads no shared-memory staging.
constexpr int kFp8Lora = static_cast<int>(kMlaFp8LoraRank);
constexpr int kFp8ThreadsPerRow = kAttnThreads / kMlaKeysPerTile;
constexpr int kFp8CodesPerThread = kFp8Lora / kFp8ThreadsPerRow;
constexpr int kFp8MaxPeWords = static_cast<int>(kMlaFp8MaxRopeDim) / 2 / kFp8ThreadsPerRow;
static_assert(kFp8ThreadsPerRow == 8 && kFp8CodesPerThread % 16 == 0 && kLatentFp8Tile % kFp8CodesPerThread == 0);

struct Fp8Part {
  uint4 codes[kFp8CodesPerThread / 16];
  float s;
  uint32_t pe[kFp8MaxPeWords];
};

// This thread's part of the entry at `entry` (null: a masked key, zeros).
__device__ __forceinline__ void fp8_fetch(Fp8Part& f, const uint8_t* entry, int part, int pe_words) {
  if (entry == nullptr) {
#pragma unroll
    for (int j = 0; j < kFp8CodesPerThread / 16; ++j) f.codes[j] = make_uint4(0, 0, 0, 0);
    f.s = 0.0f;
#pragma unroll
    for (int j = 0; j < kFp8MaxPeWords; ++j) f.pe[j] = 0;
    return;
  }
#pragma unroll
  for (int j = 0; j < kFp8CodesPerThread / 16; ++j) {
    f.codes[j] = __ldg(reinterpret_cast<const uint4*>(entry + kFp8CodesPerThread * part) + j);
  }
  f.s = __ldg(reinterpret_cast<const float*>(entry + kFp8Lora) + kFp8CodesPerThread * part / kLatentFp8Tile);
  const auto* pe = reinterpret_cast<const uint32_t*>(entry + kFp8Lora + 4 * (kFp8Lora / kLatentFp8Tile));
#pragma unroll
  for (int j = 0; j < kFp8MaxPeWords; ++j) {
    if (j < pe_words) f.pe[j] = __ldg(pe + pe_words * part + j);
  }
}

// The part written into the bf16 row [c | k_pe] the bf16 cache would hold: c[i] = bf16(e4m3(code i) * s), the
// product in fp32 (as latent_fp8_unpack); k_pe moved.
__device__ __forceinline__ void fp8_widen(const Fp8Part& f, uint8_t* row, int part, int pe_words) {
  // A code's bits moved into an fp32's (sign to bit 31, exponent and mantissa to bits 30:20) read as 2^-120 times
  // its value, subnormal codes as fp32 subnormals of the same ratio; one multiply by s * 2^120 (exact while s < 2^7)
  // then rounds the product once, as (float)e4m3 * s does. Integer and fp32 work only: the conversion instructions
  // (e4m3x2 -> f16x2 -> f32) run at a quarter of their rate and were the FP8 path's bottleneck.
  const bool big = f.s >= 0x1p7f;
  const float s_bits = big ? 0x1p120f : f.s * 0x1p120f, s_after = big ? f.s : 1.0f;
  uint4* c_out = reinterpret_cast<uint4*>(row + 2 * kFp8CodesPerThread * part);
#pragma unroll
  for (int j = 0; j < kFp8CodesPerThread / 16; ++j) {
    const uint32_t words[4] = {f.codes[j].x, f.codes[j].y, f.codes[j].z, f.codes[j].w};
    uint32_t out[8];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // code k of the word: its byte shifted to the top, then sign-extended by 4
        const uint32_t top = k == 3 ? words[w] : words[w] << (24 - 8 * k);
        v[k] = __uint_as_float(static_cast<uint32_t>(static_cast<int32_t>(top) >> 4) & 0x87F00000u) * s_bits;
        if (big) v[k] *= s_after;  // the first product was exact
      }
      // The NaN codes (0x7F, 0xFF) would read as 480: bytes whose low seven bits are all ones, found for the word at
      // once (adding 1 to such a byte, and only to such a byte, sets its top bit).
      if (const uint32_t nan_bytes = ((words[w] & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u; nan_bytes != 0) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if ((nan_bytes >> (8 * k + 7)) & 1u) v[k] = __uint_as_float(0x7FC00000u);
        }
      }
      out[2 * w] = cuda_common::pack_bf16x2(v[0], v[1]);
      out[2 * w + 1] = cuda_common::pack_bf16x2(v[2], v[3]);
    }
    c_out[2 * j] = make_uint4(out[0], out[1], out[2], out[3]);
    c_out[2 * j + 1] = make_uint4(out[4], out[5], out[6], out[7]);
  }
  uint32_t* pe_out = reinterpret_cast<uint32_t*>(row + 2 * kFp8Lora);
#pragma unroll
  for (int j = 0; j < kFp8MaxPeWords; ++j) {
    if (j < pe_words) pe_out[pe_words * part + j] = f.pe[j];
  }
}

// kFp8: the cache holds FP8 entries, widened on the way in (the bf16 kernel is compiled without that code). Both
// are held to 128 registers, so that two blocks share an SM (the register allocator otherwise goes past it).
template <bool kFp8>
__global__ void __launch_bounds__(kAttnThreads, 2) mla_attention_kernel(const AttnParams p) {
  ptx::grid_dependency_begin();
  const MlaAttentionArgs& a = p.a;
  extern __shared__ __align__(16) uint32_t smem[];
  const int lora = static_cast<int>(a.cache.kv_lora_rank), width = lora + static_cast<int>(a.cache.rope_dim);
  const int row_words = static_cast<int>(key_row_words(width)), chunks = width / 8;
  const int q_steps = width / 16, out_pairs = lora / 16;
  uint32_t* keys_s = smem;                                                        // [2][tile][row_words]
  float4* red = reinterpret_cast<float4*>(smem + 2 * kMlaKeysPerTile * row_words);  // [warp][n8 tile][lane]
  float4* total = red + kAttnWarps * kScoreTiles * 32;                               // [n8 tile][lane]
  int64_t* slot_s = reinterpret_cast<int64_t*>(total + kScoreTiles * 32);           // [3][tile]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int64_t t = blockIdx.x, head0 = int64_t{blockIdx.y} * kMlaHeadsPerBlock;

  // Key j of tile `tile` (lane j of a warp) is key position selection(tile, j) unless that is past the row's
  // position or -1 (key_pos); its physical slot is the block table's entry (key_slot). A selection's entries need no
  // sequence, so the first two tiles' (warps 0 and 1) are loaded before the sequence lookup; later tiles' loads run
  // two tiles ahead of the compute (slot_s holds three tiles' slots, see the loop), off the tiles' path.
  const bool causal = a.selected == nullptr;
  const int64_t tile_begin = int64_t{blockIdx.z} * p.tiles_per_split;
  auto selection = [&](int64_t tile, int j) -> int64_t {
    const int64_t k = tile * kMlaKeysPerTile + j;
    return causal ? k : (k < a.topk ? int64_t{a.selected[t * a.topk + k]} : -1);
  };
  const int64_t first_keys = warp < 2 ? selection(tile_begin + warp, lane) : -1;

  // The warp's query fragments (A of m16n8k16: rows g and g + 8 are heads head0 + g, head0 + g + 8; columns 2 t4,
  // 2 t4 + 1 and those + 8 of each of its k16 steps), zero for heads past n_heads; they need no sequence either.
  uint32_t qf[kMaxQStepsPerWarp][4];
#pragma unroll
  for (int i = 0; i < kMaxQStepsPerWarp; ++i) {
    const int ks = warp + kAttnWarps * i;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t h = head0 + g + 8 * (r % 2);
      const int col = 16 * ks + 2 * t4 + 8 * (r / 2);
      qf[i][r] = ks < q_steps && h < a.n_heads
                     ? *reinterpret_cast<const uint32_t*>(a.q_latent + (t * a.n_heads + h) * width + col)
                     : 0u;
    }
  }

  // The row's sequence s (query_start[s] <= t < query_start[s + 1]; the last one for a row past them all, as a
  // binary search for the last s with query_start[s] <= t would find) and position. Every thread loads its
  // sequences' bounds and length at once and the one whose rows hold t publishes them: one load latency for up to
  // 256 sequences, where a binary search then the sequence's own loads were log2(n) + 1 dependent ones before the
  // first key could be fetched.
  int32_t* seq_s = reinterpret_cast<int32_t*>(slot_s + 3 * kMlaKeysPerTile);  // s, its first row, rows, length
  if (tid == 0) {  // metadata against the contract (no sequence holds row t): one key, position 0 of sequence 0
    seq_s[0] = 0, seq_s[1] = static_cast<int32_t>(t), seq_s[2] = 1, seq_s[3] = 1;
  }
  __syncthreads();
  for (int64_t i = tid; i < a.n_seqs; i += kAttnThreads) {
    const int32_t q0 = a.query_start[i], q1 = a.query_start[i + 1], len = a.seq_lens[i];
    if (q0 <= t && (t < q1 || i == a.n_seqs - 1)) {
      seq_s[0] = static_cast<int32_t>(i), seq_s[1] = q0, seq_s[2] = q1 - q0, seq_s[3] = len;
    }
  }
  __syncthreads();
  const int s = seq_s[0];
  const int64_t position = int64_t{seq_s[3]} - seq_s[2] + (t - seq_s[1]);
  const int64_t n_keys = causal ? position + 1 : a.topk;
  const int64_t bs = a.cache.block_size;
  const int32_t* table = a.block_tables + int64_t{s} * a.max_blocks_per_seq;
  const int64_t n_tiles = (n_keys + kMlaKeysPerTile - 1) / kMlaKeysPerTile;
  const int64_t tile_end = min(n_tiles, tile_begin + p.tiles_per_split);
  auto key_pos = [&](int64_t key) -> int64_t { return key > position ? -1 : key; };  // never a future key
  auto key_slot = [&](int64_t pos) -> int64_t {
    return pos >= 0 ? int64_t{table[pos / bs]} * bs + (pos & (bs - 1)) : -1;
  };
  // Tile rows into keys_s[buf] from the slots in slot_s[sbuf], a masked key's as zeros: bf16 rows by cp.async; FP8
  // entries by fp8_fetch into registers, then fp8_widen into the row.
  constexpr bool fp8 = kFp8;
  const auto* cache_bytes = static_cast<const uint8_t*>(a.cache.data);
  auto load = [&](int buf, int sbuf) {
    for (int i = tid; i < kMlaKeysPerTile * chunks; i += kAttnThreads) {
      const int r = i / chunks, c = i % chunks;
      const int64_t slot = slot_s[sbuf * kMlaKeysPerTile + r];
      ptx::cp_async_16_zfill(keys_s + (buf * kMlaKeysPerTile + r) * row_words + 4 * c,
                             cache_bytes + ((slot >= 0 ? slot : 0) * chunks + c) * 16, slot >= 0);
    }
    ptx::cp_async_commit();
  };
  const int fp8_row = tid / kFp8ThreadsPerRow, fp8_part = tid % kFp8ThreadsPerRow;
  const int pe_words = static_cast<int>(a.cache.rope_dim) / 2 / kFp8ThreadsPerRow;
  const int64_t entry_bytes = fp8_entry_bytes(lora, a.cache.rope_dim);
  [[maybe_unused]] auto fetch = [&](Fp8Part& f, int sbuf) {
    const int64_t slot = slot_s[sbuf * kMlaKeysPerTile + fp8_row];
    fp8_fetch(f, slot >= 0 ? cache_bytes + slot * entry_bytes : nullptr, fp8_part, pe_words);
  };
  [[maybe_unused]] auto widen = [&](const Fp8Part& f, int buf) {
    fp8_widen(f, reinterpret_cast<uint8_t*>(keys_s + (buf * kMlaKeysPerTile + fp8_row) * row_words), fp8_part,
              pe_words);
  };
  // The first two tiles' slots, the first tile's rows.
  if (warp < 2 && tile_begin + warp < tile_end) {
    slot_s[warp * kMlaKeysPerTile + lane] = key_slot(key_pos(first_keys));
  }
  __syncthreads();
  if (tile_begin < tile_end) {
    if constexpr (fp8) {
      Fp8Part f;
      fetch(f, 0);
      widen(f, 0);
    } else {
      load(0, 0);
    }
  }

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g, g + 8; l over this lane's keys
  float o[kMaxOutPairsPerWarp][2][4];
#pragma unroll
  for (int i = 0; i < kMaxOutPairsPerWarp; ++i) {
#pragma unroll
    for (int e = 0; e < 8; ++e) o[i][e / 4][e % 4] = 0.0f;
  }

  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int i_tile = static_cast<int>(tile - tile_begin);
    const int buf = i_tile & 1, next = buf ^ 1, sbuf = i_tile % 3;
    const bool more = tile + 1 < tile_end, ahead = warp == 0 && tile + 2 < tile_end;
    __syncthreads();  // every warp is done with tile - 1: its key buffer, slots and partial scores are free, and
                      // tile + 1's slots (written during tile - 1) are visible
    // Tile + 2's slots, warp 0: the selection's load issued here, the block table's after the scores, the slot
    // stored after the products (into tile - 1's slot buffer).
    const int64_t key_ahead = ahead ? selection(tile + 2, lane) : -1;
    [[maybe_unused]] Fp8Part ahead_part;  // FP8: tile + 1's entries, widened into `next` after this tile's products
    if constexpr (fp8) {  // this tile's rows were widened before the sync above
      if (more) fetch(ahead_part, (i_tile + 1) % 3);
    } else {
      if (more) {
        load(next, (i_tile + 1) % 3);
        ptx::cp_async_wait<1>();
      } else {
        ptx::cp_async_wait<0>();
      }
      __syncthreads();  // this tile's rows, from every thread's copies
    }
    const uint16_t* rows = reinterpret_cast<const uint16_t*>(keys_s + buf * kMlaKeysPerTile * row_words);
    const int row_elems = 2 * row_words;

    // Partial scores over the warp's k16 steps; matrix lane / 8 of each ldmatrix.x4: keys 16 np + 8 (lane / 16) +
    // lane % 8, columns 16 ks + 8 ((lane / 8) % 2), so registers {0, 1} are n8 tile 2 np's B, {2, 3} tile 2 np + 1's.
    float sc[kScoreTiles][4];
#pragma unroll
    for (int j = 0; j < kScoreTiles; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxQStepsPerWarp; ++i) {
      const int ks = warp + kAttnWarps * i;
      if (ks >= q_steps) break;  // warp-uniform
#pragma unroll
      for (int np = 0; np < kScoreTiles / 2; ++np) {
        uint32_t b[4];
        const int key = 16 * np + 8 * (lane / 16) + lane % 8;
        ptx::ldmatrix_x4(b, rows + key * row_elems + 16 * ks + 8 * ((lane / 8) % 2));
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        ptx::mma_bf16_16816(sc[2 * np], qf[i], b0);
        ptx::mma_bf16_16816(sc[2 * np + 1], qf[i], b1);
      }
    }
#pragma unroll
    for (int j = 0; j < kScoreTiles; ++j) {
      red[(warp * kScoreTiles + j) * 32 + lane] = make_float4(sc[j][0], sc[j][1], sc[j][2], sc[j][3]);
    }
    __syncthreads();
    if (tid < kScoreTiles * 32) {  // the partials added once, in warp order
      float4 sum = red[tid];
#pragma unroll
      for (int w = 1; w < kAttnWarps; ++w) {
        const float4 v = red[w * kScoreTiles * 32 + tid];
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
      }
      total[tid] = sum;
    }
    __syncthreads();
    const int64_t slot_ahead = ahead ? key_slot(key_pos(key_ahead)) : -1;
    // The whole S in this lane's fragment positions: element e of n8 tile j is head row g + 8 (e / 2), key
    // 8 j + 2 t4 + e % 2 of the tile; masked keys -inf.
    const int64_t* tile_slots = slot_s + sbuf * kMlaKeysPerTile;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kScoreTiles; ++j) {
      const float4 sum = total[j * 32 + lane];
      const bool k0 = tile_slots[8 * j + 2 * t4] >= 0, k1 = tile_slots[8 * j + 2 * t4 + 1] >= 0;
      sc[j][0] = k0 ? sum.x * a.scale : -INFINITY;
      sc[j][1] = k1 ? sum.y * a.scale : -INFINITY;
      sc[j][2] = k0 ? sum.z * a.scale : -INFINITY;
      sc[j][3] = k1 ? sum.w * a.scale : -INFINITY;
      mx[0] = fmaxf(mx[0], fmaxf(sc[j][0], sc[j][1]));
      mx[1] = fmaxf(mx[1], fmaxf(sc[j][2], sc[j][3]));
    }
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xFFFFFFFFu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xFFFFFFFFu, mx[r], 2));
      const float m_new = fmaxf(m[r], mx[r]);
      corr[r] = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new);  // o and l are still zero while m is -inf
      m[r] = m_new;
    }
    // Probabilities in A-fragment order (k16 step kk of the product is n8 tiles 2 kk, 2 kk + 1), each as a bf16
    // value and the bf16 rounding of what that leaves: p = hi + lo to about 16 bits, so the product carries p
    // almost as exactly as fp32 (p rounded to bf16 alone moved the GLM fixture's logits to transformers-bf16's
    // error). l sums the same hi + lo.
    l[0] *= corr[0], l[1] *= corr[1];
    uint32_t pa[2][2][4];  // [hi, lo][kk][A register]
#pragma unroll
    for (int j = 0; j < kScoreTiles; ++j) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // head rows g (registers a0, a2) and g + 8 (a1, a3)
        float pr[2], rest[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float v = sc[j][2 * r + e];
          pr[e] = v == -INFINITY ? 0.0f : expf(v - m[r]);
        }
        const uint32_t hi_bits = cuda_common::pack_bf16x2(pr[0], pr[1]);
        const float hi0 = __uint_as_float(hi_bits << 16), hi1 = __uint_as_float(hi_bits & 0xFFFF0000u);
        rest[0] = pr[0] - hi0, rest[1] = pr[1] - hi1;  // exact in fp32
        const uint32_t lo_bits = cuda_common::pack_bf16x2(rest[0], rest[1]);
        l[r] += (hi0 + __uint_as_float(lo_bits << 16)) + (hi1 + __uint_as_float(lo_bits & 0xFFFF0000u));
        pa[0][j / 2][2 * (j % 2) + r] = hi_bits;
        pa[1][j / 2][2 * (j % 2) + r] = lo_bits;
      }
    }
#pragma unroll
    for (int i = 0; i < kMaxOutPairsPerWarp; ++i) {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        o[i][n][0] *= corr[0], o[i][n][1] *= corr[0];
        o[i][n][2] *= corr[1], o[i][n][3] *= corr[1];
      }
    }
    // O += P C: matrix lane / 8 of each ldmatrix.x4.trans holds keys 16 kk + 8 ((lane / 8) % 2) + lane % 8 and
    // columns 16 pair + 8 (lane / 16): registers {0, 1} are the B of the pair's first n8 tile, {2, 3} its second.
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
      for (int i = 0; i < kMaxOutPairsPerWarp; ++i) {
        const int pair = warp + kAttnWarps * i;
        if (pair >= out_pairs) break;  // warp-uniform
        uint32_t b[4];
        const int key = 16 * kk + 8 * ((lane / 8) % 2) + lane % 8;
        ptx::ldmatrix_x4_trans(b, rows + key * row_elems + 16 * pair + 8 * (lane / 16));
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
        for (int part = 0; part < 2; ++part) {
          ptx::mma_bf16_16816(o[i][0], pa[part][kk], b0);
          ptx::mma_bf16_16816(o[i][1], pa[part][kk], b1);
        }
      }
    }
    if constexpr (fp8) {
      if (more) widen(ahead_part, next);  // every warp left `next` (tile - 1's) before this tile's first sync
    }
    if (ahead) slot_s[((i_tile + 2) % 3) * kMlaKeysPerTile + lane] = slot_ahead;
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xFFFFFFFFu, l[r], 1);
    l[r] += __shfl_xor_sync(0xFFFFFFFFu, l[r], 2);
  }
  // Fragment element e of n8 tile n of pair `pair`: head row g + 8 (e / 2), column 16 pair + 8 n + 2 t4 + e % 2.
  const int64_t parts = a.tokens * a.n_heads * p.splits;
  float* outs = static_cast<float*>(a.workspace);
  float* ml = outs + parts * lora;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t h = head0 + g + 8 * r;
    if (h >= a.n_heads) continue;
    const int64_t part = (t * a.n_heads + h) * p.splits + blockIdx.z;
    if (p.splits > 1 && t4 == 0) {
      ml[2 * part] = m[r];
      ml[2 * part + 1] = l[r];
    }
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxOutPairsPerWarp; ++i) {
      const int pair = warp + kAttnWarps * i;
      if (pair >= out_pairs) break;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int col = 16 * pair + 8 * n + 2 * t4;
        const float v0 = o[i][n][2 * r], v1 = o[i][n][2 * r + 1];
        if (p.splits == 1) {
          *reinterpret_cast<uint32_t*>(a.out_latent + (t * a.n_heads + h) * lora + col) =
              cuda_common::pack_bf16x2(v0 * inv, v1 * inv);
        } else {  // partials: outputs [rows, heads, splits, lora], then (m, l) pairs [rows, heads, splits, 2]
          *reinterpret_cast<float2*>(outs + part * lora + col) = make_float2(v0, v1);
        }
      }
    }
  }
}

// The splits' partials merged, o = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s. Block (row x head, 128 output
// columns), four warps: each lane holds four columns, warp w adds splits w, w + 4, ... and the four warps' sums are
// added in warp order (fixed, so runs are bit-identical). Every warp first reduces M and the denominator over all
// splits. Many blocks of independent loads: one sequence's 8 heads over 64 splits were 8 blocks walking 256 loads
// each when a block merged a whole head.
__global__ void __launch_bounds__(kCombineThreads) mla_combine_kernel(const AttnParams p) {
  ptx::grid_dependency_begin();
  const MlaAttentionArgs& a = p.a;
  const int64_t row = blockIdx.x, lora = a.cache.kv_lora_rank, parts = a.tokens * a.n_heads * p.splits;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* outs = static_cast<const float*>(a.workspace) + row * p.splits * lora;
  const float* ml = static_cast<const float*>(a.workspace) + parts * lora + 2 * row * p.splits;
  float big = -INFINITY;
  for (int s = lane; s < p.splits; s += 32) big = fmaxf(big, ml[2 * s]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) big = fmaxf(big, __shfl_xor_sync(0xFFFFFFFFu, big, off));
  float total = 0.0f;
  for (int s = lane; s < p.splits; s += 32) {
    total += ml[2 * s] == -INFINITY ? 0.0f : expf(ml[2 * s] - big) * ml[2 * s + 1];
  }
  total = warp_sum(total);
  const int64_t col = int64_t{blockIdx.y} * kCombineColumns + 4 * lane;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (col < lora) {
#pragma unroll 4
    for (int s = warp; s < p.splits; s += kCombineWarps) {
      const float m = ml[2 * s];
      if (m == -INFINITY) continue;  // an empty range
      const float w = expf(m - big);
      const float4 v = *reinterpret_cast<const float4*>(outs + s * lora + col);
      acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
    }
  }
  __shared__ float4 sums[kCombineWarps][32];
  sums[warp][lane] = acc;
  __syncthreads();
  if (warp != 0 || col >= lora) return;
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) {
    const float4 v = sums[w][lane];
    acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  uint32_t* dst = reinterpret_cast<uint32_t*>(a.out_latent + row * lora + col);
  dst[0] = cuda_common::pack_bf16x2(acc.x * inv, acc.y * inv);
  dst[1] = cuda_common::pack_bf16x2(acc.z * inv, acc.w * inv);
}

}  // namespace

size_t mla_attention_smem_bytes(int64_t width) {
  return static_cast<size_t>(2 * kMlaKeysPerTile * key_row_words(width) * 4 + (kAttnWarps + 1) * kScoreTiles * 32 * 16 +
                             3 * kMlaKeysPerTile * 8 + 4 * 4);
}

int64_t mla_attention_splits(const DeviceProps& props, int64_t tokens, int64_t n_heads, int64_t max_keys,
                             int64_t width) {
  const int64_t blocks = tokens * ((n_heads + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock);
  // Resident blocks: an SM's shared memory over a block's (and the 1 KiB the driver reserves per block), at most two
  // (the workspace bound), at least one.
  const auto per_block = static_cast<int64_t>(mla_attention_smem_bytes(width)) + 1024;
  const int64_t per_sm = std::clamp<int64_t>(static_cast<int64_t>(props.shared_mem_per_sm) / per_block, 1, 2);
  const int64_t resident = std::max(props.num_sms, 1) * per_sm;
  const int64_t by_keys = std::max<int64_t>(1, max_keys / kMlaMinKeysPerSplit);
  return std::max<int64_t>(1, std::min(resident / blocks, by_keys));
}

size_t mla_attention_workspace_bytes(const DeviceProps& props, int64_t kv_lora_rank) {
  // rows x groups x splits < 3 x num_sms blocks, kMlaHeadsPerBlock heads each.
  const auto parts = static_cast<size_t>(3 * std::max(props.num_sms, 1) * kMlaHeadsPerBlock);
  return parts * static_cast<size_t>(kv_lora_rank + 2) * 4;
}

void mla_prepare_launch(const DeviceContext& ctx, const MlaPrepareArgs& args) {
  launch_kernel(ctx, mla_prepare_kernel, dim3(static_cast<unsigned>(args.tokens)), dim3(kPrepareThreads), 0, args);
  TERN_CUDA_CHECK_LAUNCH();
}

void mla_attention_launch(const DeviceContext& ctx, const MlaAttentionArgs& args) {
  const size_t smem = mla_attention_smem_bytes(args.cache.width());
  const int64_t max_keys = args.selected != nullptr ? args.topk : args.max_seq_len;
  const int64_t splits =
      args.splits > 0 ? args.splits
                      : mla_attention_splits(ctx.props(), args.tokens, args.n_heads, max_keys, args.cache.width());
  const int64_t tiles = (max_keys + kMlaKeysPerTile - 1) / kMlaKeysPerTile;
  const AttnParams p{.a = args,
                     .splits = static_cast<int>(splits),
                     .tiles_per_split = static_cast<int>(std::max<int64_t>(1, (tiles + splits - 1) / splits))};
  const bool fp8 = args.cache.dtype == LatentCacheDtype::kFp8;
  const auto kernel = fp8 ? mla_attention_kernel<true> : mla_attention_kernel<false>;
  TERN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>(args.tokens),
                  static_cast<unsigned>((args.n_heads + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock),
                  static_cast<unsigned>(splits));
  launch_kernel(ctx, kernel, grid, dim3(kAttnThreads), smem, p);
  TERN_CUDA_CHECK_LAUNCH();
  if (splits > 1) {
    launch_kernel(ctx, mla_combine_kernel,
                  dim3(static_cast<unsigned>(args.tokens * args.n_heads),
                       static_cast<unsigned>((args.cache.kv_lora_rank + kCombineColumns - 1) / kCombineColumns)),
                  dim3(kCombineThreads), 0, p);
    TERN_CUDA_CHECK_LAUNCH();
  }
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t mla_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, mla_attention_kernel<false>);
}

}  // namespace tern
