// Rotary position embedding, NeoX layout (rotate_half), on the first rotary_dim dims of each head; the rest pass
// through (Qwen3.5 / Qwen3-Next partial rotary). Frequencies as transformers' default rope init computes them in
// fp32: inv_freq[i] = 1 / theta^(2i / rotary_dim); angle = float(position) * inv_freq[i].
// For text-only input Qwen3.5's mRoPE equals this 1-D RoPE (all position streams are the token index).
#pragma once

#include <cstdint>
#include <vector>

namespace tern {

class Rope {
 public:
  Rope() = default;
  Rope(int64_t rotary_dim, double theta);

  // x [n_heads, head_dim] of one token at `position`, rotated in place.
  void apply(float* x, int64_t n_heads, int64_t head_dim, int64_t position) const;

  int64_t rotary_dim() const { return rotary_dim_; }
  double theta() const { return theta_; }
  const std::vector<float>& inv_freq() const { return inv_freq_; }  // [rotary_dim / 2]

 private:
  int64_t rotary_dim_ = 0;
  double theta_ = 0.0;
  std::vector<float> inv_freq_;
};

}  // namespace tern
