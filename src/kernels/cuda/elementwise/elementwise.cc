// Argument checks of the elementwise kernels; the kernels are in elementwise.cu.
#include "kernels/cuda/elementwise/elementwise.h"

#include <cmath>
#include <limits>

namespace tern {
namespace {

constexpr int64_t kVecValues = 8;  // bf16 values per 16-byte access of the vectorised kernels
constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// A bf16 operand of a vectorised kernel: present and 16-byte aligned.
Expected<void> check_vec_operand(const char* kernel, const char* name, const void* ptr) {
  if (ptr == nullptr) return make_error("{}: {} is null", kernel, name);
  if (!aligned16(ptr)) return make_error("{}: {} is not 16-byte aligned", kernel, name);
  return {};
}

Expected<void> check_row_length(const char* kernel, const char* name, int64_t length) {
  if (length <= 0 || length % kVecValues != 0) {
    return make_error("{}: {}={} must be a positive multiple of {}", kernel, name, length, kVecValues);
  }
  return {};
}

Expected<void> check_count(const char* kernel, const char* name, int64_t count, int64_t row_length) {
  if (count < 0) return make_error("{}: {}={} is negative", kernel, name, count);
  if (count > kMaxCount || (row_length > 0 && count > std::numeric_limits<int64_t>::max() / 4 / row_length)) {
    return make_error("{}: {}={} is too large", kernel, name, count);
  }
  return {};
}

Expected<void> rms_norm_validate(const RmsNormArgs& a) {
  constexpr const char* k = "rms_norm";
  TERN_TRY(check_row_length(k, "dim", a.dim));
  if (a.dim > kRmsNormMaxDim) return make_error("{}: dim={} exceeds the kernel's limit {}", k, a.dim, kRmsNormMaxDim);
  TERN_TRY(check_count(k, "rows", a.rows, a.dim));
  TERN_TRY(check_vec_operand(k, "x", a.x));
  TERN_TRY(check_vec_operand(k, "weight", a.weight));
  TERN_TRY(check_vec_operand(k, "y", a.y));
  if (a.residual != nullptr || a.h_out != nullptr) {
    TERN_TRY(check_vec_operand(k, "residual", a.residual));
    TERN_TRY(check_vec_operand(k, "h_out (needed with a residual)", a.h_out));
  }
  if (a.gate != nullptr) TERN_TRY(check_vec_operand(k, "gate", a.gate));
  if (a.gate_stride != 0) {
    if (a.gate_heads <= 0 || a.rows % a.gate_heads != 0) {
      return make_error("{}: gate_heads={} must be positive and divide rows={}", k, a.gate_heads, a.rows);
    }
    if (a.gate_stride < a.gate_heads * a.dim || a.gate_stride % 8 != 0) {
      return make_error("{}: gate_stride={} must be a multiple of 8 (16-byte rows) and at least gate_heads * dim = {}",
                        k, a.gate_stride, a.gate_heads * a.dim);
    }
  }
  if (a.x_stride != 0) {
    if (a.residual != nullptr) return make_error("{}: x_stride with a residual is not supported", k);
    if (a.x_stride < a.dim || a.x_stride % 8 != 0) {
      return make_error("{}: x_stride={} must be a multiple of 8 (16-byte rows) and at least dim = {}", k, a.x_stride,
                        a.dim);
    }
  }
  if (a.y_stride != 0) {
    if (a.residual != nullptr) return make_error("{}: y_stride with a residual is not supported", k);
    if (a.y_stride < a.dim || a.y_stride % 8 != 0) {
      return make_error("{}: y_stride={} must be a multiple of 8 (16-byte rows) and at least dim = {}", k, a.y_stride,
                        a.dim);
    }
  }
  if (!(a.eps > 0.0f) || !std::isfinite(a.eps)) return make_error("{}: eps={} must be positive and finite", k, a.eps);
  return {};
}

Expected<void> rope_validate(const RopeArgs& a) {
  constexpr const char* k = "rope";
  if (a.head_dim <= 0 || a.head_dim % 2 != 0) return make_error("{}: head_dim={} must be positive and even", k, a.head_dim);
  if (a.rotary_dim <= 0 || a.rotary_dim % 2 != 0 || a.rotary_dim > a.head_dim) {
    return make_error("{}: rotary_dim={} must be positive, even and at most head_dim={}", k, a.rotary_dim, a.head_dim);
  }
  if (a.rotary_dim > kRopeMaxRotaryDim) {
    return make_error("{}: rotary_dim={} exceeds the kernel's limit {}", k, a.rotary_dim, kRopeMaxRotaryDim);
  }
  if (a.n_heads <= 0 || a.n_heads * a.head_dim / 2 > int64_t{65535} * 256) {
    return make_error("{}: n_heads={} out of range for head_dim={}", k, a.n_heads, a.head_dim);
  }
  TERN_TRY(check_count(k, "tokens", a.tokens, a.n_heads * a.head_dim));
  if (a.x == nullptr || a.y == nullptr || a.positions == nullptr || a.inv_freq == nullptr) {
    return make_error("{}: null pointer (x, y, positions or inv_freq)", k);
  }
  return {};
}

}  // namespace

Expected<void> rms_norm(const DeviceContext& ctx, const RmsNormArgs& args) {
  TERN_TRY(rms_norm_validate(args));
  if (args.rows > 0) rms_norm_launch(ctx, args);
  return {};
}

Expected<void> rope(const DeviceContext& ctx, const RopeArgs& args) {
  TERN_TRY(rope_validate(args));
  if (args.tokens > 0) rope_launch(ctx, args);
  return {};
}

Expected<void> silu_mul(const DeviceContext& ctx, const SiluMulArgs& a) {
  constexpr const char* k = "silu_mul";
  TERN_TRY(check_row_length(k, "inter", a.inter));
  TERN_TRY(check_count(k, "rows", a.rows, 2 * a.inter));
  TERN_TRY(check_vec_operand(k, "gate_up", a.gate_up));
  TERN_TRY(check_vec_operand(k, "y", a.y));
  if (a.gate_up_stride != 0 && (a.gate_up_stride < 2 * a.inter || a.gate_up_stride % 8 != 0)) {
    return make_error("{}: gate_up_stride={} must be a multiple of 8 (16-byte rows) and at least 2 * inter = {}", k,
                      a.gate_up_stride, 2 * a.inter);
  }
  if (a.rows > 0) silu_mul_launch(ctx, a);
  return {};
}

Expected<void> residual_add(const DeviceContext& ctx, const ResidualAddArgs& a) {
  constexpr const char* k = "residual_add";
  if (a.n % kVecValues != 0) return make_error("{}: n={} must be a multiple of {}", k, a.n, kVecValues);
  TERN_TRY(check_count(k, "n / 8", a.n / kVecValues, kVecValues));
  TERN_TRY(check_vec_operand(k, "a", a.a));
  TERN_TRY(check_vec_operand(k, "b", a.b));
  TERN_TRY(check_vec_operand(k, "y", a.y));
  if (a.n > 0) residual_add_launch(ctx, a);
  return {};
}

Expected<void> embedding_lookup(const DeviceContext& ctx, const EmbeddingArgs& a) {
  constexpr const char* k = "embedding";
  TERN_TRY(check_row_length(k, "hidden", a.hidden));
  if (a.vocab <= 0 || a.vocab > kMaxCount) return make_error("{}: vocab={} out of range", k, a.vocab);
  TERN_TRY(check_count(k, "tokens", a.tokens, a.hidden));
  TERN_TRY(check_vec_operand(k, "table", a.table));
  TERN_TRY(check_vec_operand(k, "y", a.y));
  if (a.ids == nullptr || a.bad == nullptr) return make_error("{}: null pointer (ids or bad-id report)", k);
  if (a.tokens > 0) embedding_launch(ctx, a);
  return {};
}

Expected<void> embedding_check_ids(const DeviceContext& ctx, const EmbeddingArgs& a) {
  if (a.tokens == 0) return {};
  unsigned long long bad = kEmbeddingNoBadId;
  TERN_CUDA_CHECK(cudaMemcpyAsync(&bad, a.bad, sizeof(bad), cudaMemcpyDeviceToHost, ctx.stream()));
  ctx.synchronize();
  if (bad == kEmbeddingNoBadId) return {};
  const int64_t token = static_cast<int64_t>(bad >> 32);
  const int32_t id = static_cast<int32_t>(static_cast<uint32_t>(bad & 0xFFFFFFFFull));
  return make_error("embedding: token {} has id {} outside the vocabulary [0, {})", token, id, a.vocab);
}

std::vector<float> rope_inv_freq(int64_t rotary_dim, double theta) {
  std::vector<float> inv_freq;
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
    inv_freq.push_back(1.0f / std::pow(static_cast<float>(theta), exponent));
  }
  return inv_freq;
}

}  // namespace tern
