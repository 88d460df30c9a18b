// Time of one Sampler::sample call on a 248320-token row (Qwen3.5's padded vocabulary), per configuration.
// The CPU sampler is the reference path; these numbers show what one decode step per sequence costs on it.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "kernels/cpu/sampler.h"

namespace tern {
namespace {

constexpr size_t kVocab = 248320;

std::vector<float> bench_row() {
  std::mt19937 gen(1);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> row(kVocab);
  for (float& x : row) x = normal(gen);
  return row;
}

void run_sampler(benchmark::State& state, const SamplingParams& params) {
  const std::vector<float> row = bench_row();
  std::vector<int32_t> prompt(2000), output(500);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919) % kVocab);
  for (size_t i = 0; i < output.size(); ++i) output[i] = static_cast<int32_t>((i * 104729) % kVocab);
  Sampler sampler(params);
  for (auto _ : state) {
    auto token = sampler.sample(row, prompt, output);
    if (!token) state.SkipWithError(token.error().message.c_str());
    benchmark::DoNotOptimize(token);
  }
}

void BM_Greedy(benchmark::State& s) {
  run_sampler(s, {.temperature = 0.0f});
}
void BM_Temperature(benchmark::State& s) {
  run_sampler(s, {.temperature = 0.7f, .seed = 1});
}
void BM_TopK20(benchmark::State& s) {
  run_sampler(s, {.temperature = 0.7f, .top_k = 20, .seed = 1});
}
void BM_TopP095(benchmark::State& s) {
  run_sampler(s, {.temperature = 0.7f, .top_p = 0.95f, .seed = 1});
}
void BM_TopKTopPMinP(benchmark::State& s) {
  run_sampler(s, {.temperature = 0.6f, .top_k = 20, .top_p = 0.95f, .min_p = 0.05f, .seed = 1});
}
void BM_PenaltiesLogprobs(benchmark::State& s) {
  run_sampler(s, {.temperature = 0.7f,
                  .top_p = 0.9f,
                  .repetition_penalty = 1.1f,
                  .presence_penalty = 0.5f,
                  .frequency_penalty = 0.2f,
                  .seed = 1,
                  .logprobs = 20});
}

BENCHMARK(BM_Greedy)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Temperature)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TopK20)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TopP095)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TopKTopPMinP)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PenaltiesLogprobs)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace tern

BENCHMARK_MAIN();
