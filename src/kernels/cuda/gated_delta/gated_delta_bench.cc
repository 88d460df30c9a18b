// Gated DeltaNet kernel timings on one GPU at Qwen3.5's head shapes (Hk 16, Hv 32, dk = dv = 128, conv kernel 4).
// Plain main (not run by ctest):  gdn_bench
//   decode:  one token for 1..256 sequences; the state is read and written once per call (8 bytes per fp32 element),
//            reported in GB/s next to a device-to-device copy of the same run (the memory ceiling).
//   prefill: one sequence of 4096 tokens, both delta-rule kernels: tokens/s and TFLOP/s of the recurrence's useful
//            work (about 6 dk dv FLOPs per token and value head: decay, S^T k, rank-1 update, S^T q).
// Each call rotates over copies of the states (slots) so that, summed over the rotation, they exceed the L2 several
// times; the median of several timed loops is reported.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "core/formats.h"
#include "kernels/cuda/gated_delta/gated_delta.h"

namespace tern {
namespace {

constexpr int64_t kHk = 16, kHv = 32, kDk = 128, kDv = 128, kConvKernel = 4;
constexpr int64_t kWidth = 2 * kHk * kDk + kHv * kDv;
constexpr size_t kRotateBytes = size_t{512} << 20;

// Median milliseconds per call of launch(i) over n_calls calls, i cycling over n_slots.
double time_ms(const DeviceContext& ctx, int n_slots, const std::function<void(int)>& launch) {
  const int n_calls = std::max(n_slots, 20);
  cudaEvent_t start, stop;
  TERN_CUDA_CHECK(cudaEventCreate(&start));
  TERN_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < n_slots; ++i) launch(i);  // warm-up
  std::vector<float> ms(5);
  for (auto& t : ms) {
    TERN_CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
    for (int i = 0; i < n_calls; ++i) launch(i % n_slots);
    TERN_CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
    TERN_CUDA_CHECK(cudaEventSynchronize(stop));
    TERN_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
  }
  TERN_CUDA_CHECK(cudaEventDestroy(start));
  TERN_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] / n_calls;
}

DeviceBuffer random_bf16_device(size_t count, float scale, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<uint16_t> host(count);
  for (auto& v : host) v = float_to_bf16(u(rng));
  DeviceBuffer b(std::max<size_t>(count * 2, 16));
  TERN_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), count * 2, cudaMemcpyHostToDevice));
  return b;
}

template <class T>
DeviceBuffer to_device(const std::vector<T>& host) {
  DeviceBuffer b(std::max<size_t>(host.size() * sizeof(T), 16));
  TERN_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}

// n_seqs sequences of `len` rows each, continuing (seq_past > 0), one metadata set per rotation slot r using
// state slots [r * n_seqs, (r + 1) * n_seqs).
struct RotatingBatch {
  DeviceBuffer query_start, seq_past, slots;
  int64_t n_seqs, len;
  GdnSequences seqs(int r) const {
    return {.query_start = query_start.as<int32_t>(), .state_slot = slots.as<int32_t>() + r * n_seqs,
            .seq_past = seq_past.as<int32_t>(), .n_seqs = n_seqs, .tokens = n_seqs * len, .max_query_len = len};
  }
};

RotatingBatch rotating_batch(int64_t n_seqs, int64_t len, int n_rot) {
  std::vector<int32_t> qs, past(static_cast<size_t>(n_seqs), 100), slots;
  for (int64_t s = 0; s <= n_seqs; ++s) qs.push_back(static_cast<int32_t>(s * len));
  for (int64_t i = 0; i < n_rot * n_seqs; ++i) slots.push_back(static_cast<int32_t>(i));
  return {to_device(qs), to_device(past), to_device(slots), n_seqs, len};
}

struct Weights {
  DeviceBuffer a_log, dt_bias, conv_w;
};

Weights make_weights() {
  std::vector<float> a_log(kHv, 1.0f), dt_bias(kHv, -4.0f), conv_w(static_cast<size_t>(kWidth * kConvKernel), 0.25f);
  return {to_device(a_log), to_device(dt_bias), to_device(conv_w)};
}

void bench_delta(const DeviceContext& ctx, const Weights& w, int64_t n_seqs, int64_t len, GdnVariant variant,
                 double copy_gbs, std::mt19937& rng) {
  const size_t state_bytes = static_cast<size_t>(n_seqs * kHv * kDk * kDv * 4);
  const int n_rot = static_cast<int>(std::clamp<size_t>(kRotateBytes / state_bytes, 1, 256));
  const int64_t tokens = n_seqs * len;
  const RotatingBatch batch = rotating_batch(n_seqs, len, n_rot);
  const DeviceBuffer qkv = random_bf16_device(static_cast<size_t>(tokens * kWidth), 1.0f, rng);
  const DeviceBuffer ab = random_bf16_device(static_cast<size_t>(tokens * kHv), 2.0f, rng);
  DeviceBuffer state(state_bytes * n_rot), out(static_cast<size_t>(tokens * kHv * kDv * 2));
  TERN_CUDA_CHECK(cudaMemset(state.data(), 0, state.size_bytes()));
  const int64_t ws_bytes = gdn_chunked_workspace_bytes(tokens, kHk, kHv, kDk, kDv);
  const DeviceBuffer workspace(static_cast<size_t>(ws_bytes));
  const double ms = time_ms(ctx, n_rot, [&](int r) {
    const GdnDeltaRuleArgs a{.qkv = qkv.as<uint16_t>(), .qkv_stride = kWidth, .a = ab.as<uint16_t>(),
                             .b = ab.as<uint16_t>(), .ab_stride = kHv, .a_log = w.a_log.as<float>(),
                             .dt_bias = w.dt_bias.as<float>(), .state = state.as<float>(), .out = out.as<uint16_t>(),
                             .seqs = batch.seqs(r), .n_key_heads = kHk, .n_value_heads = kHv, .key_dim = kDk,
                             .value_dim = kDv, .workspace = workspace.as<float>(), .workspace_bytes = ws_bytes};
    if (!gdn_delta_rule(ctx, a, variant)) std::abort();
  });
  const char* name = variant == GdnVariant::kChunked ? "chunked" : variant == GdnVariant::kRecurrent ? "recurrent" : "auto";
  if (len == 1) {
    const double gbs = 2.0 * static_cast<double>(state_bytes) / (ms * 1e6);
    std::printf("decode  seqs=%-4lld %-9s %9.1f us  state %7.0f GB/s  %5.1f%% of copy\n", static_cast<long long>(n_seqs),
                name, ms * 1e3, gbs, 100.0 * gbs / copy_gbs);
  } else {
    const double flops = 6.0 * static_cast<double>(tokens) * kHv * kDk * kDv;
    std::printf("prefill T=%-5lld %-9s %9.1f us  %9.0f tokens/s  %6.2f TFLOP/s\n", static_cast<long long>(tokens), name,
                ms * 1e3, static_cast<double>(tokens) / (ms * 1e-3), flops / (ms * 1e9));
  }
  std::fflush(stdout);
}

void bench_conv(const DeviceContext& ctx, const Weights& w, int64_t n_seqs, int64_t len, double copy_gbs,
                std::mt19937& rng) {
  const int64_t tokens = n_seqs * len;
  const RotatingBatch batch = rotating_batch(n_seqs, len, 1);
  const DeviceBuffer x = random_bf16_device(static_cast<size_t>(tokens * kWidth), 1.0f, rng);
  DeviceBuffer state(static_cast<size_t>(n_seqs * kWidth * (kConvKernel - 1) * 2)), y(static_cast<size_t>(tokens * kWidth * 2));
  TERN_CUDA_CHECK(cudaMemset(state.data(), 0, state.size_bytes()));
  const double ms = time_ms(ctx, 1, [&](int) {
    const GdnConvArgs a{.x = x.as<uint16_t>(), .x_stride = kWidth, .weight = w.conv_w.as<float>(),
                        .conv_state = state.as<uint16_t>(), .y = y.as<uint16_t>(), .seqs = batch.seqs(0),
                        .channels = kWidth, .kernel = kConvKernel};
    if (!gdn_conv1d(ctx, a)) std::abort();
  });
  const double bytes = 4.0 * static_cast<double>(tokens * kWidth) + 4.0 * static_cast<double>(state.size_bytes());
  std::printf("conv    seqs=%-4lld T=%-5lld     %9.1f us  %7.0f GB/s  %5.1f%% of copy\n", static_cast<long long>(n_seqs),
              static_cast<long long>(tokens), ms * 1e3, bytes / (ms * 1e6), 100.0 * bytes / (ms * 1e6) / copy_gbs);
}

double copy_gbs(const DeviceContext& ctx) {
  const size_t bytes = size_t{1} << 30;
  DeviceBuffer a(bytes), b(bytes);
  const double ms = time_ms(ctx, 1, [&](int) {
    TERN_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, ctx.stream()));
  });
  return 2.0 * static_cast<double>(bytes) / (ms * 1e6);
}

int bench_main() {
  DeviceContext ctx;
  std::printf("device: %s (cc %d.%d), %d SMs; Hk=%lld Hv=%lld dk=%lld dv=%lld conv kernel %lld; chunk %lld rows\n",
              ctx.props().name.c_str(), ctx.props().cc_major, ctx.props().cc_minor, ctx.props().num_sms,
              static_cast<long long>(kHk), static_cast<long long>(kHv), static_cast<long long>(kDk),
              static_cast<long long>(kDv), static_cast<long long>(kConvKernel),
              static_cast<long long>(gdn_chunked_chunk_len(ctx.props(), kDk)));
  const double copy = copy_gbs(ctx);
  std::printf("device-to-device cudaMemcpyAsync: %.0f GB/s (bytes read + written)\n\n", copy);
  const Weights w = make_weights();
  std::mt19937 rng(7);
  for (int64_t seqs : {1, 2, 4, 8, 16, 32, 64, 128, 256}) bench_delta(ctx, w, seqs, 1, GdnVariant::kAuto, copy, rng);
  for (const GdnVariant v : {GdnVariant::kChunked, GdnVariant::kRecurrent}) bench_delta(ctx, w, 1, 4096, v, copy, rng);
  bench_delta(ctx, w, 8, 512, GdnVariant::kChunked, copy, rng);
  for (int64_t seqs : {1, 64, 256}) bench_conv(ctx, w, seqs, 1, copy, rng);
  bench_conv(ctx, w, 1, 4096, copy, rng);
  return 0;
}

}  // namespace
}  // namespace tern

int main() { return tern::bench_main(); }
