// The native block-scaled FP4 GEMM: argument checks, activation quantization and the cuBLASLt call. The contract is
// in gemm_nvfp4_native.h.
#include "kernels/cuda/gemm/gemm_nvfp4_native.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cuda/gemm/cublaslt_descs.h"
#include "kernels/cuda/nvfp4/nvfp4_quantize.h"
#include "kernels/cuda/nvfp4/nvfp4_scale_layout.h"

namespace tern {
namespace {

constexpr const char* kName = "gemm_nvfp4_native";
constexpr size_t kWorkspaceAlign = 256;  // the tiled scales start on their own 256-byte boundary

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

size_t packed_bytes_rounded(int64_t m, int64_t k) {
  const size_t bytes = static_cast<size_t>(m) * static_cast<size_t>(k / 2);
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

int64_t effective_ldy(const GemmNvfp4NativeArgs& a) { return a.ldy > 0 ? a.ldy : a.w.n; }

Expected<void> validate_shape(const GemmNvfp4NativeArgs& a) {
  const Nvfp4NativeWeightView& w = a.w;
  if (a.m < 0 || w.n <= 0 || w.k <= 0) return make_error("{}: bad shape m={} n={} k={}", kName, a.m, w.n, w.k);
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (a.m > kMaxDim || w.n > kMaxDim || w.k > kMaxDim) {
    return make_error("{}: dimension over 2^31-1 (m={} n={} k={})", kName, a.m, w.n, w.k);
  }
  if (w.k % 32 != 0) {
    return make_error("{}: k={} is not a multiple of 32 (cuBLASLt needs 16-byte rows of packed FP4)", kName, w.k);
  }
  if (a.ldy != 0 && a.ldy < w.n) return make_error("{}: ldy={} is less than n={}", kName, a.ldy, w.n);
  if (effective_ldy(a) % 8 != 0) {
    return make_error("{}: ldy={} is not a multiple of 8 (cuBLASLt needs 16-byte rows of y)", kName, effective_ldy(a));
  }
  if (!std::isfinite(w.global_scale)) return make_error("{}: weight_scale_2 is not finite ({})", kName, w.global_scale);
  if (!std::isfinite(a.input_scale) || !(a.input_scale > 0.0f)) {
    return make_error("{}: input_scale must be positive and finite, got {}", kName, a.input_scale);
  }
  if (!std::isfinite(w.global_scale * a.input_scale)) {
    return make_error("{}: alpha = weight_scale_2 * input_scale overflows", kName);
  }
  return {};
}

Expected<void> validate_pointers(const GemmNvfp4NativeArgs& a) {
  if (a.x == nullptr || a.w.packed == nullptr || a.w.scales_tiled == nullptr || a.input_scale_device == nullptr ||
      a.y == nullptr || a.workspace == nullptr) {
    return make_error("{}: null pointer (x, weight, weight scales, input_scale_device, y or workspace)", kName);
  }
  if (!is_aligned16(a.x)) return make_error("{}: x is not 16-byte aligned", kName);
  if (!is_aligned16(a.w.packed)) return make_error("{}: packed weight is not 16-byte aligned", kName);
  if (!is_aligned16(a.w.scales_tiled)) return make_error("{}: weight scales are not 16-byte aligned", kName);
  if (!is_aligned16(a.y)) return make_error("{}: y is not 16-byte aligned", kName);
  if (!is_aligned16(a.workspace)) return make_error("{}: workspace is not 16-byte aligned", kName);
  if (reinterpret_cast<uintptr_t>(a.input_scale_device) % 4 != 0) {
    return make_error("{}: input_scale_device is not 4-byte aligned", kName);
  }
  const size_t needed = gemm_nvfp4_native_workspace_bytes(std::min<int64_t>(a.m, 1), a.w.k);
  if (a.workspace_bytes < needed) {
    return make_error("{}: workspace of {} bytes, at least {} needed (one row of k={})", kName, a.workspace_bytes,
                      needed, a.w.k);
  }
  return {};
}

// The most rows whose quantized activations fit the workspace (a multiple of the 128-row scale tile past one tile).
int64_t rows_per_chunk(const GemmNvfp4NativeArgs& a) {
  if (gemm_nvfp4_native_workspace_bytes(a.m, a.w.k) <= a.workspace_bytes) return a.m;
  const size_t per_row = static_cast<size_t>(a.w.k / 2) + static_cast<size_t>(nvfp4_tiled_scale_cols(a.w.k));
  int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(a.workspace_bytes / per_row));
  while (rows > 1 && gemm_nvfp4_native_workspace_bytes(rows, a.w.k) > a.workspace_bytes) --rows;
  if (rows > kNvfp4ScaleTileRows) rows = rows / kNvfp4ScaleTileRows * kNvfp4ScaleTileRows;
  return rows;
}

// cuBLASLt statuses become errors rather than aborts: on a device without FP4 support a call may refuse the
// configuration, and that must not take a server down.
Expected<void> lt_ok(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return {};
  return make_error("{}: cuBLASLt {} failed: {}", kName, call, cublasLtGetStatusName(status));
}

template <class T>
Expected<void> set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value,
                        const char* what) {
  return lt_ok(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)), what);
}

// cuBLASLt is column-major: row-major y[M,N] is column-major y^T[N,M] = W[N,K] . x^T[K,M]. Row-major W [N, K/2
// bytes] is column-major FP4 [K, N] (ld K) used transposed (A, "T"); row-major x is column-major [K, M] (ld K) used
// as is (B, "N"). Each operand's scales are tiled over its non-K dimension: N for A, M for B.
Expected<void> describe(const DeviceContext& ctx, const GemmNvfp4NativeArgs& args, const uint8_t* x_scales,
                        LtDescs& desc) {
  const auto m = static_cast<uint64_t>(args.m), n = static_cast<uint64_t>(args.w.n),
             k = static_cast<uint64_t>(args.w.k);
  TERN_TRY(lt_ok(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate"));
  TERN_TRY(set_desc(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T, "TRANSA"));
  TERN_TRY(set_desc(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N, "TRANSB"));
  const cublasLtMatmulMatrixScale_t vec16 = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
  TERN_TRY(set_desc(desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, vec16, "A_SCALE_MODE"));
  TERN_TRY(set_desc(desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, vec16, "B_SCALE_MODE"));
  const void* a_scales = args.w.scales_tiled;
  const void* b_scales = x_scales;
  TERN_TRY(set_desc(desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scales, "A_SCALE_POINTER"));
  TERN_TRY(set_desc(desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scales, "B_SCALE_POINTER"));
  TERN_TRY(lt_ok(cublasLtMatrixLayoutCreate(&desc.a, CUDA_R_4F_E2M1, k, n, static_cast<int64_t>(k)), "layout A"));
  TERN_TRY(lt_ok(cublasLtMatrixLayoutCreate(&desc.b, CUDA_R_4F_E2M1, k, m, static_cast<int64_t>(k)), "layout B"));
  TERN_TRY(lt_ok(cublasLtMatrixLayoutCreate(&desc.d, CUDA_R_16BF, n, m, effective_ldy(args)), "layout D"));
  TERN_TRY(lt_ok(cublasLtMatmulPreferenceCreate(&desc.pref), "cublasLtMatmulPreferenceCreate"));
  const size_t workspace = ctx.cublas_workspace_bytes();
  return lt_ok(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                    sizeof(workspace)),
               "MAX_WORKSPACE_BYTES");
}

Expected<cublasLtMatmulAlgo_t> pick_algorithm(const DeviceContext& ctx, const GemmNvfp4NativeArgs& args,
                                              const LtDescs& desc) {
  cublasLtMatmulHeuristicResult_t heuristic{};
  int n_found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt(), desc.op, desc.a, desc.b, desc.d, desc.d,
                                                               desc.pref, 1, &heuristic, &n_found);
  if (status == CUBLAS_STATUS_SUCCESS && n_found > 0) return heuristic.algo;
  const DeviceProps& p = ctx.props();
  return make_error("{}: cuBLASLt has no block-scaled FP4 algorithm for m={} n={} k={} on {} (sm_{}{}{}): {}", kName,
                    args.m, args.w.n, args.w.k, p.name, p.cc_major, p.cc_minor,
                    nvfp4_native_supported(p) ? "" : ", which has no FP4 tensor cores",
                    status == CUBLAS_STATUS_SUCCESS ? "no candidate" : cublasLtGetStatusName(status));
}

}  // namespace

size_t gemm_nvfp4_native_workspace_bytes(int64_t m, int64_t k) {
  if (m <= 0 || k <= 0) return 0;
  return packed_bytes_rounded(m, k) + static_cast<size_t>(nvfp4_tiled_scale_bytes(m, k));
}

bool nvfp4_native_supported(const DeviceProps& props) {
  switch (props.cc_major * 10 + props.cc_minor) {
    case 100:
    case 101:
    case 103:
    case 120:
    case 121:
      return true;
    default:
      return false;  // sm_90 and older have no FP4 MMA; unknown future GPUs are not assumed to
  }
}

namespace {

// One chunk of rows whose quantized activations fit the workspace.
Expected<void> gemm_nvfp4_native_rows(const DeviceContext& ctx, const GemmNvfp4NativeArgs& args) {
  auto* x_packed = static_cast<uint8_t*>(args.workspace);
  uint8_t* x_scales = x_packed + packed_bytes_rounded(args.m, args.w.k);
  TERN_TRY(nvfp4_quantize_activations(ctx, {.x = args.x,
                                            .input_scale = args.input_scale_device,
                                            .packed = x_packed,
                                            .scales = x_scales,
                                            .m = args.m,
                                            .k = args.w.k,
                                            .layout = Nvfp4ScaleLayout::kTiled128x4}));
  LtDescs desc;
  TERN_TRY(describe(ctx, args, x_scales, desc));
  TERN_ASSIGN_OR_RETURN(const cublasLtMatmulAlgo_t algo, pick_algorithm(ctx, args, desc));
  // Both per-tensor scales go into alpha: cuBLASLt's VEC16 scale modes carry only the e4m3 block scales.
  const float alpha = args.w.global_scale * args.input_scale, beta = 0.0f;
  return lt_ok(
      cublasLtMatmul(ctx.cublaslt(), desc.op, &alpha, args.w.packed, desc.a, x_packed, desc.b, &beta, args.y, desc.d,
                     args.y, desc.d, &algo, ctx.cublas_workspace(), ctx.cublas_workspace_bytes(), ctx.stream()),
      "cublasLtMatmul");
}

}  // namespace

Expected<void> gemm_nvfp4_native(const DeviceContext& ctx, const GemmNvfp4NativeArgs& args) {
  TERN_TRY(validate_shape(args));
  TERN_TRY(validate_pointers(args));
  const int64_t chunk = rows_per_chunk(args), ldy = effective_ldy(args);
  for (int64_t row = 0; row < args.m; row += chunk) {
    GemmNvfp4NativeArgs part = args;
    part.x = args.x + row * args.w.k;
    part.y = args.y + row * ldy;
    part.m = std::min(chunk, args.m - row);
    TERN_TRY(gemm_nvfp4_native_rows(ctx, part));
  }
  return {};
}

}  // namespace tern
