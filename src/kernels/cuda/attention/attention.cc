// Argument checks of the paged attention kernels; the kernels are in attention_prepare.cu, attention_decode.cu and
// attention_prefill.cu.
#include "kernels/cuda/attention/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cuda/arg_checks.h"

namespace tern {
namespace {

constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxGridYz = 65535;

Expected<void> check_head_dim(const char* kernel, const char* name, int64_t head_dim) {
  if (head_dim != 32 && head_dim != 64 && head_dim != 128 && head_dim != 256) {
    return make_error("{}: {}={} is not supported (32, 64, 128 or 256)", kernel, name, head_dim);
  }
  return {};
}

Expected<void> check_heads(const char* kernel, int64_t n_heads, int64_t n_kv_heads) {
  if (n_kv_heads <= 0 || n_kv_heads > kMaxGridYz) {
    return make_error("{}: n_kv_heads={} out of range [1, {}]", kernel, n_kv_heads, kMaxGridYz);
  }
  if (n_heads <= 0 || n_heads > kMaxGridYz || n_heads % n_kv_heads != 0) {
    return make_error("{}: n_heads={} must be a positive multiple of n_kv_heads={}", kernel, n_heads, n_kv_heads);
  }
  if (n_heads / n_kv_heads > kAttentionMaxGroup) {
    return make_error("{}: {} query heads per kv head exceed the kernels' limit {}", kernel, n_heads / n_kv_heads,
                      kAttentionMaxGroup);
  }
  return {};
}

// The pools of a cache whose head_dim and n_kv_heads the caller has matched against its own.
Expected<void> check_cache(const char* kernel, const PagedKvCache& c) {
  TERN_TRY(check_vec_pointer(kernel, "cache.k", c.k));
  TERN_TRY(check_vec_pointer(kernel, "cache.v", c.v));
  TERN_TRY(check_head_dim(kernel, "cache.head_dim", c.head_dim));
  const int64_t bs = c.block_size;
  if (bs < 8 || bs > 1024 || (bs & (bs - 1)) != 0) {
    return make_error("{}: cache.block_size={} must be a power of two in [8, 1024]", kernel, bs);
  }
  if (c.n_blocks <= 0 || c.n_blocks > kMaxCount / bs) {
    return make_error("{}: cache.n_blocks={} out of range for block_size {}", kernel, c.n_blocks, bs);
  }
  return {};
}

Expected<void> prepare_validate(const AttentionPrepareArgs& a) {
  constexpr const char* k = "attention_prepare";
  TERN_TRY(check_head_dim(k, "head_dim", a.head_dim));
  TERN_TRY(check_heads(k, a.n_heads, a.n_kv_heads));
  if (a.cache.head_dim != a.head_dim || a.cache.n_kv_heads != a.n_kv_heads) {
    return make_error("{}: cache is [.., {} kv heads, {}] but the tokens have {} kv heads of {}", k, a.cache.n_kv_heads,
                      a.cache.head_dim, a.n_kv_heads, a.head_dim);
  }
  TERN_TRY(check_cache(k, a.cache));
  if (a.tokens < 0 || a.tokens > kMaxCount) return make_error("{}: tokens={} out of range", k, a.tokens);
  const int64_t q_width = a.n_heads * (a.gated ? 2 : 1) * a.head_dim, kv_width = a.n_kv_heads * a.head_dim;
  if (a.q_proj_stride < q_width) {
    return make_error("{}: q_proj_stride={} is below the row's {} values", k, a.q_proj_stride, q_width);
  }
  if (a.kv_stride < kv_width)
    return make_error("{}: kv_stride={} is below the row's {} values", k, a.kv_stride, kv_width);
  if (a.rotary_dim < 0 || a.rotary_dim % 2 != 0 || a.rotary_dim > a.head_dim) {
    return make_error("{}: rotary_dim={} must be even and in [0, head_dim={}]", k, a.rotary_dim, a.head_dim);
  }
  if (!(a.eps > 0.0f) || !std::isfinite(a.eps)) return make_error("{}: eps={} must be positive and finite", k, a.eps);
  TERN_TRY(check_pointer(k, "q_proj", a.q_proj));
  TERN_TRY(check_pointer(k, "k", a.k));
  TERN_TRY(check_pointer(k, "v", a.v));
  TERN_TRY(check_pointer(k, "slot_mapping", a.slot_mapping));
  TERN_TRY(check_pointer(k, "q_out", a.q_out));
  if (a.gated) TERN_TRY(check_pointer(k, "gate_out (gated)", a.gate_out));
  if (a.rotary_dim > 0) {
    TERN_TRY(check_pointer(k, "positions", a.positions));
    TERN_TRY(check_pointer(k, "inv_freq", a.inv_freq));
  }
  return {};
}

Expected<void> attention_validate(const PagedAttentionArgs& a) {
  constexpr const char* k = "paged_attention";
  TERN_TRY(check_cache(k, a.cache));
  TERN_TRY(check_heads(k, a.n_heads, a.cache.n_kv_heads));
  if (a.tokens < 0 || a.tokens > kMaxCount) return make_error("{}: tokens={} out of range", k, a.tokens);
  if (a.n_seqs < 0 || a.n_seqs > kMaxGridYz)
    return make_error("{}: n_seqs={} out of range [0, {}]", k, a.n_seqs, kMaxGridYz);
  if (a.tokens == 0 || a.n_seqs == 0) return {};
  if (a.max_query_len < 1 || a.max_query_len > a.tokens) {
    return make_error("{}: max_query_len={} must be in [1, tokens={}]", k, a.max_query_len, a.tokens);
  }
  if (a.max_seq_len < a.max_query_len || a.max_seq_len > kMaxCount) {
    return make_error("{}: max_seq_len={} must be in [max_query_len={}, {}]", k, a.max_seq_len, a.max_query_len,
                      kMaxCount);
  }
  const int64_t blocks_needed = (a.max_seq_len + a.cache.block_size - 1) / a.cache.block_size;
  if (a.max_blocks_per_seq < blocks_needed || a.max_blocks_per_seq > kMaxCount / a.cache.block_size) {
    return make_error("{}: max_blocks_per_seq={} must hold max_seq_len={} in blocks of {} (at least {})", k,
                      a.max_blocks_per_seq, a.max_seq_len, a.cache.block_size, blocks_needed);
  }
  if (!(a.scale > 0.0f) || !std::isfinite(a.scale))
    return make_error("{}: scale={} must be positive and finite", k, a.scale);
  TERN_TRY(check_vec_pointer(k, "q", a.q));
  TERN_TRY(check_vec_pointer(k, "out", a.out));
  if (a.gate != nullptr) TERN_TRY(check_vec_pointer(k, "gate", a.gate));
  TERN_TRY(check_pointer(k, "block_tables", a.block_tables));
  TERN_TRY(check_pointer(k, "query_start", a.query_start));
  TERN_TRY(check_pointer(k, "seq_lens", a.seq_lens));
  return {};
}

// The decode grid (tokens * n_kv_heads blocks along x), its tiles on this device and the split-K workspace.
Expected<void> decode_check(const DeviceContext& ctx, const PagedAttentionArgs& a) {
  if (a.tokens * a.cache.n_kv_heads > kMaxCount) {
    return make_error("paged_attention: decode of tokens={} x cache.n_kv_heads={} exceeds {} blocks", a.tokens,
                      a.cache.n_kv_heads, kMaxCount);
  }
  if (attention_decode_tiles(ctx.props(), a.cache.head_dim).stages == 0) {
    return make_error(
        "paged_attention: the decode tiles of head_dim {} do not fit this device's {} bytes of shared memory per "
        "block",
        a.cache.head_dim, ctx.props().shared_mem_per_block_optin);
  }
  const int64_t n_splits =
      attention_decode_splits(ctx.props(), a.cache.head_dim, a.tokens, a.n_heads, a.cache.n_kv_heads, a.max_seq_len);
  const size_t needed = attention_decode_workspace_bytes(n_splits, a.tokens, a.n_heads, a.cache.head_dim);
  if (needed == 0) return {};
  if (a.workspace == nullptr || a.workspace_bytes < needed || !aligned16(a.workspace)) {
    return make_error("paged_attention: decode needs a 16-byte aligned workspace of {} bytes ({} given)", needed,
                      a.workspace == nullptr ? 0 : a.workspace_bytes);
  }
  return {};
}

}  // namespace

size_t paged_attention_workspace_bytes(const DeviceProps& props, int64_t tokens, int64_t n_heads, int64_t head_dim,
                                       int64_t max_seq_len) {
  // Fewer tokens get more splits, so the need is not monotone in the token count: take the largest over every count
  // up to `tokens`. For each count the split count is at most attention_decode_max_splits, which shrinks as
  // n_kv_heads grows and grows with max_seq_len, so its value at n_kv_heads = 1 and this max_seq_len bounds every
  // launch within these bounds (about 3 * resident blocks + tokens rows of partials).
  size_t most = 0;
  for (int64_t t = 1; t <= tokens; ++t) {
    const int64_t n_splits = attention_decode_max_splits(props, head_dim, t, 1, max_seq_len);
    most = std::max(most, attention_decode_workspace_bytes(n_splits, t, n_heads, head_dim));
  }
  return most;
}

Expected<void> attention_prepare(const DeviceContext& ctx, const AttentionPrepareArgs& args) {
  TERN_TRY(prepare_validate(args));
  if (args.tokens > 0) attention_prepare_launch(ctx, args);
  return {};
}

Expected<void> paged_attention(const DeviceContext& ctx, const PagedAttentionArgs& args, AttentionVariant variant) {
  TERN_TRY(attention_validate(args));
  if (args.tokens == 0 || args.n_seqs == 0) return {};
  if (variant == AttentionVariant::kAuto) {
    variant =
        args.max_query_len <= kAttentionDecodeMaxQueryLen ? AttentionVariant::kDecode : AttentionVariant::kPrefill;
  }
  if (variant == AttentionVariant::kDecode) {
    TERN_TRY(decode_check(ctx, args));
    paged_attention_decode_launch(ctx, args);
    return {};
  }
  if (variant == AttentionVariant::kPrefill && attention_prefill_sm90_fits(ctx.props(), args.cache.head_dim)) {
    paged_attention_prefill_sm90_launch(ctx, args);
    return {};
  }
  const AttentionPrefillTiles tiles = attention_prefill_tiles(ctx.props(), args.cache.head_dim);
  if (tiles.stages == 0) {
    return make_error(
        "paged_attention: the prefill tiles of head_dim {} do not fit this device's {} bytes of shared "
        "memory per block",
        args.cache.head_dim, ctx.props().shared_mem_per_block_optin);
  }
  paged_attention_prefill_launch(ctx, args);
  return {};
}

}  // namespace tern
