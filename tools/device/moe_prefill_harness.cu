// Standalone check and timing of the grouped MoE prefill GEMM on Hopper: the wgmma kernel (moe_gemm_prefill_sm90.cu)
// against the mma.sync one (moe_gemm_prefill.cu) on every element and against an fp64 host product on sampled rows,
// at the Qwen3.5-35B-A3B and 397B-A17B expert shapes with random top-k routing (docs/perf/gpu.md, "MoE prefill on
// wgmma"). Built and run on the GPU machine by tools/device/moe_prefill_harness.sh; `timing` adds cudaEvent medians,
// `tiles` times the wgmma kernel at other tile shapes and stage counts (each checked against the mma.sync kernel bit
// for bit), for choosing the launcher's shapes. The wgmma kernel's file is included here, not linked, so that its
// templates can be launched at any shape. Pass a case filter (e.g. `35B`): the 397B cases build tens of GB of weights
// on the host.
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>
#include "kernels/cuda/device.h"
#include "kernels/cuda/moe/moe_launch.h"
#include "kernels/cuda/moe/moe_gemm_prefill_sm90.cu"

using namespace tern;

static uint16_t f2bf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7FFF + ((u >> 16) & 1); return u >> 16; }
static float bf2f(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; memcpy(&f, &u, 4); return f; }
static float e2m1(int c) { static const float t[8] = {0, .5f, 1, 1.5f, 2, 3, 4, 6}; return (c & 8 ? -1 : 1) * t[c & 7]; }
static float e4m3(int c) { int s = c >> 7, e = (c >> 3) & 15, m = c & 7; float v = e == 0 ? m / 8.f * std::ldexp(1.f, -6) : (1 + m / 8.f) * std::ldexp(1.f, e - 7); return s ? -v : v; }

template <class T> T* up(const std::vector<T>& h) { T* d; cudaMalloc(&d, std::max<size_t>(h.size() * sizeof(T), 16)); cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice); return d; }

struct Case { const char* name; int T, E, topk, n, k; bool nvfp4, gather; int n2; };

// Both projections of `a` at one tile shape (the launcher's choice bypassed).
template <bool kNv, int kBm, int kBn, int kStages>
void tile_launch(const DeviceContext& ctx, const MoeGemmArgs& a) {
  wg_launch<kNv, kBm, kBn, kStages>(make_params(a), a.rows, a.w.n_experts, ctx);
  if (a.w2.n != 0) {
    const MoeGemmArgs b = second_projection(a);
    wg_launch<kNv, kBm, kBn, kStages>(make_params(b), b.rows, b.w.n_experts, ctx);
  }
}

int main(int argc, char** argv) {
  DeviceContext ctx(0);
  bool timing = argc > 1 && strcmp(argv[1], "timing") == 0;
  bool tiles = argc > 1 && strcmp(argv[1], "tiles") == 0;
  const char* only = argc > 2 ? argv[2] : nullptr;
  std::vector<Case> cases = {
      {"small-odd bf16", 100, 16, 2, 200, 128, false, true, 0},
      {"small-odd fp4", 100, 16, 2, 200, 128, true, true, 72},
      {"35B gate_up bf16", 4096, 256, 8, 1024, 2048, false, true, 0},
      {"35B down bf16", 4096, 256, 8, 2048, 512, false, false, 0},
      {"35B gate+up fp4", 4096, 256, 8, 512, 2048, true, true, 512},
      {"35B down fp4", 4096, 256, 8, 2048, 512, true, false, 0},
      {"397B gate+up fp4", 4096, 512, 10, 1024, 4096, true, true, 1024},
      {"397B down fp4", 4096, 512, 10, 4096, 1024, true, false, 0},
      {"T=128 35B gate+up fp4", 128, 256, 8, 512, 2048, true, true, 512},
  };
  std::mt19937 rng(1234);
  int failures = 0;
  for (const Case& c : cases) {
    if (only && !strstr(c.name, only)) continue;
    const int rows = c.T * c.topk;
    // Routing: distinct experts per token; counting sort stable in pair order.
    std::vector<int> ids(rows);
    for (int t = 0; t < c.T; ++t) {
      std::vector<int> perm(c.E); std::iota(perm.begin(), perm.end(), 0);
      for (int j = 0; j < c.topk; ++j) { std::uniform_int_distribution<int> d(j, c.E - 1); std::swap(perm[j], perm[d(rng)]); ids[t * c.topk + j] = perm[j]; }
    }
    std::vector<int> off(c.E + 1, 0), sorted(rows);
    for (int id : ids) off[id + 1]++;
    for (int e = 0; e < c.E; ++e) off[e + 1] += off[e];
    { std::vector<int> fill(off.begin(), off.end() - 1); for (int p = 0; p < rows; ++p) sorted[fill[ids[p]]++] = p; }
    const int xrows = c.gather ? c.T : rows;
    const int ntot = c.n + c.n2;
    std::uniform_real_distribution<float> u(-1, 1);
    std::vector<uint16_t> x(size_t(xrows) * c.k);
    for (auto& v : x) v = f2bf(u(rng));
    // Weights (w and w2 the same shape except n).
    auto make = [&](int n, std::vector<uint16_t>& wb, std::vector<uint8_t>& pk, std::vector<uint8_t>& sc, std::vector<float>& gs, MoeExpertWeights& view, std::vector<float>& wf) {
      view = {.format = c.nvfp4 ? MoeWeightFormat::kNvfp4 : MoeWeightFormat::kBf16, .n_experts = c.E, .n = n, .k = c.k};
      wf.assign(size_t(c.E) * n * c.k, 0);
      if (!c.nvfp4) {
        wb.resize(wf.size());
        for (size_t i = 0; i < wb.size(); ++i) { wb[i] = f2bf(u(rng) * 0.05f); wf[i] = bf2f(wb[i]); }
        view.bf16 = up(wb); view.bf16_expert_stride = int64_t(n) * c.k;
      } else {
        pk.resize(wf.size() / 2); sc.resize(wf.size() / 16); gs.resize(c.E);
        std::uniform_int_distribution<int> byte(0, 255), sd(0x28, 0x48);
        for (auto& b : pk) b = byte(rng);
        for (auto& s : sc) s = sd(rng);
        for (auto& g : gs) g = 0.01f * (1 + u(rng) * 0.5f);
        for (size_t i = 0; i < wf.size(); ++i) wf[i] = e2m1((pk[i / 2] >> (4 * (i % 2))) & 15) * e4m3(sc[i / 16]) * gs[i / (size_t(n) * c.k)];
        view.packed = up(pk); view.packed_expert_stride = int64_t(n) * c.k / 2;
        view.scales = up(sc); view.scales_expert_stride = int64_t(n) * c.k / 16;
        view.global_scales = up(gs);
      }
    };
    std::vector<uint16_t> wb1, wb2; std::vector<uint8_t> pk1, pk2, sc1, sc2; std::vector<float> gs1, gs2, wf1, wf2;
    MoeExpertWeights w1{}, w2{};
    make(c.n, wb1, pk1, sc1, gs1, w1, wf1);
    if (c.n2) make(c.n2, wb2, pk2, sc2, gs2, w2, wf2);
    uint16_t* dx = up(x); int* doff = up(off); int* dsorted = up(sorted);
    uint16_t* dy; cudaMalloc(&dy, size_t(rows) * ntot * 2);
    MoeGemmArgs a{.x = dx, .ldx = c.k, .sorted_pairs = dsorted, .top_k = c.topk, .gather = c.gather, .expert_offsets = doff,
                  .w = w1, .y = dy, .ldy = ntot, .rows = rows, .w2 = w2, .y2_offset = c.n};
    if (!moe_gemm_prefill_sm90_fits(ctx, a)) { printf("%s: sm90 kernel does not fit\n", c.name); failures++; continue; }
    std::vector<uint16_t> y_new(size_t(rows) * ntot), y_old(y_new.size());
    cudaMemsetAsync(dy, 0xFF, y_new.size() * 2, ctx.stream());
    moe_gemm_launch_prefill(ctx, a);
    ctx.synchronize();
    cudaMemcpy(y_old.data(), dy, y_old.size() * 2, cudaMemcpyDeviceToHost);
    double flop = 2.0 * rows * double(ntot) * c.k;
    auto time_it = [&](bool wg) {
      std::vector<float> ts;
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      for (int rep = 0; rep < 11; ++rep) {
        cudaEventRecord(e0, ctx.stream());
        if (wg) moe_gemm_launch_prefill_sm90(ctx, a); else moe_gemm_launch_prefill(ctx, a);
        cudaEventRecord(e1, ctx.stream()); cudaEventSynchronize(e1);
        float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms);
      }
      std::sort(ts.begin(), ts.end());
      return ts[ts.size() / 2];
    };
    if (timing && rows >= 4096) { float t = time_it(false); printf("    mma      : %7.1f us  %4.0f TFLOP/s\n", t * 1e3, flop / (t * 1e-3) / 1e12); }
    {
    const char* variant = "";
    cudaMemsetAsync(dy, 0xFF, y_new.size() * 2, ctx.stream());
    moe_gemm_launch_prefill_sm90(ctx, a);
    ctx.synchronize();
    cudaMemcpy(y_new.data(), dy, y_new.size() * 2, cudaMemcpyDeviceToHost);
    double max_rel_old = 0; long nan_new = 0, bad_old = 0;
    for (size_t i = 0; i < y_new.size(); ++i) {
      float a1 = bf2f(y_new[i]), b1 = bf2f(y_old[i]);
      if (!std::isfinite(a1)) { nan_new++; continue; }
      double d = std::fabs(a1 - b1) / std::max(1e-3, double(std::fabs(b1)));
      if (std::fabs(a1 - b1) > 1.0 / 64 * std::fabs(b1) + 1e-3) bad_old++;
      max_rel_old = std::max(max_rel_old, std::fabs(a1 - b1) > 1e-3 ? d : 0.0);
    }
    double worst = 0; int checked = 0;
    std::mt19937 rng2(99);
    std::uniform_int_distribution<int> rd(0, rows - 1);
    for (int s = 0; s < 16; ++s) {
      int r = rd(rng2);
      int e = int(std::upper_bound(off.begin(), off.end(), r) - off.begin()) - 1;
      int src = c.gather ? sorted[r] / c.topk : r;
      for (int col = 0; col < ntot; ++col) {
        const bool second = col >= c.n; const int nn = second ? c.n2 : c.n, cc = second ? col - c.n : col;
        const std::vector<float>& wf = second ? wf2 : wf1;
        double ref = 0, mag = 0;
        for (int kk = 0; kk < c.k; ++kk) { double t = double(bf2f(x[size_t(src) * c.k + kk])) * wf[(size_t(e) * nn + cc) * c.k + kk]; ref += t; mag += std::fabs(t); }
        double got = bf2f(y_new[size_t(r) * ntot + col]);
        double err = std::fabs(got - ref) / (std::fabs(ref) / 128 + mag * 1e-5 + 1e-30);
        worst = std::max(worst, std::isfinite(got) ? err : 1e9); checked++;
      }
    }
    bool ok = nan_new == 0 && bad_old == 0 && worst <= 1.0;
    failures += !ok;
    printf("%-22s%s rows %6d: nan %ld, |new-old| big: %ld (max rel %.2g), vs double: worst %.3f over %d  %s",
           c.name, variant, rows, nan_new, bad_old, max_rel_old, worst, checked, ok ? "OK" : "FAIL");
    if (timing && rows >= 4096) { float t = time_it(true); printf("   %7.1f us  %4.0f TFLOP/s", t * 1e3, flop / (t * 1e-3) / 1e12); }
    printf("\n");
    }
    if (tiles && rows >= 4096) {
      // Every tile shape against the mma.sync output, bit for bit, then its median time.
      auto run_cfg = [&](const char* name, void (*launch)(const DeviceContext&, const MoeGemmArgs&)) {
        cudaMemsetAsync(dy, 0xFF, y_new.size() * 2, ctx.stream());
        launch(ctx, a);
        ctx.synchronize();
        cudaMemcpy(y_new.data(), dy, y_new.size() * 2, cudaMemcpyDeviceToHost);
        long differ = 0;
        for (size_t i = 0; i < y_new.size(); ++i) differ += y_new[i] != y_old[i];
        std::vector<float> ts;
        cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
        for (int rep = 0; rep < 11; ++rep) {
          cudaEventRecord(e0, ctx.stream());
          launch(ctx, a);
          cudaEventRecord(e1, ctx.stream()); cudaEventSynchronize(e1);
          float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms);
        }
        std::sort(ts.begin(), ts.end());
        const float t = ts[ts.size() / 2];
        printf("    %-16s %7.1f us  %4.0f TFLOP/s  %s\n", name, t * 1e3, flop / (t * 1e-3) / 1e12,
               differ == 0 ? "same bits" : "DIFFERENT");
        failures += differ != 0;
      };
      if (c.nvfp4) {
        run_cfg("128x256 s4", tile_launch<true, 128, 256, 4>); run_cfg("128x256 s3", tile_launch<true, 128, 256, 3>);
        run_cfg("128x128 s4", tile_launch<true, 128, 128, 4>); run_cfg("128x128 s3", tile_launch<true, 128, 128, 3>);
        run_cfg("64x256 s4", tile_launch<true, 64, 256, 4>); run_cfg("64x128 s4", tile_launch<true, 64, 128, 4>);
      } else {
        run_cfg("128x256 s4", tile_launch<false, 128, 256, 4>); run_cfg("128x256 s3", tile_launch<false, 128, 256, 3>);
        run_cfg("128x128 s4", tile_launch<false, 128, 128, 4>); run_cfg("128x128 s3", tile_launch<false, 128, 128, 3>);
        run_cfg("64x256 s4", tile_launch<false, 64, 256, 4>); run_cfg("64x128 s4", tile_launch<false, 64, 128, 4>);
      }
    }
  }
  printf("%s (%d failing cases)\n", failures ? "FAILED" : "ALL OK", failures);
  return failures != 0;
}
