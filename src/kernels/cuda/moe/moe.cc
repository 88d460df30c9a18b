// Argument checks and dispatch of the MoE kernels; the kernels are in moe_route.cu (route, align, combine),
// moe_gemm_decode.cu and moe_gemm_prefill.cu (the grouped expert GEMM).
#include "kernels/cuda/moe/moe.h"

#include <cmath>
#include <limits>

#include "kernels/cuda/elementwise/elementwise.h"

namespace tern {
namespace {

// Row counts (tokens * top_k) and element offsets inside one row stay within int32 in the kernels.
constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max() / 2;
constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max() / 2;

bool is_aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

Expected<void> check_ptr(const char* kernel, const char* name, const void* ptr, uintptr_t align = 1) {
  if (ptr == nullptr) return make_error("{}: {} is null", kernel, name);
  if (!is_aligned(ptr, align)) return make_error("{}: {} is not {}-byte aligned", kernel, name, align);
  return {};
}

Expected<void> check_n_experts(const char* kernel, int64_t n_experts) {
  if (n_experts < 1 || n_experts > kMoeMaxExperts) {
    return make_error("{}: n_experts={} must be in [1, {}]", kernel, n_experts, kMoeMaxExperts);
  }
  return {};
}

// tokens and top_k: the (token, j) pairs.
Expected<void> check_pairs(const char* kernel, int64_t tokens, int64_t top_k) {
  if (top_k < 1 || top_k > kMoeMaxTopK) return make_error("{}: top_k={} must be in [1, {}]", kernel, top_k, kMoeMaxTopK);
  if (tokens < 0 || tokens > kMaxRows / top_k) {
    return make_error("{}: tokens={} out of range for top_k={}", kernel, tokens, top_k);
  }
  return {};
}

// tokens, n_experts and top_k as the routing takes them (top_k of the n_experts).
Expected<void> check_routing_shape(const char* kernel, int64_t tokens, int64_t n_experts, int64_t top_k) {
  TERN_TRY(check_n_experts(kernel, n_experts));
  if (top_k > n_experts) return make_error("{}: top_k={} is more than n_experts={}", kernel, top_k, n_experts);
  return check_pairs(kernel, tokens, top_k);
}

// This rank's experts [begin, begin + count) of the router's n_experts (expert parallelism; all of them: 0, n).
Expected<void> check_expert_range(const char* kernel, int64_t begin, int64_t count, int64_t n_experts) {
  if (begin < 0 || count < 1 || begin + count > n_experts) {
    return make_error("{}: experts [{}, {}) are not within the router's {}", kernel, begin, begin + count, n_experts);
  }
  return {};
}

// The routing mode (MoeRouteArgs): sigmoid routing's groups, scaling and bias, or softmax's defaults for them.
struct RoutingMode {
  bool sigmoid;
  int64_t n_group, topk_group;
  float routed_scaling;
  const float* correction_bias;
};

Expected<void> check_routing_mode(const char* kernel, const RoutingMode& m, int64_t n_experts, int64_t top_k) {
  if (!m.sigmoid) {
    if (m.n_group != 1 || m.topk_group != 1 || m.routed_scaling != 1.0f || m.correction_bias != nullptr) {
      return make_error("{}: expert groups (n_group={}, topk_group={}), routed_scaling={} and a correction_bias are "
                        "sigmoid routing's; softmax routing takes 1, 1, 1 and none",
                        kernel, m.n_group, m.topk_group, m.routed_scaling);
    }
    return {};
  }
  if (m.n_group < 1 || m.n_group > kMoeMaxGroups) {
    return make_error("{}: n_group={} must be in [1, {}]", kernel, m.n_group, kMoeMaxGroups);
  }
  if (n_experts % m.n_group != 0) {
    return make_error("{}: n_experts={} is not a multiple of n_group={}", kernel, n_experts, m.n_group);
  }
  if (m.topk_group < 1 || m.topk_group > m.n_group) {
    return make_error("{}: topk_group={} must be in [1, n_group={}]", kernel, m.topk_group, m.n_group);
  }
  const int64_t kept = m.topk_group * (n_experts / m.n_group);
  if (top_k > kept) {
    return make_error("{}: top_k={} is more than the {} experts of the topk_group={} kept groups of {}", kernel, top_k,
                      kept, m.topk_group, n_experts / m.n_group);
  }
  if (!std::isfinite(m.routed_scaling)) {
    return make_error("{}: routed_scaling={} must be finite", kernel, m.routed_scaling);
  }
  if (!is_aligned(m.correction_bias, 4)) return make_error("{}: correction_bias is not 4-byte aligned", kernel);
  return {};
}

Expected<void> route_validate(const MoeRouteArgs& a) {
  constexpr const char* k = "moe_route";
  TERN_TRY(check_routing_shape(k, a.tokens, a.n_experts, a.top_k));
  TERN_TRY(check_routing_mode(k, {a.sigmoid, a.n_group, a.topk_group, a.routed_scaling, a.correction_bias},
                              a.n_experts, a.top_k));
  if (a.logits_stride < a.n_experts || a.logits_stride > kMaxDim) {
    return make_error("{}: logits_stride={} must be at least n_experts={}", k, a.logits_stride, a.n_experts);
  }
  if (a.logits_f32 != nullptr) {
    if (a.logits != nullptr || !a.sigmoid) {
      return make_error("{}: fp32 logits are for sigmoid routing, and instead of the bf16 ones", k);
    }
    TERN_TRY(check_ptr(k, "logits_f32", a.logits_f32, 4));
  } else {
    TERN_TRY(check_ptr(k, "logits", a.logits, 2));
  }
  TERN_TRY(check_ptr(k, "topk_ids", a.topk_ids, 4));
  return check_ptr(k, "topk_weights", a.topk_weights, 4);
}

Expected<void> align_validate(const MoeAlignArgs& a) {
  constexpr const char* k = "moe_align";
  // n_experts buckets; top_k may exceed them when they are one rank's share of the router's experts.
  TERN_TRY(check_n_experts(k, a.n_experts));
  TERN_TRY(check_pairs(k, a.tokens, a.top_k));
  TERN_TRY(check_expert_range(k, a.expert_begin, a.n_experts, INT32_MAX));
  TERN_TRY(check_ptr(k, "topk_ids", a.topk_ids, 4));
  TERN_TRY(check_ptr(k, "expert_offsets", a.expert_offsets, 4));
  TERN_TRY(check_ptr(k, "sorted_pairs", a.sorted_pairs, 4));
  TERN_TRY(check_ptr(k, "pair_row", a.pair_row, 4));
  if (a.decode_passes != nullptr) TERN_TRY(check_ptr(k, "decode_passes", a.decode_passes, 16));
  const size_t needed = moe_align_workspace_bytes(a.tokens, a.top_k, a.n_experts);
  if (needed > 0) TERN_TRY(check_ptr(k, "workspace", a.workspace, 4));
  if (a.workspace_bytes < needed || (needed > 0 && a.workspace == nullptr)) {
    return make_error("{}: workspace of {} bytes at {} is smaller than the {} bytes needed", k, a.workspace_bytes,
                      a.workspace, needed);
  }
  return {};
}

// A route and the align that sorts its ids, as one launch does both.
Expected<void> route_align_validate(const char* k, const MoeRouteArgs& route, const MoeAlignArgs& align) {
  TERN_TRY(route_validate(route));
  TERN_TRY(align_validate(align));
  if (align.topk_ids != route.topk_ids || align.tokens != route.tokens || align.top_k != route.top_k) {
    return make_error("{}: align must sort the route's topk_ids (same pointer, tokens and top_k)", k);
  }
  TERN_TRY(check_expert_range(k, align.expert_begin, align.n_experts, route.n_experts));
  return {};
}

const char* format_name(MoeWeightFormat f) {
  switch (f) {
    case MoeWeightFormat::kBf16: return "bf16";
    case MoeWeightFormat::kNvfp4: return "nvfp4";
    case MoeWeightFormat::kFp8: return "fp8";
  }
  return "unknown";
}

Expected<void> weights_validate(const char* k, const MoeExpertWeights& w) {
  if (w.n < 1 || w.n > kMaxDim) return make_error("{}: n={} out of range", k, w.n);
  if (w.k < 16 || w.k % 16 != 0 || w.k > kMaxDim) {
    return make_error("{}: k={} must be a positive multiple of 16", k, w.k);
  }
  if (w.format == MoeWeightFormat::kBf16) {
    TERN_TRY(check_ptr(k, "bf16 weight", w.bf16, 16));
    if (w.bf16_expert_stride < w.n * w.k || w.bf16_expert_stride % 8 != 0) {
      return make_error("{}: bf16_expert_stride={} must be a multiple of 8 and at least n*k={}", k,
                        w.bf16_expert_stride, w.n * w.k);
    }
    return {};
  }
  if (w.format == MoeWeightFormat::kFp8) {
    // The codes are read 16 at a time, so every row (k % 16 == 0) of every expert starts 16-byte aligned.
    TERN_TRY(check_ptr(k, "fp8 codes (packed)", w.packed, 16));
    TERN_TRY(check_ptr(k, "fp8 row_scales", w.row_scales, 4));
    if (w.packed_expert_stride < w.n * w.k || w.packed_expert_stride % 16 != 0) {
      return make_error("{}: packed_expert_stride={} of the fp8 codes must be a multiple of 16 and at least n*k={}", k,
                        w.packed_expert_stride, w.n * w.k);
    }
    const int64_t scale_cols = (w.k + 127) / 128;
    if (w.row_scales_expert_stride < w.n * scale_cols) {
      return make_error("{}: row_scales_expert_stride={} must be at least n*ceil(k/128)={}", k,
                        w.row_scales_expert_stride, w.n * scale_cols);
    }
    return {};
  }
  if (w.format != MoeWeightFormat::kNvfp4) return make_error("{}: unknown weight format", k);
  TERN_TRY(check_ptr(k, "packed weight", w.packed, 8));
  TERN_TRY(check_ptr(k, "weight scales", w.scales, 1));
  TERN_TRY(check_ptr(k, "global_scales", w.global_scales, 4));
  if (w.packed_expert_stride < w.n * w.k / 2 || w.packed_expert_stride % 8 != 0) {
    return make_error("{}: packed_expert_stride={} must be a multiple of 8 and at least n*k/2={}", k,
                      w.packed_expert_stride, w.n * w.k / 2);
  }
  if (w.scales_expert_stride < w.n * w.k / 16) {
    return make_error("{}: scales_expert_stride={} must be at least n*k/16={}", k, w.scales_expert_stride,
                      w.n * w.k / 16);
  }
  return {};
}

// MoeGemmArgs::w2: the same experts, k and format as w, its columns of y beside w's and inside ldy.
Expected<void> second_projection_validate(const MoeGemmArgs& a) {
  constexpr const char* k = "moe_gemm";
  if (a.w2.n == 0) return {};
  TERN_TRY(weights_validate("moe_gemm: w2", a.w2));
  if (a.w2.format != a.w.format || a.w2.n_experts != a.w.n_experts || a.w2.k != a.w.k) {
    return make_error("{}: w2 ({} experts, k={}, {}) must have w's {} experts, k={} and format ({})", k,
                      a.w2.n_experts, a.w2.k, format_name(a.w2.format), a.w.n_experts, a.w.k, format_name(a.w.format));
  }
  if (a.y2_offset < a.w.n || a.y2_offset > a.ldy - a.w2.n) {
    return make_error("{}: y2_offset={} must be in [n={}, ldy - w2.n={}]", k, a.y2_offset, a.w.n, a.ldy - a.w2.n);
  }
  return {};
}

Expected<void> gemm_validate(const MoeGemmArgs& a) {
  constexpr const char* k = "moe_gemm";
  if (a.decode_token_tiles < 0 || a.decode_token_tiles > 2) {
    return make_error("{}: decode_token_tiles={} must be 0 (the launcher's rule), 1 or 2", k, a.decode_token_tiles);
  }
  const MoeExpertWeights& w = a.w;
  if (w.n_experts < 1 || w.n_experts > kMoeMaxExperts) {
    return make_error("{}: n_experts={} must be in [1, {}]", k, w.n_experts, kMoeMaxExperts);
  }
  TERN_TRY(weights_validate(k, w));
  if (a.rows < 0 || a.rows > kMaxRows) return make_error("{}: rows={} out of range", k, a.rows);
  if (a.top_k < 1 || a.top_k > kMoeMaxTopK) return make_error("{}: top_k={} out of range", k, a.top_k);
  TERN_TRY(check_ptr(k, "x", a.x, 16));
  if (a.ldx < w.k || a.ldx % 8 != 0 || a.ldx > kMaxDim) {
    return make_error("{}: ldx={} must be a multiple of 8 and at least k={}", k, a.ldx, w.k);
  }
  TERN_TRY(check_ptr(k, "y", a.y, 4));
  if (a.ldy < w.n || a.ldy > kMaxDim) return make_error("{}: ldy={} must be at least n={}", k, a.ldy, w.n);
  if (a.route.logits == nullptr) {
    TERN_TRY(check_ptr(k, "expert_offsets", a.expert_offsets, 4));
    if (a.gather) TERN_TRY(check_ptr(k, "sorted_pairs (needed to gather)", a.sorted_pairs, 4));
  }
  if (a.decode_passes != nullptr) {
    TERN_TRY(check_ptr(k, "decode_passes", a.decode_passes, 16));
    if (a.decode_token_tiles == 2 || a.route.logits != nullptr) {
      return make_error("{}: decode_passes are one-tile passes found in the list: not with decode_token_tiles=2 or "
                        "routing in the launch", k);
    }
  }
  return second_projection_validate(a);
}

// MoeGemmArgs::route: one token's pairs on the decode kernel, gathered, and a route + align of that token over w's
// experts.
Expected<void> route_in_launch_validate(const MoeGemmArgs& a, bool decode) {
  constexpr const char* k = "moe_gemm";
  if (!decode || a.x_silu_mul || !a.gather || a.route.tokens != 1 || a.rows != a.top_k || a.route.top_k != a.top_k) {
    return make_error(
        "{}: routing in the launch needs the decode variant, one token (route.tokens = 1, rows = "
        "top_k = route.top_k; got {}, {}, {}, {}), gathered rows and no x_silu_mul",
        k, a.route.tokens, a.rows, a.top_k, a.route.top_k);
  }
  if (a.route.n_experts != a.w.n_experts || a.align.expert_begin != 0) {
    return make_error("{}: route has {} experts, the weights {} (from {}): routing in the launch needs all of them",
                      k, a.route.n_experts, a.w.n_experts, a.align.expert_begin);
  }
  if (a.route.sigmoid) {
    return make_error("{}: routing in the launch is softmax only (route sigmoid routing with moe_route_align)", k);
  }
  return route_align_validate(k, a.route, a.align);
}

// MoeGemmArgs::x_silu_mul: the decode kernel, [gate | up] rows inside ldx, and room for the act rows.
Expected<void> silu_mul_x_validate(const DeviceContext& ctx, const MoeGemmArgs& a, bool decode) {
  constexpr const char* k = "moe_gemm";
  if (!decode) return make_error("{}: x_silu_mul needs the decode variant (rows={})", k, a.rows);
  if (a.ldx < 2 * a.w.k) return make_error("{}: ldx={} must be at least 2k={} with x_silu_mul", k, a.ldx, 2 * a.w.k);
  const size_t smem = moe_gemm_silu_smem_bytes(a.w.k);
  if (smem > ctx.props().shared_mem_per_block_optin) {
    return make_error("{}: x_silu_mul with k={} needs {} bytes of shared memory per block, the device allows {}", k,
                      a.w.k, smem, ctx.props().shared_mem_per_block_optin);
  }
  return {};
}

// The pieces of moe_forward's workspace, each 256-byte aligned.
struct ForwardLayout {
  size_t ids, weights, offsets, sorted_pairs, pair_row, gate_up, act, expert_out, passes, align, total;
};

ForwardLayout forward_layout(int64_t tokens, int64_t top_k, int64_t n_experts, int64_t inter, int64_t hidden) {
  const auto rows = static_cast<size_t>(tokens * top_k);
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t here = at;
    at += (bytes + 255) / 256 * 256;
    return here;
  };
  ForwardLayout l{};
  l.ids = take(rows * 4);
  l.weights = take(rows * 4);
  l.offsets = take(static_cast<size_t>(n_experts + 1) * 4);
  l.sorted_pairs = take(rows * 4);
  l.pair_row = take(rows * 4);
  l.gate_up = take(rows * static_cast<size_t>(2 * inter) * 2);
  l.act = take(rows * static_cast<size_t>(inter) * 2);
  l.expert_out = take(rows * static_cast<size_t>(hidden) * 2);
  l.passes = take(static_cast<size_t>(moe_decode_pass_slots(tokens * top_k, n_experts)) * 16);
  l.align = take(moe_align_workspace_bytes(tokens, top_k, n_experts));
  l.total = at;
  return l;
}

Expected<void> forward_validate(const MoeForwardArgs& a) {
  constexpr const char* k = "moe_forward";
  TERN_TRY(check_routing_shape(k, a.tokens, a.n_experts, a.top_k));
  TERN_TRY(check_routing_mode(k, {a.sigmoid, a.n_group, a.topk_group, a.routed_scaling, a.correction_bias},
                              a.n_experts, a.top_k));
  if (a.inter < 8 || a.inter % 8 != 0) return make_error("{}: inter={} must be a positive multiple of 8", k, a.inter);
  // The weights hold this rank's experts [expert_begin, expert_begin + local) of the router's.
  const int64_t local = a.gate_up.n_experts;
  TERN_TRY(check_expert_range(k, a.expert_begin, local, a.n_experts));
  const bool split = a.up.n != 0;
  const int64_t gate_n = split ? a.inter : 2 * a.inter;
  if (a.gate_up.n != gate_n || a.gate_up.k != a.hidden) {
    return make_error("{}: {} weights are [{}][{}][{}], want [{}][{}][{}]", k, split ? "gate" : "gate_up",
                      a.gate_up.n_experts, a.gate_up.n, a.gate_up.k, local, gate_n, a.hidden);
  }
  if (split && (a.up.n_experts != local || a.up.n != a.inter || a.up.k != a.hidden)) {
    return make_error("{}: up weights are [{}][{}][{}], want [{}][{}][{}]", k, a.up.n_experts, a.up.n, a.up.k,
                      local, a.inter, a.hidden);
  }
  if (a.down.n_experts != local || a.down.n != a.hidden || a.down.k != a.inter) {
    return make_error("{}: down weights are [{}][{}][{}], want [{}][{}][{}]", k, a.down.n_experts, a.down.n, a.down.k,
                      local, a.hidden, a.inter);
  }
  const size_t needed = moe_forward_workspace_bytes(a.tokens, a.top_k, a.n_experts, a.inter, a.hidden);
  if (a.workspace_bytes < needed) {
    return make_error("{}: workspace of {} bytes is smaller than the {} bytes needed", k, a.workspace_bytes, needed);
  }
  return check_ptr(k, "workspace", a.workspace, 256);
}

Expected<void> combine_validate(const MoeCombineArgs& a) {
  constexpr const char* k = "moe_combine";
  if (a.top_k < 1 || a.top_k > kMoeMaxTopK) return make_error("{}: top_k={} out of range", k, a.top_k);
  if (a.tokens < 0 || a.tokens > kMaxRows / a.top_k) return make_error("{}: tokens={} out of range", k, a.tokens);
  if (a.hidden < 8 || a.hidden % 8 != 0 || a.hidden > kMaxDim) {
    return make_error("{}: hidden={} must be a positive multiple of 8", k, a.hidden);
  }
  TERN_TRY(check_ptr(k, "expert_out", a.expert_out, 16));
  TERN_TRY(check_ptr(k, "pair_row", a.pair_row, 4));
  TERN_TRY(check_ptr(k, "topk_ids", a.topk_ids, 4));
  TERN_TRY(check_ptr(k, "topk_weights", a.topk_weights, 4));
  TERN_TRY(check_ptr(k, "y", a.y, 16));
  if (a.expert_begin < 0 || a.expert_begin >= a.expert_end) {
    return make_error("{}: experts [{}, {}) are empty", k, a.expert_begin, a.expert_end);
  }
  // A shared expert without a gate is added unweighted; a gate without a shared expert is a caller's mistake.
  if (a.shared_gate != nullptr) TERN_TRY(check_ptr(k, "shared_out (needed with shared_gate)", a.shared_out, 16));
  if (a.shared_out != nullptr) TERN_TRY(check_ptr(k, "shared_out", a.shared_out, 16));
  if (a.shared_gate != nullptr) {
    TERN_TRY(check_ptr(k, "shared_gate", a.shared_gate, 2));
    if (a.shared_gate_stride < 1 || a.shared_gate_stride > kMaxDim) {
      return make_error("{}: shared_gate_stride={} must be positive", k, a.shared_gate_stride);
    }
  }
  return {};
}

}  // namespace

size_t moe_align_workspace_bytes(int64_t tokens, int64_t top_k, int64_t n_experts) {
  return moe_align_workspace_ints(tokens, top_k, n_experts) * sizeof(int32_t);
}

Expected<void> moe_route(const DeviceContext& ctx, const MoeRouteArgs& args) {
  TERN_TRY(route_validate(args));
  if (args.tokens > 0) moe_route_launch(ctx, args);
  return {};
}

Expected<void> moe_align(const DeviceContext& ctx, const MoeAlignArgs& args) {
  TERN_TRY(align_validate(args));
  // With no tokens the offsets are still written (all zero), so a following GEMM sees empty experts.
  moe_align_launch(ctx, args);
  return {};
}

Expected<void> moe_route_align(const DeviceContext& ctx, const MoeRouteArgs& route, const MoeAlignArgs& align) {
  constexpr const char* k = "moe_route_align";
  TERN_TRY(route_align_validate(k, route, align));
  if (route.tokens * route.top_k > kMoeRouteAlignMaxPairs) {
    return make_error("{}: tokens * top_k = {} is more than the {} pairs of one block", k, route.tokens * route.top_k,
                      kMoeRouteAlignMaxPairs);
  }
  moe_route_align_launch(ctx, route, align);  // with no tokens it still writes the (all-zero) offsets
  return {};
}

Expected<void> moe_gemm(const DeviceContext& ctx, const MoeGemmArgs& args, MoeGemmVariant variant) {
  TERN_TRY(gemm_validate(args));
  const bool decode = variant == MoeGemmVariant::kDecode ||
                      (variant == MoeGemmVariant::kAuto && args.rows <= kMoeDecodeMaxTokens * args.top_k);
  if (args.x_silu_mul) TERN_TRY(silu_mul_x_validate(ctx, args, decode));
  if (args.route.logits != nullptr) TERN_TRY(route_in_launch_validate(args, decode));
  if (args.rows == 0) return {};
  if (decode) {
    moe_gemm_launch_decode(ctx, args);
  } else if (variant != MoeGemmVariant::kPrefillMma && moe_gemm_prefill_rs_fits(ctx, args)) {
    moe_gemm_launch_prefill_rs(ctx, args);
  } else if (variant != MoeGemmVariant::kPrefillMma && moe_gemm_prefill_sm90_fits(ctx, args)) {
    moe_gemm_launch_prefill_sm90(ctx, args);
  } else {
    moe_gemm_launch_prefill(ctx, args);
  }
  return {};
}

Expected<void> moe_combine(const DeviceContext& ctx, const MoeCombineArgs& args) {
  TERN_TRY(combine_validate(args));
  if (args.tokens > 0) moe_combine_launch(ctx, args);
  return {};
}

size_t moe_forward_workspace_bytes(int64_t tokens, int64_t top_k, int64_t n_experts, int64_t inter, int64_t hidden) {
  return forward_layout(tokens, top_k, n_experts, inter, hidden).total;
}

namespace {

// moe_forward's workspace as typed pointers.
struct ForwardBuffers {
  int32_t* ids;
  float* weights;
  int32_t *offsets, *sorted_pairs, *pair_row;
  uint16_t *gate_up, *act, *expert_out;
  int32_t* passes;
  void* align;
  size_t align_bytes;
};

ForwardBuffers forward_buffers(const MoeForwardArgs& a) {
  const ForwardLayout l = forward_layout(a.tokens, a.top_k, a.n_experts, a.inter, a.hidden);
  auto* base = static_cast<unsigned char*>(a.workspace);
  return {.ids = reinterpret_cast<int32_t*>(base + l.ids),
          .weights = reinterpret_cast<float*>(base + l.weights),
          .offsets = reinterpret_cast<int32_t*>(base + l.offsets),
          .sorted_pairs = reinterpret_cast<int32_t*>(base + l.sorted_pairs),
          .pair_row = reinterpret_cast<int32_t*>(base + l.pair_row),
          .gate_up = reinterpret_cast<uint16_t*>(base + l.gate_up),
          .act = reinterpret_cast<uint16_t*>(base + l.act),
          .expert_out = reinterpret_cast<uint16_t*>(base + l.expert_out),
          .passes = reinterpret_cast<int32_t*>(base + l.passes),
          .align = base + l.align,
          .align_bytes = l.total - l.align};
}

struct Routing {
  MoeRouteArgs route;
  MoeAlignArgs align;
};

Routing routing_args(const MoeForwardArgs& a, const ForwardBuffers& b) {
  const MoeRouteArgs route{.logits = a.router_logits,
                           .logits_f32 = a.router_logits_f32,
                           .logits_stride = a.logits_stride,
                           .topk_ids = b.ids,
                           .topk_weights = b.weights,
                           .tokens = a.tokens,
                           .n_experts = a.n_experts,
                           .top_k = a.top_k,
                           .renormalize = a.renormalize,
                           .sigmoid = a.sigmoid,
                           .n_group = a.n_group,
                           .topk_group = a.topk_group,
                           .routed_scaling = a.routed_scaling,
                           .correction_bias = a.correction_bias};
  const MoeAlignArgs align{.topk_ids = b.ids,
                           .tokens = a.tokens,
                           .top_k = a.top_k,
                           .n_experts = a.gate_up.n_experts,
                           .expert_begin = a.expert_begin,
                           .expert_offsets = b.offsets,
                           .sorted_pairs = b.sorted_pairs,
                           .pair_row = b.pair_row,
                           .workspace = b.align,
                           .workspace_bytes = b.align_bytes,
                           .decode_passes = b.passes};
  return {route, align};
}

// Route and align: one launch at decode, where the pairs fit one block.
Expected<void> forward_route(const DeviceContext& ctx, const MoeForwardArgs& a, const ForwardBuffers& b, bool decode) {
  const Routing r = routing_args(a, b);
  if (decode && a.tokens * a.top_k <= kMoeRouteAlignMaxPairs) return moe_route_align(ctx, r.route, r.align);
  TERN_TRY(moe_route(ctx, r.route));
  return moe_align(ctx, r.align);
}

// gate_up [rows, 2I] = x . [gate | up]^T. At decode a separate up stack joins the gate's launch (w2), so one grid
// covers both; with route_in_launch that launch also routes the one token (MoeGemmArgs::route).
Expected<void> forward_gate_up(const DeviceContext& ctx, const MoeForwardArgs& a, const ForwardBuffers& b, bool decode,
                               bool route_in_launch) {
  const bool up_in_gate_launch = decode && a.up.n != 0;
  const Routing routing = route_in_launch ? routing_args(a, b) : Routing{};
  const MoeGemmArgs gate{.x = a.x,
                         .ldx = a.hidden,
                         .sorted_pairs = b.sorted_pairs,
                         .top_k = a.top_k,
                         .gather = true,
                         .expert_offsets = b.offsets,
                         .w = a.gate_up,
                         .y = b.gate_up,
                         .ldy = 2 * a.inter,
                         .rows = a.tokens * a.top_k,
                         .w2 = up_in_gate_launch ? a.up : MoeExpertWeights{},
                         .y2_offset = a.inter,
                         .route = routing.route,
                         .align = routing.align,
                         .decode_passes = b.passes};
  TERN_TRY(moe_gemm(ctx, gate, a.variant));
  if (a.up.n == 0 || up_in_gate_launch) return {};
  MoeGemmArgs up = gate;
  up.w = a.up;
  up.y = b.gate_up + a.inter;
  return moe_gemm(ctx, up, a.variant);
}

// expert_out [rows, H] = silu_mul(gate_up) . down^T. At decode the down GEMM computes silu(gate) * up itself while
// loading its input (x_silu_mul), where its shared memory allows.
Expected<void> forward_down(const DeviceContext& ctx, const MoeForwardArgs& a, const ForwardBuffers& b, bool decode) {
  const int64_t rows = a.tokens * a.top_k;
  const bool fold_silu = decode && moe_gemm_silu_smem_bytes(a.inter) <= ctx.props().shared_mem_per_block_optin;
  if (!fold_silu) TERN_TRY(silu_mul(ctx, {.gate_up = b.gate_up, .y = b.act, .rows = rows, .inter = a.inter}));
  return moe_gemm(ctx,
                  {.x = fold_silu ? b.gate_up : b.act,
                   .ldx = fold_silu ? 2 * a.inter : a.inter,
                   .sorted_pairs = b.sorted_pairs,
                   .top_k = a.top_k,
                   .gather = false,
                   .expert_offsets = b.offsets,
                   .w = a.down,
                   .y = b.expert_out,
                   .ldy = a.hidden,
                   .rows = rows,
                   .x_silu_mul = fold_silu,
                   .decode_passes = b.passes},
                  a.variant);
}

}  // namespace

// Every step is a checked launch, so a bad weight view or buffer is reported by the step that would use it. Decode
// (kDecode, or kAuto with few tokens, as moe_gemm decides) takes the fused launches.
Expected<MoeCombineArgs> moe_forward_experts(const DeviceContext& ctx, const MoeForwardArgs& a) {
  TERN_TRY(forward_validate(a));
  ForwardBuffers b = forward_buffers(a);
  const MoeCombineArgs combine{.expert_out = b.expert_out,
                               .pair_row = b.pair_row,
                               .topk_ids = b.ids,
                               .topk_weights = b.weights,
                               .shared_out = a.shared_out,
                               .shared_gate = a.shared_gate,
                               .shared_gate_stride = a.shared_gate_stride,
                               .y = a.y,
                               .tokens = a.tokens,
                               .top_k = a.top_k,
                               .hidden = a.hidden,
                               .expert_begin = static_cast<int32_t>(a.expert_begin),
                               .expert_end = static_cast<int32_t>(a.expert_begin + a.gate_up.n_experts)};
  if (a.tokens == 0) return combine;
  const bool decode =
      a.variant == MoeGemmVariant::kDecode || (a.variant == MoeGemmVariant::kAuto && a.tokens <= kMoeDecodeMaxTokens);
  // One token at decode: the gate/up launch routes it, and route and align are no launch of their own (softmax
  // routing only: the gate/up kernel's block routing has no sigmoid variant, so moe_route_align routes that token).
  // Nor under expert parallelism: the gate/up kernel's blocks route to all of the router's experts.
  const bool route_in_launch = decode && a.tokens == 1 && !a.sigmoid && a.gate_up.n_experts == a.n_experts;
  // Past kMoeDecodePassRows tokens an expert may have more rows than one decode pass: the align writes the pass
  // list and both decode GEMMs give each pass its own blocks (MoeGemmArgs::decode_passes).
  if (!decode || a.tokens <= kMoeDecodePassRows) b.passes = nullptr;
  if (!route_in_launch) TERN_TRY(forward_route(ctx, a, b, decode));
  TERN_TRY(forward_gate_up(ctx, a, b, decode, route_in_launch));
  TERN_TRY(forward_down(ctx, a, b, decode));
  return combine;
}

Expected<void> moe_forward(const DeviceContext& ctx, const MoeForwardArgs& a) {
  TERN_ASSIGN_OR_RETURN(const MoeCombineArgs combine, moe_forward_experts(ctx, a));
  if (a.tokens == 0) return {};
  return moe_combine(ctx, combine);
}

}  // namespace tern
