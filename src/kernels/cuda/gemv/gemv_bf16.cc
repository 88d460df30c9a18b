// Argument checks and the group size of the BF16 GEMV; the kernel is in gemv_bf16.cu.
#include "kernels/cuda/gemv/gemv_bf16.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

namespace tern {
namespace {

// Blocks per SM the grid should offer before groups grow (several resident blocks hide each other's reductions
// and tails; fewer, longer groups keep the shuffle work per weight small).
constexpr int64_t kMinBlocksPerSm = 2;
constexpr int64_t kBlockThreads = 256;  // gemv_bf16.cu's kThreads
constexpr int64_t kGroupCols = 4;       // gemv_bf16.cu's kCols

bool is_aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

Expected<void> gemv_bf16_validate(const GemmBf16Args& a) {
  if (a.m < 0 || a.n <= 0 || a.k <= 0) return make_error("gemv_bf16: bad shape m={} n={} k={}", a.m, a.n, a.k);
  if (a.m > kGemvMaxRows) {
    return make_error("gemv_bf16: m={} is more rows than the GEMV takes (kGemvMaxRows = {}); use gemm_bf16", a.m,
                      kGemvMaxRows);
  }
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (a.n > kMaxDim || a.k > kMaxDim) return make_error("gemv_bf16: dimension over 2^31-1 (n={} k={})", a.n, a.k);
  if (a.k % 8 != 0) return make_error("gemv_bf16: k={} is not a multiple of 8 (16-byte rows of x and W)", a.k);
  if (a.x == nullptr) return make_error("gemv_bf16: x is a null pointer");
  if (a.w == nullptr) return make_error("gemv_bf16: w is a null pointer");
  if (a.y == nullptr) return make_error("gemv_bf16: y is a null pointer");
  if (!is_aligned(a.x, 16)) return make_error("gemv_bf16: x is not 16-byte aligned");
  if (!is_aligned(a.w, 16)) return make_error("gemv_bf16: w is not 16-byte aligned");
  if (!is_aligned(a.y, 2)) return make_error("gemv_bf16: y is not 2-byte aligned");
  if (a.ldy != 0 && a.ldy < a.n) return make_error("gemv_bf16: ldy={} is less than n={}", a.ldy, a.n);
  return {};
}

// [a, a + bytes) and [b, b + bytes) share a byte (null pointers share none).
bool overlaps(const void* a, const void* b, size_t bytes) {
  if (a == nullptr || b == nullptr) return false;
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + bytes && pb < pa + bytes;
}

Expected<void> gemv_norm_validate(const GemmBf16Args& a, const GemvNormArgs& n) {
  if (n.weight == nullptr) return make_error("gemv_bf16_rmsnorm: the norm weight is a null pointer");
  if (!is_aligned(n.weight, 16)) return make_error("gemv_bf16_rmsnorm: the norm weight is not 16-byte aligned");
  if (!is_aligned(n.residual, 16) || !is_aligned(n.h_out, 16) || !is_aligned(n.x_out, 16)) {
    return make_error("gemv_bf16_rmsnorm: residual, h_out and x_out must be 16-byte aligned");
  }
  if (!(n.eps > 0.0f) || !std::isfinite(n.eps)) {
    return make_error("gemv_bf16_rmsnorm: eps={} must be positive and finite", n.eps);
  }
  const auto bytes = static_cast<size_t>(a.m * a.k) * 2;
  for (const uint16_t* out : {static_cast<const uint16_t*>(n.h_out), static_cast<const uint16_t*>(n.x_out)}) {
    if (overlaps(out, a.x, bytes) || overlaps(out, n.residual, bytes)) {
      return make_error("gemv_bf16_rmsnorm: h_out and x_out must not overlap x or residual, which every block reads");
    }
  }
  return {};
}

Expected<void> gemv_silu_validate(const GemmBf16Args& a, int64_t ldx) {
  if (ldx < 2 * a.k) {
    return make_error("gemv_bf16_silu_mul: ldx={} is less than 2k={} (a row holds gate and up, k each)", ldx, 2 * a.k);
  }
  if (ldx % 8 != 0) return make_error("gemv_bf16_silu_mul: ldx={} is not a multiple of 8 (16-byte rows)", ldx);
  return {};
}

// The product's parameters without a prologue (ldy 0 read as n).
// gemv_bf16_silu_mul_moe_combine's combine: the product's tokens and hidden size, a top_k the epilogue takes, and
// the pointers it reads (shared_out and y are not used).
Expected<void> gemv_combine_validate(const GemmBf16Args& a, const MoeCombineArgs& c) {
  constexpr const char* k = "gemv_bf16_silu_mul_moe_combine";
  if (c.tokens != a.m || c.hidden != a.n) {
    return make_error("{}: the combine's {} tokens x hidden {} are not the product's m={} x n={}", k, c.tokens,
                      c.hidden, a.m, a.n);
  }
  if (c.top_k < 1 || c.top_k > kGemvCombineMaxTopK) {
    return make_error("{}: top_k={} must be in [1, {}]", k, c.top_k, kGemvCombineMaxTopK);
  }
  // shared_gate may be null: the shared expert is then added unweighted.
  const std::pair<const void*, const char*> ptrs[] = {{c.expert_out, "expert_out"},
                                                      {c.pair_row, "pair_row"},
                                                      {c.topk_ids, "topk_ids"},
                                                      {c.topk_weights, "topk_weights"}};
  for (const auto& [ptr, name] : ptrs) {
    if (ptr == nullptr) return make_error("{}: {} is null", k, name);
  }
  if (reinterpret_cast<uintptr_t>(c.expert_out) % 2 != 0 || reinterpret_cast<uintptr_t>(c.shared_gate) % 2 != 0 ||
      reinterpret_cast<uintptr_t>(c.pair_row) % 4 != 0 || reinterpret_cast<uintptr_t>(c.topk_ids) % 4 != 0 ||
      reinterpret_cast<uintptr_t>(c.topk_weights) % 4 != 0) {
    return make_error("{}: a combine pointer is misaligned (bf16 ones 2 bytes, ids, rows and weights 4)", k);
  }
  if (c.expert_begin < 0 || c.expert_begin >= c.expert_end) {
    return make_error("{}: experts [{}, {}) are empty", k, c.expert_begin, c.expert_end);
  }
  if (c.shared_gate != nullptr && c.shared_gate_stride < 1)
    return make_error("{}: shared_gate_stride={} must be positive", k, c.shared_gate_stride);
  return {};
}

GemvBf16Params gemv_params(const GemmBf16Args& a) {
  return GemvBf16Params{.x = a.x,
                        .w = a.w,
                        .y = a.y,
                        .m = static_cast<int>(a.m),
                        .n = a.n,
                        .k = a.k,
                        .ldy = a.ldy > 0 ? a.ldy : a.n};
}

}  // namespace

int gemv_bf16_group_threads(int m, int64_t n, int64_t k, int num_sms) {
  const int64_t n_chunks = k / 8;
  if (m == 1) {
    int64_t threads = 32;
    while (threads < kBlockThreads && threads < n_chunks) threads *= 2;
    return static_cast<int>(threads);
  }
  auto blocks = [n](int64_t threads) {
    const int64_t cols = kBlockThreads / threads * kGroupCols;
    return (n + cols - 1) / cols;
  };
  // Grow the group (more blocks, each thread a shorter stretch of k) while the grid is short of blocks and the
  // group still has fewer threads than k has chunks.
  int64_t threads = 32;
  while (threads < kBlockThreads && threads < n_chunks && blocks(threads) < kMinBlocksPerSm * num_sms) threads *= 2;
  return static_cast<int>(threads);
}

Expected<void> gemv_bf16(const DeviceContext& ctx, const GemmBf16Args& args) {
  TERN_TRY(gemv_bf16_validate(args));
  if (args.m == 0) return {};
  gemv_bf16_launch(ctx, gemv_params(args));
  return {};
}

Expected<void> gemv_bf16_rmsnorm(const DeviceContext& ctx, const GemmBf16Args& args, const GemvNormArgs& norm) {
  TERN_TRY(gemv_bf16_validate(args));
  TERN_TRY(gemv_norm_validate(args, norm));
  if (args.m == 0) return {};
  GemvBf16Params p = gemv_params(args);
  p.norm_weight = norm.weight;
  p.residual = norm.residual;
  p.norm_eps = norm.eps;
  p.norm_zero_centred = norm.zero_centred;
  p.h_out = norm.h_out;
  p.x_out = norm.x_out;
  gemv_bf16_launch(ctx, p);
  return {};
}

Expected<void> gemv_bf16_silu_mul(const DeviceContext& ctx, const GemmBf16Args& args, int64_t ldx) {
  TERN_TRY(gemv_bf16_validate(args));
  TERN_TRY(gemv_silu_validate(args, ldx));
  if (args.m == 0) return {};
  GemvBf16Params p = gemv_params(args);
  p.silu_ldx = ldx;
  gemv_bf16_launch(ctx, p);
  return {};
}

Expected<void> gemv_bf16_silu_mul_moe_combine(const DeviceContext& ctx, const GemmBf16Args& args, int64_t ldx,
                                              const MoeCombineArgs& combine) {
  TERN_TRY(gemv_bf16_validate(args));
  TERN_TRY(gemv_silu_validate(args, ldx));
  TERN_TRY(gemv_combine_validate(args, combine));
  if (args.m == 0) return {};
  GemvBf16Params p = gemv_params(args);
  p.silu_ldx = ldx;
  const GemvMoeCombine epilogue{.expert_out = combine.expert_out,
                                .pair_row = combine.pair_row,
                                .topk_ids = combine.topk_ids,
                                .topk_weights = combine.topk_weights,
                                .top_k = static_cast<int>(combine.top_k),
                                .gate = combine.shared_gate,
                                .gate_stride = combine.shared_gate_stride,
                                .expert_begin = combine.expert_begin,
                                .expert_end = combine.expert_end};
  gemv_bf16_launch(ctx, p, &epilogue);
  return {};
}

}  // namespace tern
