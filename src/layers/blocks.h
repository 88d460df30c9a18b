// The blocks of a decoder layer, and how a device runs them.
//
// A model is written once, device-neutral: its builder (models/<arch>.cc) makes each layer's blocks as host objects
// holding their weights and shapes: a token mixer (attention or Gated DeltaNet, which keep per-sequence state) and a
// feed-forward block (dense MLP or mixture of experts, row-independent). The CPU math of each block is its
// reference forward(). At load, every block is placed on the device that runs the model (`place`, which calls the
// BlockOps method of its own type, so no caller ever asks which kind a block is) and becomes a Block: that device's
// implementation, holding its weights in the device's format and deciding its own fusions. The model's layer loop
// (CausalLm::run_blocks) calls only Blocks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/error.h"
#include "layers/batch.h"

namespace tern {

class BlockOps;
struct RmsNorm;

// One block as a device runs it, bound to that device's step state (the residual stream, the batch) at placement:
// the stream goes through the block's norm and the block, and the block's output is added back to the stream.
class Block {
 public:
  virtual ~Block() = default;
  // `layer` names the block's intermediates for a tracer (-1 outside the decoder layers).
  virtual Expected<void> forward(int64_t layer) const = 0;
};

class Mixer {
 public:
  virtual ~Mixer() = default;
  // CPU reference: x, y [batch.n_rows, hidden]; reads and extends each sequence's cache.layers[layer].
  virtual void forward(const float* x, float* y, const Batch& batch, int64_t layer, const Tracer* tracer) const = 0;
  // This mixer, with `norm` in front of it, as `ops`'s device runs it.
  virtual Expected<std::unique_ptr<Block>> place(BlockOps& ops, const RmsNorm& norm) const = 0;
};

class FeedForward {
 public:
  virtual ~FeedForward() = default;
  virtual void forward(const float* x, float* y, int64_t rows, const std::string& trace_prefix,
                       const Tracer* tracer) const = 0;
  virtual Expected<std::unique_ptr<Block>> place(BlockOps& ops, const RmsNorm& norm) const = 0;
};

}  // namespace tern
