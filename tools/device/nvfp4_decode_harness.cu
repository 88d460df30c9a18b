// An experiment on the dense NVFP4 decode GEMV (M = 1) at Qwen3-8B's shapes (docs/perf/gemm.md, "Decode, the
// unchecked loop"): the kernel (gemm_nvfp4_w4a16.cu, through its launcher) against a variant that feeds the same mma
// code from a per-warp ring of cp.async stages in shared memory, so that a warp has several steps of weight in
// flight without holding them in registers, and that ring with the mmas replaced by a XOR of the words (what its
// loads alone reach). Built and run on the GPU machine by tools/device/nvfp4_decode_harness.sh:
//   nvfp4_decode_harness [time | profile]
// `time`: medians of graph replays over enough weight copies to defeat L2, GB/s of packed + scales + x + y, and the
// ring's output against the kernel's. `profile`: the kernel and the ring launched a few times, for ncu.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/bench_timing.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/gemm/gemm_nvfp4_w4a16_launch.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/nvfp4/nvfp4_device.cuh"

namespace tern {
// roofline.cu (its header pulls in core/error.h, which nvcc cannot compile).
void bench_copy_launch(const void* src, void* dst, size_t bytes, int num_sms, cudaStream_t stream);
}  // namespace tern

using namespace tern;
using namespace tern::nvfp4_device;

namespace {

struct RingParams {
  const uint16_t* x;
  const uint8_t* packed;
  const uint8_t* scales;
  uint16_t* y;
  float out_scale;
  int n, k;
};

__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ uint4 lds16(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t lds2(uint32_t a) {
  unsigned short v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(a));
  return v;
}

// Stage layout (per warp): weights [2 kMTiles][32 lanes][16 B], then scales [2 kMTiles][8 g][8 B].
template <int kMTiles>
__host__ __device__ constexpr int stage_bytes() {
  return 2 * kMTiles * 32 * 16 + 2 * kMTiles * 8 * 8;
}

template <int kMTiles>
__device__ __forceinline__ void ring_issue(const RingParams& p, int n0, int step, uint32_t slot) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int k0 = step * kDecodeStepK + t * 32;
#pragma unroll
  for (int h = 0; h < 2 * kMTiles; ++h) {
    const int row = n0 + g + 8 * h;
    cp16(slot + (h * 32 + lane) * 16, p.packed + static_cast<int64_t>(row) * (p.k / 2) + k0 / 2);
  }
  if (t < 2 * kMTiles) {  // lane (g, t) copies the 8 scale bytes of row g + 8t for this step
    const int row = n0 + g + 8 * t;
    cp8(slot + 2 * kMTiles * 512 + (t * 8 + g) * 8, p.scales + static_cast<int64_t>(row) * (p.k / 16) + step * 8);
  }
}

template <int kMTiles>
__device__ __forceinline__ void ring_read(uint32_t slot, DecodeW<kMTiles>& w) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  uint32_t s[2 * kMTiles];
#pragma unroll
  for (int h = 0; h < 2 * kMTiles; ++h) {
    w.q[h] = lds16(slot + (h * 32 + lane) * 16);
    s[h] = lds2(slot + 2 * kMTiles * 512 + (h * 8 + g) * 8 + 2 * t);
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) w.s[mt] = byte_perm(s[2 * mt], s[2 * mt + 1], 0x5140);
}

// kCompute false: the loads and a XOR of what arrived, for the memory side alone.
template <int kMTiles, int kSplitK, int kStages, int kMinBlocks, bool kCompute>
__global__ void __launch_bounds__(decode_block_warps(kSplitK) * 32, kMinBlocks) ring_kernel(const RingParams p) {
  constexpr int kTiles = decode_block_tiles(kSplitK), kRows = 16 * kMTiles;
  extern __shared__ __align__(16) unsigned char smem[];
  float* red = reinterpret_cast<float*>(smem);
  constexpr int kRedBytes = (decode_red_floats<kSplitK, kMTiles, 1>() * 4 + 127) / 128 * 128;
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4;
  const uint32_t ring = smem_addr(smem + kRedBytes) + warp * kStages * stage_bytes<kMTiles>();
  const int split = warp % kSplitK;
  const int n0 = (blockIdx.x * kTiles + warp / kSplitK) * kRows;
  const int n_steps = p.k / kDecodeStepK;
  const int count = n_steps > split ? (n_steps - split + kSplitK - 1) / kSplitK : 0;
  float acc[1][kMTiles][4] = {};
  ptx::grid_dependents_launch();
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < count) ring_issue<kMTiles>(p, n0, split + i * kSplitK, ring + i * stage_bytes<kMTiles>());
    cp_async_commit();
  }
  ptx::grid_dependency_wait();
  const int64_t xoff[1] = {g == 0 ? 0 : -1};
  uint32_t xr = 0;
  for (int i = 0; i < count; ++i) {
    cp_async_wait<kStages - 2>();
    __syncwarp();
    DecodeW<kMTiles> w;
    ring_read<kMTiles>(ring + (i % kStages) * stage_bytes<kMTiles>(), w);
    const int next = i + kStages - 1;
    if (next < count) {
      ring_issue<kMTiles>(p, n0, split + next * kSplitK, ring + (next % kStages) * stage_bytes<kMTiles>());
    }
    cp_async_commit();
    if constexpr (kCompute) {
      uint4 xv[1][4];
      decode_load_x<1>(p.x, xoff, p.k, split + i * kSplitK, xv);
      decode_mma_step<kMTiles, 1>(w, xv, acc);
    } else {
#pragma unroll
      for (int h = 0; h < 2 * kMTiles; ++h) xr ^= w.q[h].x ^ w.q[h].y ^ w.q[h].z ^ w.q[h].w;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) xr ^= w.s[mt];
    }
  }
  if constexpr (!kCompute) acc[0][0][0] = static_cast<float>(xr & 1);
  decode_reduce_store<kSplitK, kMTiles, 1>(acc, red, [&](int tile, int row, int token, float sum) {
    const int col = (blockIdx.x * kTiles + tile) * kRows + row;
    if (col < p.n && token < 1) p.y[col] = f32_to_bf16(sum * p.out_scale);
  });
}

template <int kMTiles, int kSplitK, int kStages, int kMinBlocks, bool kCompute>
void launch_ring(const DeviceContext& ctx, const RingParams& p) {
  constexpr int kTiles = decode_block_tiles(kSplitK), kRows = 16 * kMTiles;
  constexpr int kRedBytes = (decode_red_floats<kSplitK, kMTiles, 1>() * 4 + 127) / 128 * 128;
  const size_t smem = kRedBytes + decode_block_warps(kSplitK) * kStages * stage_bytes<kMTiles>();
  auto kernel = ring_kernel<kMTiles, kSplitK, kStages, kMinBlocks, kCompute>;
  static bool once = [&] {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    return true;
  }();
  (void)once;
  launch_kernel(ctx, kernel, dim3((p.n + kTiles * kRows - 1) / (kTiles * kRows)),
                dim3(decode_block_warps(kSplitK) * 32), smem, p);
}

using RingFn = void (*)(const DeviceContext&, const RingParams&);

template <int kMTiles, int kStages, int kMinBlocks, bool kCompute>
RingFn ring_for_split(int split) {
  switch (split) {
    case 1:
      return launch_ring<kMTiles, 1, kStages, kMinBlocks, kCompute>;
    case 2:
      return launch_ring<kMTiles, 2, kStages, kMinBlocks, kCompute>;
    case 4:
      return launch_ring<kMTiles, 4, kStages, kMinBlocks, kCompute>;
    case 8:
      return launch_ring<kMTiles, 8, kStages, kMinBlocks, kCompute>;
    default:
      return launch_ring<kMTiles, 16, kStages, kMinBlocks, kCompute>;
  }
}

// Split so that tiles * split warps fit `warps_per_sm` per SM in one wave (no more warps than steps).
int choose_split(int num_sms, int n, int k, int m_tiles, int warps_per_sm) {
  const int tiles = n / (16 * m_tiles), steps = k / kDecodeStepK;
  int split = 1;
  while (split < 16 && 2 * split <= steps && tiles * 2 * split <= warps_per_sm * num_sms) split *= 2;
  return split;
}

uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float bf2f(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  const bool profile = argc > 1 && std::strcmp(argv[1], "profile") == 0;
  DeviceContext ctx;
  const int sms = ctx.props().num_sms;
  std::printf("device %s, %d SMs, programmatic launch %d\n", ctx.props().name.c_str(), sms,
              static_cast<int>(ctx.programmatic_launch()));
  struct {
    double kernel_gbs;
  } copy{};
  {
    const size_t bytes = size_t{2} << 30;
    void *a, *b;
    cudaMalloc(&a, bytes);
    cudaMalloc(&b, bytes);
    cudaMemset(a, 0x3C, bytes);
    const double ms = bench_time_ms(ctx, 1, 20, [&](int) { bench_copy_launch(a, b, bytes, sms, ctx.stream()); });
    copy.kernel_gbs = 2.0 * bytes / (ms * 1e6);
    cudaFree(a);
    cudaFree(b);
  }
  std::printf("copy kernel %.0f GB/s\n", copy.kernel_gbs);
  std::mt19937 rng(4242);
  const std::vector<std::pair<int, int>> shapes =
      profile ? std::vector<std::pair<int, int>>{{24576, 4096}}
              : std::vector<std::pair<int, int>>{{4096, 4096},  {6144, 4096},  {12288, 4096},
                                                 {24576, 4096}, {4096, 12288}, {1024, 4096}};
  for (const auto& [n, k] : shapes) {
    const size_t packed_bytes = static_cast<size_t>(n) * k / 2, scale_bytes = static_cast<size_t>(n) * k / 16;
    const size_t bytes = packed_bytes + scale_bytes + 2 * (k + n);
    const int copies = profile ? 2 : static_cast<int>(std::max<size_t>(2, (400u << 20) / bytes));
    std::vector<uint8_t> hp(packed_bytes), hs(scale_bytes);
    std::vector<uint16_t> hx(k);
    for (auto& b : hp) b = static_cast<uint8_t>(rng());
    for (auto& b : hs) b = static_cast<uint8_t>(0x28 + rng() % 0x20);  // e4m3 2^-2 .. 2^2
    for (auto& v : hx) v = f2bf(std::uniform_real_distribution<float>(-1.f, 1.f)(rng));
    std::vector<uint8_t*> dp(copies), ds(copies);
    for (int c = 0; c < copies; ++c) {
      cudaMalloc(&dp[c], packed_bytes);
      cudaMalloc(&ds[c], scale_bytes);
      cudaMemcpy(dp[c], hp.data(), packed_bytes, cudaMemcpyHostToDevice);
      cudaMemcpy(ds[c], hs.data(), scale_bytes, cudaMemcpyHostToDevice);
    }
    uint16_t *dx, *dy;
    cudaMalloc(&dx, 2 * k);
    cudaMalloc(&dy, 2 * n);
    cudaMemcpy(dx, hx.data(), 2 * k, cudaMemcpyHostToDevice);
    auto args = [&](int c) {
      GemmNvfp4W4a16Args a;
      a.x = dx;
      a.w.packed = dp[c];
      a.w.scales = ds[c];
      a.w.global_scale = 0.01f;
      a.w.n = n;
      a.w.k = k;
      a.y = dy;
      a.m = 1;
      return a;
    };
    std::vector<uint16_t> ref(n), out(n);
    nvfp4_w4a16_launch_decode(ctx, args(0));
    cudaStreamSynchronize(ctx.stream());
    cudaMemcpy(ref.data(), dy, 2 * n, cudaMemcpyDeviceToHost);
    const double base_us =
        profile ? 0
                : 1e3 * bench_time_ms(ctx, copies, 4 * copies, [&](int c) { nvfp4_w4a16_launch_decode(ctx, args(c)); });
    if (profile) {
      for (int i = 0; i < 3; ++i) nvfp4_w4a16_launch_decode(ctx, args(i % copies));
    }
    std::printf("\n%d x %d (%.1f MB), %d copies: kernel %.2f us, %.0f GB/s, %.1f%% of copy\n", n, k, bytes / 1e6,
                copies, base_us, bytes / base_us / 1e3, 100 * bytes / base_us / 1e3 / copy.kernel_gbs);
    auto rp = [&](int c) { return RingParams{dx, dp[c], ds[c], dy, 0.01f * 1024.0f, n, k}; };
    // Checks fn's output against the kept kernel's, then times it (or, profiling, launches it three more times).
    auto measure = [&](const std::string& name, bool check, auto&& fn) {
      cudaMemset(dy, 0xFF, 2 * n);
      fn(ctx, rp(0));
      const cudaError_t err = cudaStreamSynchronize(ctx.stream());
      if (err != cudaSuccess) {
        std::printf("  %s: %s\n", name.c_str(), cudaGetErrorString(err));
        std::exit(1);
      }
      cudaMemcpy(out.data(), dy, 2 * n, cudaMemcpyDeviceToHost);
      double worst = 0;
      int exact = 0;
      for (int i = 0; i < n; ++i) {
        const double a = bf2f(ref[i]), b = bf2f(out[i]);
        worst = std::max(worst, std::isfinite(b) ? std::abs(a - b) / (std::abs(a) + 1e-3) : 1e30);
        exact += ref[i] == out[i];
      }
      if (profile) {
        for (int i = 0; i < 3; ++i) fn(ctx, rp(i % copies));
        cudaStreamSynchronize(ctx.stream());
        return;
      }
      const double us = 1e3 * bench_time_ms(ctx, copies, 4 * copies, [&](int c) { fn(ctx, rp(c)); });
      const std::string verdict = !check         ? ""
                                  : worst < 2e-2 ? "ok, exact " + std::to_string(exact) + "/" + std::to_string(n)
                                                 : "MISMATCH worst rel " + std::to_string(worst);
      std::printf("  %-44s %7.2f us %5.0f GB/s %5.1f%% | %s\n", name.c_str(), us, bytes / us / 1e3,
                  100 * bytes / us / 1e3 / copy.kernel_gbs, verdict.c_str());
    };
    {
      for (bool compute : {false, true}) {
        const int wps = compute ? 16 : 24, stages = 3;
        const int split = choose_split(sms, n, k, 2, wps);
        const int min_blocks = std::max(1, wps / decode_block_warps(split));
        RingFn fn = nullptr;
        if (min_blocks == 1)
          fn = compute ? ring_for_split<2, 3, 1, true>(split) : ring_for_split<2, 3, 1, false>(split);
        if (min_blocks == 2)
          fn = compute ? ring_for_split<2, 3, 2, true>(split) : ring_for_split<2, 3, 2, false>(split);
        if (min_blocks == 3)
          fn = compute ? ring_for_split<2, 3, 3, true>(split) : ring_for_split<2, 3, 3, false>(split);
        if (fn == nullptr || decode_block_warps(split) * stages * stage_bytes<2>() + 16384 > 227 * 1024) continue;
        measure(std::string("ring ") + (compute ? "mma" : "load only") + " wps " + std::to_string(wps) + " split " +
                    std::to_string(split),
                compute, fn);
      }
    }
    for (int c = 0; c < copies; ++c) {
      cudaFree(dp[c]);
      cudaFree(ds[c]);
    }
    cudaFree(dx);
    cudaFree(dy);
  }
  return 0;
}
