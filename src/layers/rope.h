// Rotary position embedding, NeoX layout (rotate_half), on the first rotary_dim dims of each head; the rest pass
// through (Qwen3.5 / Qwen3-Next partial rotary). Frequencies as transformers' rope init functions compute them in
// fp32 (modeling_rope_utils.py; rope_frequencies below); angle = float(position) * inv_freq[i], and cos and sin are
// multiplied by the variant's attention factor (1 but for YaRN), as transformers scales them.
// For text-only input Qwen3.5's mRoPE equals this 1-D RoPE (all position streams are the token index).
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "io/model_config.h"

namespace tern {

// A RoPE variant's frequency table [rotary_dim / 2] and cos / sin multiplier, in transformers' fp32 arithmetic:
//   default: inv_freq[i] = 1 / theta^(2i / rotary_dim);
//   linear:  the default table / factor;
//   yarn:    per frequency a blend of the default table (extrapolation) and the table / factor (interpolation),
//            the blend a ramp over the dims [low, high] that make beta_fast .. beta_slow rotations within
//            original_max_position_embeddings (rounded outwards when truncate); attention factor: the config's, or
//            with mscale and mscale_all_dim get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim), else
//            get_mscale(factor), where get_mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1).
// dynamic (its table depends on the sequence length) and llama3 are errors naming the type.
struct RopeFrequencies {
  std::vector<float> inv_freq;
  float attention_factor = 1.0f;
};
Expected<RopeFrequencies> rope_frequencies(const RopeConfig& rope, int64_t rotary_dim);

// DeepSeek-V3 / GLM-5's softmax scale multiplier under a scaled RoPE: get_mscale(factor, mscale_all_dim)^2 when the
// RoPE type is not default and mscale_all_dim is set (non-zero), else 1 (transformers' DeepseekV3Attention).
double mla_softmax_mscale(const RopeConfig& rope);

class Rope {
 public:
  Rope() = default;
  Rope(int64_t rotary_dim, double theta);  // the default table
  Rope(int64_t rotary_dim, double theta, RopeFrequencies frequencies);

  // x [n_heads, head_dim] of one token at `position`, rotated in place.
  void apply(float* x, int64_t n_heads, int64_t head_dim, int64_t position) const;

  int64_t rotary_dim() const { return rotary_dim_; }
  double theta() const { return theta_; }
  const std::vector<float>& inv_freq() const { return inv_freq_; }  // [rotary_dim / 2]
  float attention_factor() const { return attention_factor_; }

 private:
  int64_t rotary_dim_ = 0;
  double theta_ = 0.0;
  std::vector<float> inv_freq_;
  float attention_factor_ = 1.0f;
};

}  // namespace tern
