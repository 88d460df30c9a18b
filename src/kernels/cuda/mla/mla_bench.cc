// Absorbed MLA decode attention (mla_attention) on one GPU at GLM-5's latent (512 + 64 values) and head counts of
// one rank at TP8 (8 heads) and of the whole model (64), for 1, 4, 16 and 64 sequences of 4k context, causal and
// over a DSA selection of 2048 keys. Plain main (not run by ctest):
//   mla_bench [--splits] [--fp8]
// Bytes counted per call: each sequence's latent rows read once (what an ideal kernel reads; this one reads them
// once per 16-head group, through the L2), the queries read and the outputs written; achieved GB/s next to the copy
// kernel's (roofline.h, bytes read + written) of the same run as the ceiling. Every sequence has its own blocks in a
// pool larger than the L2. Timings are medians of CUDA graph replays (bench_timing.h). --splits: each row also at
// every power-of-two split-K count the workspace bound allows (MlaAttentionArgs::splits; the rule's count marked *).
// --fp8: the cache in FP8 entries (656 bytes per token, core/latent_fp8.h) instead of bf16 (1152).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

#include "kernels/cuda/bench_timing.h"
#include "kernels/cuda/mla/mla.h"
#include "kernels/cuda/roofline.h"

namespace tern {
namespace {

constexpr int64_t kLora = 512, kRope = 64, kWidth = kLora + kRope, kBlockSize = 64, kContext = 4096, kTopk = 2048;
constexpr int kCalls = 10;

template <class T>
DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer b(std::max<size_t>(host.size() * sizeof(T), 16));
  if (!host.empty()) b.upload(host.data(), host.size() * sizeof(T));
  return b;
}

std::vector<uint16_t> random_bf16(size_t n, uint32_t seed) {
  std::vector<uint16_t> out(n);
  uint32_t s = seed;
  for (auto& v : out) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    v = static_cast<uint16_t>(0x3C00u | (s & 0x83FFu));  // magnitudes in [2^-7, 2^-3), random sign
  }
  return out;
}

// FP8 entries: finite random codes (not the NaN codes 0x7F / 0xFF), each tile's scale 2^-6, random bf16 k_pe.
std::vector<uint8_t> random_fp8_entries(int64_t tokens, uint32_t seed) {
  const int64_t entry = latent_fp8_bytes(kLora, kRope), pe_at = kLora + 4 * (kLora / kLatentFp8Tile);
  std::vector<uint8_t> out(static_cast<size_t>(tokens * entry));
  const std::vector<uint16_t> pe = random_bf16(static_cast<size_t>(tokens * kRope), seed + 1);
  uint32_t s = seed;
  const float scale = 0x1p-6f;
  for (int64_t t = 0; t < tokens; ++t) {
    uint8_t* e = &out[t * entry];
    for (int64_t i = 0; i < kLora; ++i) {
      s ^= s << 13;
      s ^= s >> 17;
      s ^= s << 5;
      e[i] = static_cast<uint8_t>(s & 0xF7u);  // bit 3 clear: never 0x7F or 0xFF
    }
    for (int64_t i = 0; i < kLora / kLatentFp8Tile; ++i) std::memcpy(e + kLora + 4 * i, &scale, 4);
    std::memcpy(e + pe_at, &pe[t * kRope], 2 * kRope);
  }
  return out;
}

int run(bool sweep, bool fp8) {
  DeviceContext ctx;
  const DeviceProps& p = ctx.props();
  std::printf("device: %s (cc %d.%d), %d SMs\n", p.name.c_str(), p.cc_major, p.cc_minor, p.num_sms);
  const size_t copy_bytes = size_t{1} << 30;
  double copy_gbs = 0.0;
  {
    DeviceBuffer a(copy_bytes), b(copy_bytes);
    const double ms = bench_time_ms(
        ctx, 1, kCalls, [&](int) { bench_copy_launch(a.data(), b.data(), copy_bytes, p.num_sms, ctx.stream()); });
    copy_gbs = 2.0 * static_cast<double>(copy_bytes) / (ms * 1e6);
  }
  std::printf("copy kernel (bytes read + written): %.0f GB/s\n", copy_gbs);
  std::printf("GLM-5 latent %ld + %ld, block size %ld, context %ld\n", long(kLora), long(kRope), long(kBlockSize),
              long(kContext));
  constexpr int64_t kMaxSeqs = 64, kBlocksPerSeq = kContext / kBlockSize, kPoolBlocks = kMaxSeqs * kBlocksPerSeq;
  const DeviceBuffer pool = fp8 ? upload(random_fp8_entries(kPoolBlocks * kBlockSize, 7))
                                : upload(random_bf16(static_cast<size_t>(kPoolBlocks * kBlockSize * kWidth), 7));
  const int64_t key_bytes = fp8 ? latent_fp8_bytes(kLora, kRope) : 2 * kWidth;
  std::printf("cache: %s, %ld bytes per token\n", fp8 ? "fp8 entries" : "bf16", long(key_bytes));
  std::vector<int32_t> tables(static_cast<size_t>(kPoolBlocks));
  std::iota(tables.begin(), tables.end(), 0);
  const DeviceBuffer d_tables = upload(tables);
  const DeviceBuffer workspace(mla_attention_workspace_bytes(p, kLora));
  for (const int64_t seqs : {int64_t{1}, int64_t{4}, int64_t{16}, kMaxSeqs}) {
    std::vector<int32_t> query_start(seqs + 1), seq_lens(seqs, static_cast<int32_t>(kContext));
    std::iota(query_start.begin(), query_start.end(), 0);
    // Selections: every other key of the last 2 * topk positions.
    std::vector<int32_t> selected(static_cast<size_t>(seqs * kTopk));
    for (int64_t t = 0; t < seqs; ++t) {
      for (int64_t j = 0; j < kTopk; ++j) selected[t * kTopk + j] = static_cast<int32_t>(kContext - 2 * kTopk + 2 * j);
    }
    const DeviceBuffer d_qs = upload(query_start), d_lens = upload(seq_lens), d_sel = upload(selected);
    for (const int64_t heads : {int64_t{8}, int64_t{64}}) {
      const DeviceBuffer q = upload(random_bf16(static_cast<size_t>(seqs * heads * kWidth), 11));
      DeviceBuffer out(static_cast<size_t>(seqs * heads * kLora) * 2);
      for (const bool sparse : {false, true}) {
        const MlaAttentionArgs args{.q_latent = q.as<uint16_t>(),
                                    .out_latent = out.as<uint16_t>(),
                                    .cache = {.data = pool.data(),
                                              .n_blocks = kPoolBlocks,
                                              .block_size = kBlockSize,
                                              .kv_lora_rank = kLora,
                                              .rope_dim = kRope,
                                              .dtype = fp8 ? LatentCacheDtype::kFp8 : LatentCacheDtype::kBf16},
                                    .block_tables = d_tables.as<int32_t>(),
                                    .max_blocks_per_seq = kBlocksPerSeq,
                                    .query_start = d_qs.as<int32_t>(),
                                    .seq_lens = d_lens.as<int32_t>(),
                                    .n_seqs = seqs,
                                    .tokens = seqs,
                                    .n_heads = heads,
                                    .selected = sparse ? d_sel.as<int32_t>() : nullptr,
                                    .topk = sparse ? kTopk : 0,
                                    .scale = 0.0625f,
                                    .max_seq_len = kContext,
                                    .workspace = workspace.data(),
                                    .workspace_bytes = workspace.size_bytes()};
        if (auto r = mla_attention(ctx, args); !r) {
          std::fprintf(stderr, "mla_attention: %s\n", r.error().message.c_str());
          return 1;
        }
        const int64_t keys = sparse ? kTopk : kContext;
        const double bytes = static_cast<double>(seqs) * (keys * key_bytes + heads * (kWidth + kLora) * 2);
        const int64_t rule = mla_attention_splits(p, seqs, heads, keys, kWidth);
        // The launcher's split count, then (--splits) each other power of two the workspace bound allows.
        const int64_t blocks = seqs * ((heads + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock);
        std::vector<int64_t> counts{rule};
        for (int64_t c = 1; sweep && blocks * c < 3 * p.num_sms && c <= keys / kMlaKeysPerTile; c *= 2) {
          if (c != rule) counts.push_back(c);
        }
        for (const int64_t c : counts) {
          MlaAttentionArgs forced = args;
          forced.splits = c;
          if (auto r = mla_attention(ctx, forced); !r) {
            std::fprintf(stderr, "mla_attention: %s\n", r.error().message.c_str());
            return 1;
          }
          const double ms = bench_time_ms(ctx, 1, kCalls, [&](int) { (void)mla_attention(ctx, forced); });
          const double gbs = bytes / (ms * 1e6);
          std::printf("decode seqs %3ld heads %2ld %-6s keys %5ld splits %3ld%s | %8.1f us | %7.1f MB | %6.0f GB/s "
                      "%5.1f%% of copy\n",
                      long(seqs), long(heads), sparse ? "sparse" : "causal", long(keys), long(c),
                      c == rule ? "*" : " ", ms * 1e3, bytes / 1e6, gbs, 100.0 * gbs / copy_gbs);
        }
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace tern

int main(int argc, char** argv) {
  bool sweep = false, fp8 = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--splits") == 0) {
      sweep = true;
    } else if (std::strcmp(argv[i], "--fp8") == 0) {
      fp8 = true;
    } else {
      std::fprintf(stderr, "usage: mla_bench [--splits] [--fp8]\n");
      return 2;
    }
  }
  return tern::run(sweep, fp8);
}
