#include "ops/attention_cuda.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "kernels/cuda/attention/attention.h"
#include "ops/cuda_util.h"

namespace tern {
namespace {

constexpr uint16_t kNanBf16 = 0x7FC0;  // unused cache slots

// The case's caches in a paged pool: each sequence's blocks drawn from a shuffled pool (with spare blocks), the
// table entries past a sequence's blocks -1.
struct PagedHost {
  std::vector<uint16_t> k_pool, v_pool;
  std::vector<int32_t> tables, query_start, seq_lens;
  int64_t n_blocks = 0, max_blocks = 0, max_seq = 0;
};

PagedHost page_inputs(const AttentionInputs& in) {
  constexpr int64_t bs = kAttentionCaseBlockSize;
  const int64_t row = in.n_kv_heads * in.head_dim;
  PagedHost p;
  p.max_seq = in.seq_len(in.n_seqs - 1);
  p.max_blocks = (p.max_seq + bs - 1) / bs;
  for (int64_t s = 0; s < in.n_seqs; ++s) p.n_blocks += (in.seq_len(s) + bs - 1) / bs;
  p.n_blocks += 2;
  std::vector<int32_t> perm(static_cast<size_t>(p.n_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(static_cast<uint32_t>(p.n_blocks)));
  p.k_pool.assign(static_cast<size_t>(p.n_blocks * bs * row), kNanBf16);
  p.v_pool = p.k_pool;
  p.tables.assign(static_cast<size_t>(in.n_seqs * p.max_blocks), -1);
  size_t next = 0;
  for (int64_t s = 0; s < in.n_seqs; ++s) {
    p.query_start.push_back(static_cast<int32_t>(s * in.query_len));
    p.seq_lens.push_back(static_cast<int32_t>(in.seq_len(s)));
    for (int64_t j = 0; j < in.seq_len(s); ++j) {
      int32_t& block = p.tables[s * p.max_blocks + j / bs];
      if (j % bs == 0) block = perm[next++];
      const int64_t slot = int64_t{block} * bs + j % bs, src = (in.cache_begin(s) + j) * row;
      std::copy_n(in.k.begin() + src, row, p.k_pool.begin() + slot * row);
      std::copy_n(in.v.begin() + src, row, p.v_pool.begin() + slot * row);
    }
  }
  p.query_start.push_back(static_cast<int32_t>(in.tokens()));
  return p;
}

std::string attention_unsupported(const DeviceDescription& d, const SelfTestCase& c, AttentionVariant variant) {
  if (d.backend != Backend::kCuda) return "runs on CUDA devices only";
  if (std::string why = binary_can_run(cuda_binary_image(), d); !why.empty()) return why;
  if (c.dims.size() != 7) return "needs dims {n_seqs, query_len, past, n_heads, n_kv_heads, head_dim, gated}";
  const int64_t n_heads = c.dims[3], n_kv = c.dims[4], hd = c.dims[5];
  if (hd != 32 && hd != 64 && hd != 128 && hd != 256) return "head_dim must be 32, 64, 128 or 256";
  if (n_kv < 1 || n_heads % n_kv != 0 || n_heads / n_kv > kAttentionMaxGroup) {
    return "needs n_heads a multiple of n_kv_heads with at most 16 query heads per kv head";
  }
  if (variant == AttentionVariant::kPrefill) {
    if (!arch_features(d.cc_major, d.cc_minor).mma_bf16) return "needs bf16 mma.sync (sm_80 or later targets)";
    DeviceProps props;
    props.shared_mem_per_block_optin = static_cast<size_t>(d.smem_per_block_optin);
    if (attention_prefill_tiles(props, hd).stages == 0) return "the prefill tiles do not fit the shared memory";
  }
  return "";
}

}  // namespace

Expected<RunOutput> attention_cuda_run(const DeviceContext& ctx, const AttentionInputs& in, AttentionVariant variant,
                                       const ArgsTweak<PagedAttentionArgs>& tweak) {
  const PagedHost host = page_inputs(in);
  const cudaStream_t stream = ctx.stream();
  const DeviceBuffer q = cuda_upload(in.q, stream), gate = cuda_upload(in.gate, stream);
  const DeviceBuffer k_pool = cuda_upload(host.k_pool, stream), v_pool = cuda_upload(host.v_pool, stream);
  const DeviceBuffer tables = cuda_upload(host.tables, stream), starts = cuda_upload(host.query_start, stream);
  const DeviceBuffer lens = cuda_upload(host.seq_lens, stream);
  const size_t ws_bytes =
      paged_attention_workspace_bytes(ctx.props(), in.tokens(), in.n_heads, in.head_dim, host.max_seq);
  const DeviceBuffer workspace(std::max<size_t>(ws_bytes, 16));
  return cuda_run_timed(ctx, in.tokens(), in.n_heads * in.head_dim, [&](uint16_t* out) {
    PagedAttentionArgs a{.q = q.as<uint16_t>(),
                         .gate = in.gated ? gate.as<uint16_t>() : nullptr,
                         .out = out,
                         .cache = {.k = k_pool.as<uint16_t>(),
                                   .v = v_pool.as<uint16_t>(),
                                   .n_blocks = host.n_blocks,
                                   .block_size = kAttentionCaseBlockSize,
                                   .n_kv_heads = in.n_kv_heads,
                                   .head_dim = in.head_dim},
                         .block_tables = tables.as<int32_t>(),
                         .max_blocks_per_seq = host.max_blocks,
                         .query_start = starts.as<int32_t>(),
                         .seq_lens = lens.as<int32_t>(),
                         .n_seqs = in.n_seqs,
                         .tokens = in.tokens(),
                         .n_heads = in.n_heads,
                         .max_query_len = in.query_len,
                         .max_seq_len = host.max_seq,
                         .scale = in.scale,
                         .workspace = workspace.data(),
                         .workspace_bytes = ws_bytes};
    if (tweak) tweak(a);
    return paged_attention(ctx, a, variant);
  });
}

Expected<void> attention_register_cuda(Registry& registry, std::shared_ptr<DeviceContext> context) {
  auto add = [&](const char* name, AttentionVariant variant, Tolerance tolerance) {
    return registry.add(Implementation{
        .op = "attention",
        .name = name,
        .backend = Backend::kCuda,
        .priority = 10,
        .tolerance = tolerance,
        .unsupported_reason = [variant](const DeviceDescription& d,
                                        const SelfTestCase& c) { return attention_unsupported(d, c, variant); },
        .run =
            [context, variant](const OpInputs& b) {
              return attention_cuda_run(*context, static_cast<const AttentionInputs&>(b), variant);
            }});
  };
  TERN_TRY(add("cuda-decode", AttentionVariant::kDecode, kAttentionDecodeTolerance));
  TERN_TRY(add("cuda-prefill", AttentionVariant::kPrefill, kAttentionPrefillTolerance));
  return {};
}

}  // namespace tern
