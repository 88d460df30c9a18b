// GEMM timings on one GPU: NVFP4 W4A16 (decode and prefill) against cuBLASLt BF16 of the same shape, the BF16
// GEMV of decode against cuBLASLt, and the device-to-device copy bandwidth of the same run as the memory ceiling.
// Plain main (not run by ctest):
//   gemm_bench [--quick | --decode | --fp8 | --dequant | --batch | --gemv | --gemv-sweep]
// --decode: only M = 1 and 8 on the dense decode shapes N in {2048, 4096, 6144} x K in {2048, 4096} and Qwen3-8B's
// (1024, 12288 and 24576 x 4096, 4096 x 12288). GB/s counts
// the bytes that must move (packed weight + block scales + x + y). --gemv: only the GEMV table (gemv_bf16 against
// gemm_bf16 at M = 1, 2, 4, 8 on the BF16 projections of Qwen3-8B and Qwen3.5-35B-A3B, GB/s of W + x + y), which
// the full run prints after the GEMM table. --gemv-sweep: that table with, under each line, the GEMV's time at
// every group size (gemv_bf16_group_threads' choice marked), for tuning that choice. --fp8: block-wise FP8 W8A16
// (gemm_fp8_w8a16) on the --decode shapes at M = 1, 8, 16, 64 and 2048, GB/s of codes + row scales + x + y.
// --dequant: for M = 16 .. 8192, NVFP4 and FP8 each through the prefill kernel, through the decode kernel per 16-row
// slice and the batch kernel (M <= 64), and dequantized to bf16 then cuBLASLt (kDequant), against cuBLASLt BF16 on a
// bf16 weight. --batch: the same table at M = 16 .. 64, the batch kernel's range, without the prefill kernel.
// Each timing is a CUDA graph of back-to-back launches that rotate over enough copies of the operands to exceed
// the L2 several times, replayed after a warm-up; the median replay over the launch count is reported.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/formats.h"
#include "kernels/cuda/bench_timing.h"
#include "kernels/cuda/gemm/gemm_bf16.h"
#include "kernels/cuda/gemm/gemm_fp8_w8a16.h"
#include "kernels/cuda/gemm/gemm_nvfp4_w4a16.h"
#include "kernels/cuda/gemv/gemv_bf16.h"
#include "kernels/cuda/roofline.h"

namespace tern {

namespace {

constexpr size_t kRotateBytes = size_t{512} << 20;  // > 8x the H200's 50 MiB L2

double time_ms(const DeviceContext& ctx, int n_slots, const std::function<void(int)>& launch) {
  return bench_time_ms(ctx, n_slots, std::max(n_slots, 20), launch);
}

// Bytes read plus written by a large device-to-device copy, per second: through a copy kernel (the ceiling) and
// through cudaMemcpyAsync (for reference).
struct CopyBandwidth {
  double kernel_gbs, memcpy_gbs;
};

CopyBandwidth copy_bandwidth(const DeviceContext& ctx) {
  const size_t bytes = size_t{2} << 30;
  DeviceBuffer a(bytes), b(bytes);
  TERN_CUDA_CHECK(cudaMemsetAsync(a.data(), 0x3C, bytes, ctx.stream()));
  const double kernel_ms = time_ms(ctx, 1, [&](int) {
    bench_copy_launch(a.data(), b.data(), bytes, ctx.props().num_sms, ctx.stream());
  });
  const double memcpy_ms = time_ms(ctx, 1, [&](int) {
    TERN_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, ctx.stream()));
  });
  return {2.0 * static_cast<double>(bytes) / (kernel_ms * 1e6), 2.0 * static_cast<double>(bytes) / (memcpy_ms * 1e6)};
}

template <class T>
void fill_device(void* dst, const std::vector<T>& host, int copies, size_t stride_bytes) {
  for (int c = 0; c < copies; ++c) {
    TERN_CUDA_CHECK(cudaMemcpy(static_cast<char*>(dst) + c * stride_bytes, host.data(), host.size() * sizeof(T),
                               cudaMemcpyHostToDevice));
  }
}

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct Row {
  int64_t m, n, k;
};

// Host operands of one weight shape, generated once and reused for every m.
struct HostWeights {
  std::vector<uint8_t> packed, scales;
  std::vector<uint16_t> wbf;
};

HostWeights make_host_weights(int64_t n, int64_t k, std::mt19937& rng) {
  HostWeights h{std::vector<uint8_t>(static_cast<size_t>(n * k / 2)), std::vector<uint8_t>(static_cast<size_t>(n * k / 16)),
                std::vector<uint16_t>(static_cast<size_t>(n * k))};
  std::uniform_int_distribution<int> byte(0, 255), scale_code(0x28, 0x48);  // e4m3 ~ 2^-2 .. 2^2, never NaN
  std::uniform_real_distribution<float> uniform(-0.05f, 0.05f);
  for (auto& v : h.packed) v = static_cast<uint8_t>(byte(rng));
  for (auto& v : h.scales) v = static_cast<uint8_t>(scale_code(rng));
  for (auto& v : h.wbf) {
    do {
      v = float_to_bf16(uniform(rng));
    } while ((v & 0x7FFF) == 0);
  }
  return h;
}

void bench_shape(const DeviceContext& ctx, const Row& s, const HostWeights& hw, double copy_gbs, std::mt19937& rng) {
  const auto m = static_cast<size_t>(s.m), n = static_cast<size_t>(s.n), k = static_cast<size_t>(s.k);
  const size_t x_bytes = round_up(m * k * 2, 256), y_bytes = round_up(m * n * 2, 256);
  const size_t p_bytes = round_up(n * k / 2, 256), sc_bytes = round_up(n * k / 16, 256);
  const size_t wbf_bytes = round_up(n * k * 2, 256);
  const size_t fp4_set = x_bytes + y_bytes + p_bytes + sc_bytes, bf_set = x_bytes + y_bytes + wbf_bytes;
  const int fp4_slots = static_cast<int>(std::clamp<size_t>(kRotateBytes / fp4_set, 1, 64));
  const int bf_slots = static_cast<int>(std::clamp<size_t>(kRotateBytes / bf_set, 1, 64));
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<uint16_t> x(m * k);
  for (auto& v : x) {
    do {
      v = float_to_bf16(uniform(rng));
    } while ((v & 0x7FFF) == 0);
  }
  const auto& packed = hw.packed;
  const auto& scales = hw.scales;
  const auto& wbf = hw.wbf;

  DeviceBuffer dx(x_bytes * std::max(fp4_slots, bf_slots)), dy(y_bytes * std::max(fp4_slots, bf_slots));
  DeviceBuffer dp(p_bytes * fp4_slots), ds(sc_bytes * fp4_slots), dw(wbf_bytes * bf_slots);
  fill_device(dx.data(), x, std::max(fp4_slots, bf_slots), x_bytes);
  fill_device(dp.data(), packed, fp4_slots, p_bytes);
  fill_device(ds.data(), scales, fp4_slots, sc_bytes);
  fill_device(dw.data(), wbf, bf_slots, wbf_bytes);

  auto fp4_args = [&](int i) {
    return GemmNvfp4W4a16Args{
        .x = reinterpret_cast<const uint16_t*>(dx.as<char>() + i * x_bytes),
        .w = Nvfp4WeightView{.packed = dp.as<uint8_t>() + i * p_bytes,
                             .scales = ds.as<uint8_t>() + i * sc_bytes,
                             .global_scale = 1.0f / 2688.0f,
                             .n = s.n,
                             .k = s.k},
        .y = reinterpret_cast<uint16_t*>(dy.as<char>() + i * y_bytes),
        .m = s.m};
  };
  const double fp4_ms = time_ms(ctx, fp4_slots, [&](int i) {
    if (!gemm_nvfp4_w4a16(ctx, fp4_args(i))) std::abort();
  });
  const double bf_ms = time_ms(ctx, bf_slots, [&](int i) {
    const GemmBf16Args a{.x = reinterpret_cast<const uint16_t*>(dx.as<char>() + i * x_bytes),
                         .w = reinterpret_cast<const uint16_t*>(dw.as<char>() + i * wbf_bytes),
                         .y = reinterpret_cast<uint16_t*>(dy.as<char>() + i * y_bytes),
                         .m = s.m,
                         .n = s.n,
                         .k = s.k};
    if (!gemm_bf16(ctx, a)) std::abort();
  });
  const double fp4_bytes = static_cast<double>(m * k * 2 + m * n * 2 + n * k / 2 + n * k / 16);
  const double bf_bytes = static_cast<double>(m * k * 2 + m * n * 2 + n * k * 2);
  const double flops = 2.0 * static_cast<double>(m * n * k);
  const double fp4_gbs = fp4_bytes / (fp4_ms * 1e6), bf_gbs = bf_bytes / (bf_ms * 1e6);
  std::printf("%6lld %6lld %6lld | %-7s %9.2f %7.0f %5.1f%% %7.1f | %9.2f %7.0f %5.1f%% %7.1f | %5.2fx\n",
              static_cast<long long>(s.m), static_cast<long long>(s.n), static_cast<long long>(s.k),
              s.m <= kNvfp4DecodeMaxM ? "decode" : s.m <= kNvfp4BatchMaxM ? "batch" : "dequant", fp4_ms * 1e3, fp4_gbs,
              100.0 * fp4_gbs / copy_gbs,
              flops / (fp4_ms * 1e9), bf_ms * 1e3, bf_gbs, 100.0 * bf_gbs / copy_gbs, flops / (bf_ms * 1e9),
              bf_ms / fp4_ms);
  std::fflush(stdout);
}

// A bf16 weight for timing: a random 1 Mi-element pattern tiled over the matrix (values do not change the time of
// a memory-bound kernel; drawing 10^9 fresh ones would take longer than the run).
std::vector<uint16_t> tiled_bf16(size_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-0.05f, 0.05f);
  std::vector<uint16_t> tile(std::min<size_t>(count, size_t{1} << 20));
  for (auto& v : tile) {
    do {
      v = float_to_bf16(uniform(rng));
    } while ((v & 0x7FFF) == 0);
  }
  std::vector<uint16_t> out(count);
  for (size_t i = 0; i < count; i += tile.size()) {
    std::copy_n(tile.begin(), std::min(tile.size(), count - i), out.begin() + static_cast<std::ptrdiff_t>(i));
  }
  return out;
}

// gemm_fp8_w8a16 at each m on one [n, k] weight of random finite e4m3 codes and per-row block scales.
void bench_fp8_shape(const DeviceContext& ctx, int64_t n, int64_t k, const std::vector<int64_t>& ms, double copy_gbs,
                     std::mt19937& rng) {
  const int64_t scale_cols = (k + 127) / 128;
  std::vector<uint8_t> codes(static_cast<size_t>(n * k));
  std::vector<float> scales(static_cast<size_t>(n * scale_cols));
  std::uniform_int_distribution<int> code(0, 255);
  std::uniform_real_distribution<float> scale(1e-4f, 1e-3f);
  for (auto& v : codes) {
    do {
      v = static_cast<uint8_t>(code(rng));
    } while ((v & 0x7F) == 0x7F);  // e4m3fn's NaN
  }
  for (auto& v : scales) v = scale(rng);
  const int64_t max_m = *std::max_element(ms.begin(), ms.end());
  const size_t c_bytes = round_up(codes.size(), 256), s_bytes = round_up(scales.size() * 4, 256);
  const size_t x_bytes = round_up(static_cast<size_t>(max_m * k) * 2, 256);
  const size_t y_bytes = round_up(static_cast<size_t>(max_m * n) * 2, 256);
  const int slots = static_cast<int>(std::clamp<size_t>(kRotateBytes / (c_bytes + s_bytes + x_bytes + y_bytes), 1, 64));
  DeviceBuffer dc(c_bytes * slots), ds(s_bytes * slots), dx(x_bytes * slots), dy(y_bytes * slots);
  fill_device(dc.data(), codes, slots, c_bytes);
  fill_device(ds.data(), scales, slots, s_bytes);
  fill_device(dx.data(), tiled_bf16(static_cast<size_t>(max_m * k), rng), slots, x_bytes);
  for (int64_t m : ms) {
    const double ms_time = time_ms(ctx, slots, [&](int i) {
      const auto* row_scales = reinterpret_cast<const float*>(ds.as<char>() + i * s_bytes);
      const GemmFp8W8a16Args a{.x = reinterpret_cast<const uint16_t*>(dx.as<char>() + i * x_bytes),
                               .w = Fp8WeightView{.codes = dc.as<uint8_t>() + i * c_bytes,
                                                  .row_scales = row_scales,
                                                  .n = n,
                                                  .k = k},
                               .y = reinterpret_cast<uint16_t*>(dy.as<char>() + i * y_bytes),
                               .m = m};
      if (!gemm_fp8_w8a16(ctx, a)) std::abort();
    });
    const double bytes = static_cast<double>(n * k + n * scale_cols * 4 + m * k * 2 + m * n * 2);
    const double gbs = bytes / (ms_time * 1e6), flops = 2.0 * static_cast<double>(m * n * k);
    std::printf("%6lld %6lld %6lld | %-7s %9.2f %7.0f %5.1f%% %7.1f\n", static_cast<long long>(m),
                static_cast<long long>(n), static_cast<long long>(k),
                m <= kFp8DecodeMaxM ? "decode" : m <= kFp8BatchMaxM ? "batch" : "dequant", ms_time * 1e3, gbs,
                100.0 * gbs / copy_gbs, flops / (ms_time * 1e9));
    std::fflush(stdout);
  }
}

// One weight shape through every multi-row path of both formats at each m (--dequant, --batch): the prefill kernel
// (not with --batch), the decode kernel per 16-row slice and the batch kernel (m <= 64; 0 past it), the dequantized
// weight on cuBLASLt.
void bench_dequant_shape(const DeviceContext& ctx, int64_t n, int64_t k, const std::vector<int64_t>& ms,
                         bool with_prefill, std::mt19937& rng) {
  const int64_t max_m = *std::max_element(ms.begin(), ms.end());
  const HostWeights hw = make_host_weights(n, k, rng);
  std::vector<uint8_t> codes(static_cast<size_t>(n * k));
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(0x20 | (hw.packed[i / 2] & 0x9F));
  const std::vector<float> scales(static_cast<size_t>(n * ((k + 127) / 128)), 0.01f);
  DeviceBuffer dp(hw.packed.size()), ds(hw.scales.size()), dc(codes.size()), drs(scales.size() * 4);
  DeviceBuffer dw(hw.wbf.size() * 2), dx(static_cast<size_t>(max_m * k) * 2), dy(static_cast<size_t>(max_m * n) * 2);
  fill_device(dp.data(), hw.packed, 1, 0);
  fill_device(ds.data(), hw.scales, 1, 0);
  fill_device(dc.data(), codes, 1, 0);
  fill_device(drs.data(), scales, 1, 0);
  fill_device(dw.data(), hw.wbf, 1, 0);
  fill_device(dx.data(), tiled_bf16(static_cast<size_t>(max_m * k), rng), 1, 0);
  const auto* x = dx.as<uint16_t>();
  auto* y = dy.as<uint16_t>();
  for (int64_t m : ms) {
    const GemmNvfp4W4a16Args fa{.x = x,
                                .w = Nvfp4WeightView{.packed = dp.as<uint8_t>(), .scales = ds.as<uint8_t>(),
                                                     .global_scale = 1.0f / 2688.0f, .n = n, .k = k},
                                .y = y,
                                .m = m};
    const GemmFp8W8a16Args ea{
        .x = x, .w = Fp8WeightView{.codes = dc.as<uint8_t>(), .row_scales = drs.as<float>(), .n = n, .k = k}, .y = y,
        .m = m};
    auto fp4 = [&](Nvfp4GemmVariant v) {
      return time_ms(ctx, 1, [&](int) {
        if (!gemm_nvfp4_w4a16(ctx, fa, v)) std::abort();
      });
    };
    auto fp8 = [&](Fp8GemmVariant v) {
      return time_ms(ctx, 1, [&](int) {
        if (!gemm_fp8_w8a16(ctx, ea, v)) std::abort();
      });
    };
    const double bf = time_ms(ctx, 1, [&](int) {
      if (!gemm_bf16(ctx, GemmBf16Args{.x = x, .w = dw.as<uint16_t>(), .y = y, .m = m, .n = n, .k = k})) std::abort();
    });
    const bool small = m <= kNvfp4BatchMaxM;
    std::printf("%6lld %6lld %6lld | %9.2f %9.2f %9.2f %9.2f | %9.2f %9.2f %9.2f %9.2f | %9.2f\n",
                static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
                with_prefill ? fp4(Nvfp4GemmVariant::kPrefill) * 1e3 : 0.0,
                small ? fp4(Nvfp4GemmVariant::kSliced) * 1e3 : 0.0, small ? fp4(Nvfp4GemmVariant::kBatch) * 1e3 : 0.0,
                fp4(Nvfp4GemmVariant::kDequant) * 1e3, with_prefill ? fp8(Fp8GemmVariant::kPrefill) * 1e3 : 0.0,
                small ? fp8(Fp8GemmVariant::kSliced) * 1e3 : 0.0, small ? fp8(Fp8GemmVariant::kBatch) * 1e3 : 0.0,
                fp8(Fp8GemmVariant::kDequant) * 1e3, bf * 1e3);
    std::fflush(stdout);
  }
}

// The GEMV's time at each group size, through the unchecked launcher (the arguments are gemv_bf16's, validated).
void bench_gemv_group_sizes(const DeviceContext& ctx, int slots, const std::function<GemmBf16Args(int)>& args) {
  const GemmBf16Args a0 = args(0);
  const int chosen = gemv_bf16_group_threads(static_cast<int>(a0.m), a0.n, a0.k, ctx.props().num_sms);
  std::printf("%22s group threads:", "");
  for (int threads : {32, 64, 128, 256}) {
    const double ms = time_ms(ctx, slots, [&](int i) {
      const GemmBf16Args a = args(i);
      gemv_bf16_launch(ctx, GemvBf16Params{.x = a.x,
                                           .w = a.w,
                                           .y = a.y,
                                           .m = static_cast<int>(a.m),
                                           .n = a.n,
                                           .k = a.k,
                                           .ldy = a.n,
                                           .group_threads = threads});
    });
    std::printf("  %3d%s %8.2f us", threads, threads == chosen ? "*" : " ", ms * 1e3);
  }
  std::printf("\n");
}

// gemv_bf16 and gemm_bf16 on the same operands, rotating over enough copies of W to exceed the L2.
void bench_gemv_shape(const DeviceContext& ctx, int64_t n, int64_t k, const std::vector<int64_t>& ms, double copy_gbs,
                      bool sweep, std::mt19937& rng) {
  const size_t w_bytes = round_up(static_cast<size_t>(n * k) * 2, 256);
  const size_t x_bytes = round_up(static_cast<size_t>(kGemvMaxRows * k) * 2, 256);
  const size_t y_bytes = round_up(static_cast<size_t>(kGemvMaxRows * n) * 2, 256);
  // Small weights (a router) need thousands of copies to leave the L2, as they do between two decode steps.
  const int slots = static_cast<int>(std::clamp<size_t>(kRotateBytes / (w_bytes + x_bytes + y_bytes), 1, 4096));
  DeviceBuffer dw(w_bytes * slots), dx(x_bytes * slots), dy(y_bytes * slots);
  fill_device(dw.data(), tiled_bf16(static_cast<size_t>(n * k), rng), slots, w_bytes);
  fill_device(dx.data(), tiled_bf16(static_cast<size_t>(kGemvMaxRows * k), rng), slots, x_bytes);
  for (int64_t m : ms) {
    auto args = [&](int i) {
      return GemmBf16Args{.x = reinterpret_cast<const uint16_t*>(dx.as<char>() + i * x_bytes),
                          .w = reinterpret_cast<const uint16_t*>(dw.as<char>() + i * w_bytes),
                          .y = reinterpret_cast<uint16_t*>(dy.as<char>() + i * y_bytes),
                          .m = m,
                          .n = n,
                          .k = k};
    };
    const double gemv_ms = time_ms(ctx, slots, [&](int i) {
      if (!gemv_bf16(ctx, args(i))) std::abort();
    });
    const double gemm_ms = time_ms(ctx, slots, [&](int i) {
      if (!gemm_bf16(ctx, args(i))) std::abort();
    });
    const double bytes = static_cast<double>(n * k * 2 + m * k * 2 + m * n * 2);
    const double gemv_gbs = bytes / (gemv_ms * 1e6), gemm_gbs = bytes / (gemm_ms * 1e6);
    std::printf("%6lld %7lld %6lld | %9.2f %7.0f %5.1f%% | %9.2f %7.0f %5.1f%% | %6.2fx\n", static_cast<long long>(m),
                static_cast<long long>(n), static_cast<long long>(k), gemv_ms * 1e3, gemv_gbs,
                100.0 * gemv_gbs / copy_gbs, gemm_ms * 1e3, gemm_gbs, 100.0 * gemm_gbs / copy_gbs, gemm_ms / gemv_ms);
    if (sweep) bench_gemv_group_sizes(ctx, slots, args);
    std::fflush(stdout);
  }
}

void bench_gemv(const DeviceContext& ctx, double copy_gbs, bool sweep) {
  std::printf("\nBF16 GEMV (gemv_bf16) against cuBLASLt (gemm_bf16); GB/s of W + x + y\n");
  std::printf("%6s %7s %6s | %9s %7s %6s | %9s %7s %6s | %7s\n", "M", "N", "K", "gemv us", "GB/s", "%copy", "bf16 us",
              "GB/s", "%copy", "speedup");
  // Qwen3-8B: qkv, o_proj, gate|up, down_proj, lm_head. Qwen3.5-35B-A3B (hidden 2048), as the CUDA model fuses its
  // BF16 projections: attention q|gate|k|v and o_proj (= GDN out_proj), GDN in_proj_qkv, in_proj_z, in_proj_b|a,
  // router|shared expert gate, shared expert gate|up and down, lm_head.
  const std::pair<int64_t, int64_t> shapes[] = {
      {6144, 4096}, {4096, 4096}, {24576, 4096}, {4096, 12288}, {151936, 4096}, {9216, 2048}, {2048, 4096},
      {8192, 2048}, {4096, 2048}, {64, 2048},    {257, 2048},   {1024, 2048},   {2048, 512},  {248320, 2048}};
  std::mt19937 rng(4242);
  for (const auto& [n, k] : shapes) bench_gemv_shape(ctx, n, k, {1, 2, 4, 8}, copy_gbs, sweep, rng);
}

const std::vector<std::pair<int64_t, int64_t>> kDecodeShapes = {{2048, 2048}, {2048, 4096},  {4096, 2048},
                                                                  {4096, 4096}, {6144, 2048},  {6144, 4096},
                                                                  {1024, 4096}, {12288, 4096}, {4096, 12288},
                                                                  {24576, 4096}};

int bench_main(bool quick, bool decode_only, bool fp8, bool dequant, bool batch, bool gemv_only, bool gemv_sweep) {
  DeviceContext ctx;
  const DeviceProps& p = ctx.props();
  std::printf("device: %s (cc %d.%d), %d SMs, L2 %d MiB, smem/block opt-in %zu KiB, smem/SM %zu KiB, "
              "regs/SM %d, SM clock %d MHz, memory %zu GiB, bus %d bit\n",
              p.name.c_str(), p.cc_major, p.cc_minor, p.num_sms, p.l2_bytes >> 20, p.shared_mem_per_block_optin >> 10,
              p.shared_mem_per_sm >> 10, p.regs_per_sm, p.sm_clock_khz / 1000, p.global_mem_bytes >> 30,
              p.memory_bus_bits);
  const CopyBandwidth copy = copy_bandwidth(ctx);
  const double copy_gbs = copy.kernel_gbs;
  std::printf("device-to-device copy (bytes read + written): copy kernel %.0f GB/s, cudaMemcpyAsync %.0f GB/s; "
              "%%copy below is of the kernel's\n\n",
              copy.kernel_gbs, copy.memcpy_gbs);
  if (gemv_only || gemv_sweep) {
    bench_gemv(ctx, copy_gbs, gemv_sweep);
    return 0;
  }
  if (dequant || batch) {
    std::printf("us per call; 0: not run (the sliced decode and the batch kernel are for M <= 64 only, --batch skips "
                "the prefill kernel); the L2 is warm (one weight copy)\n");
    std::printf("%6s %6s %6s | %9s %9s %9s %9s | %9s %9s %9s %9s | %9s\n", "M", "N", "K", "fp4 pref", "fp4 slic",
                "fp4 batch", "fp4 deq", "fp8 pref", "fp8 slic", "fp8 batch", "fp8 deq", "bf16");
    std::mt19937 rng(9090);
    const std::vector<int64_t> ms = batch ? std::vector<int64_t>{16, 24, 32, 48, 64}
                                          : std::vector<int64_t>{16, 32, 64, 128, 256, 512, 2048, 8192};
    for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{
             {4096, 4096}, {6144, 4096}, {12288, 4096}, {4096, 12288}, {1024, 4096}, {24576, 4096}}) {
      bench_dequant_shape(ctx, n, k, ms, !batch, rng);
    }
    return 0;
  }
  if (fp8) {
    std::printf("%6s %6s %6s | %-7s %9s %7s %6s %7s\n", "M", "N", "K", "fp8", "us", "GB/s", "%copy", "TFLOP/s");
    std::mt19937 rng(8080);
    for (const auto& [n, k] : kDecodeShapes) bench_fp8_shape(ctx, n, k, {1, 8, 16, 64, 2048}, copy_gbs, rng);
    return 0;
  }
  std::printf("%6s %6s %6s | %-7s %9s %7s %6s %7s | %9s %7s %6s %7s | %6s\n", "M", "N", "K", "nvfp4", "us", "GB/s",
              "%copy", "TFLOP/s", "bf16 us", "GB/s", "%copy", "TFLOP/s", "speedup");
  const std::vector<std::pair<int64_t, int64_t>> shapes =
      decode_only ? kDecodeShapes
                  : std::vector<std::pair<int64_t, int64_t>>{{4096, 4096}, {12288, 4096}, {4096, 12288},
                                                             {1024, 4096}, {4096, 1024},  {2048, 6144}};
  const std::vector<int64_t> ms = decode_only ? std::vector<int64_t>{1, 8}
                                  : quick     ? std::vector<int64_t>{1, 16, 2048}
                                              : std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192};
  std::mt19937 rng(31337);
  for (const auto& [n, k] : shapes) {
    const HostWeights hw = make_host_weights(n, k, rng);
    for (int64_t m : ms) bench_shape(ctx, Row{m, n, k}, hw, copy_gbs, rng);
  }
  if (!quick && !decode_only) bench_gemv(ctx, copy_gbs, false);
  return 0;
}

}  // namespace
}  // namespace tern

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const bool decode_only = argc > 1 && std::strcmp(argv[1], "--decode") == 0;
  const bool fp8 = argc > 1 && std::strcmp(argv[1], "--fp8") == 0;
  const bool dequant = argc > 1 && std::strcmp(argv[1], "--dequant") == 0;
  const bool batch = argc > 1 && std::strcmp(argv[1], "--batch") == 0;
  const bool gemv_only = argc > 1 && std::strcmp(argv[1], "--gemv") == 0;
  const bool gemv_sweep = argc > 1 && std::strcmp(argv[1], "--gemv-sweep") == 0;
  return tern::bench_main(quick, decode_only, fp8, dequant, batch, gemv_only, gemv_sweep);
}
