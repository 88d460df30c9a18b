// Paged attention prefill of the GPU model path: the tensor-core flash attention kernel over the paged cache and
// the device-dependent choice of its stages; contracts in attention_launch.h.
#include "kernels/cuda/attention/attention_device.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"

namespace tern {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Prefill (flash attention on tensor cores). Block (query tile, head, sequence), 4 warps; warp w owns query rows
// 16w..16w+15 of the tile. The Q tile stays in shared memory; K/V tiles of kKvTile keys are gathered from the cache
// slot by slot with cp.async (zero-filled past the last key the tile needs). Per K/V tile:
//   S = Q K^T (ldmatrix of Q rows and K rows: K stored [key][dim] is exactly the mma's col-major B);
//   causal mask, running row max and rescale in the log2 domain, P = 2^(S - max) in registers;
//   O += P V, P's accumulator fragments reused as the A operand (bf16), V through ldmatrix.trans.
// Rows are padded by 16 bytes so ldmatrix's eight 16-byte row reads fall in distinct banks.

constexpr int kPrefillWarps = 4;
constexpr int kPrefillThreads = kPrefillWarps * 32;

// Row r's dims 8 c .. of a padded [rows][kLd] tile, in bytes (prefill_load_q / prefill_load_kv).
template <int kHeadDim>
__device__ __forceinline__ uint32_t padded_at(int r, int c) {
  return static_cast<uint32_t>((r * (kHeadDim + 8) + c * 8) * 2);
}

// Gathers keys [key0, key0 + kKvTile) of the kv head into k_s / v_s ([kKvTile][kLd] each), zero past n_keys.
template <int kHeadDim, int kKvTile>
__device__ __forceinline__ void prefill_gather_kv(const PrefillParams& p, const PrefillTile& tile, int kvh, int key0,
                                                  uint16_t* k_s, uint16_t* v_s) {
  prefill_load_kv<kHeadDim, kKvTile, kPrefillThreads>(p, tile, kvh, key0, reinterpret_cast<uint8_t*>(k_s),
                                                      reinterpret_cast<uint8_t*>(v_s), padded_at<kHeadDim>);
}

// S = Q K^T for the warp's 16 rows and the tile's keys.
template <int kHeadDim, int kKvTile>
__device__ __forceinline__ void prefill_scores(const uint16_t* q_s, const uint16_t* k_s, float (&s)[kKvTile / 8][4]) {
  constexpr int kLd = kHeadDim + 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < kKvTile / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < kHeadDim; kk += 16) {
    uint32_t a[4];
    ldmatrix_x4(a, q_s + (warp * 16 + lane % 16) * kLd + kk + (lane / 16) * 8);
#pragma unroll
    for (int n = 0; n < kKvTile / 8; n += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, k_s + (n * 8 + (lane / 16) * 8 + lane % 8) * kLd + kk + ((lane / 8) % 2) * 8);
      mma_bf16_16816(s[n], a, {b[0], b[1]});
      mma_bf16_16816(s[n + 1], a, {b[2], b[3]});
    }
  }
}

// O += P V with P the probabilities in s (accumulator layout of keys 16k..16k+15 = the A fragment of step k).
template <int kHeadDim, int kKvTile>
__device__ __forceinline__ void prefill_pv(const float (&s)[kKvTile / 8][4], const uint16_t* v_s,
                                           float (&o)[kHeadDim / 8][4]) {
  constexpr int kLd = kHeadDim + 8;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < kKvTile; kk += 16) {
    const int n = kk / 8;
    const uint32_t a[4] = {pack_bf16x2(s[n][0], s[n][1]), pack_bf16x2(s[n][2], s[n][3]),
                           pack_bf16x2(s[n + 1][0], s[n + 1][1]), pack_bf16x2(s[n + 1][2], s[n + 1][3])};
#pragma unroll
    for (int dn = 0; dn < kHeadDim / 8; dn += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_s + (kk + ((lane / 8) % 2) * 8 + lane % 8) * kLd + dn * 8 + (lane / 16) * 8);
      mma_bf16_16816(o[dn], a, {b[0], b[1]});
      mma_bf16_16816(o[dn + 1], a, {b[2], b[3]});
    }
  }
}

template <int kHeadDim, int kKvTile, int kStages>
__global__ void __launch_bounds__(kPrefillThreads) paged_prefill_kernel(const PrefillParams p) {
  ptx::grid_dependency_begin();
  constexpr int kLd = kHeadDim + 8, kRows = 16 * kPrefillWarps;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* q_s = smem;                 // [kRows][kLd]
  uint16_t* kv_s = smem + kRows * kLd;  // per stage: K [kKvTile][kLd], then V [kKvTile][kLd]
  const PagedAttentionArgs& a = p.a;
  const int h = blockIdx.y, kvh = h / p.group;
  PrefillTile tile;
  if (!prefill_tile(p, kRows, tile)) return;
  const int n_tiles = (tile.n_keys + kKvTile - 1) / kKvTile;

  // Q tile and the first K/V tile in one cp.async group.
  prefill_load_q<kHeadDim, kRows, kPrefillThreads>(p, tile, h, reinterpret_cast<uint8_t*>(q_s), padded_at<kHeadDim>);
  prefill_gather_kv<kHeadDim, kKvTile>(p, tile, kvh, 0, kv_s, kv_s + kKvTile * kLd);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int qpos[2] = {tile.pos0 + warp * 16 + lane / 4, tile.pos0 + warp * 16 + lane / 4 + 8};
  float o[kHeadDim / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  for (int j = 0; j < n_tiles; ++j) {
    if constexpr (kStages == 2) {  // prefetch tile j + 1 into the other stage, then wait for tile j only
      if (j + 1 < n_tiles) {
        uint16_t* next = kv_s + ((j + 1) % 2) * 2 * kKvTile * kLd;
        prefill_gather_kv<kHeadDim, kKvTile>(p, tile, kvh, (j + 1) * kKvTile, next, next + kKvTile * kLd);
      }
      cp_async_commit();  // always, so the group count per step stays uniform
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint16_t* k_s = kv_s + (j % kStages) * 2 * kKvTile * kLd;
    float s[kKvTile / 8][4];
    prefill_scores<kHeadDim, kKvTile>(q_s, k_s, s);
    prefill_softmax<kKvTile, kHeadDim>([&](int i) -> float& { return s[i / 4][i % 4]; },
                                       [&](int i) -> float& { return o[i / 4][i % 4]; }, m, l, qpos, j * kKvTile,
                                       true, p.scale_log2);
    prefill_pv<kHeadDim, kKvTile>(s, k_s + kKvTile * kLd, o);
    __syncthreads();  // the stage just read is overwritten by the next load
    if constexpr (kStages == 1) {
      if (j + 1 < n_tiles) {
        prefill_gather_kv<kHeadDim, kKvTile>(p, tile, kvh, (j + 1) * kKvTile, kv_s, kv_s + kKvTile * kLd);
        cp_async_commit();
      }
    }
  }
  cp_async_wait<0>();

  prefill_store<kHeadDim>(a, tile, h, warp * 16 + lane / 4, l, [&](int i) { return o[i / 4][i % 4]; });
}

// K/V tile keys: 64 keep S at 32 fp32 registers next to O's head_dim / 2 up to head_dim 128; head_dim 256 holds
// 128 registers of O, so its tiles shrink to 32 keys to stay under 255 registers without spills.
constexpr int prefill_kv_tile(int head_dim) {
  return head_dim <= 128 ? 64 : 32;
}

size_t prefill_smem_bytes(int head_dim, int stages) {
  const size_t row_bytes = static_cast<size_t>(head_dim + 8) * 2;
  return (16 * kPrefillWarps + static_cast<size_t>(stages) * 2 * prefill_kv_tile(head_dim)) * row_bytes;
}

template <int kHeadDim, int kStages>
void prefill_launch_tiles(const DeviceContext& ctx, const PrefillParams& p, size_t smem) {
  constexpr int kKvTile = prefill_kv_tile(kHeadDim);
  auto* kernel = paged_prefill_kernel<kHeadDim, kKvTile, kStages>;
  TERN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t rows = 16 * kPrefillWarps;
  const dim3 grid(static_cast<unsigned>((p.a.max_query_len + rows - 1) / rows), static_cast<unsigned>(p.a.n_heads),
                  static_cast<unsigned>(p.a.n_seqs));
  launch_kernel(ctx, kernel, grid, dim3(kPrefillThreads), smem, p);
}

template <int kHeadDim>
void prefill_launch_hd(const DeviceContext& ctx, const PrefillParams& p, const AttentionPrefillTiles& tiles) {
  if (tiles.stages == 2) {
    prefill_launch_tiles<kHeadDim, 2>(ctx, p, tiles.smem_bytes);
  } else {
    prefill_launch_tiles<kHeadDim, 1>(ctx, p, tiles.smem_bytes);
  }
}

}  // namespace

// Two stages (loads of the next K/V tile under the current tile's math) where the opt-in shared memory allows it
// (H200: 227 KiB for every head_dim; RTX PRO 6000: 99 KiB, exactly two stages at head_dim 256), one otherwise.
AttentionPrefillTiles attention_prefill_tiles(const DeviceProps& props, int64_t head_dim) {
  const int hd = static_cast<int>(head_dim);
  for (int stages = 2; stages >= 1; --stages) {
    const size_t bytes = prefill_smem_bytes(hd, stages);
    if (bytes <= props.shared_mem_per_block_optin) {
      return {.kv_tile = prefill_kv_tile(hd), .stages = stages, .smem_bytes = bytes};
    }
  }
  return {.kv_tile = prefill_kv_tile(hd), .stages = 0, .smem_bytes = 0};
}

void paged_attention_prefill_launch(const DeviceContext& ctx, const PagedAttentionArgs& args) {
  const PrefillParams p{.a = args,
                        .group = static_cast<int>(args.n_heads / args.cache.n_kv_heads),
                        .log2_bs = log2_int(args.cache.block_size),
                        .scale_log2 = args.scale * kLog2e};
  const AttentionPrefillTiles tiles = attention_prefill_tiles(ctx.props(), args.cache.head_dim);
  switch (args.cache.head_dim) {
    case 32:
      prefill_launch_hd<32>(ctx, p, tiles);
      break;
    case 64:
      prefill_launch_hd<64>(ctx, p, tiles);
      break;
    case 128:
      prefill_launch_hd<128>(ctx, p, tiles);
      break;
    default:
      prefill_launch_hd<256>(ctx, p, tiles);
      break;
  }
  TERN_CUDA_CHECK_LAUNCH();
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t attention_prefill_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, paged_prefill_kernel<128, 64, 2>);
}

}  // namespace tern
