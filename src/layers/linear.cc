#include "layers/linear.h"

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

}  // namespace tern
