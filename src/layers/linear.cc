#include "layers/linear.h"

#include <algorithm>

#include "core/nvfp4.h"

namespace tern {

void Linear::forward(const float* x, int64_t m, float* y) const {
  const int64_t in = matrix_.cols, out = matrix_.rows;
  if (quantize_input_) {
    std::vector<float> xq(static_cast<size_t>(m * in));
    for (int64_t i = 0; i < m; ++i) nvfp4_fake_quantize_activation_row(x + i * in, in, input_scale_, &xq[i * in]);
    cpu_matmul(xq.data(), m, matrix_, y);
  } else {
    cpu_matmul(x, m, matrix_, y);
  }
  if (!bias_.empty()) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < out; ++j) y[i * out + j] += bias_[j];
  }
}

LinearKind linear_kind(const Linear& l) {
  switch (l.matrix().format) {
    case CpuWeightFormat::kNvfp4: return l.quantizes_input() ? LinearKind::kW4a4 : LinearKind::kNvfp4;
    case CpuWeightFormat::kFp8Block128: return LinearKind::kFp8;
    default: return LinearKind::kBf16;
  }
}

bool share_w4a4_scales(std::span<const Linear* const> linears) {
  return std::all_of(linears.begin(), linears.end(), [&](const Linear* l) {
    return l->matrix().global_scale == linears[0]->matrix().global_scale &&
           l->input_scale() == linears[0]->input_scale();
  });
}

std::vector<ProjectionRun> projection_runs(const std::vector<const Linear*>& parts) {
  std::vector<ProjectionRun> runs;
  size_t i = 0;
  while (i < parts.size()) {
    ProjectionRun run{.kind = linear_kind(*parts[i]), .begin = i};
    const bool nvfp4 = is_nvfp4(*parts[i]);
    const size_t max_parts = nvfp4 ? static_cast<size_t>(kNvfp4MaxStackedParts) : parts.size();
    size_t j = i + 1;
    while (j < parts.size() && j - i < max_parts && linear_kind(*parts[j]) == run.kind) ++j;
    if (run.kind == LinearKind::kW4a4 && !share_w4a4_scales(std::span(parts).subspan(i, j - i))) {
      j = i + 1;  // a GEMM a part
    }
    run.end = j;
    for (size_t k = i; k < j; ++k) run.rows += parts[k]->out_features();
    if (run.kind == LinearKind::kBf16 && j == parts.size()) run.rows = fused_projection_rows(run.rows);
    runs.push_back(run);
    i = j;
  }
  return runs;
}

}  // namespace tern
