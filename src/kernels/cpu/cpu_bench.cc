// Memory bandwidth of this machine (copy and read, all threads) next to the decode-shaped matmuls (one activation
// row against a weight matrix that does not fit in cache), so matmul GB/s can be read against the machine's limit.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/formats.h"
#include "core/nvfp4.h"
#include "kernels/cpu/matmul.h"

namespace tern {
namespace {

constexpr size_t kBytes = size_t{512} << 20;

void BM_MemoryCopy(benchmark::State& state) {
  std::vector<char> src(kBytes, 1), dst(kBytes, 0);
  for (auto _ : state) {
#pragma omp parallel
    {
      const size_t n = kBytes / static_cast<size_t>(omp_get_num_threads());
      const size_t begin = n * static_cast<size_t>(omp_get_thread_num());
      std::memcpy(dst.data() + begin, src.data() + begin, n);
    }
    benchmark::ClobberMemory();
  }
  // read + write
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * 2 * kBytes));
}
BENCHMARK(BM_MemoryCopy)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_MemoryRead(benchmark::State& state) {
  std::vector<uint64_t> src(kBytes / 8, 3);
  for (auto _ : state) {
    uint64_t total = 0;
#pragma omp parallel for reduction(+ : total) schedule(static)
    for (size_t i = 0; i < src.size(); ++i) total += src[i];
    benchmark::DoNotOptimize(total);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
}
BENCHMARK(BM_MemoryRead)->Unit(benchmark::kMillisecond)->UseRealTime();

// y[1, n] = x[1, k] . W^T over a 3072 x 1024 weight, 28 copies so the set exceeds the caches (a 0.6B model's MLPs).
void BM_DecodeMatmul(benchmark::State& state) {
  const bool nvfp4 = state.range(0) == 1;
  const int64_t n = 3072, k = 1024, copies = 28;
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<float> w(n * k), x(k), y(n);
  for (float& v : w) v = dist(rng);
  for (float& v : x) v = dist(rng);
  std::vector<std::vector<uint16_t>> bf16(copies);
  std::vector<Nvfp4Matrix> q(copies);
  for (int64_t c = 0; c < copies; ++c) {
    if (nvfp4) {
      q[c] = nvfp4_quantize_weight(w, n, k);
    } else {
      bf16[c].resize(w.size());
      for (size_t i = 0; i < w.size(); ++i) bf16[c][i] = float_to_bf16(w[i]);
    }
  }
  int64_t bytes = 0;
  for (auto _ : state) {
    for (int64_t c = 0; c < copies; ++c) {
      const CpuMatrix m = nvfp4 ? CpuMatrix{CpuWeightFormat::kNvfp4, n, k, q[c].packed.data(),
                                            q[c].block_scales.data(), q[c].global_scale}
                                : CpuMatrix{CpuWeightFormat::kBf16, n, k, bf16[c].data()};
      cpu_matmul(x.data(), 1, m, y.data());
      bytes += nvfp4 ? n * k / 2 + n * k / 16 : n * k * 2;
    }
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(bytes);
  state.SetLabel(nvfp4 ? "nvfp4" : "bf16");
}
BENCHMARK(BM_DecodeMatmul)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace tern

BENCHMARK_MAIN();
