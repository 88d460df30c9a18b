// Argument checks of the DSA lightning indexer kernels; the kernels are in indexer.cu.
#include "kernels/cuda/mla/indexer.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cuda/arg_checks.h"

namespace tern {
namespace {

constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxSeqLen = int64_t{1} << 30;  // keeps every key index and chunk bound of the kernels in int

Expected<void> check_shape(const char* kernel, int64_t n_heads, int64_t head_dim) {
  if (head_dim < 16 || head_dim > kIndexerMaxHeadDim || head_dim % 16 != 0) {
    return make_error("{}: head_dim={} is not supported (a multiple of 16 in [16, {}])", kernel, head_dim,
                      kIndexerMaxHeadDim);
  }
  if (n_heads < 1 || n_heads > kIndexerMaxHeads) {
    return make_error("{}: n_heads={} out of range [1, {}]", kernel, n_heads, kIndexerMaxHeads);
  }
  return {};
}

Expected<void> check_cache(const char* kernel, const PagedIndexerKeys& c, int64_t head_dim, bool vec) {
  TERN_TRY(vec ? check_vec_pointer(kernel, "cache.k", c.k) : check_pointer(kernel, "cache.k", c.k));
  if (c.head_dim != head_dim) {
    return make_error("{}: cache.head_dim={} differs from head_dim={}", kernel, c.head_dim, head_dim);
  }
  const int64_t bs = c.block_size;
  if (bs < 1 || bs > 1024 || (bs & (bs - 1)) != 0) {
    return make_error("{}: cache.block_size={} must be a power of two in [1, 1024]", kernel, bs);
  }
  if (c.n_blocks <= 0 || c.n_blocks > kMaxCount / bs) {
    return make_error("{}: cache.n_blocks={} out of range for block_size {}", kernel, c.n_blocks, bs);
  }
  return {};
}

Expected<void> prepare_validate(const IndexerPrepareArgs& a) {
  constexpr const char* k = "indexer_prepare";
  TERN_TRY(check_shape(k, a.n_heads, a.head_dim));
  TERN_TRY(check_cache(k, a.cache, a.head_dim, false));
  if (a.tokens < 0 || a.tokens > kMaxCount) return make_error("{}: tokens={} out of range", k, a.tokens);
  if (a.q_stride < a.n_heads * a.head_dim) {
    return make_error("{}: q_stride={} is below the row's {} values", k, a.q_stride, a.n_heads * a.head_dim);
  }
  if (a.k_stride < a.head_dim) return make_error("{}: k_stride={} is below head_dim={}", k, a.k_stride, a.head_dim);
  if (a.rope_dim < 0 || a.rope_dim % 2 != 0 || a.rope_dim > a.head_dim) {
    return make_error("{}: rope_dim={} must be even and in [0, head_dim={}]", k, a.rope_dim, a.head_dim);
  }
  if (!(a.eps > 0.0f) || !std::isfinite(a.eps)) return make_error("{}: eps={} must be positive and finite", k, a.eps);
  TERN_TRY(check_pointer(k, "q", a.q));
  TERN_TRY(check_pointer(k, "q_out", a.q_out));
  TERN_TRY(check_pointer(k, "k", a.k));
  TERN_TRY(check_pointer(k, "k_norm_weight", a.k_norm_weight));
  TERN_TRY(check_pointer(k, "k_norm_bias", a.k_norm_bias));
  TERN_TRY(check_pointer(k, "slot_mapping", a.slot_mapping));
  if (a.rope_dim > 0) {
    TERN_TRY(check_pointer(k, "positions", a.positions));
    TERN_TRY(check_pointer(k, "inv_freq", a.inv_freq));
  }
  return {};
}

Expected<void> select_validate(const DeviceContext& ctx, const IndexerSelectArgs& a) {
  constexpr const char* k = "indexer_select";
  TERN_TRY(check_shape(k, a.n_heads, a.head_dim));
  TERN_TRY(check_cache(k, a.cache, a.head_dim, true));
  if (a.tokens < 0 || a.tokens > kMaxCount) return make_error("{}: tokens={} out of range", k, a.tokens);
  if (a.n_seqs < 0 || a.n_seqs > kMaxCount) return make_error("{}: n_seqs={} out of range", k, a.n_seqs);
  if (a.topk < 1 || a.topk > kMaxCount) return make_error("{}: topk={} out of range [1, {}]", k, a.topk, kMaxCount);
  if (a.tokens == 0 || a.n_seqs == 0) return {};
  if (a.max_seq_len < 1 || a.max_seq_len > kMaxSeqLen) {
    return make_error("{}: max_seq_len={} out of range [1, {}]", k, a.max_seq_len, kMaxSeqLen);
  }
  const int64_t blocks_needed = (a.max_seq_len + a.cache.block_size - 1) / a.cache.block_size;
  if (a.max_blocks_per_seq < blocks_needed || a.max_blocks_per_seq > kMaxCount / a.cache.block_size) {
    return make_error("{}: max_blocks_per_seq={} must hold max_seq_len={} in blocks of {} (at least {})", k,
                      a.max_blocks_per_seq, a.max_seq_len, a.cache.block_size, blocks_needed);
  }
  if (a.weights_stride < a.n_heads) {
    return make_error("{}: weights_stride={} is below n_heads={}", k, a.weights_stride, a.n_heads);
  }
  if (a.topk_blocks != 0 && a.topk_blocks != 1 && a.topk_blocks != 2 && a.topk_blocks != 4 && a.topk_blocks != 8) {
    return make_error("{}: topk_blocks={} must be 0 (the rule), 1, 2, 4 or 8", k, a.topk_blocks);
  }
  TERN_TRY(check_vec_pointer(k, "q", a.q));
  TERN_TRY(check_pointer(k, "weights", a.weights));
  TERN_TRY(check_pointer(k, "block_tables", a.block_tables));
  TERN_TRY(check_pointer(k, "query_start", a.query_start));
  TERN_TRY(check_pointer(k, "seq_lens", a.seq_lens));
  TERN_TRY(check_pointer(k, "selected", a.selected));
  const size_t needed = indexer_select_workspace_bytes(a.tokens, a.max_seq_len);
  if (a.workspace == nullptr || a.workspace_bytes < needed || !aligned16(a.workspace)) {
    return make_error("{}: workspace must be 16-byte aligned and hold {} bytes ({} given)", k, needed,
                      a.workspace == nullptr ? 0 : a.workspace_bytes);
  }
  if (indexer_select_tiles(ctx.props(), a.head_dim, a.n_heads).stages == 0) {
    return make_error(
        "{}: the score tiles of head_dim {} and {} heads do not fit this device's {} bytes of shared "
        "memory per block",
        k, a.head_dim, a.n_heads, ctx.props().shared_mem_per_block_optin);
  }
  return {};
}

}  // namespace

Expected<void> indexer_prepare(const DeviceContext& ctx, const IndexerPrepareArgs& args) {
  TERN_TRY(prepare_validate(args));
  if (args.tokens > 0) indexer_prepare_launch(ctx, args);
  return {};
}

Expected<void> indexer_select(const DeviceContext& ctx, const IndexerSelectArgs& args) {
  TERN_TRY(select_validate(ctx, args));
  if (args.tokens == 0 || args.n_seqs == 0) return {};
  indexer_select_launch(ctx, args);
  return {};
}

}  // namespace tern
