// Paged attention prefill on Hopper (sm_90a): the contract of paged_attention_prefill_launch (attention_launch.h)
// with the products on wgmma. A block of two warpgroups owns 128 query rows of one head (warpgroup w: rows 64 w ..
// 64 w + 63); the Q tile and a two-stage ring of K/V tiles of kBn keys sit in shared memory in the 128-byte-swizzled
// layout wgmma reads (wgmma.cuh), gathered from the paged cache with cp.async (zero-filled past the tile's last key).
// Per K/V tile each warpgroup:
//   S = Q K^T: m64n{kBn}k16 from shared memory, K [key][dim] being the K-major B;
//   causal mask, running row max and rescale in the log2 domain, P = 2^(S - max) in registers (as the mma.sync
//   kernel: wgmma's accumulator layout is mma.m16n8's, per warp and 8-column group);
//   O += P V: m64n{head_dim}k16 with P as the register A operand (bf16) and V [key][dim] as an N-major B.
// The next tile's loads run under this tile's products; the two warpgroups' softmaxes and products interleave on
// the SM (one block an SM; docs/perf/gpu.md §attention-wgmma for the shapes measured). Every warpgroup issues its
// products, also for tiles wholly past its rows (all masked): the wgmmas stay out of branches, which ptxas would
// otherwise serialize (as in the MoE kernels, docs/perf/gpu.md §moe-prefill-wgmma). Head dims 64, 128 and 256
// (whole 128-byte rows per 64 dims); kBn keys a K/V tile (wg_kv_tile), so S, P and O fit the registers (at 256: O
// 128, S 32, P 16 a thread).
#include "kernels/cuda/attention/attention_device.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/module_attributes.h"
#include "kernels/cuda/wgmma.cuh"

namespace tern {
namespace {

constexpr int kWgRows = 128;     // query rows per block
constexpr int kWgThreads = 256;  // two warpgroups
constexpr int kWgStages = 2;

// Keys a K/V tile: 128 up to head_dim 128, 64 at 256 (its O alone holds 128 registers a thread). Two blocks an SM of
// 64-key tiles measured 8-12% faster at head_dim 128, but only with ptxas serializing their wgmmas for want of
// registers, which the build refuses (docs/perf/gpu.md §attention-wgmma).
__host__ __device__ constexpr int wg_kv_tile(int head_dim) { return head_dim <= 128 ? 128 : 64; }

// Q tile, the K/V ring, 1024 bytes of alignment slack.
constexpr size_t wg_smem_bytes(int head_dim, int kv_tile) {
  return static_cast<size_t>(kWgRows + 2 * kWgStages * kv_tile) * head_dim * 2 + 1024;
}

#if TERN_WGMMA_AVAILABLE
// Row r of a tile of kRows rows, dims 8 c .. 8 c + 7, in the swizzled layout: 64-dim column blocks of kRows x 128
// bytes one after another.
template <int kRows>
__device__ __forceinline__ uint32_t wg_chunk(int r, int c) {
  return static_cast<uint32_t>((c / 8) * kRows * 128) + wgmma::sw128_offset(r, c % 8);
}

// Keys key0 .. key0 + kBn - 1 of the kv head into the K and V tiles at k_s / v_s, zero past n_keys.
template <int kHeadDim, int kBn>
__device__ __forceinline__ void wg_load_kv(const PrefillParams& p, const PrefillTile& tile, int kvh, int key0,
                                           uint8_t* k_s, uint8_t* v_s) {
  prefill_load_kv<kHeadDim, kBn, kWgThreads>(p, tile, kvh, key0, k_s, v_s, wg_chunk<kBn>);
}
#endif  // TERN_WGMMA_AVAILABLE

template <int kHeadDim>
__global__ void __launch_bounds__(kWgThreads, 1) paged_prefill_wgmma_kernel(const PrefillParams p) {
#if TERN_WGMMA_AVAILABLE
  ptx::grid_dependency_begin();
  constexpr int kBn = wg_kv_tile(kHeadDim);
  constexpr uint32_t kQBytes = kWgRows * kHeadDim * 2, kKvBytes = kBn * kHeadDim * 2;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  uint8_t* q_s = smem;
  uint8_t* kv_s = smem + kQBytes;  // stage t: K at kv_s + 2 t kKvBytes, V kKvBytes further
  const PagedAttentionArgs& a = p.a;
  const int h = blockIdx.y, kvh = h / p.group;
  PrefillTile tile;
  if (!prefill_tile(p, kWgRows, tile)) return;
  const int n_tiles = (tile.n_keys + kBn - 1) / kBn;

  // Q tile and the first K/V tile in one cp.async group.
  prefill_load_q<kHeadDim, kWgRows, kWgThreads>(p, tile, h, q_s, wg_chunk<kWgRows>);
  wg_load_kv<kHeadDim, kBn>(p, tile, kvh, 0, kv_s, kv_s + kKvBytes);
  cp_async_commit();

  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int row = wg * 64 + warp * 16 + lane / 4;  // this thread's first row in the tile; the second is 8 further
  const int qpos[2] = {tile.pos0 + row, tile.pos0 + row + 8};
  const int wg_pos0 = tile.pos0 + wg * 64;
  const uint32_t q_wg = smem_addr(q_s) + wg * 64 * 128;
  float o[kHeadDim / 2] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {  // the other stage, freed by the barrier that ended tile j - 1
      uint8_t* next = kv_s + ((j + 1) % kWgStages) * 2 * kKvBytes;
      wg_load_kv<kHeadDim, kBn>(p, tile, kvh, (j + 1) * kBn, next, next + kKvBytes);
    }
    cp_async_commit();  // always, so the group count per step stays uniform
    cp_async_wait<1>();
    wgmma::fence_proxy_async_shared();
    __syncthreads();
    const uint32_t k_addr = smem_addr(kv_s) + (j % kWgStages) * 2 * kKvBytes, v_addr = k_addr + kKvBytes;

    float s[kBn / 2];
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t col = (kk % 4) * 32;  // k16 slice kk % 4 of 64-dim column block kk / 4
      wgmma::mma_m64k16<kBn>(s, wgmma::sw128_desc(q_wg + (kk / 4) * kWgRows * 128 + col),
                             wgmma::sw128_desc(k_addr + (kk / 4) * kBn * 128 + col), kk > 0 ? 1 : 0);
    }
    wgmma::commit_group();
    wgmma::wait_group<0>();
    wgmma::fence_operands(s);

    const int key0 = j * kBn;
    prefill_softmax<kBn, kHeadDim>([&](int i) -> float& { return s[i]; }, [&](int i) -> float& { return o[i]; }, m,
                                   l, qpos, key0, key0 + kBn - 1 > wg_pos0, p.scale_log2);

    // P as the bf16 A fragments of the P V products, one per 16 keys.
    uint32_t pa[kBn / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBn / 16; ++kk) {
#pragma unroll
      for (int f = 0; f < 4; ++f) pa[kk][f] = pack_bf16x2(s[8 * kk + 2 * f], s[8 * kk + 2 * f + 1]);
    }
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kBn / 16; ++kk) {
      wgmma::mma_rs_m64k16<kHeadDim, 1>(o, pa[kk], wgmma::sw128_mn_desc(v_addr + kk * 2048, kBn * 128), 1);
    }
    wgmma::commit_group();
    wgmma::wait_group<0>();
    wgmma::fence_operands(o);
#pragma unroll
    for (int kk = 0; kk < kBn / 16; ++kk) wgmma::fence_operands(pa[kk]);
    __syncthreads();  // the stage just read is overwritten by the next load
  }
  cp_async_wait<0>();

  prefill_store<kHeadDim>(a, tile, h, row, l, [&](int i) { return o[i]; });
#else
  (void)p;
#endif  // TERN_WGMMA_AVAILABLE
}

template <int kHeadDim>
void wg_launch(const DeviceContext& ctx, const PrefillParams& p) {
  constexpr size_t kSmem = wg_smem_bytes(kHeadDim, wg_kv_tile(kHeadDim));
  auto* kernel = paged_prefill_wgmma_kernel<kHeadDim>;
  TERN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  const dim3 grid(static_cast<unsigned>((p.a.max_query_len + kWgRows - 1) / kWgRows),
                  static_cast<unsigned>(p.a.n_heads), static_cast<unsigned>(p.a.n_seqs));
  launch_kernel(ctx, kernel, grid, dim3(kWgThreads), kSmem, p);
}

}  // namespace

bool attention_prefill_sm90_fits(const DeviceProps& props, int64_t head_dim) {
#if TERN_BUILD_HAS_SM90A
  return props.cc_major == 9 && props.cc_minor == 0 && (head_dim == 64 || head_dim == 128 || head_dim == 256) &&
         wg_smem_bytes(static_cast<int>(head_dim), wg_kv_tile(static_cast<int>(head_dim))) <=
             props.shared_mem_per_block_optin;
#else
  (void)props;
  (void)head_dim;
  return false;  // no sm_90a machine code in this build: the kernel's body would be empty
#endif
}

void paged_attention_prefill_sm90_launch(const DeviceContext& ctx, const PagedAttentionArgs& args) {
  const PrefillParams p{.a = args,
                        .group = static_cast<int>(args.n_heads / args.cache.n_kv_heads),
                        .log2_bs = log2_int(args.cache.block_size),
                        .scale_log2 = args.scale * kLog2e};
  switch (args.cache.head_dim) {
    case 64:
      wg_launch<64>(ctx, p);
      break;
    case 128:
      wg_launch<128>(ctx, p);
      break;
    default:
      wg_launch<256>(ctx, p);
      break;
  }
  TERN_CUDA_CHECK_LAUNCH();
}

// What the driver loaded of this module for the current device (module_attributes.h). Its kernels have a body only
// in sm_90a machine code.
cudaError_t attention_prefill_sm90_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, paged_prefill_wgmma_kernel<128>);
}

}  // namespace tern
