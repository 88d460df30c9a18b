// MoE kernel timings on one GPU for Qwen3.5-35B-A3B's expert shapes (hidden 2048, 256 experts, top-8,
// moe_intermediate 512), bf16, NVFP4 and block-wise FP8 experts. Plain main (not run by ctest):
//   moe_bench [--quick | --decode | --small | --forward | --rs-shapes | --tiles [--skew S]] [--bf16 | --nvfp4 | --fp8]
// Decode (tokens 1..64, both GEMM variants): the grouped gate_up (n = 1024, k = 2048) and down (n = 2048, k = 512)
// GEMMs, reported as GB/s of the active experts' weight bytes (packed + block scales for NVFP4, codes + per-row
// block scales for FP8) against a
// device-to-device copy kernel's bandwidth (read + written); also, decode only, gate and up as two [512, 2048]
// stacks in one launch (gate+up) and the down GEMM with silu_mul folded in (down+silu). --decode: only the decode
// kernel at T = 1 and 8.
// Every timing rotates over 16 random routings so consecutive launches read different experts and the L2 stays
// cold. Prefill (4096 tokens): TFLOP/s of the same GEMMs, with the kernel the model runs (wgmma on sm_90a) and the
// mma.sync one. Route, align (apart and in one launch where the pairs fit one block) and combine are timed at both
// sizes; --small: only those, at 1 to 256 tokens and 4096. --tiles: NVFP4 decode at 8 to 64 tokens with each x-row
// tile width forced and with the pass list (MoeGemmArgs::decode_token_tiles, decode_passes), on random and on skewed
// routings (make_routings; --skew sets their exponent, 0.5 by default). A format flag times that weight format
// alone (with --tiles: NVFP4 unless one is given). --forward: the whole routed block (moe_forward) at decode token
// counts, NVFP4 (bench_forward). --rs-shapes: the NVFP4 prefill kernel with the weight in registers at each of its
// shapes against the launcher's choice, at 1024 and 4096 tokens (bench_rs_shapes).
// Each timing is a CUDA graph of back-to-back launches, replayed after a warm-up; the median replay is reported.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "core/formats.h"
#include "kernels/cuda/bench_timing.h"
#include "kernels/cuda/moe/moe.h"
#include "kernels/cuda/moe/moe_launch.h"
#include "kernels/cuda/roofline.h"

namespace tern {

namespace {

constexpr int64_t kHidden = 2048, kInter = 512, kExperts = 256, kTopK = 8;
constexpr int kSlots = 16;  // routings rotated over

double time_ms(const DeviceContext& ctx, int n_calls, const std::function<void(int)>& launch) {
  return bench_time_ms(ctx, kSlots, n_calls, launch);
}

template <class T>
DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer b(std::max<size_t>(host.size() * sizeof(T), 256));
  TERN_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}

// A large buffer filled by repeating a random host pattern of `pattern` values drawn by `draw`.
template <class T, class Draw>
DeviceBuffer fill_random(size_t count, Draw draw) {
  std::vector<T> pattern(std::min<size_t>(count, size_t{1} << 22));
  for (auto& v : pattern) v = draw();
  DeviceBuffer b(count * sizeof(T));
  for (size_t at = 0; at < count; at += pattern.size()) {
    const size_t n = std::min(pattern.size(), count - at);
    TERN_CUDA_CHECK(cudaMemcpy(b.as<T>() + at, pattern.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  return b;
}

// One projection of all experts on the device, in either format.
struct BenchWeights {
  DeviceBuffer data, scales, global;
  MoeExpertWeights view;
};

BenchWeights make_weights(MoeWeightFormat format, int64_t n, int64_t k, std::mt19937& rng) {
  BenchWeights w;
  const auto elems = static_cast<size_t>(kExperts * n * k);
  std::uniform_real_distribution<float> uniform(-0.05f, 0.05f);
  std::uniform_int_distribution<int> byte(0, 255), scale_code(0x28, 0x48);  // e4m3 ~ 2^-2 .. 2^2, never NaN
  w.view = {.format = format, .n_experts = kExperts, .n = n, .k = k};
  if (format == MoeWeightFormat::kBf16) {
    w.data = fill_random<uint16_t>(elems, [&] { return float_to_bf16(uniform(rng)); });
    w.view.bf16 = w.data.as<uint16_t>();
    w.view.bf16_expert_stride = n * k;
    return w;
  }
  if (format == MoeWeightFormat::kFp8) {
    const int64_t scale_cols = (k + 127) / 128;
    std::uniform_real_distribution<float> scale(1e-4f, 1e-3f);
    // The exponent's low bit cleared: never the NaN code S.1111.111.
    w.data = fill_random<uint8_t>(elems, [&] { return static_cast<uint8_t>(byte(rng) & 0xF7); });
    w.scales = fill_random<float>(static_cast<size_t>(kExperts * n * scale_cols), [&] { return scale(rng); });
    w.view.packed = w.data.as<uint8_t>();
    w.view.packed_expert_stride = n * k;
    w.view.row_scales = w.scales.as<float>();
    w.view.row_scales_expert_stride = n * scale_cols;
    return w;
  }
  w.data = fill_random<uint8_t>(elems / 2, [&] { return static_cast<uint8_t>(byte(rng)); });
  w.scales = fill_random<uint8_t>(elems / 16, [&] { return static_cast<uint8_t>(scale_code(rng)); });
  w.global = upload(std::vector<float>(kExperts, 1.0f / 2688.0f));
  w.view.packed = w.data.as<uint8_t>();
  w.view.packed_expert_stride = n * k / 2;
  w.view.scales = w.scales.as<uint8_t>();
  w.view.scales_expert_stride = n * k / 16;
  w.view.global_scales = w.global.as<float>();
  return w;
}

// The bytes of one expert's weight that the kernels read (FP8: one fp32 scale per row and 128 columns).
double expert_bytes(const MoeExpertWeights& w) {
  const double elems = static_cast<double>(w.n * w.k);
  switch (w.format) {
    case MoeWeightFormat::kBf16:
      return 2.0 * elems;
    case MoeWeightFormat::kNvfp4:
      return elems / 2 + elems / 16;
    case MoeWeightFormat::kFp8:
      return elems + 4.0 * static_cast<double>(w.n * ((w.k + 127) / 128));
  }
  return 0.0;
}

const char* format_name(MoeWeightFormat f) {
  return f == MoeWeightFormat::kBf16 ? "bf16" : f == MoeWeightFormat::kNvfp4 ? "nvfp4" : "fp8";
}

// kSlots random routings of `tokens` tokens: device ids, offsets, permutations and decode pass lists, the mean
// active experts and the mean rows of the busiest expert.
struct Routings {
  DeviceBuffer ids, offsets, sorted_pairs, pair_row, weights, passes;
  double mean_active = 0.0, mean_busiest = 0.0;
};

// skew 0: each token's top_k experts uniformly at random; skew s > 0: drawn without replacement with weights
// 1 / (rank + 1)^s over a random ranking of the experts per routing, as a router that favours some experts for
// every token of a batch (s = 0.5 gives the busiest expert about 8x the mean rows at 64 tokens).
Routings make_routings(int64_t tokens, std::mt19937& rng, double skew = 0.0) {
  const int64_t rows = tokens * kTopK, pass_slots = moe_decode_pass_slots(rows, kExperts);
  std::vector<int32_t> ids, offsets, sorted, pair_row, passes;
  std::vector<int32_t> experts(kExperts), ranking(kExperts);
  Routings r;
  for (int s = 0; s < kSlots; ++s) {
    std::vector<int32_t> slot_ids;
    std::iota(ranking.begin(), ranking.end(), 0);
    std::shuffle(ranking.begin(), ranking.end(), rng);
    for (int64_t t = 0; t < tokens; ++t) {
      if (skew == 0.0) {
        std::iota(experts.begin(), experts.end(), 0);
        std::shuffle(experts.begin(), experts.end(), rng);
        slot_ids.insert(slot_ids.end(), experts.begin(), experts.begin() + kTopK);
        continue;
      }
      std::vector<double> weight(kExperts);
      for (int64_t i = 0; i < kExperts; ++i) weight[ranking[i]] = std::pow(static_cast<double>(i + 1), -skew);
      for (int64_t j = 0; j < kTopK; ++j) {
        const auto e = static_cast<int32_t>(std::discrete_distribution<int>(weight.begin(), weight.end())(rng));
        weight[e] = 0.0;
        slot_ids.push_back(e);
      }
    }
    std::vector<int32_t> off(kExperts + 1, 0), perm(static_cast<size_t>(rows)), inverse(static_cast<size_t>(rows));
    for (int32_t id : slot_ids) ++off[id + 1];
    std::partial_sum(off.begin(), off.end(), off.begin());
    std::vector<int32_t> next(off.begin(), off.end() - 1);
    for (int64_t p = 0; p < rows; ++p) {
      inverse[p] = next[slot_ids[p]]++;
      perm[inverse[p]] = static_cast<int32_t>(p);
    }
    r.mean_active += static_cast<double>(std::set<int32_t>(slot_ids.begin(), slot_ids.end()).size()) / kSlots;
    int32_t busiest = 0, n_passes = 0;
    for (int64_t e = 0; e < kExperts; ++e) {
      busiest = std::max(busiest, off[e + 1] - off[e]);
      constexpr auto kPass = static_cast<int32_t>(kMoeDecodePassRows);
      for (int32_t b = off[e]; b < off[e + 1]; b += kPass, ++n_passes) {
        passes.insert(passes.end(), {static_cast<int32_t>(e), b, std::min(b + kPass, off[e + 1]), 0});
      }
    }
    for (int64_t i = n_passes; i < pass_slots; ++i) passes.insert(passes.end(), {-1, 0, 0, 0});
    r.mean_busiest += static_cast<double>(busiest) / kSlots;
    ids.insert(ids.end(), slot_ids.begin(), slot_ids.end());
    offsets.insert(offsets.end(), off.begin(), off.end());
    sorted.insert(sorted.end(), perm.begin(), perm.end());
    pair_row.insert(pair_row.end(), inverse.begin(), inverse.end());
  }
  r.ids = upload(ids);
  r.offsets = upload(offsets);
  r.sorted_pairs = upload(sorted);
  r.pair_row = upload(pair_row);
  r.passes = upload(passes);
  r.weights = upload(std::vector<float>(static_cast<size_t>(rows * kSlots), 1.0f / kTopK));
  return r;
}

struct GemmTiming {
  double ms, bytes, flops;
};

// The grouped GEMM of one projection over the rotating routings; x [tokens or rows, k], y [rows, n]. tweak adjusts
// the arguments of routing s (a second projection, x_silu_mul, its pass list); the bytes and flops count w2 when it
// is set.
GemmTiming time_gemm(const DeviceContext& ctx, const BenchWeights& w, const Routings& r, int64_t tokens, bool gather,
                     MoeGemmVariant variant, const DeviceBuffer& x, const DeviceBuffer& y,
                     const std::function<void(MoeGemmArgs&, int)>& tweak = nullptr, int rs_shape = -1) {
  const int64_t rows = tokens * kTopK;
  MoeExpertWeights w2;
  const double ms = time_ms(ctx, 4 * kSlots, [&](int s) {
    MoeGemmArgs a{.x = x.as<uint16_t>(),
                  .ldx = w.view.k,
                  .sorted_pairs = r.sorted_pairs.as<int32_t>() + s * rows,
                  .top_k = kTopK,
                  .gather = gather,
                  .expert_offsets = r.offsets.as<int32_t>() + s * (kExperts + 1),
                  .w = w.view,
                  .y = y.as<uint16_t>(),
                  .ldy = w.view.n,
                  .rows = rows};
    if (tweak) tweak(a, s);
    w2 = a.w2;
    if (rs_shape >= 0) {
      moe_gemm_launch_prefill_rs(ctx, a, rs_shape);  // the caller checked moe_gemm_prefill_rs_fits
    } else if (!moe_gemm(ctx, a, variant)) {
      std::abort();
    }
  });
  const double flops = 2.0 * static_cast<double>(rows * (w.view.n + w2.n) * w.view.k);
  return {ms, r.mean_active * (expert_bytes(w.view) + (w2.n != 0 ? expert_bytes(w2) : 0.0)), flops};
}

double copy_bandwidth(const DeviceContext& ctx) {
  const size_t bytes = size_t{2} << 30;
  DeviceBuffer a(bytes), b(bytes);
  TERN_CUDA_CHECK(cudaMemset(a.data(), 0x3C, bytes));
  const double ms = time_ms(ctx, 4, [&](int) { bench_copy_launch(a.data(), b.data(), bytes, ctx.props().num_sms, ctx.stream()); });
  return 2.0 * static_cast<double>(bytes) / (ms * 1e6);
}

void bench_format(const DeviceContext& ctx, MoeWeightFormat format, const std::vector<int64_t>& decode_tokens,
                  bool decode_only, bool tiles, double skew, double copy_gbs, std::mt19937& rng) {
  const char* name = format_name(format);
  const BenchWeights gate_up = make_weights(format, 2 * kInter, kHidden, rng);
  const BenchWeights down = make_weights(format, kHidden, kInter, rng);
  const int64_t max_rows = 4096 * kTopK;
  const DeviceBuffer x = fill_random<uint16_t>(static_cast<size_t>(max_rows * kHidden), [&] {
    return float_to_bf16(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng));
  });
  const DeviceBuffer y(static_cast<size_t>(max_rows * kHidden) * 2);
  // Gate and up as two stacks (as NVFP4 checkpoints store them), timed as one decode launch (MoeGemmArgs::w2).
  const BenchWeights gate = make_weights(format, kInter, kHidden, rng), up = make_weights(format, kInter, kHidden, rng);
  auto print = [&](const char* variant, int64_t tokens, const char* proj, const Routings& r, const GemmTiming& t) {
    const double gbs = t.bytes / (t.ms * 1e6);
    std::printf("%-6s %-8s T=%-5lld %-9s %6.1f active experts %5.1f busiest %9.2f us %7.0f GB/s %5.1f%% of copy\n",
                name, variant, static_cast<long long>(tokens), proj, r.mean_active, r.mean_busiest, t.ms * 1e3, gbs,
                100.0 * gbs / copy_gbs);
  };
  // The decode launches of moe_forward: gate and up in one grid, and down reading [gate | up] rows and applying
  // silu_mul itself (MoeGemmArgs::x_silu_mul). mode 0: the launcher's x-row tiles; 1, 2: that many forced
  // (MoeGemmArgs::decode_token_tiles); 3: the pass list (MoeGemmArgs::decode_passes), as moe_forward past 8 tokens.
  auto fused_decode = [&](int64_t tokens, const Routings& r, int mode, const char* label) {
    const int64_t pass_ints = 4 * moe_decode_pass_slots(tokens * kTopK, kExperts);
    auto set_mode = [&](MoeGemmArgs& a, int s) {
      a.decode_token_tiles = mode <= 2 ? mode : 0;
      if (mode == 3) a.decode_passes = r.passes.as<int32_t>() + s * pass_ints;
    };
    print(label, tokens, "gate+up", r,
          time_gemm(ctx, gate, r, tokens, true, MoeGemmVariant::kDecode, x, y, [&](MoeGemmArgs& a, int s) {
            a.w2 = up.view;
            a.y2_offset = kInter;
            a.ldy = 2 * kInter;
            set_mode(a, s);
          }));
    print(label, tokens, "down+silu", r,
          time_gemm(ctx, down, r, tokens, false, MoeGemmVariant::kDecode, x, y, [&](MoeGemmArgs& a, int s) {
            a.ldx = 2 * kInter;
            a.x_silu_mul = true;
            set_mode(a, s);
          }));
  };
  for (int64_t tokens : decode_tokens) {
    const Routings r = make_routings(tokens, rng);
    fused_decode(tokens, r, 0, "decode");
    if (tiles && tokens > 8) {
      // Past 8 tokens each way of taking an expert's rows, on random routings and on skewed ones.
      const Routings skewed = make_routings(tokens, rng, skew);
      for (const auto& [routing, suffix] : {std::pair{&r, ""}, std::pair{&skewed, "-skew"}}) {
        for (const auto& [mode, label] : {std::pair{1, "t1"}, std::pair{2, "t2"}, std::pair{3, "passes"}}) {
          fused_decode(tokens, *routing, mode, (std::string(label) + suffix).c_str());
        }
      }
    }
    if (tiles) continue;
    for (const auto& [proj, w, gather] : {std::tuple{"gate_up", &gate_up, true}, std::tuple{"down", &down, false}}) {
      // Both variants, so kMoeDecodeMaxTokens can be checked against where they cross.
      for (const MoeGemmVariant v : {MoeGemmVariant::kDecode, MoeGemmVariant::kPrefill}) {
        if (decode_only && v != MoeGemmVariant::kDecode) continue;
        print(v == MoeGemmVariant::kDecode ? "decode" : "prefill", tokens, proj, r,
              time_gemm(ctx, *w, r, tokens, gather, v, x, y));
      }
    }
  }
  if (decode_only) return;
  const int64_t tokens = 4096;
  const Routings r = make_routings(tokens, rng);
  for (const auto& [proj, w, gather] : {std::tuple{"gate_up", &gate_up, true}, std::tuple{"down", &down, false}}) {
    // The kernel the model runs (wgmma on sm_90a) and the mma.sync one every GPU has.
    for (const MoeGemmVariant v : {MoeGemmVariant::kPrefill, MoeGemmVariant::kPrefillMma}) {
      const GemmTiming t = time_gemm(ctx, *w, r, tokens, gather, v, x, y);
      std::printf("%-6s %-11s T=%-5lld %-8s %9.2f us %7.1f TFLOP/s\n", name,
                  v == MoeGemmVariant::kPrefill ? "prefill" : "prefill-mma", static_cast<long long>(tokens), proj,
                  t.ms * 1e3, t.flops / (t.ms * 1e9));
    }
  }
  std::fflush(stdout);
}

// Route, align and combine at decode and prefill sizes.
void bench_small_kernels(const DeviceContext& ctx, const std::vector<int64_t>& token_counts, std::mt19937& rng) {
  for (int64_t tokens : token_counts) {
    const int64_t rows = tokens * kTopK;
    const Routings r = make_routings(tokens, rng);
    const DeviceBuffer logits = fill_random<uint16_t>(static_cast<size_t>(tokens * kExperts), [&] {
      return float_to_bf16(std::normal_distribution<float>(0.0f, 2.0f)(rng));
    });
    const DeviceBuffer ids(static_cast<size_t>(rows) * 4), weights(static_cast<size_t>(rows) * 4);
    const DeviceBuffer off((kExperts + 1) * 4), sorted(static_cast<size_t>(rows) * 4), pr(static_cast<size_t>(rows) * 4);
    const DeviceBuffer out(static_cast<size_t>(rows * kHidden) * 2), y(static_cast<size_t>(tokens * kHidden) * 2);
    const size_t align_ws_bytes = moe_align_workspace_bytes(tokens, kTopK, kExperts);
    const DeviceBuffer align_ws(std::max<size_t>(align_ws_bytes, 4));
    const double route_ms = time_ms(ctx, 20, [&](int) {
      if (!moe_route(ctx, {.logits = logits.as<uint16_t>(), .logits_stride = kExperts, .topk_ids = ids.as<int32_t>(),
                           .topk_weights = weights.as<float>(), .tokens = tokens, .n_experts = kExperts,
                           .top_k = kTopK})) std::abort();
    });
    const double align_ms = time_ms(ctx, 20, [&](int s) {
      if (!moe_align(ctx, {.topk_ids = r.ids.as<int32_t>() + s * rows, .tokens = tokens, .top_k = kTopK,
                           .n_experts = kExperts, .expert_offsets = off.as<int32_t>(),
                           .sorted_pairs = sorted.as<int32_t>(), .pair_row = pr.as<int32_t>(),
                           .workspace = align_ws.data(), .workspace_bytes = align_ws_bytes})) std::abort();
    });
    // Route and align in one launch where the pairs fit one block (as moe_forward does at decode).
    const double route_align_ms = rows > kMoeRouteAlignMaxPairs ? 0.0 : time_ms(ctx, 20, [&](int) {
      const MoeRouteArgs route{.logits = logits.as<uint16_t>(),
                               .logits_stride = kExperts,
                               .topk_ids = ids.as<int32_t>(),
                               .topk_weights = weights.as<float>(),
                               .tokens = tokens,
                               .n_experts = kExperts,
                               .top_k = kTopK};
      if (!moe_route_align(ctx, route,
                           {.topk_ids = ids.as<int32_t>(),
                            .tokens = tokens,
                            .top_k = kTopK,
                            .n_experts = kExperts,
                            .expert_offsets = off.as<int32_t>(),
                            .sorted_pairs = sorted.as<int32_t>(),
                            .pair_row = pr.as<int32_t>()})) {
        std::abort();
      }
    });
    const double combine_ms = time_ms(ctx, 20, [&](int s) {
      if (!moe_combine(ctx, {.expert_out = out.as<uint16_t>(), .pair_row = r.pair_row.as<int32_t>() + s * rows,
                             .topk_ids = r.ids.as<int32_t>() + s * rows, .topk_weights = r.weights.as<float>(),
                             .y = y.as<uint16_t>(), .tokens = tokens, .top_k = kTopK, .hidden = kHidden})) std::abort();
    });
    const double combine_gbs = 2.0 * static_cast<double>(rows * kHidden + tokens * kHidden) / (combine_ms * 1e6);
    std::printf("T=%-5lld route %8.2f us   align %8.2f us   route+align %8.2f us   combine %8.2f us (%5.0f GB/s)\n",
                static_cast<long long>(tokens), route_ms * 1e3, align_ms * 1e3, route_align_ms * 1e3, combine_ms * 1e3,
                combine_gbs);
  }
}

// The whole routed block as the model runs it (moe_forward: route + align, gate/up, down with SiLU, combine) at
// decode token counts, NVFP4 with gate and up as two stacks: one graph of the block's launches back to back, so each
// GEMM follows the launch it depends on as in a decode step. Random router logits spread the tokens as the dummy
// model's router does (docs/perf/gpu.md §decode-passes); GB/s counts the experts the routings touch.
void bench_forward(const DeviceContext& ctx, double copy_gbs, std::mt19937& rng) {
  const BenchWeights gate = make_weights(MoeWeightFormat::kNvfp4, kInter, kHidden, rng);
  const BenchWeights up = make_weights(MoeWeightFormat::kNvfp4, kInter, kHidden, rng);
  const BenchWeights down = make_weights(MoeWeightFormat::kNvfp4, kHidden, kInter, rng);
  for (const int64_t tokens : {1, 8, 16, 32, 64}) {
    const DeviceBuffer x = fill_random<uint16_t>(static_cast<size_t>(tokens * kHidden), [&] {
      return float_to_bf16(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng));
    });
    // kSlots sets of logits, rotated so that consecutive blocks touch different experts.
    const DeviceBuffer logits = fill_random<uint16_t>(static_cast<size_t>(kSlots * tokens * kExperts), [&] {
      return float_to_bf16(std::normal_distribution<float>(0.0f, 2.0f)(rng));
    });
    const size_t ws_bytes = moe_forward_workspace_bytes(tokens, kTopK, kExperts, kInter, kHidden);
    const DeviceBuffer ws(ws_bytes), y(static_cast<size_t>(tokens * kHidden) * 2);
    const double ms = time_ms(ctx, 2 * kSlots, [&](int s) {
      const MoeForwardArgs a{.x = x.as<uint16_t>(),
                             .router_logits = logits.as<uint16_t>() + s * tokens * kExperts,
                             .logits_stride = kExperts,
                             .tokens = tokens,
                             .hidden = kHidden,
                             .inter = kInter,
                             .n_experts = kExperts,
                             .top_k = kTopK,
                             .gate_up = gate.view,
                             .up = up.view,
                             .down = down.view,
                             .y = y.as<uint16_t>(),
                             .workspace = ws.data(),
                             .workspace_bytes = ws_bytes};
      if (!moe_forward(ctx, a)) std::abort();
    });
    const double p_untouched = std::pow(1.0 - static_cast<double>(kTopK) / kExperts, static_cast<double>(tokens));
    const double active = kExperts * (1.0 - p_untouched);  // expected distinct experts of uniform routing
    const double bytes = active * (expert_bytes(gate.view) + expert_bytes(up.view) + expert_bytes(down.view));
    const double gbs = bytes / (ms * 1e6);
    std::printf("nvfp4  forward  T=%-5lld %6.1f active experts (expected) %9.2f us %7.0f GB/s %5.1f%% of copy\n",
                static_cast<long long>(tokens), active, ms * 1e3, gbs, 100.0 * gbs / copy_gbs);
  }
}

// The NVFP4 prefill kernel with the weight in registers at each of its shapes against the launcher's choice
// (kPrefill), at 1024 and 4096 tokens.
void bench_rs_shapes(const DeviceContext& ctx, std::mt19937& rng) {
  const BenchWeights gate_up = make_weights(MoeWeightFormat::kNvfp4, 2 * kInter, kHidden, rng);
  const BenchWeights down = make_weights(MoeWeightFormat::kNvfp4, kHidden, kInter, rng);
  const int64_t max_rows = 4096 * kTopK;
  const DeviceBuffer x = fill_random<uint16_t>(static_cast<size_t>(max_rows * kHidden), [&] {
    return float_to_bf16(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng));
  });
  const DeviceBuffer y(static_cast<size_t>(max_rows * kHidden) * 2);
  const std::vector<std::string> shapes = moe_gemm_prefill_rs_shapes();
  for (int64_t tokens : {1024, 4096}) {
    const Routings r = make_routings(tokens, rng);
    for (const auto& [proj, w, gather] : {std::tuple{"gate_up", &gate_up, true}, std::tuple{"down", &down, false}}) {
      const MoeGemmArgs probe{.x = x.as<uint16_t>(), .ldx = w->view.k, .w = w->view, .rows = tokens * kTopK};
      for (int shape = -1; shape < static_cast<int>(shapes.size()); ++shape) {
        if (shape >= 0 && !moe_gemm_prefill_rs_fits(ctx, probe)) continue;
        const GemmTiming t = time_gemm(ctx, *w, r, tokens, gather, MoeGemmVariant::kPrefill, x, y, nullptr, shape);
        std::printf("nvfp4 T=%-5lld %-8s %-36s %9.2f us %7.1f TFLOP/s\n", static_cast<long long>(tokens), proj,
                    shape < 0 ? "prefill (the model's)" : ("rs " + shapes[static_cast<size_t>(shape)]).c_str(),
                    t.ms * 1e3, t.flops / (t.ms * 1e9));
      }
    }
  }
  std::fflush(stdout);
}

// formats empty: every format (--tiles: NVFP4).
int bench_main(bool quick, bool decode_only, bool small_only, bool tiles, bool forward, bool rs_shapes, double skew,
               std::vector<MoeWeightFormat> formats) {
  DeviceContext ctx;
  const DeviceProps& p = ctx.props();
  std::printf("device: %s (cc %d.%d), %d SMs, L2 %d MiB\n", p.name.c_str(), p.cc_major, p.cc_minor, p.num_sms,
              p.l2_bytes >> 20);
  const double copy_gbs = copy_bandwidth(ctx);
  std::printf("device-to-device copy kernel (bytes read + written): %.0f GB/s\n", copy_gbs);
  std::printf("shapes: hidden %lld, moe_intermediate %lld, %lld experts, top-%lld\n\n", static_cast<long long>(kHidden),
              static_cast<long long>(kInter), static_cast<long long>(kExperts), static_cast<long long>(kTopK));
  const std::vector<int64_t> decode_tokens = decode_only ? std::vector<int64_t>{1, 8}
                                             : quick     ? std::vector<int64_t>{1, 8, 16, 64}
                                                         : std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64};
  std::mt19937 rng(4242);
  if (forward) {
    bench_forward(ctx, copy_gbs, rng);
    return 0;
  }
  if (rs_shapes) {
    bench_rs_shapes(ctx, rng);
    return 0;
  }
  if (small_only) {
    bench_small_kernels(ctx, {1, 4, 8, 16, 32, 64, 128, 256, 4096}, rng);
    return 0;
  }
  if (tiles) {
    for (MoeWeightFormat f : formats.empty() ? std::vector{MoeWeightFormat::kNvfp4} : formats) {
      bench_format(ctx, f, {8, 16, 32, 64}, true, true, skew, copy_gbs, rng);
    }
    return 0;
  }
  if (formats.empty()) formats = {MoeWeightFormat::kBf16, MoeWeightFormat::kNvfp4, MoeWeightFormat::kFp8};
  for (MoeWeightFormat f : formats) bench_format(ctx, f, decode_tokens, decode_only, false, skew, copy_gbs, rng);
  if (!decode_only) bench_small_kernels(ctx, {1, 64, 4096}, rng);
  return 0;
}

}  // namespace
}  // namespace tern

int main(int argc, char** argv) {
  bool quick = false, decode_only = false, small_only = false, tiles = false, forward = false, rs_shapes = false;
  double skew = 0.5;
  std::vector<tern::MoeWeightFormat> formats;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strcmp(a, "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(a, "--decode") == 0) {
      decode_only = true;
    } else if (std::strcmp(a, "--small") == 0) {
      small_only = true;
    } else if (std::strcmp(a, "--tiles") == 0) {
      tiles = true;
    } else if (std::strcmp(a, "--forward") == 0) {
      forward = true;
    } else if (std::strcmp(a, "--rs-shapes") == 0) {
      rs_shapes = true;
    } else if (std::strcmp(a, "--skew") == 0 && i + 1 < argc) {
      skew = std::atof(argv[++i]);
    } else if (std::strcmp(a, "--bf16") == 0) {
      formats.push_back(tern::MoeWeightFormat::kBf16);
    } else if (std::strcmp(a, "--nvfp4") == 0) {
      formats.push_back(tern::MoeWeightFormat::kNvfp4);
    } else if (std::strcmp(a, "--fp8") == 0) {
      formats.push_back(tern::MoeWeightFormat::kFp8);
    } else {
      std::fprintf(stderr,
                   "usage: moe_bench [--quick | --decode | --small | --forward | --rs-shapes | --tiles [--skew S]] "
                   "[--bf16 | --nvfp4 | --fp8]\n");
      return 2;
    }
  }
  return tern::bench_main(quick, decode_only, small_only, tiles, forward, rs_shapes, skew, std::move(formats));
}
