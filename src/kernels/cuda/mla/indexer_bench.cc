// DSA lightning indexer timings on one GPU at GLM-5's shapes (32 index heads of 128, topk 2048). Plain main (not run
// by ctest):
//   mla_indexer_bench [--blocks]
// decode: indexer_select of one layer for 1, 4, 16 and 64 rows (one new token per sequence) at contexts 8k, 32k and
// 128k, with the score kernel and the top-k also timed alone. Every sequence has its own keys in a pool larger than
// the L2, so they come from memory. Bytes counted per call: the keys (head_dim * 2 bytes per key and row), queries
// and weights read, the fp32 scores written and read once (what an ideal pair of kernels moves), the selection
// written; achieved GB/s next to the copy kernel's (roofline.h, bytes read + written) of the same run as the
// ceiling. --blocks: the top-k also at each forced count of blocks per row (IndexerSelectArgs::topk_blocks; the
// rule's count marked *).
// prefill: 1024 rows continuing a 7168-token prefix (one sequence, so its keys are shared through the L2); TFLOP/s
// counting 2 * n_heads * head_dim FLOPs per (row, causal key).
// Timings are medians of CUDA graph replays (bench_timing.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "core/formats.h"
#include "kernels/cuda/bench_timing.h"
#include "kernels/cuda/mla/indexer.h"
#include "kernels/cuda/roofline.h"

namespace tern {
namespace {

constexpr int64_t kHeads = 32, kHeadDim = 128, kTopk = 2048, kBlockSize = 64;
constexpr int64_t kMaxRows = 64, kMaxContext = 131072;
constexpr int kCalls = 10;

template <class T>
DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer b(std::max<size_t>(host.size() * sizeof(T), 16));
  if (!host.empty()) b.upload(host.data(), host.size() * sizeof(T));
  return b;
}

// Uniform bf16 values in [-1, 1) from a xorshift generator (fast enough for tens of millions of values).
std::vector<uint16_t> random_bf16(size_t n, uint64_t seed) {
  std::vector<uint16_t> out(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v = float_to_bf16(static_cast<float>(x >> 40) / static_cast<float>(1 << 23) - 1.0f);
  }
  return out;
}

void check(const Expected<void>& r) {
  if (!r) {
    std::fprintf(stderr, "%s\n", r.error().message.c_str());
    std::abort();
  }
}

// kMaxRows sequences of kMaxContext keys each, sequence s in blocks [s * per_seq, (s + 1) * per_seq) of the pool.
struct Pool {
  DeviceBuffer keys, tables;
  PagedIndexerKeys cache;
  int64_t blocks_per_seq = 0;
};

Pool make_pool() {
  Pool p;
  const size_t seq_values = static_cast<size_t>(kMaxContext * kHeadDim);
  p.keys = DeviceBuffer(seq_values * kMaxRows * 2);
  const std::vector<uint16_t> one = random_bf16(seq_values, 7);
  p.keys.upload(one.data(), seq_values * 2);
  for (int64_t s = 1; s < kMaxRows; ++s) {  // the same values, at other addresses: each row reads its own keys
    TERN_CUDA_CHECK(
        cudaMemcpy(p.keys.as<uint16_t>() + s * seq_values, p.keys.data(), seq_values * 2, cudaMemcpyDeviceToDevice));
  }
  // The copies ran on the legacy stream, which the context's stream does not wait for.
  TERN_CUDA_CHECK(cudaDeviceSynchronize());
  p.blocks_per_seq = kMaxContext / kBlockSize;
  std::vector<int32_t> tables(static_cast<size_t>(kMaxRows * p.blocks_per_seq));
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i);
  p.tables = upload(tables);
  p.cache = {.k = p.keys.as<uint16_t>(),
             .n_blocks = kMaxRows * p.blocks_per_seq,
             .block_size = kBlockSize,
             .head_dim = kHeadDim};
  return p;
}

struct Step {
  DeviceBuffer q, weights, starts, lens, workspace, selected;
  IndexerSelectArgs args;
};

// n_seqs sequences of seq_len cached tokens, rows_per_seq new rows each.
Step make_step(const Pool& pool, int64_t n_seqs, int64_t rows_per_seq, int64_t seq_len) {
  Step s;
  const int64_t tokens = n_seqs * rows_per_seq;
  s.q = upload(random_bf16(static_cast<size_t>(tokens * kHeads * kHeadDim), 11));
  s.weights = upload(random_bf16(static_cast<size_t>(tokens * kHeads), 13));
  std::vector<int32_t> starts, lens;
  for (int64_t i = 0; i <= n_seqs; ++i) starts.push_back(static_cast<int32_t>(i * rows_per_seq));
  for (int64_t i = 0; i < n_seqs; ++i) lens.push_back(static_cast<int32_t>(seq_len));
  s.starts = upload(starts);
  s.lens = upload(lens);
  const size_t ws_bytes = indexer_select_workspace_bytes(tokens, seq_len);
  s.workspace = DeviceBuffer(ws_bytes);
  s.selected = DeviceBuffer(static_cast<size_t>(tokens * kTopk * 4));
  s.args = {.q = s.q.as<uint16_t>(),
            .weights = s.weights.as<uint16_t>(),
            .weights_stride = kHeads,
            .cache = pool.cache,
            .block_tables = pool.tables.as<int32_t>(),
            .max_blocks_per_seq = pool.blocks_per_seq,
            .query_start = s.starts.as<int32_t>(),
            .seq_lens = s.lens.as<int32_t>(),
            .n_seqs = n_seqs,
            .tokens = tokens,
            .n_heads = kHeads,
            .head_dim = kHeadDim,
            .topk = kTopk,
            .max_seq_len = seq_len,
            .workspace = s.workspace.data(),
            .workspace_bytes = ws_bytes,
            .selected = s.selected.as<int32_t>()};
  return s;
}

struct Times {
  double scores_ms, topk_ms, select_ms;
};

Times time_step(const DeviceContext& ctx, const Step& s) {
  check(indexer_select(ctx, s.args));  // validates once; the parts below launch unchecked
  TERN_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
  Times t{};
  t.scores_ms = bench_time_ms(ctx, 1, kCalls, [&](int) { indexer_scores_launch(ctx, s.args); });
  t.topk_ms = bench_time_ms(ctx, 1, kCalls, [&](int) { indexer_topk_launch(ctx, s.args); });
  t.select_ms = bench_time_ms(ctx, 1, kCalls, [&](int) { check(indexer_select(ctx, s.args)); });
  return t;
}

int bench_main(bool sweep) {
  DeviceContext ctx;
  const DeviceProps& p = ctx.props();
  std::printf("device: %s (cc %d.%d), %d SMs, L2 %d MiB, smem/block opt-in %zu KiB\n", p.name.c_str(), p.cc_major,
              p.cc_minor, p.num_sms, p.l2_bytes >> 20, p.shared_mem_per_block_optin >> 10);
  const IndexerSelectTiles tiles = indexer_select_tiles(p, kHeadDim, kHeads);
  std::printf("score tiles: %d stage(s), %zu bytes of shared memory, %d blocks per SM planned\n", tiles.stages,
              tiles.smem_bytes, tiles.blocks_per_sm);
  const size_t copy_bytes = size_t{1} << 30;
  double copy_gbs = 0.0;
  {
    DeviceBuffer a(copy_bytes), b(copy_bytes);
    const double ms = bench_time_ms(
        ctx, 1, kCalls, [&](int) { bench_copy_launch(a.data(), b.data(), copy_bytes, p.num_sms, ctx.stream()); });
    copy_gbs = 2.0 * static_cast<double>(copy_bytes) / (ms * 1e6);
  }
  std::printf("copy kernel (bytes read + written): %.0f GB/s\n", copy_gbs);
  std::printf("GLM-5 indexer: %lld heads of %lld, topk %lld, block size %lld\n\n", static_cast<long long>(kHeads),
              static_cast<long long>(kHeadDim), static_cast<long long>(kTopk), static_cast<long long>(kBlockSize));
  std::fflush(stdout);

  const Pool pool = make_pool();
  for (int64_t context : {int64_t{8192}, int64_t{32768}, int64_t{131072}}) {
    for (int64_t rows : {int64_t{1}, int64_t{4}, int64_t{16}, int64_t{64}}) {
      Step s = make_step(pool, rows, 1, context);
      const Times t = time_step(ctx, s);
      const double n = static_cast<double>(rows * context);
      const double key_bytes = n * kHeadDim * 2;
      const double bytes = key_bytes + static_cast<double>(rows * kHeads * (kHeadDim + 1) * 2) + n * 4 * 2 +
                           static_cast<double>(rows * kTopk * 4);
      const double gbs = bytes / (t.select_ms * 1e6);
      std::printf(
          "decode rows %3lld ctx %6lld | scores %8.1f us  topk %8.1f us  select %8.1f us | keys %7.1f MB  total "
          "%7.1f MB | %6.0f GB/s %5.1f%% of copy\n",
          static_cast<long long>(rows), static_cast<long long>(context), t.scores_ms * 1e3, t.topk_ms * 1e3,
          t.select_ms * 1e3, key_bytes / 1e6, bytes / 1e6, gbs, 100.0 * gbs / copy_gbs);
      const int64_t rule = indexer_topk_blocks(p, rows, context);
      for (int64_t blocks = 1; sweep && blocks <= 8; blocks *= 2) {
        s.args.topk_blocks = blocks;
        check(indexer_select(ctx, s.args));
        TERN_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
        const double ms = bench_time_ms(ctx, 1, kCalls, [&](int) { indexer_topk_launch(ctx, s.args); });
        std::printf("    topk blocks per row %lld%s | %8.1f us\n", static_cast<long long>(blocks),
                    blocks == rule ? "*" : " ", ms * 1e3);
      }
      std::fflush(stdout);
    }
  }

  constexpr int64_t kPrefillRows = 1024, kPrefillPast = 7168;
  const Step s = make_step(pool, 1, kPrefillRows, kPrefillPast + kPrefillRows);
  const Times t = time_step(ctx, s);
  double keys = 0.0;  // sum over rows of the causal keys
  for (int64_t r = 0; r < kPrefillRows; ++r) keys += static_cast<double>(kPrefillPast + r + 1);
  const double flops = 2.0 * kHeads * kHeadDim * keys;
  std::printf(
      "prefill rows %4lld after %lld | scores %8.1f us  topk %8.1f us  select %8.1f us | %6.1f TFLOP/s (scores)\n",
      static_cast<long long>(kPrefillRows), static_cast<long long>(kPrefillPast), t.scores_ms * 1e3, t.topk_ms * 1e3,
      t.select_ms * 1e3, flops / (t.scores_ms * 1e9));
  return 0;
}

}  // namespace
}  // namespace tern

int main(int argc, char** argv) {
  const bool sweep = argc > 1 && std::string_view(argv[1]) == "--blocks";
  if (argc > 1 && !sweep) {
    std::fprintf(stderr, "usage: mla_indexer_bench [--blocks]\n");
    return 2;
  }
  return tern::bench_main(sweep);
}
