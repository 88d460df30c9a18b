// A decoder-only language model: embeddings, decoder layers (norm -> mixer -> residual, norm -> feed-forward
// -> residual), final norm, lm_head, written once for every device. The architecture files (qwen3.cc, qwen3_moe.cc,
// qwen3_5_moe.cc) build its host blocks from a config and a WeightStore (model_build_host); a device's runner
// (runtime/model_runner.h) owns the model, places its blocks through the device's BlockOps and runs the one layer
// loop, run_blocks, in every step.
//
//   TERN_ASSIGN_OR_RETURN(auto runner, runner_load("/models/qwen3", {}));  // runtime/model_runner.h
//   SequenceCache seq = runner->new_sequence();
//   std::vector<SequenceInput> batch{{&seq, prompt_ids}};
//   TERN_ASSIGN_OR_RETURN(auto logits, runner->forward(batch, LogitsFor::kLastToken));  // [1, vocab]
#pragma once

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"
#include "io/model_config.h"
#include "layers/block_ops.h"
#include "layers/blocks.h"
#include "layers/linear.h"
#include "layers/norms.h"
#include "models/weights.h"
#include "ops/kernel_choices.h"

namespace tern {

// One decoder layer: norm -> mixer -> residual, norm -> feed-forward -> residual. The host blocks (the builder's)
// and, once placed, the same blocks as the runner's device runs them.
struct DecoderLayer {
  RmsNorm input_norm, post_attention_norm;
  std::unique_ptr<Mixer> mixer;
  std::unique_ptr<FeedForward> ffn;
  std::unique_ptr<Block> mixer_block, ffn_block;
};

// A multi-token-prediction module, run as the draft model of speculative decoding (Qwen3.5 / Qwen3-Next `mtp.*`,
// docs/speculative.md): for the token x[t + 1] and the model's hidden state h[t] (after its final norm), the stream
// starts as fc([norm_embedding(embed(x[t + 1])) ; norm_hidden(h[t])]), runs one decoder layer (layer
// num_hidden_layers of a sequence's caches, at position t) and ends in final_norm and the model's lm_head: logits
// for x[t + 2]. Chained, its own normed output stands in for h.
//
// DeepSeek-V3 / GLM-5 ("nextn", decoder layer num_hidden_layers): enorm, hnorm, eh_proj and shared_head.norm in
// those places, read the same way (the model's normed hidden state; chained, the draft's after shared_head.norm;
// docs/speculative.md says why). The checkpoint's copies of the embedding and lm_head in that layer are not read:
// the model's own are used.
struct DraftModule {
  RmsNorm norm_embedding, norm_hidden, final_norm;
  Linear fc;  // [hidden, 2 * hidden]
  DecoderLayer layer;
  std::unique_ptr<Block> input_block, head_block;
};

class CausalLm {
 public:
  CausalLm(ModelConfig config, std::unique_ptr<WeightStore> weights) : config_(std::move(config)),
                                                                      weights_(std::move(weights)) {}

  const ModelConfig& config() const { return config_; }
  // A new sequence's host caches (one LayerCache per layer and one for the draft module's layer, empty), without
  // any device state.
  SequenceCache new_cache() const;

  // Makes every block for `ops`'s device and keeps them: from then on run_blocks runs them (a runner does this once
  // at load; the host weights stay, since the device's blocks may read them, unless the runner releases them).
  Expected<void> place(BlockOps& ops);
  // Hands every host block to `ops` in the model's order (embedding, each layer's mixer and feed-forward block,
  // lm_head; then, `with_draft`, the draft module's) and drops what it makes: for devices that only look, such as
  // the self-test's planner.
  Expected<void> visit_blocks(BlockOps& ops, bool with_draft = false) const;
  // Frees the host blocks' weights and the store behind them (the dummy and tensor-parallel copies, the mapped
  // checkpoint), keeping the placed blocks, the config and the structure (vocab, draft, notices): for a device
  // whose blocks hold their own copies (BlockOps::blocks_copy_weights), which the runner calls once placed. Blocks
  // can be neither placed nor visited after it.
  void release_host_weights();
  bool host_weights_released() const { return host_released_; }

  // The layer loop, the same on every device and every tensor-parallel rank: embedding, each layer's mixer and
  // feed-forward block, the final norm and lm_head, as placed by place(ops). The runner sets up the step its blocks
  // read before calling it.
  Expected<void> run_blocks(BlockOps& ops) const;
  // The draft module's loop (embedding, its input block, its layer, its head), as placed by place(ops); the runner
  // sets up the step and the hidden rows its input block reads.
  Expected<void> run_draft_blocks(BlockOps& ops) const;

  // Set by the architecture builders.
  CpuMatrix embed_tokens;
  std::vector<DecoderLayer> layers;
  RmsNorm final_norm;
  Linear lm_head;
  VocabRange vocab;  // the rows of the vocabulary embed_tokens and lm_head hold (a tensor-parallel rank's, or all)
  std::unique_ptr<DraftModule> draft;  // loaded when asked for (ModelLoadOptions::load_draft)
  std::vector<std::string> notices;  // worth telling the user once (e.g. skipped vision weights)

 private:
  // Every host block made for `ops`, in the model's order: embedding, each layer's mixer and feed-forward block,
  // lm_head; then, `with_draft`, the draft module's input block, mixer, feed-forward block and head.
  Expected<std::vector<std::unique_ptr<Block>>> make_blocks(BlockOps& ops, bool with_draft) const;

  ModelConfig config_;
  std::unique_ptr<WeightStore> weights_;  // owns the memory the views above point into
  bool host_released_ = false;
  std::unique_ptr<Block> embedding_block_, head_block_;
};

// kShapes: the dummy weights' names, shapes and formats with zero contents (WeightStore::make_shapes_only), for
// looking at a model's blocks without computing with them.
enum class LoadFormat { kAuto, kDummy, kShapes };

enum class ModelDevice { kCpu, kCuda };

// Sizes of what a device runner allocates up front.
struct DeviceModelOptions {
  int device = 0;                    // CUDA ordinal
  int64_t max_batch_tokens = 8192;   // rows of one forward call
  int64_t max_sequences = 64;        // sequences alive at once (Gated DeltaNet state slots)
  int64_t kv_cache_tokens = 0;       // 0: sized from free device memory (half of it, at most 32k per sequence)
  int64_t kv_block_size = 16;
  // The longest sequence (tokens) whose decode steps get a CUDA graph captured at load (0: the whole KV cache); a
  // longer one is captured on its second step.
  int64_t max_context_tokens = 0;
  // The kernels and fusions the start-up self-test verified (or the user forced), ops/kernel_choices.h: the
  // defaults run each family's kernels by shape and fuse nothing.
  KernelChoices kernels;
  // Decode steps (one token per sequence) replayed as CUDA graphs, one per batch size and context bucket, instead
  // of ~10 launches per layer from the host. Off: every step launched eagerly (--enforce-eager).
  bool cuda_graphs = true;
  // Programmatic dependent launch: each kernel may be scheduled while the previous one finishes (it waits before
  // touching memory), hiding launch and block-scheduling latency between the many short kernels of a decode step.
  // Used where a probe at load shows the device takes it (sm_90 and later); off: plain stream order (--no-pdl).
  bool programmatic_launch = true;
  // With the model's draft module (speculative decoding): the most rows one verification of a sequence holds, its
  // last token and the drafts (--speculative-num-steps + 1). A GPU keeps a Gated DeltaNet state per row of it for
  // every sequence (docs/speculative.md), so it is sized to what the server asks for.
  int64_t verify_rows = 5;
};

// How attention caches its keys (--kv-cache-dtype). kAuto and kBf16: bf16 values. kFp8E4m3: the FP8 form, for now
// MLA's latent only (core/latent_fp8.h, 656 bytes per token for GLM-5 instead of 1152): GLM-5's tile scales as fp32,
// DeepSeek-V3's rounded up to powers of two; a model with other attention is refused.
enum class KvCacheDtype { kAuto, kBf16, kFp8E4m3 };

struct ModelLoadOptions {
  LoadFormat load_format = LoadFormat::kAuto;
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;
  // Ranks to split the model over (runtime/tp_runner.h): each holds its slice of every weight (models/shard.h) and
  // runs on its own thread; 1: the whole model on one device.
  int tensor_parallel_size = 1;
  // Expert parallelism (--enable-expert-parallel): each rank holds whole routed experts, a 1 / tensor_parallel_size
  // share of them, instead of a slice of every expert; everything else splits as before (ShardRank::expert_parallel).
  bool expert_parallel = false;
  // Which slice of the weights model_build_host reads (models/shard.h); {0, 1}: all of them. The tensor-parallel
  // runner sets it for each rank, with the rank's `communicator`, over which its blocks sum their partial outputs
  // (null: the whole model).
  ShardRank shard;
  Communicator* communicator = nullptr;
  // The GPU of each rank under tensor parallelism (empty: rank r on GPU r). Ranks on one GPU share it through
  // collectives staged through the host (slow; for tests); ranks on distinct GPUs use NCCL.
  std::vector<int> cuda_devices;
  // How long the group's start-up all-reduce may take before start-up fails (runtime/tp_runner.h).
  std::chrono::milliseconds tp_check_deadline{30000};
  // Several processes ("nodes", SGLang's flags): --nnodes, --node-rank, --dist-init-addr HOST:PORT (node 0's
  // rendezvous store); each runs tensor_parallel_size / nnodes of the ranks. How long joining them may take.
  int nnodes = 1;
  int node_rank = 0;
  std::string dist_init_addr;
  // Node 0 runs no ranks: it holds the scheduler and the server, and the ranks run on nodes 1 .. nnodes - 1
  // (tensor_parallel_size / (nnodes - 1) each); the node holding rank 0 sends each step's logits back to it.
  bool front_end = false;
  std::chrono::milliseconds tp_join_timeout{120000};
  Nvfp4Activations nvfp4_activations = Nvfp4Activations::kDequantize;  // which NVFP4 linears run W4A4
  // Also the model's multi-token-prediction module (CausalLm::draft), the draft model of speculative decoding: an
  // error for a model without one.
  bool load_draft = false;
  uint64_t dummy_seed = 0;
  ModelDevice device = ModelDevice::kCpu;
  DeviceModelOptions device_options;
};

// The model's host blocks, placed on no device (options.device and options.device_options are the runner's:
// runtime/model_runner.h's runner_load): what its architecture file builds from the config and the weights.
Expected<std::unique_ptr<CausalLm>> model_build_host(const std::filesystem::path& dir, const ModelLoadOptions& options);
// Whether model_build_host has a builder for the architecture (it refuses the others before making any weights).
bool model_build_supported(Architecture architecture);

// Architecture builders (one file each); which NVFP4 linears run W4A4 is the WeightStore's (set_nvfp4_activations).
Expected<void> qwen3_build(CausalLm& model, WeightStore& weights, const WeightSchema& schema);
Expected<void> qwen3_moe_build(CausalLm& model, WeightStore& weights, const WeightSchema& schema);
Expected<void> qwen3_5_moe_build(CausalLm& model, WeightStore& weights, const WeightSchema& schema);
// `latent_fp8`: the latent cache in FP8 entries (KvCacheDtype::kFp8E4m3).
Expected<void> glm_moe_dsa_build(CausalLm& model, WeightStore& weights, const WeightSchema& schema, bool latent_fp8);
// The draft module the schema declares (weight_schema_build's with_draft) into model.draft.
Expected<void> qwen3_5_moe_build_draft(CausalLm& model, WeightStore& weights, const WeightSchema& schema);
Expected<void> glm_moe_dsa_build_draft(CausalLm& model, WeightStore& weights, const WeightSchema& schema, bool latent_fp8);

}  // namespace tern
