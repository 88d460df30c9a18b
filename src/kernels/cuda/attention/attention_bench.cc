// Paged attention timings on one GPU. Plain main (not run by ctest):
//   attention_bench [--quick | --prefill]
// decode: 1..128 sequences with one new token each over 1042..32k cached tokens (--quick: 64 and 128 x 1042, 64 and
// 1 x 32k, for 32/8 heads of 128 and 32/2 heads of 256); achieved GB/s of K and V read, next to the bandwidth of the
// copy kernel (roofline.h, bytes read + written) of the same run as the ceiling. Successive calls read disjoint
// regions of a large pool so small batches are not served from the L2.
// prefill: 4096 new tokens (one prompt, and two of 2048), causal, on mma.sync (kPrefillMma) and on what kPrefill
// takes (the wgmma kernel on sm_90a); TFLOP/s counting 4 * head_dim FLOPs per (query, visible key, head) for q.k and
// p.v. --prefill: only those, at the model shapes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/formats.h"
#include "kernels/cuda/attention/attention.h"
#include "kernels/cuda/roofline.h"

namespace tern {
namespace {

constexpr int kCalls = 20;

// Milliseconds per call of launch(i) over kCalls calls after one warm-up round.
double time_ms(const DeviceContext& ctx, const std::function<void(int)>& launch) {
  for (int i = 0; i < kCalls; ++i) launch(i);
  cudaEvent_t start, stop;
  TERN_CUDA_CHECK(cudaEventCreate(&start));
  TERN_CUDA_CHECK(cudaEventCreate(&stop));
  TERN_CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
  for (int i = 0; i < kCalls; ++i) launch(i);
  TERN_CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
  TERN_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  TERN_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  TERN_CUDA_CHECK(cudaEventDestroy(start));
  TERN_CUDA_CHECK(cudaEventDestroy(stop));
  return ms / kCalls;
}

double copy_gbs(const DeviceContext& ctx) {
  const size_t bytes = size_t{1} << 30;
  DeviceBuffer a(bytes), b(bytes);
  const double ms =
      time_ms(ctx, [&](int) { bench_copy_launch(a.data(), b.data(), bytes, ctx.props().num_sms, ctx.stream()); });
  return 2.0 * static_cast<double>(bytes) / (ms * 1e6);
}

struct HeadConfig {
  int64_t n_heads, n_kv_heads, head_dim;
};

// A pool of `tokens` slots, filled with small bf16 values (0x3C3C ~ 0.0115): timing does not depend on them.
struct Pool {
  PagedKvCache cache;
  DeviceBuffer k, v;
};

Pool make_pool(const HeadConfig& h, int64_t tokens, int64_t block_size) {
  Pool p;
  const size_t bytes = static_cast<size_t>(tokens * h.n_kv_heads * h.head_dim * 2);
  p.k = DeviceBuffer(bytes);
  p.v = DeviceBuffer(bytes);
  TERN_CUDA_CHECK(cudaMemset(p.k.data(), 0x3C, bytes));
  TERN_CUDA_CHECK(cudaMemset(p.v.data(), 0x3C, bytes));
  p.cache = {.k = p.k.as<uint16_t>(),
             .v = p.v.as<uint16_t>(),
             .n_blocks = tokens / block_size,
             .block_size = block_size,
             .n_kv_heads = h.n_kv_heads,
             .head_dim = h.head_dim};
  return p;
}

template <class T>
DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer b(std::max<size_t>(host.size() * sizeof(T), 16));
  TERN_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}

// One batch of n_seqs sequences of past + n_q tokens each, its blocks starting at `first_block` of the pool.
struct BatchMeta {
  DeviceBuffer tables, starts, lens;
  int64_t max_blocks;
};

BatchMeta make_meta(int64_t n_seqs, int64_t n_q, int64_t seq_len, int64_t block_size, int64_t first_block) {
  const int64_t max_blocks = (seq_len + block_size - 1) / block_size;
  std::vector<int32_t> tables, starts, lens;
  for (int64_t s = 0; s <= n_seqs; ++s) starts.push_back(static_cast<int32_t>(s * n_q));
  for (int64_t s = 0; s < n_seqs; ++s) {
    lens.push_back(static_cast<int32_t>(seq_len));
    for (int64_t b = 0; b < max_blocks; ++b) tables.push_back(static_cast<int32_t>(first_block + s * max_blocks + b));
  }
  return {upload(tables), upload(starts), upload(lens), max_blocks};
}

// Times paged_attention over `n_regions` disjoint batches of the pool; returns ms per call.
double time_attention(const DeviceContext& ctx, const Pool& pool, const HeadConfig& h, int64_t n_seqs, int64_t n_q,
                      int64_t seq_len, AttentionVariant variant) {
  const int64_t bs = pool.cache.block_size, blocks = n_seqs * ((seq_len + bs - 1) / bs);
  const int64_t n_regions = std::clamp<int64_t>(pool.cache.n_blocks / blocks, 1, 8);
  std::vector<BatchMeta> metas;
  for (int64_t r = 0; r < n_regions; ++r) metas.push_back(make_meta(n_seqs, n_q, seq_len, bs, r * blocks));
  const int64_t tokens = n_seqs * n_q, width = h.n_heads * h.head_dim;
  std::vector<uint16_t> q_host(static_cast<size_t>(tokens * width), float_to_bf16(0.5f));
  const DeviceBuffer q = upload(q_host);
  DeviceBuffer out(static_cast<size_t>(tokens * width * 2));
  const size_t ws_bytes = paged_attention_workspace_bytes(ctx.props(), tokens, h.n_heads, h.head_dim, seq_len);
  DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
  return time_ms(ctx, [&](int i) {
    const BatchMeta& m = metas[i % n_regions];
    const PagedAttentionArgs a{.q = q.as<uint16_t>(),
                               .out = out.as<uint16_t>(),
                               .cache = pool.cache,
                               .block_tables = m.tables.as<int32_t>(),
                               .max_blocks_per_seq = m.max_blocks,
                               .query_start = m.starts.as<int32_t>(),
                               .seq_lens = m.lens.as<int32_t>(),
                               .n_seqs = n_seqs,
                               .tokens = tokens,
                               .n_heads = h.n_heads,
                               .max_query_len = n_q,
                               .max_seq_len = seq_len,
                               .scale = 0.08f,
                               .workspace = ws.data(),
                               .workspace_bytes = ws_bytes};
    if (auto r = paged_attention(ctx, a, variant); !r) {
      std::fprintf(stderr, "%s\n", r.error().message.c_str());
      std::abort();
    }
  });
}

struct DecodeCase {
  int64_t n_seqs, ctx_len;
};

void bench_decode(const DeviceContext& ctx, const HeadConfig& h, const std::vector<DecodeCase>& cases, double copy) {
  constexpr int64_t kPoolTokens = int64_t{128} * 32768, kBlockSize = 16;
  const Pool pool = make_pool(h, kPoolTokens, kBlockSize);
  for (const DecodeCase& c : cases) {
    if (c.n_seqs * c.ctx_len > kPoolTokens) continue;
    const double ms = time_attention(ctx, pool, h, c.n_seqs, 1, c.ctx_len, AttentionVariant::kDecode);
    const double bytes = 2.0 * 2.0 * static_cast<double>(c.n_seqs * c.ctx_len * h.n_kv_heads * h.head_dim);
    const double gbs = bytes / (ms * 1e6);
    std::printf("decode  %2lld/%lld x %3lld | seqs %3lld ctx %6lld | %9.1f us %7.0f GB/s %5.1f%% of copy\n",
                static_cast<long long>(h.n_heads), static_cast<long long>(h.n_kv_heads),
                static_cast<long long>(h.head_dim), static_cast<long long>(c.n_seqs), static_cast<long long>(c.ctx_len),
                ms * 1e3, gbs, 100.0 * gbs / copy);
    std::fflush(stdout);
  }
}

void bench_prefill(const DeviceContext& ctx, const HeadConfig& h) {
  const Pool pool = make_pool(h, 8 * 4096, 16);
  for (int64_t n_seqs : {int64_t{1}, int64_t{2}}) {
    for (const AttentionVariant v : {AttentionVariant::kPrefillMma, AttentionVariant::kPrefill}) {
      const int64_t n_q = 4096 / n_seqs;
      const double ms = time_attention(ctx, pool, h, n_seqs, n_q, n_q, v);
      // Query i sees i + 1 keys.
      const double flops = 4.0 * static_cast<double>(h.n_heads * h.head_dim) * n_seqs * (n_q * (n_q + 1) / 2.0);
      const bool wgmma = v == AttentionVariant::kPrefill && attention_prefill_sm90_fits(ctx.props(), h.head_dim);
      const std::string kernel = wgmma ? "wgmma" : "mma.sync";
      std::printf("prefill %-8s %2lld/%lld x %3lld | seqs %3lld x %4lld tokens | %9.1f us %7.1f TFLOP/s\n",
                  kernel.c_str(), static_cast<long long>(h.n_heads), static_cast<long long>(h.n_kv_heads),
                  static_cast<long long>(h.head_dim), static_cast<long long>(n_seqs), static_cast<long long>(n_q),
                  ms * 1e3, flops / (ms * 1e9));
      std::fflush(stdout);
    }
  }
}

int bench_main(bool quick, bool prefill_only) {
  DeviceContext ctx;
  const DeviceProps& p = ctx.props();
  std::printf("device: %s (cc %d.%d), %d SMs, L2 %d MiB, smem/block opt-in %zu KiB\n", p.name.c_str(), p.cc_major,
              p.cc_minor, p.num_sms, p.l2_bytes >> 20, p.shared_mem_per_block_optin >> 10);
  if (prefill_only) {  // the model shapes: Qwen3-8B (32/8 heads of 128), Qwen3.5-35B-A3B (16/2 of 256)
    for (const HeadConfig& h : {HeadConfig{32, 8, 128}, HeadConfig{16, 2, 256}, HeadConfig{32, 2, 256}}) {
      bench_prefill(ctx, h);
    }
    return 0;
  }
  const double copy = copy_gbs(ctx);
  std::printf("copy kernel (bytes read + written): %.0f GB/s\n\n", copy);
  // 1042 cached tokens: a 1k-token prompt a few steps into its answer.
  const std::vector<DecodeCase> quick_cases = {{64, 1042}, {128, 1042}, {64, 32768}, {1, 32768}};
  std::vector<DecodeCase> all_cases;
  for (int64_t ctx_len : {int64_t{1042}, int64_t{4096}, int64_t{16384}, int64_t{32768}}) {
    for (int64_t n : {int64_t{1}, int64_t{8}, int64_t{16}, int64_t{32}, int64_t{64}, int64_t{128}}) {
      all_cases.push_back({n, ctx_len});
    }
  }
  const std::vector<HeadConfig> configs = quick ? std::vector<HeadConfig>{{32, 8, 128}, {32, 2, 256}}
                                                : std::vector<HeadConfig>{{32, 8, 128}, {32, 2, 256}, {64, 4, 128}};
  for (const HeadConfig& h : configs) bench_decode(ctx, h, quick ? quick_cases : all_cases, copy);
  for (const HeadConfig& h : configs) bench_prefill(ctx, h);
  return 0;
}

}  // namespace
}  // namespace tern

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const bool prefill_only = argc > 1 && std::strcmp(argv[1], "--prefill") == 0;
  return tern::bench_main(quick, prefill_only);
}
