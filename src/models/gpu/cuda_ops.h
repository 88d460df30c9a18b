// The model's blocks on a CUDA device (BlockOps for runtime/cuda_runner.h): weights uploaded once in their stored
// format (gpu_weights.h), bf16 activations with fp32 math inside every kernel, a paged KV cache per attention layer
// and fp32 Gated DeltaNet states in per-sequence slots.
//
// Each block reads the residual stream through its norm and leaves its output in the arena's `out` rows; the next
// block's norm adds it to the stream (the RMSNorm kernel's residual input), so the stream is updated without a
// launch of its own. The fusions the self-test verified (DeviceModelOptions) are decided here, per call, by shape:
// the norm inside a one-row BF16 GEMV, the SiLU-and-mul inside the down GEMV, the MoE combine inside the shared
// expert's down GEMV, the GDN gated norm inside the recurrent delta rule.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/attention/attention.h"
#include "kernels/cuda/device.h"
#include "dist/device_communicator.h"
#include "kernels/cuda/gated_delta/gated_delta.h"
#include "layers/block_ops.h"
#include "models/causal_lm.h"
#include "models/gpu/gpu_weights.h"

namespace tern {

// A step as the blocks see it: its sizes and the device copy of its metadata (runtime/cuda_runner.cc plans and
// uploads it).
struct CudaStep {
  bool decode = false;   // one token per sequence, the last-token logits wanted
  bool graphed = false;  // replayed as a CUDA graph (a decode step, a verification, a chained draft row): no allocation
  bool draft = false;    // the draft module's step
  int64_t tokens = 0, n_seqs = 0, max_query_len = 0, max_seq_len = 0, max_blocks = 0;
  const int32_t *ids = nullptr, *positions = nullptr, *slot_mapping = nullptr, *query_start = nullptr,
                *seq_lens = nullptr, *block_tables = nullptr, *state_slot = nullptr, *seq_past = nullptr;
  // The rows whose logits the step returns, in order: each sequence's last row, or all of its rows (LogitsFor
  // kAllTokens, or a verification). When they are fewer than the step's rows, the head gathers them.
  const int32_t* head_rows = nullptr;
  int64_t n_head_rows = 0;
  // Speculative verification (GdnSequences::row_slots): [n_seqs * max_rows] state slots for the states after each
  // row of a verified sequence; null when the step verifies nothing.
  const int32_t* row_slots = nullptr;
  int64_t max_rows = 0;
  // A model with a draft module: the head copies every row's normed hidden state here ([tokens, hidden]); a draft
  // step's input block reads row hidden_rows[k] of hidden_in for its row k.
  uint16_t* keep_hidden = nullptr;
  const uint16_t* hidden_in = nullptr;
  const int32_t* hidden_rows = nullptr;
  const Tracer* tracer = nullptr;
  uint16_t* logits = nullptr;  // [n_head_rows, vocab] bf16

  bool gathers_head_rows() const { return n_head_rows < tokens; }
};

// The widest block table a graphed decode step has (runtime/cuda_runner.cc plans them): the blocks of
// `context_tokens` rounded up to a power of two, capped at the cache's blocks. Its max_seq_len is that times
// block_size, up to twice the context; workspaces sized for graphed steps use it.
inline int64_t decode_graph_max_blocks(int64_t context_tokens, int64_t kv_blocks, int64_t block_size) {
  const auto need = static_cast<uint64_t>(std::max<int64_t>((context_tokens + block_size - 1) / block_size, 1));
  return kv_blocks == 0 ? 1 : std::min<int64_t>(static_cast<int64_t>(std::bit_ceil(need)), kv_blocks);
}

struct GpuNorm;
struct GpuAttention;
struct GpuGdn;
struct GpuMla;
struct GpuMlp;
struct GpuMoe;

class CudaOps final : public BlockOps {
 public:
  // hidden: the model's hidden size; options.kernels (the self-test's choices) decide the kernels and fusions.
  // comm: the tensor-parallel group when the model is one rank's slice (null, or world 1: the whole model). Each
  // block then sums its output over the ranks, the embedding sums the rows each rank holds, and lm_head gathers
  // every rank's logits, so that the logits are the whole vocabulary's on every rank.
  CudaOps(DeviceContext& ctx, const DeviceModelOptions& options, int64_t hidden, DeviceCommunicator* comm = nullptr);
  ~CudaOps() override;

  Expected<std::unique_ptr<Block>> embedding(const CpuMatrix& table, VocabRange vocab) override;
  Expected<std::unique_ptr<Block>> attention(const RmsNorm& norm, const Attention& a) override;
  Expected<std::unique_ptr<Block>> gated_deltanet(const RmsNorm& norm, const GatedDeltaNet& g) override;
  Expected<std::unique_ptr<Block>> mlp(const RmsNorm& norm, const Mlp& m) override;
  Expected<std::unique_ptr<Block>> moe(const RmsNorm& norm, const Moe& m) override;
  Expected<std::unique_ptr<Block>> lm_head(const RmsNorm& final_norm, const Linear& head, VocabRange vocab) override;
  Expected<std::unique_ptr<Block>> mla(const RmsNorm& norm, const MlaAttention& a) override;
  Expected<std::unique_ptr<Block>> draft_input(const RmsNorm& norm_embedding, const RmsNorm& norm_hidden,
                                               const Linear& fc) override;
  Expected<void> trace_output(std::string_view name) override;
  bool blocks_copy_weights() const override { return true; }  // every block's weights uploaded (DeviceWeights)

  // Once every block is made: the activation arena for max_batch_tokens rows, the GDN state slots, and the KV
  // cache (DeviceModelOptions::kv_cache_tokens, or what fits in half of the free memory).
  Expected<void> allocate();
  // The step the next body runs; the stream restarts at the embedding.
  void begin_step(const CudaStep& step) { step_ = step; }

  // The KV blocks sequences may hold (ids [0, kv_blocks())). One block past them (spare_block()) and one state slot
  // past max_sequences (spare_slot()) are allocated too: they take the writes of the padding rows a decode step is
  // filled up with to its CUDA graph's batch size, so no sequence's cache sees them.
  int64_t kv_blocks() const { return kv_blocks_; }
  int32_t spare_block() const { return static_cast<int32_t>(kv_blocks_); }
  // Gated DeltaNet state slots: state_slots() of them, the last the spare. A model with a draft module holds
  // rows_per_verification() + 1 slots per sequence (DeviceModelOptions::verify_rows): the sequence's state and one
  // per row of a verification (runtime/cuda_runner.cc picks which is which).
  int64_t state_slots() const { return options_.max_sequences * (verify_rows() + 1) + 1; }
  int32_t spare_slot() const { return static_cast<int32_t>(state_slots() - 1); }
  int64_t verify_rows() const { return has_draft_ ? options_.verify_rows : 0; }
  // The most rows a graphed step has: a decode step's max_sequences, or a verification's max_sequences x
  // verify_rows. Buffers that captured graphs read are sized for it at load.
  int64_t graphed_rows() const {
    return std::max<int64_t>(options_.max_sequences, 1) * std::max<int64_t>(verify_rows(), 1);
  }
  // The normed hidden states of every row of the last model step and of the last draft step ([max_batch_tokens,
  // hidden] each; a model with a draft module only).
  uint16_t* model_hidden() const { return model_hidden_; }
  uint16_t* draft_hidden() const { return draft_hidden_; }
  bool has_gdn() const { return !gdns_.empty(); }
  int64_t vocab() const { return vocab_; }                    // the logits' width: the whole vocabulary
  int64_t embedding_rows() const { return embedding_rows_; }  // the token ids the embedding takes
  bool graph_capturable() const { return comm_ == nullptr || comm_->graph_capturable(); }
  size_t weight_bytes() const { return weights_.bytes(); }

  // ---- What the blocks call (cuda_ops.cc) ----
  const CudaStep& step() const { return step_; }
  Expected<void> run_embedding(const DeviceMatrix& table);
  Expected<void> run_attention(const GpuAttention& a, const GpuNorm& norm, int64_t layer);
  Expected<void> run_mla(const GpuMla& a, const GpuNorm& norm, int64_t layer);
  Expected<void> run_indexer(const GpuMla& a, uint16_t* idx_q);
  Expected<void> run_gdn(const GpuGdn& g, const GpuNorm& norm, int64_t layer);
  Expected<void> run_mlp(const GpuMlp& m, const GpuNorm& norm, int64_t layer);
  Expected<void> run_moe(const GpuMoe& m, const GpuNorm& norm, int64_t layer);
  Expected<void> run_head(const DeviceMatrix& head, const GpuNorm& norm);
  Expected<void> run_draft_input(const GpuNorm& norm_embedding, const GpuNorm& norm_hidden, const DeviceMatrix& fc);
  // The sum over the tensor-parallel ranks of the block output just written (out_); nothing on one device.
  Expected<void> reduce_out();

 private:
  // The input of a block's first projection: the RMSNorm of the residual stream (x_, plus the previous block's
  // output out_ once a block has run). The norm's output lands in normed_ and the new stream in x_, whichever path
  // runs it.
  struct NormedInput {
    const GpuNorm* norm = nullptr;
    const uint16_t* residual = nullptr;
  };
  NormedInput normed_input(const GpuNorm& norm) const { return {&norm, stream_started_ ? out_ : nullptr}; }
  Expected<GpuNorm> norm(const RmsNorm& n);
  // Under tensor parallelism, this rank's logits ([rows, vocabulary range]) and every rank's: the graphs' pair is
  // reserved by allocate() for the most rows a graphed step has (a decode step's max_sequences, or a verification's
  // max_sequences x verify_rows) and never reallocated, since captured graphs hold its addresses; a longer step (a
  // prefill wanting every row's logits) grows a pair of its own. head_logits: the pair for `rows` (an error for a
  // graphed step that does not fit); gather_logits: every rank's logits into the step's.
  struct HeadLogits {
    DeviceBuffer local, all;
    int64_t rows = 0;
  };
  Expected<void> reserve_head_rows(int64_t rows, HeadLogits& head);
  Expected<HeadLogits*> head_logits(int64_t rows);
  Expected<void> gather_logits(const HeadLogits& head, int64_t rows);
  Expected<void> allocate_caches();
  // Grows the DSA indexer's score workspace to at least `bytes` (outside graph captures only).
  Expected<void> reserve_indexer_workspace(size_t bytes, DeviceBuffer& buffer);
  Expected<void> allocate_activations();
  Expected<void> rms_norm_rows(const GpuNorm& n, uint16_t* x, const uint16_t* residual, int64_t rows, uint16_t* y);
  // The norm of `in`, then w's product of normed_ into y (row stride ldy). At one row, where the self-test verified
  // the GEMV with the norm in front, one kernel does both and writes the new stream to the spare row (its block 0
  // writes it while the other blocks still read x_), which then becomes x_.
  Expected<void> norm_forward(const NormedInput& in, const DeviceMatrix& w, int64_t rows, uint16_t* y, int64_t ldy);
  Expected<void> norm_project(const NormedInput& in, const DeviceProjection& p, int64_t rows, uint16_t* y);
  // The fused SiLU GEMV (gemv_bf16_silu_mul) serves w's product on rows of [gate | up] ldx apart.
  bool silu_gemv_applies(const DeviceMatrix& w, int64_t ldx, int64_t rows) const;
  // SiLU-and-mul of the gate|up rows (row stride ldx), then w's product of it into y (row stride ldy): at one row
  // inside the GEMV's loads where the self-test found that faster, else through act_.
  Expected<void> silu_forward(const DeviceMatrix& w, const uint16_t* gate_up, int64_t ldx, int64_t rows, uint16_t* y,
                              int64_t ldy);
  // Waits for the stream and hands rows x cols of a bf16 matrix with row stride ld to the step's tracer as fp32.
  Expected<void> trace(std::string_view name, const uint16_t* data, int64_t rows, int64_t cols, int64_t ld);
  Expected<void> trace_f32(std::string_view name, const float* data, int64_t rows, int64_t cols);

  DeviceContext& ctx_;
  DeviceCommunicator* comm_ = nullptr;
  DeviceModelOptions options_;
  DeviceWeights weights_;
  int64_t hidden_ = 0, vocab_ = 0, embedding_rows_ = 0;
  int64_t vocab_begin_ = 0;                   // the first vocabulary row this rank's embedding holds
  HeadLogits head_graph_, head_grown_;         // tensor parallelism: reserve_head_rows
  AttentionVariant attention_variant_ = AttentionVariant::kAuto;
  GdnVariant gdn_variant_ = GdnVariant::kAuto;

  // The device blocks made so far (owned by their Blocks, which the model keeps), for sizing buffers and caches.
  std::vector<GpuAttention*> attentions_;
  std::vector<GpuGdn*> gdns_;
  std::vector<GpuMla*> mlas_;
  std::vector<const GpuMlp*> mlps_;
  std::vector<const GpuMoe*> moes_;

  int64_t kv_blocks_ = 0;
  std::vector<DeviceBuffer> cache_buffers_;
  DeviceBuffer arena_;

  CudaStep step_;
  bool stream_started_ = false;  // a block has run since the embedding: its output waits in out_

  // Activations (bf16 unless said), all [max_batch_tokens, ...]. x_ is the residual stream: x_rows_ at the start of
  // every step; at one row the norm-fused GEMV writes the new stream to x_spare_ and the two swap, and x_spare_
  // starts every step as x_row_ (one row).
  uint16_t *x_rows_ = nullptr, *x_row_ = nullptr, *x_spare_ = nullptr, *x_ = nullptr;
  uint16_t *normed_ = nullptr, *out_ = nullptr, *proj_ = nullptr, *q_ = nullptr, *gate_ = nullptr, *attn_ = nullptr,
           *conv_ = nullptr, *act_ = nullptr;
  uint16_t *router_ = nullptr, *shared_out_ = nullptr, *last_ = nullptr;
  // MLA: [tokens, heads, latent] absorbed queries, [tokens, heads, lora] outputs, [tokens, index heads, index
  // head_dim] indexer queries.
  uint16_t* latent_ = nullptr;
  bool has_draft_ = false;                 // draft_input was placed: speculative decoding
  int64_t draft_fc_width_ = 0;             // its fc's input width, 2 * hidden (the joined rows land in proj_)
  uint16_t *model_hidden_ = nullptr, *draft_hidden_ = nullptr;
  DeviceBuffer selected_;            // DSA: [max_batch_tokens, index_topk] int32
  DeviceBuffer router_f32_;          // sigmoid routing: [max_batch_tokens, n_experts] fp32 router logits
  DeviceBuffer indexer_workspace_;          // DSA: the indexer's score rows of graphed steps (fixed at load)
  DeviceBuffer indexer_prefill_workspace_;  // and of longer steps (grown, never captured)
  DeviceBuffer mla_workspace_;       // MLA attention's split-K partials
  unsigned long long* bad_id_ = nullptr;  // the embedding kernel's report (ids are checked on the host first)
  void* attention_workspace_ = nullptr;
  size_t attention_workspace_bytes_ = 0;
  // Scratch of the MoE block (moe_forward) and of the chunked GDN kernels, which never run at once.
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

}  // namespace tern
