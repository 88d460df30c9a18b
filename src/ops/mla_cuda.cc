#include "ops/mla_cuda.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "kernels/cuda/mla/indexer.h"
#include "kernels/cuda/mla/mla.h"
#include "ops/cuda_util.h"

namespace tern {
namespace {

constexpr uint16_t kNanBf16 = 0x7FC0;  // unused cache slots
constexpr int64_t kIndexerCaseWeightsPad = 8;

// A case's per-token cache rows (the latent, or the indexer's keys) in a paged pool: each sequence's blocks drawn
// from a shuffled pool (with spare blocks), the table entries past a sequence's blocks -1.
struct PagedHost {
  std::vector<uint16_t> pool;
  std::vector<int32_t> tables, query_start, seq_lens;
  int64_t n_blocks = 0, max_blocks = 0, max_seq = 0;
};

PagedHost page_rows(const MlaBatchShape& b, const std::vector<uint16_t>& rows, int64_t row) {
  constexpr int64_t bs = kMlaCaseBlockSize;
  PagedHost p;
  p.max_seq = b.seq_len(b.n_seqs - 1);
  p.max_blocks = (p.max_seq + bs - 1) / bs;
  for (int64_t s = 0; s < b.n_seqs; ++s) p.n_blocks += (b.seq_len(s) + bs - 1) / bs;
  p.n_blocks += 2;
  std::vector<int32_t> perm(static_cast<size_t>(p.n_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(static_cast<uint32_t>(p.n_blocks)));
  p.pool.assign(static_cast<size_t>(p.n_blocks * bs * row), kNanBf16);
  p.tables.assign(static_cast<size_t>(b.n_seqs * p.max_blocks), -1);
  size_t next = 0;
  for (int64_t s = 0; s < b.n_seqs; ++s) {
    p.query_start.push_back(static_cast<int32_t>(s * b.query_len));
    p.seq_lens.push_back(static_cast<int32_t>(b.seq_len(s)));
    for (int64_t j = 0; j < b.seq_len(s); ++j) {
      int32_t& block = p.tables[s * p.max_blocks + j / bs];
      if (j % bs == 0) block = perm[next++];
      const int64_t slot = int64_t{block} * bs + j % bs;
      std::copy_n(rows.begin() + (b.cache_begin(s) + j) * row, row, p.pool.begin() + slot * row);
    }
  }
  p.query_start.push_back(static_cast<int32_t>(b.tokens()));
  return p;
}

DeviceProps props_of(const DeviceDescription& d) {
  DeviceProps props;
  props.shared_mem_per_block_optin = static_cast<size_t>(d.smem_per_block_optin);
  props.shared_mem_per_sm = static_cast<size_t>(d.smem_per_sm);
  return props;
}

std::string mla_attention_unsupported(const DeviceDescription& d, const SelfTestCase& c) {
  if (std::string why = cuda_unsupported_reason(d, c); !why.empty()) return why;
  if (c.dims.size() != 8 && c.dims.size() != 9)
    return "needs dims {n_seqs, query_len, past, n_heads, kv_lora_rank, rope_dim, topk, qk_head_dim[, cache]}";
  const int64_t lora = c.dims[4], rope = c.dims[5];
  // The kernel's own limits (kernels/cuda/mla/mla.h): whole k16 steps and n16 pairs of its tensor-core tiles.
  if (lora < 16 || lora % 16 != 0 || lora > kMlaMaxLoraRank) {
    return "kv_lora_rank must be a multiple of 16 in [16, 512]";
  }
  if (rope < 16 || rope % 16 != 0 || rope > kMlaMaxRopeDim) return "rope_dim must be a multiple of 16 in [16, 128]";
  if (!mla_attention_fits(props_of(d), lora + rope)) return "the attention tiles do not fit the shared memory";
  if (c.dims.size() == 9 && c.dims[8] != 0 && (lora != kMlaFp8LoraRank || rope % 16 != 0 || rope > kMlaFp8MaxRopeDim)) {
    return "an FP8 latent cache needs kv_lora_rank 512 and rope_dim a multiple of 16, at most 64";
  }
  return "";
}

std::string indexer_select_unsupported(const DeviceDescription& d, const SelfTestCase& c) {
  if (std::string why = cuda_unsupported_reason(d, c); !why.empty()) return why;
  if (c.dims.size() != 6) return "needs dims {n_seqs, query_len, past, n_heads, head_dim, topk}";
  const int64_t n_heads = c.dims[3], hd = c.dims[4];
  if (hd < 16 || hd > kIndexerMaxHeadDim || hd % 16 != 0) return "head_dim must be a multiple of 16 in [16, 256]";
  if (n_heads < 1 || n_heads > kIndexerMaxHeads) return "n_heads must be in [1, 64]";
  if (!arch_features(d.cc_major, d.cc_minor).mma_bf16) return "needs bf16 mma.sync (sm_80 or later targets)";
  if (indexer_select_tiles(props_of(d), hd, n_heads).stages == 0) return "the score tiles do not fit the shared memory";
  return "";
}

}  // namespace

Expected<RunOutput> mla_attention_cuda_run(const DeviceContext& ctx, const MlaAttentionInputs& in,
                                           const ArgsTweak<MlaAttentionArgs>& tweak) {
  // An FP8 case's entries paged as 16-bit words (their byte count is even), the unused slots' words NaN: their
  // scales read as NaN.
  const bool fp8 = in.cache != MlaCacheCase::kBf16;
  std::vector<uint16_t> words;
  if (fp8) {
    words.resize(in.latent_fp8.size() / 2);
    std::memcpy(words.data(), in.latent_fp8.data(), words.size() * 2);
  }
  const PagedHost host = fp8 ? page_rows(in.batch, words, latent_fp8_bytes(in.kv_lora_rank, in.rope_dim) / 2)
                             : page_rows(in.batch, in.latent, in.width());
  const cudaStream_t stream = ctx.stream();
  const DeviceBuffer q = cuda_upload(in.q, stream), pool = cuda_upload(host.pool, stream);
  const DeviceBuffer selected = cuda_upload(in.selected, stream);
  const DeviceBuffer tables = cuda_upload(host.tables, stream), starts = cuda_upload(host.query_start, stream);
  const DeviceBuffer lens = cuda_upload(host.seq_lens, stream);
  const size_t ws_bytes = mla_attention_workspace_bytes(ctx.props(), in.kv_lora_rank);
  const DeviceBuffer workspace(ws_bytes);
  return cuda_run_timed(ctx, in.tokens(), in.n_heads * in.kv_lora_rank, [&](uint16_t* out) {
    MlaAttentionArgs a{.q_latent = q.as<uint16_t>(),
                       .out_latent = out,
                       .cache = {.data = pool.as<uint16_t>(),
                                 .n_blocks = host.n_blocks,
                                 .block_size = kMlaCaseBlockSize,
                                 .kv_lora_rank = in.kv_lora_rank,
                                 .rope_dim = in.rope_dim,
                                 .dtype = fp8 ? LatentCacheDtype::kFp8 : LatentCacheDtype::kBf16},
                       .block_tables = tables.as<int32_t>(),
                       .max_blocks_per_seq = host.max_blocks,
                       .query_start = starts.as<int32_t>(),
                       .seq_lens = lens.as<int32_t>(),
                       .n_seqs = in.batch.n_seqs,
                       .tokens = in.tokens(),
                       .n_heads = in.n_heads,
                       .selected = in.topk > 0 ? selected.as<int32_t>() : nullptr,
                       .topk = in.topk,
                       .scale = in.scale,
                       .max_seq_len = host.max_seq,
                       .workspace = workspace.data(),
                       .workspace_bytes = ws_bytes};
    if (tweak) tweak(a);
    return mla_attention(ctx, a);
  });
}

Expected<RunOutput> indexer_select_cuda_run(const DeviceContext& ctx, const IndexerSelectInputs& in,
                                            const ArgsTweak<IndexerSelectArgs>& tweak) {
  const PagedHost host = page_rows(in.batch, in.keys, in.head_dim);
  const cudaStream_t stream = ctx.stream();
  // The weights as the model holds them, columns of a wider projection output: a row stride past n_heads, with
  // zeros between the rows.
  const int64_t w_stride = in.n_heads + kIndexerCaseWeightsPad;
  std::vector<uint16_t> strided(static_cast<size_t>(in.tokens() * w_stride), 0);
  for (int64_t t = 0; t < in.tokens(); ++t) {
    std::copy_n(in.weights.begin() + t * in.n_heads, in.n_heads, strided.begin() + t * w_stride);
  }
  const DeviceBuffer q = cuda_upload(in.q, stream), weights = cuda_upload(strided, stream);
  const DeviceBuffer pool = cuda_upload(host.pool, stream);
  const DeviceBuffer tables = cuda_upload(host.tables, stream), starts = cuda_upload(host.query_start, stream);
  const DeviceBuffer lens = cuda_upload(host.seq_lens, stream);
  const size_t ws_bytes = indexer_select_workspace_bytes(in.tokens(), host.max_seq);
  const DeviceBuffer workspace(std::max<size_t>(ws_bytes, 16));
  const size_t count = static_cast<size_t>(in.tokens() * in.topk);
  const std::vector<int32_t> poison(count, kIndexerSelectPoison);
  const DeviceBuffer selected(std::max<size_t>(count * sizeof(int32_t), 16));
  IndexerSelectArgs a;
  TERN_ASSIGN_OR_RETURN(const double seconds,
                        cuda_time_best(
                            ctx,
                            [&] {
                              TERN_CUDA_CHECK(cudaMemcpyAsync(selected.data(), poison.data(), count * sizeof(int32_t),
                                                              cudaMemcpyHostToDevice, stream));
                              a = IndexerSelectArgs{.q = q.as<uint16_t>(),
                                                    .weights = weights.as<uint16_t>(),
                                                    .weights_stride = w_stride,
                                                    .cache = {.k = pool.as<uint16_t>(),
                                                              .n_blocks = host.n_blocks,
                                                              .block_size = kMlaCaseBlockSize,
                                                              .head_dim = in.head_dim},
                                                    .block_tables = tables.as<int32_t>(),
                                                    .max_blocks_per_seq = host.max_blocks,
                                                    .query_start = starts.as<int32_t>(),
                                                    .seq_lens = lens.as<int32_t>(),
                                                    .n_seqs = in.batch.n_seqs,
                                                    .tokens = in.tokens(),
                                                    .n_heads = in.n_heads,
                                                    .head_dim = in.head_dim,
                                                    .topk = in.topk,
                                                    .max_seq_len = host.max_seq,
                                                    .workspace = workspace.data(),
                                                    .workspace_bytes = ws_bytes,
                                                    .selected = selected.as<int32_t>()};
                              if (tweak) tweak(a);
                            },
                            [&] { return indexer_select(ctx, a); }));
  std::vector<int32_t> got(count);
  TERN_CUDA_CHECK(cudaMemcpy(got.data(), selected.data(), count * sizeof(int32_t), cudaMemcpyDeviceToHost));
  return RunOutput{.values = indexer_select_output(in, got), .seconds = seconds};
}

Expected<void> mla_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context) {
  TERN_TRY(registry.add(Implementation{.op = "mla_attention",
                                       .name = "cuda",
                                       .backend = Backend::kCuda,
                                       .priority = 10,
                                       .tolerance = kMlaAttentionCudaTolerance,
                                       .unsupported_reason = mla_attention_unsupported,
                                       .run = [context](const OpInputs& b) {
                                         return mla_attention_cuda_run(*context,
                                                                       static_cast<const MlaAttentionInputs&>(b));
                                       }}));
  return registry.add(Implementation{.op = "indexer_select",
                                     .name = "cuda",
                                     .backend = Backend::kCuda,
                                     .priority = 10,
                                     .tolerance = kIndexerSelectTolerance,
                                     .unsupported_reason = indexer_select_unsupported,
                                     .run = [context](const OpInputs& b) {
                                       return indexer_select_cuda_run(*context,
                                                                      static_cast<const IndexerSelectInputs&>(b));
                                     }});
}

}  // namespace tern
