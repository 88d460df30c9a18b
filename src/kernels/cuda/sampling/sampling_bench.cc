// Sampling timings on one GPU at Qwen's vocabulary (151,936): time per sample_rows call for 1, 8, 64 and 256 rows
// under a few parameter sets, and the bandwidth of the one compulsory read of the bf16 logits against the device's
// memory bandwidth (~4.8 TB/s on an H200). Plain main (not run by ctest):
//   sampling_bench
// Each timing is a CUDA graph of back-to-back calls whose logits rotate over 512 MiB of copies (beyond the L2, as
// logits fresh from the LM head would mostly be), replayed after a warm-up; the median replay is reported.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/formats.h"
#include "kernels/cuda/bench_timing.h"
#include "kernels/cuda/sampling/sampling.h"

namespace tern {
namespace {

constexpr int64_t kVocab = 151936;
constexpr size_t kRotateBytes = size_t{512} << 20;

double time_ms(const DeviceContext& ctx, int n_slots, const std::function<void(int)>& launch) {
  return bench_time_ms(ctx, n_slots, std::max(n_slots, 20), launch);
}

struct Config {
  const char* name;
  SamplingParams params;
  int n_penalty_ids;  // per row, half prompt half output
};

void bench_rows(const DeviceContext& ctx, const Config& config, int64_t rows, const DeviceBuffer& logits,
                double peak_gbs) {
  const size_t row_bytes = static_cast<size_t>(kVocab) * 2;
  const int n_slots = static_cast<int>(std::clamp<size_t>(kRotateBytes / (row_bytes * rows), 1, 256));
  std::mt19937 gen(7);
  std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(kVocab - 1));
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<SamplingRow> host_rows;
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < rows; ++r) {
    const auto begin = static_cast<int32_t>(ids.size());
    for (int i = 0; i < config.n_penalty_ids; ++i) ids.push_back(any(gen));
    const auto end = static_cast<int32_t>(ids.size());
    host_rows.push_back(sampling_row_make(config.params, unit(gen), begin, begin + (end - begin) / 2, end));
  }
  ids.push_back(0);
  DeviceBuffer d_rows(host_rows.size() * sizeof(SamplingRow)), d_ids(ids.size() * 4);
  DeviceBuffer d_id(rows * 4), d_lp(rows * 4), d_top_ids(rows * kSampleMaxTopLogprobs * 4),
      d_top_lp(rows * kSampleMaxTopLogprobs * 4), d_status(rows * 4), d_ws(sampling_workspace_bytes(rows, kVocab));
  TERN_CUDA_CHECK(cudaMemcpy(d_rows.data(), host_rows.data(), d_rows.size_bytes(), cudaMemcpyHostToDevice));
  TERN_CUDA_CHECK(cudaMemcpy(d_ids.data(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  SampleArgs args{.logits = logits.as<uint16_t>(), .logits_stride = kVocab, .rows_params = d_rows.as<SamplingRow>(),
                  .penalty_ids = d_ids.as<int32_t>(), .rows = rows, .vocab = kVocab, .out_id = d_id.as<int32_t>(),
                  .out_logprob = d_lp.as<float>(), .out_top_ids = d_top_ids.as<int32_t>(),
                  .out_top_logprobs = d_top_lp.as<float>(), .out_status = d_status.as<int32_t>(),
                  .workspace = d_ws.data(), .workspace_bytes = d_ws.size_bytes()};
  const auto check = sample_rows(ctx, args);  // once outside the graph, so an argument error is reported
  if (!check) {
    std::fprintf(stderr, "sample_rows: %s\n", check.error().message.c_str());
    std::exit(1);
  }
  const double ms = time_ms(ctx, n_slots, [&](int slot) {
    SampleArgs a = args;
    a.logits = logits.as<uint16_t>() + static_cast<size_t>(slot) * rows * kVocab;
    (void)sample_rows(ctx, a);
  });
  const double gbs = static_cast<double>(row_bytes * rows) / (ms * 1e6);
  std::printf("%-34s rows %4lld  %9.1f us  %8.1f GB/s  %5.1f%% of %.0f GB/s\n", config.name,
              static_cast<long long>(rows), ms * 1e3, gbs, 100.0 * gbs / peak_gbs, peak_gbs);
}

// The device's memory bandwidth from its bus width and clock (DDR), or the H200's 4.8 TB/s where the runtime no
// longer reports the clock.
double peak_bandwidth_gbs(const DeviceProps& p) {
  if (p.memory_clock_khz <= 0 || p.memory_bus_bits <= 0) return 4800.0;
  return 2.0 * p.memory_clock_khz * 1e3 * (p.memory_bus_bits / 8.0) / 1e9;
}

}  // namespace
}  // namespace tern

int main() {
  using namespace tern;
  DeviceContext ctx;
  const double peak = peak_bandwidth_gbs(ctx.props());
  std::printf("%s, vocab %lld\n", ctx.props().name.c_str(), static_cast<long long>(kVocab));
  // 512 MiB of bf16 logits: a language-model-like body N(0, 2.5) with a few strong tokens per row.
  const size_t n_values = kRotateBytes / 2;
  std::vector<uint16_t> host(n_values);
  std::mt19937 gen(1);
  std::normal_distribution<float> body(0.0f, 2.5f);
  for (size_t i = 0; i < n_values; ++i) host[i] = float_to_bf16(i % 9973 == 0 ? 14.0f : body(gen));
  DeviceBuffer logits(kRotateBytes);
  TERN_CUDA_CHECK(cudaMemcpy(logits.data(), host.data(), kRotateBytes, cudaMemcpyHostToDevice));
  const Config configs[] = {
      {"greedy", {.temperature = 0.0f}, 0},
      {"T 0.7 top_p 0.9", {.temperature = 0.7f, .top_p = 0.9f}, 0},
      {"T 1 top_k 50 top_p 0.95 min_p 0.05", {.top_k = 50, .top_p = 0.95f, .min_p = 0.05f}, 0},
      {"T 0.8 top_p 0.95 + penalties", {.temperature = 0.8f, .top_p = 0.95f, .repetition_penalty = 1.1f,
                                        .presence_penalty = 0.5f, .frequency_penalty = 0.2f}, 512},
      {"T 1 + 5 logprobs", {.logprobs = 5}, 0},
  };
  for (const Config& config : configs) {
    for (int64_t rows : {1, 8, 64, 256}) bench_rows(ctx, config, rows, logits, peak);
  }
  return 0;
}
