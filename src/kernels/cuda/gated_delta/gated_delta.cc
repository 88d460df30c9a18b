// Argument checks and dispatch of the Gated DeltaNet kernels; the kernels are in gated_delta.cu.
#include "kernels/cuda/gated_delta/gated_delta.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace tern {
namespace {

constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();

Expected<void> check_sequences(const char* kernel, const GdnSequences& q) {
  if (q.n_seqs < 0 || q.n_seqs > kMaxCount) return make_error("{}: n_seqs={} out of range", kernel, q.n_seqs);
  if (q.tokens < 0 || q.tokens > kMaxCount) return make_error("{}: tokens={} out of range", kernel, q.tokens);
  if (q.max_query_len < 0 || q.max_query_len > q.tokens) {
    return make_error("{}: max_query_len={} must be in [0, tokens={}]", kernel, q.max_query_len, q.tokens);
  }
  if (q.n_seqs > 0 && (q.query_start == nullptr || q.state_slot == nullptr || q.seq_past == nullptr)) {
    return make_error("{}: null sequence metadata (query_start, state_slot or seq_past)", kernel);
  }
  if (q.row_slots != nullptr && (q.max_rows < 1 || q.max_rows > kMaxCount)) {
    return make_error("{}: row_slots is set, so max_rows={} must be in [1, {}]", kernel, q.max_rows, kMaxCount);
  }
  return {};
}

Expected<void> conv_validate(const GdnConvArgs& a) {
  constexpr const char* k = "gdn_conv1d";
  TERN_TRY(check_sequences(k, a.seqs));
  if (a.kernel < kGdnMinConvKernel || a.kernel > kGdnMaxConvKernel) {
    return make_error("{}: kernel={} must be in [{}, {}]", k, a.kernel, kGdnMinConvKernel, kGdnMaxConvKernel);
  }
  if (a.channels <= 0 || a.channels > kGdnMaxConvChannels) {
    return make_error("{}: channels={} out of range", k, a.channels);
  }
  if (a.x_stride < a.channels) return make_error("{}: x_stride={} is less than channels={}", k, a.x_stride, a.channels);
  if (a.x == nullptr || a.weight == nullptr || a.conv_state == nullptr || a.y == nullptr) {
    return make_error("{}: null pointer (x, weight, conv_state or y)", k);
  }
  return {};
}

Expected<void> delta_rule_validate(const GdnDeltaRuleArgs& a) {
  constexpr const char* k = "gdn_delta_rule";
  TERN_TRY(check_sequences(k, a.seqs));
  if (!gdn_head_dim_supported(a.key_dim)) return make_error("{}: key_dim={} must be 32, 64 or 128", k, a.key_dim);
  if (!gdn_head_dim_supported(a.value_dim) || a.value_dim % kGdnValueSlice != 0) {
    return make_error("{}: value_dim={} must be 32, 64 or 128", k, a.value_dim);
  }
  if (a.n_key_heads <= 0 || a.n_value_heads <= 0 || a.n_value_heads > 65535 ||
      a.n_value_heads % a.n_key_heads != 0) {
    return make_error("{}: n_value_heads={} must be a positive multiple of n_key_heads={} (at most 65535)", k,
                      a.n_value_heads, a.n_key_heads);
  }
  const int64_t width = 2 * a.n_key_heads * a.key_dim + a.n_value_heads * a.value_dim;
  if (width > kMaxCount) return make_error("{}: q|k|v width {} is too large", k, width);
  if (a.qkv_stride < width) return make_error("{}: qkv_stride={} is less than the q|k|v width {}", k, a.qkv_stride, width);
  if (a.ab_stride < a.n_value_heads) {
    return make_error("{}: ab_stride={} is less than n_value_heads={}", k, a.ab_stride, a.n_value_heads);
  }
  if (a.qkv == nullptr || a.a == nullptr || a.b == nullptr || a.a_log == nullptr || a.dt_bias == nullptr ||
      a.state == nullptr || a.out == nullptr) {
    return make_error("{}: null pointer (qkv, a, b, a_log, dt_bias, state or out)", k);
  }
  if (a.norm.gate != nullptr) {
    if (a.norm.weight == nullptr) return make_error("{}: the gated norm has a gate but no weight", k);
    if (a.norm.gate_stride < a.n_value_heads * a.value_dim) {
      return make_error("{}: the gated norm's gate_stride={} is less than Hv * dv = {}", k, a.norm.gate_stride,
                        a.n_value_heads * a.value_dim);
    }
    if (!(a.norm.eps > 0.0f) || !std::isfinite(a.norm.eps)) {
      return make_error("{}: the gated norm's eps={} must be positive and finite", k, a.norm.eps);
    }
  }
  return {};
}

}  // namespace

Expected<void> gdn_conv1d(const DeviceContext& ctx, const GdnConvArgs& args) {
  TERN_TRY(conv_validate(args));
  if (args.seqs.n_seqs > 0) gdn_conv1d_launch(ctx, args);
  return {};
}

Expected<void> gdn_delta_rule(const DeviceContext& ctx, const GdnDeltaRuleArgs& args, GdnVariant variant) {
  TERN_TRY(delta_rule_validate(args));
  const bool chunk_fits = gdn_chunked_chunk_len(ctx.props(), args.key_dim) > 0;
  if (variant == GdnVariant::kChunked && !chunk_fits) {
    return make_error("gdn_delta_rule: the chunked kernel needs {} bytes of shared memory per block at key_dim={}, "
                      "the device allows {}", gdn_chunked_smem_bytes(args.key_dim, 32), args.key_dim,
                      ctx.props().shared_mem_per_block_optin);
  }
  if (args.seqs.n_seqs == 0) return {};
  if (variant == GdnVariant::kChunked && args.norm.gate != nullptr) {
    return make_error("gdn_delta_rule: the gated norm runs in the recurrent kernel only");
  }
  const bool chunked =
      variant == GdnVariant::kChunked || (variant == GdnVariant::kAuto && chunk_fits && args.norm.gate == nullptr &&
                                          args.seqs.max_query_len > kGdnRecurrentMaxQueryLen);
  if (chunked) {
    const int64_t needed = gdn_chunked_workspace_bytes(args.seqs.tokens, args.n_key_heads, args.n_value_heads,
                                                       args.key_dim, args.value_dim);
    const bool usable = args.workspace != nullptr && args.workspace_bytes >= needed &&
                        reinterpret_cast<uintptr_t>(args.workspace) % 16 == 0;
    if (needed > 0 && !usable) {
      return make_error("gdn_delta_rule: the chunked kernels need a 16-byte aligned workspace of {} bytes for {} "
                        "tokens (workspace {} of {} bytes)", needed, args.seqs.tokens,
                        static_cast<const void*>(args.workspace), args.workspace_bytes);
    }
    gdn_delta_rule_launch_chunked(ctx, args);
  } else {
    gdn_delta_rule_launch_recurrent(ctx, args);
  }
  return {};
}

}  // namespace tern
