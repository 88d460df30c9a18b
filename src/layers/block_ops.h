// What a model's blocks ask of a device: one BlockOps per device (CPU: models/cpu/cpu_ops.h; CUDA:
// models/gpu/cuda_ops.h), which turns each host block into that device's implementation once, at load. Which
// kernels run, and which of them are fused (an RMSNorm into the GEMV that reads it, the SiLU-and-mul into the down
// projection, the MoE combine into the shared expert, the gated norm into the delta rule), is decided inside the
// device's implementation from what its self-test verified; a model file never names a kernel.
//
// The residual stream is the device's: embedding() starts it, every other block reads it through its norm and adds
// its output to it, lm_head() ends it in logits.
#pragma once

#include <memory>
#include <string_view>

#include "core/error.h"
#include "kernels/cpu/matmul.h"
#include "layers/blocks.h"

namespace tern {

class Attention;
class GatedDeltaNet;
class Linear;
class Mlp;
class Moe;
struct RmsNorm;

class BlockOps {
 public:
  virtual ~BlockOps() = default;

  // The stream starts as the rows of `table` [vocab, hidden] picked by the step's token ids.
  virtual Expected<std::unique_ptr<Block>> embedding(const CpuMatrix& table) = 0;
  virtual Expected<std::unique_ptr<Block>> attention(const RmsNorm& norm, const Attention& a) = 0;
  virtual Expected<std::unique_ptr<Block>> gated_deltanet(const RmsNorm& norm, const GatedDeltaNet& g) = 0;
  virtual Expected<std::unique_ptr<Block>> mlp(const RmsNorm& norm, const Mlp& m) = 0;
  virtual Expected<std::unique_ptr<Block>> moe(const RmsNorm& norm, const Moe& m) = 0;
  // The final norm and the vocabulary projection over the rows whose logits the step wants.
  virtual Expected<std::unique_ptr<Block>> lm_head(const RmsNorm& final_norm, const Linear& head) = 0;

  // After a block whose output is a partial sum on each tensor-parallel rank: the sum over the ranks. The identity
  // on one device.
  virtual Expected<void> all_reduce_output() = 0;
  // Hands the last block's output [rows, hidden] to the step's tracer, if it has one, as `name`.
  virtual Expected<void> trace_output(std::string_view name) = 0;
};

}  // namespace tern
