#include "kernels/cuda/gemm/gemm_bf16.h"

#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <memory>

#include "kernels/cuda/gemm/cublaslt_descs.h"

namespace tern {
namespace {

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

Expected<void> gemm_bf16_validate(const GemmBf16Args& a) {
  if (a.m < 0 || a.n <= 0 || a.k <= 0) return make_error("gemm_bf16: bad shape m={} n={} k={}", a.m, a.n, a.k);
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (a.m > kMaxDim || a.n > kMaxDim || a.k > kMaxDim) {
    return make_error("gemm_bf16: dimension over 2^31-1 (m={} n={} k={})", a.m, a.n, a.k);
  }
  if (a.k % 8 != 0) return make_error("gemm_bf16: k={} is not a multiple of 8 (16-byte rows of x and W)", a.k);
  if ((a.y == nullptr) == (a.y_f32 == nullptr)) return make_error("gemm_bf16: exactly one of y and y_f32 is needed");
  if (a.x == nullptr || a.w == nullptr) return make_error("gemm_bf16: null pointer (x or w)");
  if (!is_aligned16(a.x)) return make_error("gemm_bf16: x is not 16-byte aligned");
  if (!is_aligned16(a.w)) return make_error("gemm_bf16: w is not 16-byte aligned");
  if (reinterpret_cast<uintptr_t>(a.y) % 2 != 0) return make_error("gemm_bf16: y is not 2-byte aligned");
  if (reinterpret_cast<uintptr_t>(a.y_f32) % 4 != 0) return make_error("gemm_bf16: y_f32 is not 4-byte aligned");
  if (a.ldy != 0 && a.ldy < a.n) return make_error("gemm_bf16: ldy={} is less than n={}", a.ldy, a.n);
  if (a.ldx != 0 && (a.ldx < a.k || a.ldx % 8 != 0)) {
    return make_error("gemm_bf16: ldx={} must be a multiple of 8 (16-byte rows) and at least k={}", a.ldx, a.k);
  }
  if (!std::isfinite(a.alpha)) return make_error("gemm_bf16: alpha={} is not finite", a.alpha);
  if (a.batch < 1 || a.batch > kMaxDim) return make_error("gemm_bf16: batch={} must be positive", a.batch);
  if (a.batch > 1) {
    for (const auto& [name, stride] : {std::pair{"x_batch_stride", a.x_batch_stride},
                                       std::pair{"w_batch_stride", a.w_batch_stride},
                                       std::pair{"y_batch_stride", a.y_batch_stride}}) {
      if (stride <= 0 || stride % 8 != 0) {
        return make_error("gemm_bf16: {}={} must be a positive multiple of 8 (16-byte aligned products)", name,
                          stride);
      }
    }
  }
  return {};
}

// The descriptors and the algorithm cuBLASLt chose for one shape. Building them costs tens of microseconds, more
// than a small decode GEMM itself, so each context keeps them per shape (a model has a few dozen shapes).
struct Bf16Plan {
  LtDescs desc;
  cublasLtMatmulAlgo_t algo{};
};

// m, n, k, ldy, y 16-byte aligned, ldx, batch and its three strides, fp32 output
using PlanKey = std::array<int64_t, 11>;
struct Bf16PlanCache {
  std::map<PlanKey, std::unique_ptr<Bf16Plan>> plans;
};

Expected<std::unique_ptr<Bf16Plan>> plan_create(const DeviceContext& ctx, const GemmBf16Args& args) {
  // cuBLASLt is column-major: row-major y[M,N] is column-major y^T[N,M] = W[N,K] · x^T[K,M]. Row-major W[N,K] is
  // column-major [K,N] (ld K) used transposed; row-major x[M,K] is column-major [K,M] (ld K) used as is.
  const auto m = static_cast<uint64_t>(args.m), n = static_cast<uint64_t>(args.n), k = static_cast<uint64_t>(args.k);
  auto plan = std::make_unique<Bf16Plan>();
  LtDescs& desc = plan->desc;
  TERN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
  TERN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)));
  TERN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans, sizeof(no_trans)));
  TERN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.a, CUDA_R_16BF, k, n, static_cast<int64_t>(k)));
  TERN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.b, CUDA_R_16BF, k, m, args.ldx > 0 ? args.ldx : args.k));
  const int64_t ldy = args.ldy > 0 ? args.ldy : args.n;
  const bool f32 = args.y_f32 != nullptr;
  TERN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.d, f32 ? CUDA_R_32F : CUDA_R_16BF, n, m, ldy));
  if (args.batch > 1) {
    const auto count = static_cast<int32_t>(args.batch);
    for (const auto& [layout, stride] : {std::pair{desc.a, args.w_batch_stride}, std::pair{desc.b, args.x_batch_stride},
                                         std::pair{desc.d, args.y_batch_stride}}) {
      TERN_CUBLAS_CHECK(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      TERN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                         sizeof(stride)));
    }
  }
  TERN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&desc.pref));
  const size_t workspace = ctx.cublas_workspace_bytes();
  TERN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &workspace, sizeof(workspace)));
  // Outputs whose rows are not all 16-byte aligned (a [1, H] gate, a vocabulary of odd size, a column slice of a
  // wider output) are only 2-byte aligned: say so, and cuBLASLt picks an algorithm that copes instead of one that
  // would fault.
  const void* y = f32 ? static_cast<const void*>(args.y_f32) : static_cast<const void*>(args.y);
  if (ldy % (f32 ? 4 : 8) != 0 || !is_aligned16(y)) {
    const uint32_t bytes = f32 ? 4 : 2;
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      TERN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(desc.pref, attr, &bytes, sizeof(bytes)));
    }
  }
  cublasLtMatmulHeuristicResult_t heuristic{};
  int n_found = 0;
  TERN_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt(), desc.op, desc.a, desc.b, desc.d, desc.d,
                                                   desc.pref, 1, &heuristic, &n_found));
  if (n_found == 0) return make_error("gemm_bf16: cuBLASLt has no algorithm for m={} n={} k={}", m, n, k);
  plan->algo = heuristic.algo;
  return plan;
}

}  // namespace

Expected<void> gemm_bf16(const DeviceContext& ctx, const GemmBf16Args& args) {
  TERN_TRY(gemm_bf16_validate(args));
  if (args.m == 0) return {};
  if (!ctx.gemm_plans) ctx.gemm_plans = std::make_shared<Bf16PlanCache>();
  auto& plans = static_cast<Bf16PlanCache*>(ctx.gemm_plans.get())->plans;
  const PlanKey key{args.m,
                    args.n,
                    args.k,
                    args.ldy > 0 ? args.ldy : args.n,
                    is_aligned16(args.y_f32 != nullptr ? static_cast<const void*>(args.y_f32) : args.y) ? 1 : 0,
                    args.ldx > 0 ? args.ldx : args.k,
                    args.batch,
                    args.batch > 1 ? args.x_batch_stride : 0,
                    args.batch > 1 ? args.w_batch_stride : 0,
                    args.batch > 1 ? args.y_batch_stride : 0,
                    args.y_f32 != nullptr ? 1 : 0};
  auto it = plans.find(key);
  if (it == plans.end()) {
    TERN_ASSIGN_OR_RETURN(std::unique_ptr<Bf16Plan> plan, plan_create(ctx, args));
    it = plans.emplace(key, std::move(plan)).first;
  }
  const Bf16Plan& p = *it->second;
  const float alpha = args.alpha, beta = 0.0f;
  void* y = args.y_f32 != nullptr ? static_cast<void*>(args.y_f32) : static_cast<void*>(args.y);
  TERN_CUBLAS_CHECK(cublasLtMatmul(ctx.cublaslt(), p.desc.op, &alpha, args.w, p.desc.a, args.x, p.desc.b, &beta,
                                   y, p.desc.d, y, p.desc.d, &p.algo, ctx.cublas_workspace(),
                                   ctx.cublas_workspace_bytes(), ctx.stream()));
  return {};
}

}  // namespace tern
