// The two halves of a decoder layer: a token mixer (attention or Gated DeltaNet, which keep per-sequence state) and
// a feed-forward block (dense MLP or mixture of experts, row-independent).
#pragma once

#include <cstdint>
#include <string>

#include "layers/batch.h"

namespace tern {

class Mixer {
 public:
  virtual ~Mixer() = default;
  // x, y [batch.n_rows, hidden]; reads and extends each sequence's cache.layers[layer].
  virtual void forward(const float* x, float* y, const Batch& batch, int64_t layer, const Tracer* tracer) const = 0;
};

class FeedForward {
 public:
  virtual ~FeedForward() = default;
  virtual void forward(const float* x, float* y, int64_t rows, const std::string& trace_prefix,
                       const Tracer* tracer) const = 0;
};

}  // namespace tern
