// What a model's blocks ask of a device: one BlockOps per device (CPU: models/cpu/cpu_ops.h; CUDA:
// models/gpu/cuda_ops.h), which turns each host block into that device's implementation once, at load. Which
// kernels run, and which of them are fused (an RMSNorm into the GEMV that reads it, the SiLU-and-mul into the down
// projection, the MoE combine into the shared expert, the gated norm into the delta rule), is decided inside the
// device's implementation from what its self-test verified; a model file never names a kernel.
//
// The residual stream is the device's: embedding() starts it, every other block reads it through its norm and adds
// its output to it, lm_head() ends it in logits.
//
// Under tensor parallelism (one BlockOps per rank, each over its rank's slice of the weights: docs/architecture.md
// "Tensor parallelism") the stream is replicated: a block whose output is a partial sum on each rank (attention's
// o_proj, Gated DeltaNet's out_proj, the MLP's and the experts' down_proj) sums it over the ranks before adding it to
// the stream, embedding() sums the rows each rank holds, and lm_head() gathers every rank's vocabulary rows, so every
// rank ends a step with the whole logits.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "core/error.h"
#include "kernels/cpu/matmul.h"
#include "layers/blocks.h"

namespace tern {

class Attention;
class GatedDeltaNet;
class Linear;
class MlaAttention;
class Mlp;
class Moe;
struct RmsNorm;

// The vocabulary rows [begin, begin + rows) of `full` that this rank's embedding table and lm_head hold (rows is the
// table's); begin 0 and rows == full on one device.
struct VocabRange {
  int64_t begin = 0;
  int64_t full = 0;
};

class BlockOps {
 public:
  virtual ~BlockOps() = default;

  // The stream starts as the rows of `table` [vocab rows, hidden] picked by the step's token ids.
  virtual Expected<std::unique_ptr<Block>> embedding(const CpuMatrix& table, VocabRange vocab) = 0;
  virtual Expected<std::unique_ptr<Block>> attention(const RmsNorm& norm, const Attention& a) = 0;
  virtual Expected<std::unique_ptr<Block>> gated_deltanet(const RmsNorm& norm, const GatedDeltaNet& g) = 0;
  virtual Expected<std::unique_ptr<Block>> mla(const RmsNorm& norm, const MlaAttention& a) = 0;
  virtual Expected<std::unique_ptr<Block>> mlp(const RmsNorm& norm, const Mlp& m) = 0;
  virtual Expected<std::unique_ptr<Block>> moe(const RmsNorm& norm, const Moe& m) = 0;
  // The final norm and the vocabulary projection over the rows whose logits the step wants.
  virtual Expected<std::unique_ptr<Block>> lm_head(const RmsNorm& final_norm, const Linear& head,
                                                   VocabRange vocab) = 0;
  // A draft module's input (models/causal_lm.h's DraftModule): the stream, which holds the embeddings of the step's
  // tokens, becomes fc([norm_embedding(stream) ; norm_hidden(h)]) with h the hidden rows the step was given.
  virtual Expected<std::unique_ptr<Block>> draft_input(const RmsNorm& norm_embedding, const RmsNorm& norm_hidden,
                                                       const Linear& fc) = 0;
  // Hands the last block's output [rows, hidden] to the step's tracer, if it has one, as `name`.
  virtual Expected<void> trace_output(std::string_view name) = 0;
  // Whether the blocks it makes hold copies of their weights (a device's memory) and never read the host blocks'
  // again, so that a runner may release the host weights once the model is placed (CausalLm::release_host_weights).
  virtual bool blocks_copy_weights() const { return false; }
};

}  // namespace tern
