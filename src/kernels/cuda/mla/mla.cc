// Argument checks of the multi-head latent attention kernels (mla.cu).
#include "kernels/cuda/mla/mla.h"

#include <cmath>
#include <limits>

#include "kernels/cuda/arg_checks.h"

namespace tern {
namespace {

constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();

Expected<void> check_count(const char* kernel, const char* name, int64_t v, int64_t lo = 1) {
  if (v < lo || v > kMaxCount) return make_error("{}: {}={} out of range [{}, {}]", kernel, name, v, lo, kMaxCount);
  return {};
}

Expected<void> check_cache(const char* kernel, const PagedLatentCache& c) {
  TERN_TRY(check_pointer(kernel, "cache.data", c.data));
  if (c.kv_lora_rank <= 0 || c.kv_lora_rank % 16 != 0 || c.kv_lora_rank > kMlaMaxLoraRank) {
    return make_error("{}: kv_lora_rank={} must be a multiple of 16 in [16, {}]", kernel, c.kv_lora_rank,
                      kMlaMaxLoraRank);
  }
  if (c.rope_dim <= 0 || c.rope_dim % 16 != 0 || c.rope_dim > kMlaMaxRopeDim) {
    return make_error("{}: rope_dim={} must be a multiple of 16 in [16, {}]", kernel, c.rope_dim, kMlaMaxRopeDim);
  }
  if (c.block_size <= 0 || (c.block_size & (c.block_size - 1)) != 0) {
    return make_error("{}: block_size={} must be a power of two", kernel, c.block_size);
  }
  TERN_TRY(check_count(kernel, "cache.n_blocks", c.n_blocks));
  if (c.dtype == LatentCacheDtype::kFp8 && (c.kv_lora_rank != kMlaFp8LoraRank || c.rope_dim > kMlaFp8MaxRopeDim)) {
    return make_error("{}: an FP8 latent cache needs kv_lora_rank {} and rope_dim at most {} (GLM-5's and "
                      "DeepSeek-V3's); this one has {} and {}", kernel, kMlaFp8LoraRank, kMlaFp8MaxRopeDim,
                      c.kv_lora_rank, c.rope_dim);
  }
  if (c.dtype != LatentCacheDtype::kBf16 && c.dtype != LatentCacheDtype::kFp8) {
    return make_error("{}: unknown latent cache dtype {}", kernel, static_cast<int>(c.dtype));
  }
  if (reinterpret_cast<uintptr_t>(c.data) % 4 != 0) return make_error("{}: cache.data is not 4-byte aligned", kernel);
  return {};
}

}  // namespace

bool mla_attention_fits(const DeviceProps& props, int64_t width) {
  return mla_attention_smem_bytes(width) <= props.shared_mem_per_block_optin;
}

Expected<void> mla_prepare(const DeviceContext& ctx, const MlaPrepareArgs& a) {
  constexpr const char* k = "mla_prepare";
  TERN_TRY(check_count(k, "tokens", a.tokens, 0));
  if (a.tokens == 0) return {};
  TERN_TRY(check_cache(k, a.cache));
  TERN_TRY(check_count(k, "n_heads", a.n_heads));
  TERN_TRY(check_count(k, "nope_dim", a.nope_dim, 0));
  for (const auto& [name, ptr] : {std::pair<const char*, const void*>{"kv_a", a.kv_a}, {"kv_norm_weight", a.kv_norm_weight},
                                  {"q", a.q}, {"q_latent", a.q_latent}, {"positions", a.positions},
                                  {"inv_freq", a.inv_freq}, {"slot_mapping", a.slot_mapping}}) {
    TERN_TRY(check_pointer(k, name, ptr));
  }
  if (a.kv_a_stride < a.cache.width()) {
    return make_error("{}: kv_a_stride={} is less than kv_lora_rank + rope_dim = {}", k, a.kv_a_stride, a.cache.width());
  }
  if (a.q_stride < a.n_heads * (a.nope_dim + a.cache.rope_dim)) {
    return make_error("{}: q_stride={} is less than n_heads * (nope_dim + rope_dim) = {}", k, a.q_stride,
                      a.n_heads * (a.nope_dim + a.cache.rope_dim));
  }
  if (!(a.eps > 0.0f) || !std::isfinite(a.eps)) return make_error("{}: eps={} must be positive and finite", k, a.eps);
  mla_prepare_launch(ctx, a);
  return {};
}

Expected<void> mla_attention(const DeviceContext& ctx, const MlaAttentionArgs& a) {
  constexpr const char* k = "mla_attention";
  TERN_TRY(check_count(k, "tokens", a.tokens, 0));
  if (a.tokens == 0) return {};
  TERN_TRY(check_cache(k, a.cache));
  TERN_TRY(check_count(k, "n_heads", a.n_heads));
  TERN_TRY(check_count(k, "n_seqs", a.n_seqs));
  TERN_TRY(check_count(k, "max_blocks_per_seq", a.max_blocks_per_seq));
  for (const auto& [name, ptr] : {std::pair<const char*, const void*>{"q_latent", a.q_latent},
                                  {"out_latent", a.out_latent}, {"block_tables", a.block_tables},
                                  {"query_start", a.query_start}, {"seq_lens", a.seq_lens}}) {
    TERN_TRY(check_pointer(k, name, ptr));
  }
  if (reinterpret_cast<uintptr_t>(a.out_latent) % 4 != 0) return make_error("{}: out_latent is not 4-byte aligned", k);
  if (reinterpret_cast<uintptr_t>(a.q_latent) % 4 != 0) return make_error("{}: q_latent is not 4-byte aligned", k);
  if (a.selected != nullptr) {
    TERN_TRY(check_count(k, "topk", a.topk));
  } else {
    TERN_TRY(check_count(k, "max_seq_len", a.max_seq_len));
  }
  if (a.cache.width() % 8 != 0 || !aligned16(a.cache.data)) {
    return make_error("{}: the latent rows must be 16-byte aligned (kv_lora_rank + rope_dim = {}, a multiple of 8)", k,
                      a.cache.width());
  }
  const int64_t groups = (a.n_heads + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock;
  if (a.splits < 0 || (a.splits > 0 && a.tokens * groups * a.splits >= 3 * int64_t{std::max(ctx.props().num_sms, 1)})) {
    return make_error("{}: splits={} must be 0 (the rule) or keep rows x head groups x splits below 3 x {} SMs", k,
                      a.splits, ctx.props().num_sms);
  }
  const int64_t splits = a.splits > 0 ? a.splits
                                      : mla_attention_splits(ctx.props(), a.tokens, a.n_heads,
                                                             a.selected != nullptr ? a.topk : a.max_seq_len,
                                                             a.cache.width());
  const size_t need = static_cast<size_t>(a.tokens * a.n_heads * splits * (a.cache.kv_lora_rank + 2)) * 4;
  if (splits > 1 && (a.workspace == nullptr || a.workspace_bytes < need)) {
    return make_error("{}: {} key ranges need a workspace of {} bytes ({} given)", k, splits, need, a.workspace_bytes);
  }
  if (a.n_heads > int64_t{65535} * kMlaHeadsPerBlock) return make_error("{}: n_heads={} too large", k, a.n_heads);
  if (!(a.scale > 0.0f) || !std::isfinite(a.scale)) return make_error("{}: scale={} must be positive", k, a.scale);
  if (!mla_attention_fits(ctx.props(), a.cache.width())) {
    return make_error("{}: a latent of {} values needs {} bytes of shared memory per block; this device allows {}", k,
                      a.cache.width(), mla_attention_smem_bytes(a.cache.width()), ctx.props().shared_mem_per_block_optin);
  }
  mla_attention_launch(ctx, a);
  return {};
}

}  // namespace tern
