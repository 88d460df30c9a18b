// The model's blocks on the CPU (BlockOps for runtime/cpu_runner.h): fp32 activations, each sequence's caches in
// its LayerCache, every block computed by its host object's reference forward (layers/). Under tensor parallelism
// each rank's CpuOps runs its slice of the model and sums partial outputs over the step's communicator.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "layers/batch.h"
#include "dist/communicator.h"
#include "layers/block_ops.h"

namespace tern {

// One step as the CPU blocks see it: the residual stream x, the normed input of the running block and its output,
// all [batch.n_rows, hidden] fp32, and the logits lm_head leaves.
struct CpuStep {
  std::span<const SequenceInput> inputs;
  Batch batch;
  LogitsFor which = LogitsFor::kLastToken;
  const Tracer* tracer = nullptr;
  int64_t hidden = 0;
  Communicator* comm = nullptr;  // the tensor-parallel group; null on one device
  std::vector<float> x, normed, out, logits;
  // Speculative decoding: the head keeps every row's normed hidden state in `hidden_out` when `keep_hidden`; a draft
  // module's input block reads the rows of `hidden_in` [batch.n_rows, hidden].
  bool keep_hidden = false;
  std::vector<float> hidden_out, hidden_in;

  // Sets up the rows of `inputs` for the blocks (each sequence's first row at its cache's length, or at
  // `positions[i]` when given); end() forgets the inputs once the step has run.
  void begin(std::span<const SequenceInput> batch_inputs, LogitsFor which_rows, const Tracer* step_tracer,
             std::span<const int64_t> positions = {});
  void end();
  // x += out, with out first summed over the ranks when it is a partial sum on each.
  Expected<void> add_out();
  // Sums `v` over the ranks (nothing on one device).
  Expected<void> all_reduce(std::vector<float>& v);
};

class CpuOps final : public BlockOps {
 public:
  explicit CpuOps(CpuStep& s) : s_(s) {}
  Expected<std::unique_ptr<Block>> embedding(const CpuMatrix& table, VocabRange vocab) override;
  Expected<std::unique_ptr<Block>> attention(const RmsNorm& norm, const Attention& a) override;
  Expected<std::unique_ptr<Block>> gated_deltanet(const RmsNorm& norm, const GatedDeltaNet& g) override;
  Expected<std::unique_ptr<Block>> mla(const RmsNorm& norm, const MlaAttention& a) override;
  Expected<std::unique_ptr<Block>> mlp(const RmsNorm& norm, const Mlp& m) override;
  Expected<std::unique_ptr<Block>> moe(const RmsNorm& norm, const Moe& m) override;
  Expected<std::unique_ptr<Block>> lm_head(const RmsNorm& final_norm, const Linear& head, VocabRange vocab) override;
  Expected<std::unique_ptr<Block>> draft_input(const RmsNorm& norm_embedding, const RmsNorm& norm_hidden,
                                               const Linear& fc) override;
  Expected<void> trace_output(std::string_view name) override;

 private:
  CpuStep& s_;
};

}  // namespace tern
