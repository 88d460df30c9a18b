// A decoder-only language model on the CPU: embeddings, decoder layers (norm -> mixer -> residual, norm -> feed-forward
// -> residual), final norm, lm_head. The architecture files (qwen3.cc, qwen3_moe.cc, qwen3_5_moe.cc) build one from a
// config and a WeightStore; model_load picks the right one.
//
//   TERN_ASSIGN_OR_RETURN(auto model, model_load("/models/qwen3", {}));
//   SequenceCache seq = model->new_sequence();
//   std::vector<SequenceInput> batch{{&seq, prompt_ids}};
//   TERN_ASSIGN_OR_RETURN(auto logits, model->forward(batch, LogitsFor::kLastToken));  // [1, vocab]
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "core/error.h"
#include "io/model_config.h"
#include "layers/blocks.h"
#include "layers/linear.h"
#include "layers/norms.h"
#include "layers/weights.h"
#include "runtime/sampler.h"

namespace tern {

struct DecoderLayer {
  RmsNorm input_norm, post_attention_norm;
  std::unique_ptr<Mixer> mixer;
  std::unique_ptr<FeedForward> ffn;
};

struct SequenceInput {
  SequenceCache* cache = nullptr;
  std::span<const int32_t> tokens;  // appended after what the cache holds
};

enum class LogitsFor { kAllTokens, kLastToken };

// How one sequence of a step picks its next token: its own Sampler (parameters and random stream) and the ids its
// penalties read. A null sampler: the sequence is mid-prompt and samples nothing this step.
struct SampleRow {
  Sampler* sampler = nullptr;
  std::span<const int32_t> prompt_ids, output_ids;
};
// Per sequence of the step: the token, or why this sequence could not sample (a non-finite logit, a penalty id
// outside the vocabulary); an entry for a null sampler holds an unused token.
using SampleResults = std::vector<Expected<SampledToken>>;

// Runs the forward pass on a device instead of the CPU (models/gpu); CausalLm::forward hands every call to it.
class ForwardBackend {
 public:
  virtual ~ForwardBackend() = default;
  virtual std::shared_ptr<DeviceSequenceState> new_sequence() = 0;
  // `tracer` (optional) receives the intermediates the CPU path names ("layers.N.mixer_out", "layers.N.ffn_out",
  // "layers.N.gdn_core", "layers.N.router_logits", "final_norm"), widened to fp32; it synchronizes after each.
  virtual Expected<std::vector<float>> forward(std::span<const SequenceInput> batch, LogitsFor which,
                                               const Tracer* tracer) = 0;
  // forward(kLastToken) with each sequence's token sampled on the device: only ids and logprobs come back. The
  // same tokens as the Sampler on forward's logits, up to the last-ulp differences runtime/sampler.h bounds.
  virtual Expected<SampleResults> forward_sample(std::span<const SequenceInput> batch,
                                                 std::span<const SampleRow> rows) = 0;
  virtual std::string describe() const = 0;  // one line: device and what it holds
  // Tokens the KV cache holds over all sequences (what DeviceModelOptions::kv_cache_tokens asked for, or what fit in
  // device memory when it was 0); 0 when the model has no attention layers.
  virtual int64_t kv_cache_tokens() const = 0;
};

class CausalLm {
 public:
  CausalLm(ModelConfig config, std::unique_ptr<WeightStore> weights) : config_(std::move(config)),
                                                                      weights_(std::move(weights)) {}

  const ModelConfig& config() const { return config_; }
  SequenceCache new_sequence() const;

  // From now on forward() runs there (set by model_load for a device; the host weights stay mapped, since the
  // backend may read them). Null for the CPU.
  void set_backend(std::unique_ptr<ForwardBackend> backend) { backend_ = std::move(backend); }
  const ForwardBackend* backend() const { return backend_.get(); }

  // Runs the tokens of every sequence (each extends its cache) and returns logits [rows, vocab]: one row per token
  // in batch order (kAllTokens) or one per sequence (kLastToken). Errors on an out-of-range token id.
  Expected<std::vector<float>> forward(std::span<const SequenceInput> batch, LogitsFor which,
                                       const Tracer* tracer = nullptr) const;
  // One step that ends in a token per sequence (rows.size() == batch.size()): sampled where the logits are (on the
  // device backend's GPU; on the CPU through each row's Sampler). An error fails the whole step; a row's own
  // failure (non-finite logits) is in its entry.
  Expected<SampleResults> forward_sample(std::span<const SequenceInput> batch, std::span<const SampleRow> rows) const;

  // Set by the architecture builders.
  CpuMatrix embed_tokens;
  std::vector<DecoderLayer> layers;
  RmsNorm final_norm;
  Linear lm_head;
  std::vector<std::string> notices;  // worth telling the user once (e.g. skipped vision weights)

 private:
  ModelConfig config_;
  std::unique_ptr<WeightStore> weights_;  // owns the memory the views above point into
  std::unique_ptr<ForwardBackend> backend_;
};

enum class LoadFormat { kAuto, kDummy };
enum class ModelDevice { kCpu, kCuda };

// Sizes of what a device backend allocates up front.
struct DeviceModelOptions {
  int device = 0;                    // CUDA ordinal
  int64_t max_batch_tokens = 8192;   // rows of one forward call
  int64_t max_sequences = 64;        // sequences alive at once (Gated DeltaNet state slots)
  int64_t kv_cache_tokens = 0;       // 0: sized from free device memory (half of it, at most 32k per sequence)
  int64_t kv_block_size = 16;
  // Kernel variants the start-up self-test verified (or the user forced): "auto" lets each call pick by its shape;
  // "cuda-decode" / "cuda-prefill" and "cuda-recurrent" / "cuda-chunked" pin one.
  std::string attention_variant = "auto";
  std::string gdn_variant = "auto";
  // BF16 projections of at most kGemvPreferredMaxRows rows (decode) through tern's own GEMV instead of cuBLASLt: set
  // when the self-test chose gemm_bf16's "gemv" implementation (or the user forced it).
  bool bf16_gemv = false;
  // At one row, each RMSNorm fused into the BF16 GEMV that reads its output (gemv_bf16_rmsnorm: no launch of its
  // own): set when the self-test verified op `rms_norm_gemv`; takes effect with bf16_gemv.
  bool norm_gemv = false;
  // At one row, the MLP's SiLU-and-mul folded into the BF16 down GEMV's loads (gemv_bf16_silu_mul): set when the
  // self-test chose the fused implementation of op `silu_mul_gemv`; takes effect with bf16_gemv.
  bool silu_gemv = false;
  // At one sequence of one token, a GDN layer's gated RMSNorm done by its recurrent delta-rule kernel (a cluster of
  // each head's value slices; GdnGatedNorm): set when the self-test chose the fused implementation of op
  // `gdn_delta_rule_norm`.
  bool gdn_norm_in_rule = false;
  // Decode steps (one token per sequence) replayed as CUDA graphs, one per batch size and context bucket, instead
  // of ~10 launches per layer from the host. Off: every step launched eagerly (--enforce-eager).
  bool cuda_graphs = true;
  // Programmatic dependent launch: each kernel may be scheduled while the previous one finishes (it waits before
  // touching memory), hiding launch and block-scheduling latency between the many short kernels of a decode step.
  // Used where a probe at load shows the device takes it (sm_90 and later); off: plain stream order (--no-pdl).
  bool programmatic_launch = true;
};

struct ModelLoadOptions {
  LoadFormat load_format = LoadFormat::kAuto;
  bool nvfp4_quantize_activations = false;  // W4A4 instead of W4A16
  uint64_t dummy_seed = 0;
  ModelDevice device = ModelDevice::kCpu;
  DeviceModelOptions device_options;
};

// CUDA devices this binary can run the model on (0 when built without CUDA or when none is present).
int model_cuda_device_count();

Expected<std::unique_ptr<CausalLm>> model_load(const std::filesystem::path& dir, const ModelLoadOptions& options);

// Architecture builders (one file each). `quantize_input`: W4A4 for NVFP4 linears.
Expected<void> qwen3_build(CausalLm& model, WeightStore& weights, const WeightSchema& schema, bool quantize_input);
Expected<void> qwen3_moe_build(CausalLm& model, WeightStore& weights, const WeightSchema& schema, bool quantize_input);
Expected<void> qwen3_5_moe_build(CausalLm& model, WeightStore& weights, const WeightSchema& schema,
                                 bool quantize_input);

}  // namespace tern
