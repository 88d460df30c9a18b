#include "models/gpu/gpu_model.h"

#include <fmt/format.h>

#include <spdlog/spdlog.h>
#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <map>
#include <optional>

#include "core/formats.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/gemv_bf16.h"
#include "kernels/cuda/moe.h"
#include "layers/attention.h"
#include "layers/gated_deltanet.h"
#include "layers/moe.h"
#include "models/gpu/gpu_sampler.h"
#include "models/gpu/gpu_weights.h"

namespace tern {
namespace {

// ---- Cache bookkeeping: KV blocks and Gated DeltaNet state slots, shared with the sequences holding them. ----

struct CachePool {
  std::vector<int32_t> free_blocks;  // a stack: the most recently freed block is reused first
  std::vector<int32_t> free_slots;
};

class GpuSequence final : public DeviceSequenceState {
 public:
  explicit GpuSequence(std::shared_ptr<CachePool> pool) : pool_(std::move(pool)) {}
  ~GpuSequence() override {
    pool_->free_blocks.insert(pool_->free_blocks.end(), blocks.rbegin(), blocks.rend());
    if (slot >= 0) pool_->free_slots.push_back(slot);
  }
  GpuSequence(const GpuSequence&) = delete;
  GpuSequence& operator=(const GpuSequence&) = delete;

  std::vector<int32_t> blocks;
  int32_t slot = -1;

 private:
  std::shared_ptr<CachePool> pool_;
};

// ---- Layers as the device runs them. ----

struct GpuNorm {
  const uint16_t* weight = nullptr;
  float eps = 1e-6f;
  bool zero_centred = false;
};

// The input of a block's first projection: the RMSNorm of the residual stream (x_, plus `residual`, the previous
// block's output, when set). The norm's output lands in normed_ and the new stream in x_, whichever path runs it.
struct NormedInput {
  const GpuNorm* norm = nullptr;
  const uint16_t* residual = nullptr;
};

struct GpuAttention {
  AttentionShape shape;
  DeviceProjection qkv;  // [q_proj | k_proj | v_proj]
  DeviceMatrix o_proj;
  GpuNorm q_norm, k_norm;
  const float* inv_freq = nullptr;
  int64_t rotary_dim = 0;
  PagedKvCache cache{};
};

struct GpuGdn {
  GatedDeltaNetShape shape;
  // [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a] as one GEMM (one matrix when all are BF16); the conv, the gated
  // norm and the delta rule read their columns with the projection's row stride.
  DeviceProjection in_proj;
  int64_t z_col = 0, b_col = 0, a_col = 0;
  DeviceMatrix out_proj;
  const float* conv_weight = nullptr;
  const float* a_log = nullptr;
  const float* dt_bias = nullptr;
  const uint16_t* norm_weight = nullptr;
  uint16_t* conv_state = nullptr;  // [slots, C, K-1]
  float* state = nullptr;          // [slots, Hv, dk, dv]
  int64_t channels() const { return 2 * shape.n_key_heads * shape.key_dim + shape.n_value_heads * shape.value_dim; }
};

struct GpuMlp {
  DeviceProjection gate_up;
  DeviceMatrix down;
  int64_t inter = 0;
};

struct GpuMoe {
  MoeShape shape;
  int64_t n_experts = 0;
  // [shared expert gate | shared expert up | router | shared_expert_gate] as one GEMM over the block's input (the
  // shared expert's columns first, so its rows start 16-byte aligned for silu_mul); without a shared expert, the
  // router.
  DeviceProjection router;
  int64_t logits_col = 0;  // the router's first column
  DeviceExperts experts;
  std::optional<DeviceMatrix> shared_down;
  int64_t shared_inter = 0;
};

struct GpuLayer {
  GpuNorm input_norm, post_norm;
  std::optional<GpuAttention> attention;
  std::optional<GpuGdn> gdn;
  std::optional<GpuMlp> mlp;
  std::optional<GpuMoe> moe;
};

// Per-step metadata, host side, laid out as one int32 array copied to the device in one transfer. A decode step
// (one token per sequence, logits of the last rows) rounds its block-table width up to a power of two and sizes
// attention for that many blocks, so the kernels' launch shapes depend only on (n_seqs, max_blocks): the key under
// which the step's CUDA graph is kept. Its outputs do not depend on whether a graph replays it.
struct StepPlan {
  bool decode = false;
  int64_t tokens = 0, n_seqs = 0, max_query_len = 0, max_seq_len = 0, max_blocks = 0;
  std::vector<int32_t> ids, positions, slot_mapping, query_start, seq_lens, block_tables, state_slot, seq_past,
      last_rows;
};

// Scratch arena: every activation buffer of a step, sized once for max_batch_tokens rows.
class Arena {
 public:
  Expected<void> reserve(size_t bytes) {
    if (!DeviceBuffer::try_allocate(bytes, buffer_)) {
      return make_error("out of device memory for {} bytes of activation buffers", bytes);
    }
    return {};
  }
  // Carves `count` elements of T, 256-byte aligned.
  template <class T>
  T* take(int64_t count) {
    const size_t bytes = (static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T) + 255) / 256 * 256;
    T* p = reinterpret_cast<T*>(static_cast<char*>(buffer_.data()) + used_);
    used_ += bytes;
    return p;
  }
  static size_t aligned(size_t bytes) { return (std::max<size_t>(bytes, 1) + 255) / 256 * 256; }

 private:
  DeviceBuffer buffer_;
  size_t used_ = 0;
};

class GpuBackend final : public ForwardBackend {
 public:
  GpuBackend(const CausalLm& model, const DeviceModelOptions& options)
      : options_(options),
        ctx_(options.device),
        weights_(ctx_.stream(), options.bf16_gemv),
        pool_(std::make_shared<CachePool>()) {
    config_hidden_ = model.config().hidden_size;
  }

  Expected<void> build(const CausalLm& model);
  std::shared_ptr<DeviceSequenceState> new_sequence() override { return std::make_shared<GpuSequence>(pool_); }
  Expected<std::vector<float>> forward(std::span<const SequenceInput> batch, LogitsFor which,
                                       const Tracer* tracer) override;
  Expected<SampleResults> forward_sample(std::span<const SequenceInput> batch,
                                         std::span<const SampleRow> rows) override;
  int64_t kv_cache_tokens() const override { return kv_blocks_ * options_.kv_block_size; }
  std::string describe() const override {
    const auto captured = std::count_if(graphs_.begin(), graphs_.end(), [](const auto& g) { return g.second.exec; });
    return fmt::format("cuda:{} {} ({:.2f} GiB of weights, KV cache {} tokens in blocks of {}, {}{})", options_.device,
                       ctx_.props().name, static_cast<double>(weights_.bytes()) / (1 << 30),
                       kv_blocks_ * options_.kv_block_size, options_.kv_block_size,
                       graphs_enabled_ ? fmt::format("{} decode graphs", captured) : std::string("eager decode"),
                       pdl_ ? ", programmatic launch in decode steps" : "");
  }

 private:
  Expected<GpuNorm> norm(const RmsNorm& n) {
    TERN_ASSIGN_OR_RETURN(const uint16_t* w, weights_.vector_bf16(n.weight));
    return GpuNorm{w, n.eps, n.zero_centred};
  }
  Expected<GpuAttention> build_attention(const Attention& a);
  Expected<GpuGdn> build_gdn(const GatedDeltaNet& g);
  Expected<GpuMlp> build_mlp(const MlpWeights& w);
  Expected<GpuMoe> build_moe(const Moe& m, const std::string& name);
  Expected<void> allocate_caches();
  Expected<void> allocate_activations();

  Expected<StepPlan> plan_step(std::span<const SequenceInput> batch, bool decode);
  void upload_plan(const StepPlan& plan);
  // Embedding to lm_head: logits of `which` rows into logits_ (rows returned), on the stream; no synchronisation.
  Expected<int64_t> run_body(const StepPlan& plan, LogitsFor which, const Tracer* tracer);
  // run_body through the decode step's CUDA graph: the first step of a shape runs eagerly (cuBLASLt plans, lazily
  // loaded kernels), the second is captured, later ones replay it. A capture that fails turns graphs off, loudly.
  Expected<int64_t> run_decode(const StepPlan& plan);
  void drop_graphs();
  Expected<void> run_attention(const GpuAttention& a, const NormedInput& in, const StepPlan& plan);
  Expected<void> run_gdn(const GpuGdn& g, const NormedInput& in, const StepPlan& plan,
                         const std::function<Expected<void>()>& after_core);
  Expected<void> run_mlp(const GpuMlp& m, const NormedInput& in, int64_t rows, uint16_t* y);
  Expected<void> run_moe(const GpuMoe& m, const NormedInput& in, int64_t tokens);
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
  // Waits for the stream and hands rows x cols of a bf16 matrix with row stride ld to the tracer as fp32.
  Expected<void> trace(const Tracer* tracer, const std::string& name, const uint16_t* data, int64_t rows, int64_t cols,
                       int64_t ld);

  DeviceModelOptions options_;
  DeviceContext ctx_;
  DeviceWeights weights_;
  std::shared_ptr<CachePool> pool_;
  int64_t config_hidden_ = 0;
  int64_t vocab_ = 0;

  DeviceMatrix embed_, lm_head_;
  GpuNorm final_norm_;
  std::vector<GpuLayer> layers_;

  int64_t kv_blocks_ = 0;
  AttentionVariant attention_variant_ = AttentionVariant::kAuto;
  GdnVariant gdn_variant_ = GdnVariant::kAuto;
  std::vector<DeviceBuffer> cache_buffers_;
  bool has_gdn_ = false;
  bool pdl_ = false;  // programmatic launch wanted and taken by the device (decode steps only: run_body)

  // Activations (bf16 unless said), all [max_batch_tokens, ...].
  Arena arena_;
  // x_ is the residual stream: x_rows_ at the start of every step; at one row it alternates with x_spare_
  // (norm_forward), which starts every step as x_row_ (one row), whatever the parity of the last step's swaps.
  uint16_t *x_rows_ = nullptr, *x_row_ = nullptr, *x_spare_ = nullptr, *x_ = nullptr;
  uint16_t *normed_ = nullptr, *out_ = nullptr, *proj_ = nullptr, *q_ = nullptr, *gate_ = nullptr, *attn_ = nullptr,
           *conv_ = nullptr, *act_ = nullptr;
  uint16_t *router_ = nullptr, *shared_out_ = nullptr, *last_ = nullptr;
  unsigned long long* bad_id_ = nullptr;  // the embedding kernel's report (ids are checked on the host first)
  void* attention_workspace_ = nullptr;
  size_t attention_workspace_bytes_ = 0;
  void* moe_workspace_ = nullptr;
  size_t moe_workspace_bytes_ = 0;
  DeviceBuffer logits_;  // [rows, vocab] bf16: max_sequences rows, grown on demand (drops graphs)
  DeviceBuffer meta_buffer_;
  int32_t* meta_ = nullptr;            // device copy of the step plan
  int32_t* meta_host_ = nullptr;       // pinned staging
  size_t meta_capacity_ = 0;           // int32 elements
  std::vector<uint16_t> logits_host_;  // bf16 staging of the logits
  // Device pointers into meta_ for the current step.
  // Decode graphs by (n_seqs, block-table width); they bake in every buffer address, so a reallocated meta_ or
  // logits_ drops them all.
  struct DecodeGraph {
    bool warmed = false;
    cudaGraphExec_t exec = nullptr;
  };
  std::map<std::pair<int64_t, int64_t>, DecodeGraph> graphs_;
  bool graphs_enabled_ = true;
  GpuSampler sampler_;  // sized for max_sequences rows
  const int32_t *d_ids_ = nullptr, *d_positions_ = nullptr, *d_slot_mapping_ = nullptr, *d_query_start_ = nullptr,
                *d_seq_lens_ = nullptr, *d_block_tables_ = nullptr, *d_state_slot_ = nullptr, *d_seq_past_ = nullptr,
                *d_last_rows_ = nullptr;

 public:
  ~GpuBackend() override {
    drop_graphs();
    if (meta_host_ != nullptr) cudaFreeHost(meta_host_);
  }
};

// ---- Building ----

Expected<GpuAttention> GpuBackend::build_attention(const Attention& a) {
  GpuAttention g;
  g.shape = a.shape();
  const AttentionWeights& w = a.weights();
  const Linear* parts[] = {&w.q_proj, &w.k_proj, &w.v_proj};
  TERN_ASSIGN_OR_RETURN(g.qkv, weights_.projection(parts));
  TERN_ASSIGN_OR_RETURN(g.o_proj, weights_.matrix(w.o_proj));
  if (w.q_norm.weight.empty() || w.k_norm.weight.empty()) {
    return make_error("{}: attention without q/k norms is not supported on CUDA yet", w.q_proj.name());
  }
  TERN_ASSIGN_OR_RETURN(g.q_norm, norm(w.q_norm));
  TERN_ASSIGN_OR_RETURN(g.k_norm, norm(w.k_norm));
  g.rotary_dim = a.rope().rotary_dim();
  TERN_ASSIGN_OR_RETURN(g.inv_freq, weights_.vector_f32(a.rope().inv_freq()));
  return g;
}

Expected<GpuGdn> GpuBackend::build_gdn(const GatedDeltaNet& gdn) {
  GpuGdn g;
  g.shape = gdn.shape();
  const GatedDeltaNetWeights& w = gdn.weights();
  if (g.shape.fused_per_key_head) {
    return make_error("{}: the Qwen3-Next fused GDN projections are not supported on CUDA yet", w.out_proj.name());
  }
  const Linear* parts[] = {&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a};
  TERN_ASSIGN_OR_RETURN(g.in_proj, weights_.projection(parts, 8));
  g.z_col = w.in_proj_qkv.out_features();
  g.b_col = g.z_col + w.in_proj_z.out_features();
  g.a_col = g.b_col + w.in_proj_b.out_features();
  if (g.z_col % 8 != 0 || g.shape.value_dim % 8 != 0) {  // the gated norm loads its gate rows 16 bytes at a time
    return make_error("{}: GDN projection widths that are not multiples of 8 are not supported on CUDA",
                      w.in_proj_qkv.name());
  }
  TERN_ASSIGN_OR_RETURN(g.out_proj, weights_.matrix(w.out_proj));
  TERN_ASSIGN_OR_RETURN(g.conv_weight, weights_.vector_f32(w.conv_weight));
  TERN_ASSIGN_OR_RETURN(g.a_log, weights_.vector_f32(w.a_log));
  TERN_ASSIGN_OR_RETURN(g.dt_bias, weights_.vector_f32(w.dt_bias));
  TERN_ASSIGN_OR_RETURN(g.norm_weight, weights_.vector_bf16(w.norm_weight));
  return g;
}

Expected<GpuMlp> GpuBackend::build_mlp(const MlpWeights& w) {
  GpuMlp m;
  const Linear* parts[] = {&w.gate_proj, &w.up_proj};
  TERN_ASSIGN_OR_RETURN(m.gate_up, weights_.projection(parts));
  TERN_ASSIGN_OR_RETURN(m.down, weights_.matrix(w.down_proj));
  m.inter = w.gate_proj.out_features();
  return m;
}

Expected<GpuMoe> GpuBackend::build_moe(const Moe& moe, const std::string& name) {
  GpuMoe m;
  m.shape = moe.shape();
  const MoeWeights& w = moe.weights();
  m.n_experts = w.router.out_features();
  std::vector<const Linear*> router;
  if (w.shared_expert) {
    const MlpWeights& s = w.shared_expert->weights();
    router = {&s.gate_proj, &s.up_proj};
    m.shared_inter = s.gate_proj.out_features();
    m.logits_col = 2 * m.shared_inter;
    if (m.shared_inter % 8 != 0) {
      return make_error("{}: a shared expert width that is not a multiple of 8 is not supported on CUDA",
                        s.gate_proj.name());
    }
    TERN_ASSIGN_OR_RETURN(m.shared_down, weights_.matrix(s.down_proj));
  }
  router.push_back(&w.router);
  if (w.shared_expert) router.push_back(&w.shared_expert_gate);
  TERN_ASSIGN_OR_RETURN(m.router, weights_.projection(router, 8));
  TERN_ASSIGN_OR_RETURN(m.experts, weights_.experts(w.experts, name + ".experts"));
  return m;
}

Expected<void> GpuBackend::build(const CausalLm& model) {
  pdl_ = options_.programmatic_launch && programmatic_launch_probe(ctx_);
  const std::string& av = options_.attention_variant;
  const std::string& gv = options_.gdn_variant;
  if (av != "auto" && av != "cuda-decode" && av != "cuda-prefill") {
    return make_error("attention variant '{}' is not one the CUDA model runs (auto, cuda-decode, cuda-prefill)", av);
  }
  if (gv != "auto" && gv != "cuda-recurrent" && gv != "cuda-chunked") {
    return make_error("GDN variant '{}' is not one the CUDA model runs (auto, cuda-recurrent, cuda-chunked)", gv);
  }
  attention_variant_ = av == "cuda-decode"    ? AttentionVariant::kDecode
                       : av == "cuda-prefill" ? AttentionVariant::kPrefill
                                              : AttentionVariant::kAuto;
  gdn_variant_ = gv == "cuda-recurrent" ? GdnVariant::kRecurrent
                 : gv == "cuda-chunked" ? GdnVariant::kChunked
                                        : GdnVariant::kAuto;
  vocab_ = model.lm_head.out_features();
  TERN_ASSIGN_OR_RETURN(embed_, weights_.matrix(model.embed_tokens, "embed_tokens"));
  if (embed_.nvfp4) return make_error("embed_tokens: NVFP4 embeddings are not supported");
  TERN_ASSIGN_OR_RETURN(lm_head_, weights_.matrix(model.lm_head));
  TERN_ASSIGN_OR_RETURN(final_norm_, norm(model.final_norm));
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const DecoderLayer& host = model.layers[i];
    const std::string name = fmt::format("layers.{}", i);
    GpuLayer layer;
    TERN_ASSIGN_OR_RETURN(layer.input_norm, norm(host.input_norm));
    TERN_ASSIGN_OR_RETURN(layer.post_norm, norm(host.post_attention_norm));
    if (const auto* a = dynamic_cast<const Attention*>(host.mixer.get())) {
      TERN_ASSIGN_OR_RETURN(layer.attention, build_attention(*a));
    } else if (const auto* g = dynamic_cast<const GatedDeltaNet*>(host.mixer.get())) {
      TERN_ASSIGN_OR_RETURN(layer.gdn, build_gdn(*g));
      has_gdn_ = true;
    } else {
      return make_error("{}: this token mixer is not supported on CUDA yet", name);
    }
    if (const auto* m = dynamic_cast<const Mlp*>(host.ffn.get())) {
      TERN_ASSIGN_OR_RETURN(layer.mlp, build_mlp(m->weights()));
    } else if (const auto* m = dynamic_cast<const Moe*>(host.ffn.get())) {
      TERN_ASSIGN_OR_RETURN(layer.moe, build_moe(*m, name + ".mlp"));
    } else {
      return make_error("{}: this feed-forward block is not supported on CUDA yet", name);
    }
    layers_.push_back(std::move(layer));
  }
  graphs_enabled_ = options_.cuda_graphs;
  TERN_TRY(allocate_activations());
  TERN_TRY(allocate_caches());
  TERN_TRY(sampler_.allocate(options_.max_sequences, vocab_));
  // Logits of a decode step at the largest batch, allocated now so that no decode graph sees this buffer move.
  if (!DeviceBuffer::try_allocate(static_cast<size_t>(options_.max_sequences * vocab_) * 2, logits_)) {
    return make_error("out of device memory for the logits of {} sequences", options_.max_sequences);
  }
  for (int64_t s = options_.max_sequences - 1; s >= 0; --s) pool_->free_slots.push_back(static_cast<int32_t>(s));
  return {};
}

Expected<void> GpuBackend::allocate_caches() {
  const int64_t bs = options_.kv_block_size, slots = options_.max_sequences;
  int64_t kv_bytes_per_token = 0;
  for (GpuLayer& l : layers_) {
    if (l.attention) kv_bytes_per_token += 2 * l.attention->shape.n_kv_heads * l.attention->shape.head_dim * 2;
    if (!l.gdn) continue;
    GpuGdn& g = *l.gdn;
    const size_t conv = static_cast<size_t>(slots * g.channels() * (g.shape.conv_kernel - 1)) * 2;
    const size_t state = static_cast<size_t>(slots * g.shape.n_value_heads * g.shape.key_dim * g.shape.value_dim) * 4;
    DeviceBuffer c, s;
    if (!DeviceBuffer::try_allocate(conv, c) || !DeviceBuffer::try_allocate(state, s)) {
      return make_error("out of device memory for the Gated DeltaNet states of {} sequences ({} bytes per layer); "
                        "lower --max-sequences", slots, conv + state);
    }
    g.conv_state = c.as<uint16_t>();
    g.state = s.as<float>();
    cache_buffers_.push_back(std::move(c));
    cache_buffers_.push_back(std::move(s));
  }
  if (kv_bytes_per_token == 0) return {};
  int64_t tokens = options_.kv_cache_tokens;
  if (tokens <= 0) {
    size_t free_bytes = 0, total = 0;
    TERN_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    // Half of what is free, so other processes and cuBLASLt keep room; at most max_sequences full 32k contexts.
    tokens = std::min<int64_t>(static_cast<int64_t>(free_bytes / 2) / kv_bytes_per_token, slots * 32768);
  }
  kv_blocks_ = std::max<int64_t>((tokens + bs - 1) / bs, 1);
  for (GpuLayer& l : layers_) {
    if (!l.attention) continue;
    GpuAttention& a = *l.attention;
    const size_t bytes = static_cast<size_t>(kv_blocks_ * bs * a.shape.n_kv_heads * a.shape.head_dim) * 2;
    DeviceBuffer k, v;
    if (!DeviceBuffer::try_allocate(bytes, k) || !DeviceBuffer::try_allocate(bytes, v)) {
      return make_error(
          "out of device memory for a KV cache of {} tokens; ask for fewer (tern serve: "
          "--max-total-tokens)",
          kv_blocks_ * bs);
    }
    a.cache = PagedKvCache{.k = k.as<uint16_t>(), .v = v.as<uint16_t>(), .n_blocks = kv_blocks_, .block_size = bs,
                           .n_kv_heads = a.shape.n_kv_heads, .head_dim = a.shape.head_dim};
    cache_buffers_.push_back(std::move(k));
    cache_buffers_.push_back(std::move(v));
  }
  for (int64_t b = kv_blocks_ - 1; b >= 0; --b) pool_->free_blocks.push_back(static_cast<int32_t>(b));
  // The split-K workspace (decode variant only, which kAuto picks for at most kAttentionDecodeMaxQueryLen rows per
  // sequence) depends on the rows of a step and the longest context the cache can hold.
  const int64_t decode_rows = attention_variant_ == AttentionVariant::kDecode
                                  ? options_.max_batch_tokens
                                  : std::min(options_.max_batch_tokens,
                                             kAttentionDecodeMaxQueryLen * options_.max_sequences);
  for (const GpuLayer& l : layers_) {
    if (!l.attention) continue;
    attention_workspace_bytes_ = std::max(
        attention_workspace_bytes_, paged_attention_workspace_bytes(ctx_.props(), decode_rows,
                                                                    l.attention->shape.n_heads,
                                                                    l.attention->shape.head_dim, kv_blocks_ * bs));
  }
  DeviceBuffer ws;
  if (!DeviceBuffer::try_allocate(attention_workspace_bytes_, ws)) {
    return make_error("out of device memory for the attention workspace ({} bytes)", attention_workspace_bytes_);
  }
  attention_workspace_ = ws.data();
  cache_buffers_.push_back(std::move(ws));
  return {};
}

Expected<void> GpuBackend::allocate_activations() {
  const int64_t t = options_.max_batch_tokens, h = config_hidden_;
  int64_t proj = 0, heads = 0, conv = 0, act = 0, router = 0;
  for (const GpuLayer& l : layers_) {
    if (l.attention) {
      proj = std::max(proj, l.attention->qkv.width);
      heads = std::max(heads, l.attention->shape.n_heads * l.attention->shape.head_dim);
    }
    if (l.gdn) {
      proj = std::max(proj, l.gdn->in_proj.width);
      conv = std::max(conv, l.gdn->channels());
      heads = std::max(heads, l.gdn->shape.n_value_heads * l.gdn->shape.value_dim);  // the GDN core lands in attn_
    }
    if (l.mlp) {
      proj = std::max(proj, l.mlp->gate_up.width);
      act = std::max(act, l.mlp->inter);
    }
    if (l.moe) {
      router = std::max(router, l.moe->router.width);
      act = std::max(act, l.moe->shared_inter);
      moe_workspace_bytes_ = std::max(moe_workspace_bytes_,
                                      moe_forward_workspace_bytes(t, l.moe->shape.top_k, l.moe->n_experts,
                                                                  l.moe->experts.inter, h));
    }
  }
  // Every bf16 buffer with its element count, once: sized first, then carved in this order.
  const std::pair<uint16_t**, int64_t> buffers[] = {
      {&x_rows_, t * h},      {&x_row_, h},          {&normed_, t * h},   {&out_, t * h},     {&proj_, t * proj},
      {&q_, t * heads},       {&gate_, t * heads},   {&attn_, t * heads}, {&conv_, t * conv}, {&act_, t * act},
      {&router_, t * router}, {&shared_out_, t * h}, {&last_, t * h}};
  size_t bytes = Arena::aligned(moe_workspace_bytes_) + Arena::aligned(8);
  for (const auto& [ptr, count] : buffers) bytes += Arena::aligned(static_cast<size_t>(count) * 2);
  TERN_TRY(arena_.reserve(bytes));
  for (const auto& [ptr, count] : buffers) *ptr = arena_.take<uint16_t>(count);
  moe_workspace_ = arena_.take<char>(static_cast<int64_t>(moe_workspace_bytes_));
  bad_id_ = arena_.take<unsigned long long>(1);
  return {};
}

// ---- One step ----

Expected<StepPlan> GpuBackend::plan_step(std::span<const SequenceInput> batch, bool decode) {
  StepPlan p;
  p.decode = decode;
  p.n_seqs = static_cast<int64_t>(batch.size());
  if (p.n_seqs > options_.max_sequences) {
    return make_error("{} sequences in one step; this model was set up for at most {}", p.n_seqs,
                      options_.max_sequences);
  }
  const int64_t bs = options_.kv_block_size;
  for (const SequenceInput& in : batch) {
    for (const int32_t id : in.tokens) {
      if (id < 0 || id >= embed_.n) return make_error("token id {} is outside the vocabulary [0, {})", id, embed_.n);
    }
  }
  p.query_start.push_back(0);
  for (const SequenceInput& in : batch) {
    auto* seq = dynamic_cast<GpuSequence*>(in.cache->device.get());
    if (seq == nullptr) return make_error("a sequence was not created by this CUDA model (new_sequence())");
    const int64_t past = in.cache->length, n = static_cast<int64_t>(in.tokens.size());
    const int64_t need_blocks = (past + n + bs - 1) / bs;
    while (static_cast<int64_t>(seq->blocks.size()) < need_blocks) {
      if (pool_->free_blocks.empty()) {
        return make_error("the KV cache is full ({} tokens); finish or cancel requests, or raise --max-total-tokens",
                          kv_blocks_ * bs);
      }
      seq->blocks.push_back(pool_->free_blocks.back());
      pool_->free_blocks.pop_back();
    }
    if (has_gdn_ && seq->slot < 0) {
      if (pool_->free_slots.empty()) return make_error("no free state slot: {} sequences are alive", options_.max_sequences);
      seq->slot = pool_->free_slots.back();
      pool_->free_slots.pop_back();
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = past + i;
      p.ids.push_back(in.tokens[i]);
      p.positions.push_back(static_cast<int32_t>(pos));
      p.slot_mapping.push_back(kv_blocks_ == 0 ? 0 : static_cast<int32_t>(seq->blocks[pos / bs] * bs + pos % bs));
    }
    p.tokens += n;
    p.query_start.push_back(static_cast<int32_t>(p.tokens));
    p.seq_lens.push_back(static_cast<int32_t>(past + n));
    p.state_slot.push_back(seq->slot);
    p.seq_past.push_back(static_cast<int32_t>(past));
    p.last_rows.push_back(static_cast<int32_t>(std::max<int64_t>(p.tokens - 1, 0)));
    p.max_query_len = std::max(p.max_query_len, n);
    p.max_seq_len = std::max(p.max_seq_len, past + n);
    p.max_blocks = std::max(p.max_blocks, need_blocks);
  }
  if (p.tokens > options_.max_batch_tokens) {
    return make_error("{} tokens in one step; this model was set up for at most {} (--max-batch-tokens)", p.tokens,
                      options_.max_batch_tokens);
  }
  p.max_blocks = std::max<int64_t>(p.max_blocks, 1);
  if (decode && kv_blocks_ > 0) {
    p.max_blocks = std::min(std::bit_ceil(static_cast<uint64_t>(p.max_blocks)), static_cast<uint64_t>(kv_blocks_));
    p.max_seq_len = p.max_blocks * bs;
  }
  p.block_tables.assign(static_cast<size_t>(p.n_seqs * p.max_blocks), 0);
  for (int64_t s = 0; s < p.n_seqs; ++s) {
    const auto& blocks = static_cast<GpuSequence*>(batch[s].cache->device.get())->blocks;
    std::copy(blocks.begin(), blocks.end(), p.block_tables.begin() + s * p.max_blocks);
  }
  return p;
}

void GpuBackend::upload_plan(const StepPlan& p) {
  const std::vector<int32_t>* parts[] = {&p.ids, &p.positions, &p.slot_mapping, &p.query_start, &p.seq_lens,
                                         &p.block_tables, &p.state_slot, &p.seq_past, &p.last_rows};
  const int32_t** targets[] = {&d_ids_, &d_positions_, &d_slot_mapping_, &d_query_start_, &d_seq_lens_,
                               &d_block_tables_, &d_state_slot_, &d_seq_past_, &d_last_rows_};
  size_t total = 0;
  for (const auto* v : parts) total += (v->size() + 3) / 4 * 4;  // 16-byte aligned parts
  if (total > meta_capacity_) {
    drop_graphs();
    if (meta_host_ != nullptr) TERN_CUDA_CHECK(cudaFreeHost(meta_host_));
    meta_capacity_ = std::max(total, 2 * meta_capacity_);
    TERN_CUDA_CHECK(cudaMallocHost(&meta_host_, meta_capacity_ * 4));
    meta_buffer_ = DeviceBuffer(meta_capacity_ * 4);  // the previous step has finished (forward synchronizes)
    meta_ = meta_buffer_.as<int32_t>();
  }
  size_t offset = 0;
  for (size_t i = 0; i < std::size(parts); ++i) {
    std::copy(parts[i]->begin(), parts[i]->end(), meta_host_ + offset);
    *targets[i] = meta_ + offset;
    offset += (parts[i]->size() + 3) / 4 * 4;
  }
  TERN_CUDA_CHECK(cudaMemcpyAsync(meta_, meta_host_, total * 4, cudaMemcpyHostToDevice, ctx_.stream()));
}

Expected<void> GpuBackend::rms_norm_rows(const GpuNorm& n, uint16_t* x, const uint16_t* residual, int64_t rows,
                                         uint16_t* y) {
  return rms_norm(ctx_, RmsNormArgs{.x = x,
                                    .residual = residual,
                                    .h_out = residual != nullptr ? x : nullptr,
                                    .weight = n.weight,
                                    .y = y,
                                    .rows = rows,
                                    .dim = config_hidden_,
                                    .eps = n.eps,
                                    .zero_centred = n.zero_centred});
}

Expected<void> GpuBackend::norm_forward(const NormedInput& in, const DeviceMatrix& w, int64_t rows, uint16_t* y,
                                        int64_t ldy) {
  if (!options_.norm_gemv || rows != 1 || w.nvfp4 || !w.gemv) {
    TERN_TRY(rms_norm_rows(*in.norm, x_, in.residual, rows, normed_));
    return device_matrix_forward(ctx_, w, normed_, rows, y, ldy);
  }
  uint16_t* h = in.residual != nullptr ? x_spare_ : nullptr;
  TERN_TRY(gemv_bf16_rmsnorm(ctx_, GemmBf16Args{.x = x_, .w = w.bf16, .y = y, .m = 1, .n = w.n, .k = w.k, .ldy = ldy},
                             GemvNormArgs{.weight = in.norm->weight,
                                          .residual = in.residual,
                                          .eps = in.norm->eps,
                                          .zero_centred = in.norm->zero_centred,
                                          .h_out = h,
                                          .x_out = normed_}));
  if (h != nullptr) std::swap(x_, x_spare_);
  return {};
}

Expected<void> GpuBackend::norm_project(const NormedInput& in, const DeviceProjection& p, int64_t rows, uint16_t* y) {
  TERN_TRY(norm_forward(in, p.parts.front(), rows, y + p.offsets.front(), p.width));
  for (size_t i = 1; i < p.parts.size(); ++i) {
    TERN_TRY(device_matrix_forward(ctx_, p.parts[i], normed_, rows, y + p.offsets[i], p.width));
  }
  return {};
}

bool GpuBackend::silu_gemv_applies(const DeviceMatrix& w, int64_t ldx, int64_t rows) const {
  return options_.silu_gemv && rows == 1 && !w.nvfp4 && w.gemv && ldx % 8 == 0;
}

Expected<void> GpuBackend::silu_forward(const DeviceMatrix& w, const uint16_t* gate_up, int64_t ldx, int64_t rows,
                                        uint16_t* y, int64_t ldy) {
  if (silu_gemv_applies(w, ldx, rows)) {
    return gemv_bf16_silu_mul(
        ctx_, GemmBf16Args{.x = gate_up, .w = w.bf16, .y = y, .m = 1, .n = w.n, .k = w.k, .ldy = ldy}, ldx);
  }
  TERN_TRY(
      silu_mul(ctx_, SiluMulArgs{.gate_up = gate_up, .y = act_, .rows = rows, .inter = w.k, .gate_up_stride = ldx}));
  return device_matrix_forward(ctx_, w, act_, rows, y, ldy);
}

Expected<void> GpuBackend::run_attention(const GpuAttention& a, const NormedInput& in, const StepPlan& plan) {
  const AttentionShape& s = a.shape;
  const int64_t t = plan.tokens, q_width = s.n_heads * s.head_dim * (s.gated ? 2 : 1), kv_width = s.n_kv_heads * s.head_dim;
  TERN_TRY(norm_project(in, a.qkv, t, proj_));
  const AttentionPrepareArgs prep{.q_proj = proj_,
                                  .q_proj_stride = a.qkv.width,
                                  .k = proj_ + q_width,
                                  .v = proj_ + q_width + kv_width,
                                  .kv_stride = a.qkv.width,
                                  .q_norm_weight = a.q_norm.weight,
                                  .k_norm_weight = a.k_norm.weight,
                                  .eps = a.q_norm.eps,
                                  .zero_centred = a.q_norm.zero_centred,
                                  .positions = d_positions_,
                                  .inv_freq = a.inv_freq,
                                  .rotary_dim = a.rotary_dim,
                                  .slot_mapping = d_slot_mapping_,
                                  .q_out = q_,
                                  .gate_out = s.gated ? gate_ : nullptr,
                                  .cache = a.cache,
                                  .tokens = t,
                                  .n_heads = s.n_heads,
                                  .n_kv_heads = s.n_kv_heads,
                                  .head_dim = s.head_dim,
                                  .gated = s.gated};
  TERN_TRY(attention_prepare(ctx_, prep));
  const PagedAttentionArgs args{.q = q_,
                                .gate = s.gated ? gate_ : nullptr,
                                .out = attn_,
                                .cache = a.cache,
                                .block_tables = d_block_tables_,
                                .max_blocks_per_seq = plan.max_blocks,
                                .query_start = d_query_start_,
                                .seq_lens = d_seq_lens_,
                                .n_seqs = plan.n_seqs,
                                .tokens = t,
                                .n_heads = s.n_heads,
                                .max_query_len = plan.max_query_len,
                                .max_seq_len = plan.max_seq_len,
                                .scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                                .workspace = attention_workspace_,
                                .workspace_bytes = attention_workspace_bytes_};
  TERN_TRY(paged_attention(ctx_, args, attention_variant_));
  return device_matrix_forward(ctx_, a.o_proj, attn_, t, out_, config_hidden_);
}

Expected<void> GpuBackend::run_gdn(const GpuGdn& g, const NormedInput& in, const StepPlan& plan,
                                   const std::function<Expected<void>()>& after_core) {
  const GatedDeltaNetShape& s = g.shape;
  const int64_t t = plan.tokens, c = g.channels(), hv = s.n_value_heads;
  TERN_TRY(norm_project(in, g.in_proj, t, proj_));
  const GdnSequences seqs{.query_start = d_query_start_,
                          .state_slot = d_state_slot_,
                          .seq_past = d_seq_past_,
                          .n_seqs = plan.n_seqs,
                          .tokens = t,
                          .max_query_len = plan.max_query_len};
  TERN_TRY(gdn_conv1d(ctx_, GdnConvArgs{.x = proj_,
                                        .x_stride = g.in_proj.width,
                                        .weight = g.conv_weight,
                                        .conv_state = g.conv_state,
                                        .y = conv_,
                                        .seqs = seqs,
                                        .channels = c,
                                        .kernel = s.conv_kernel}));
  // One sequence of one token: the gated norm in the delta rule's kernel (measured slower at 8 sequences).
  const bool norm_in_rule = options_.gdn_norm_in_rule && plan.decode && plan.n_seqs == 1 && !after_core &&
                            gdn_variant_ != GdnVariant::kChunked;
  const GdnGatedNorm norm{
      .gate = proj_ + g.z_col, .gate_stride = g.in_proj.width, .weight = g.norm_weight, .eps = s.norm_eps};
  TERN_TRY(gdn_delta_rule(ctx_,
                          GdnDeltaRuleArgs{.qkv = conv_,
                                           .qkv_stride = c,
                                           .a = proj_ + g.a_col,
                                           .b = proj_ + g.b_col,
                                           .ab_stride = g.in_proj.width,
                                           .a_log = g.a_log,
                                           .dt_bias = g.dt_bias,
                                           .state = g.state,
                                           .out = attn_,
                                           .seqs = seqs,
                                           .n_key_heads = s.n_key_heads,
                                           .n_value_heads = hv,
                                           .key_dim = s.key_dim,
                                           .value_dim = s.value_dim,
                                           .norm = norm_in_rule ? norm : GdnGatedNorm{}},
                          gdn_variant_));
  if (after_core) TERN_TRY(after_core());
  if (!norm_in_rule) {
    TERN_TRY(rms_norm(ctx_, RmsNormArgs{.x = attn_,
                                        .gate = norm.gate,
                                        .gate_stride = norm.gate_stride,
                                        .gate_heads = hv,
                                        .weight = norm.weight,
                                        .y = attn_,
                                        .rows = t * hv,
                                        .dim = s.value_dim,
                                        .eps = norm.eps}));
  }
  return device_matrix_forward(ctx_, g.out_proj, attn_, t, out_, config_hidden_);
}

Expected<void> GpuBackend::run_mlp(const GpuMlp& m, const NormedInput& in, int64_t rows, uint16_t* y) {
  TERN_TRY(norm_project(in, m.gate_up, rows, proj_));
  return silu_forward(m.down, proj_, m.gate_up.width, rows, y, config_hidden_);
}

Expected<void> GpuBackend::run_moe(const GpuMoe& m, const NormedInput& in, int64_t tokens) {
  TERN_TRY(norm_project(in, m.router, tokens, router_));
  // At one token, with the fused SiLU GEMV for the shared expert's down projection, that GEMV runs last and does the
  // combine in its epilogue (the same bits as silu_forward + the combine launch, one launch fewer).
  const bool fold_combine = m.shared_down && silu_gemv_applies(*m.shared_down, m.router.width, tokens);
  if (m.shared_down && !fold_combine) {
    TERN_TRY(silu_forward(*m.shared_down, router_, m.router.width, tokens, shared_out_, config_hidden_));
  }
  const DeviceExperts& e = m.experts;
  const MoeForwardArgs args{.x = normed_,
                            .router_logits = router_ + m.logits_col,
                            .logits_stride = m.router.width,
                            .tokens = tokens,
                            .hidden = config_hidden_,
                            .inter = e.inter,
                            .n_experts = m.n_experts,
                            .top_k = m.shape.top_k,
                            .renormalize = m.shape.renormalize,
                            .gate_up = e.nvfp4 ? e.gate : e.gate_up,
                            .up = e.nvfp4 ? e.up : MoeExpertWeights{},
                            .down = e.down,
                            .shared_out = m.shared_down ? shared_out_ : nullptr,
                            .shared_gate = m.shared_down ? router_ + m.logits_col + m.n_experts : nullptr,
                            .shared_gate_stride = m.router.width,
                            .y = out_,
                            .workspace = moe_workspace_,
                            .workspace_bytes = moe_workspace_bytes_};
  if (!fold_combine) return moe_forward(ctx_, args);
  TERN_ASSIGN_OR_RETURN(const MoeCombineArgs c, moe_forward_experts(ctx_, args));
  const DeviceMatrix& w = *m.shared_down;
  return gemv_bf16_silu_mul_moe_combine(
      ctx_, GemmBf16Args{.x = router_, .w = w.bf16, .y = c.y, .m = 1, .n = w.n, .k = w.k, .ldy = config_hidden_},
      m.router.width, c);
}

Expected<void> GpuBackend::trace(const Tracer* tracer, const std::string& name, const uint16_t* data, int64_t rows,
                                 int64_t cols, int64_t ld) {
  if (tracer == nullptr) return {};
  std::vector<uint16_t> bits(static_cast<size_t>(rows * ld));
  TERN_CUDA_CHECK(cudaMemcpyAsync(bits.data(), data, bits.size() * 2, cudaMemcpyDeviceToHost, ctx_.stream()));
  const cudaError_t status = cudaStreamSynchronize(ctx_.stream());
  if (status != cudaSuccess) return make_error("CUDA error before {}: {}", name, cudaGetErrorString(status));
  std::vector<float> values(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) values[r * cols + c] = bf16_to_float(bits[r * ld + c]);
  }
  (*tracer)(name, values.data(), rows, cols);
  return {};
}

Expected<int64_t> GpuBackend::run_body(const StepPlan& plan, LogitsFor which, const Tracer* tracer) {
  const int64_t t = plan.tokens, h = config_hidden_;
  x_ = x_rows_;
  x_spare_ = x_row_;
  // Programmatic launch hides the gaps between a decode step's short kernels; in a prefill, whose kernels run many
  // waves, the next kernel's early blocks hold SM slots the running one still fills: on the H200 it made the
  // Qwen3.5-35B-A3B NVFP4 4k prefill 14% slower (231 against 203 ms), and the 8B's no faster.
  ctx_.set_programmatic_launch(pdl_ && plan.decode);
  TERN_TRY(embedding_lookup(ctx_, EmbeddingArgs{.ids = d_ids_, .table = embed_.bf16, .y = x_,
                                                .bad = bad_id_, .tokens = t, .vocab = embed_.n, .hidden = h}));
  for (size_t i = 0; i < layers_.size(); ++i) {
    const GpuLayer& l = layers_[i];
    const NormedInput mixer_in{.norm = &l.input_norm, .residual = i == 0 ? nullptr : out_};
    const int64_t li = static_cast<int64_t>(i);
    if (l.attention) TERN_TRY(run_attention(*l.attention, mixer_in, plan));
    if (l.gdn) {
      TERN_TRY(run_gdn(*l.gdn, mixer_in, plan, tracer ? [&] {
        return trace(tracer, trace_name(li, "gdn_core"), attn_, t, l.gdn->shape.n_value_heads * l.gdn->shape.value_dim,
                     l.gdn->shape.n_value_heads * l.gdn->shape.value_dim);
      } : std::function<Expected<void>()>{}));
    }
    TERN_TRY(trace(tracer, trace_name(li, "mixer_out"), out_, t, h, h));
    const NormedInput ffn_in{.norm = &l.post_norm, .residual = out_};
    if (l.mlp) TERN_TRY(run_mlp(*l.mlp, ffn_in, t, out_));
    if (l.moe) {
      TERN_TRY(run_moe(*l.moe, ffn_in, t));
      TERN_TRY(trace(tracer, trace_name(li, "router_logits"), router_ + l.moe->logits_col, t, l.moe->n_experts,
                     l.moe->router.width));
    }
    TERN_TRY(trace(tracer, trace_name(li, "ffn_out"), out_, t, h, h));
  }
  // A prefill's logits for its last tokens are of each sequence's last row, gathered out of the normed rows (the
  // embedding gather); a decode step's rows are its sequences already.
  const bool gather = which == LogitsFor::kLastToken && !plan.decode && t > 1;
  const int64_t n = gather ? plan.n_seqs : t;
  const size_t logit_bytes = static_cast<size_t>(n * vocab_) * 2;
  if (logits_.size_bytes() < logit_bytes) {
    drop_graphs();
    if (!DeviceBuffer::try_allocate(logit_bytes, logits_))
      return make_error("out of device memory for {} rows of logits", n);
  }
  const NormedInput head_in{.norm = &final_norm_, .residual = out_};
  if (!gather) {
    TERN_TRY(norm_forward(head_in, lm_head_, t, logits_.as<uint16_t>(), vocab_));
    TERN_TRY(trace(tracer, "final_norm", normed_, t, h, h));
    return t;
  }
  TERN_TRY(rms_norm_rows(*head_in.norm, x_, head_in.residual, t, normed_));
  TERN_TRY(embedding_lookup(
      ctx_,
      EmbeddingArgs{
          .ids = d_last_rows_, .table = normed_, .y = last_, .bad = bad_id_, .tokens = n, .vocab = t, .hidden = h}));
  TERN_TRY(trace(tracer, "final_norm", last_, n, h, h));
  TERN_TRY(device_matrix_forward(ctx_, lm_head_, last_, n, logits_.as<uint16_t>(), vocab_));
  return n;
}

void GpuBackend::drop_graphs() {
  for (auto& [key, g] : graphs_) {
    if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
  }
  graphs_.clear();
}

Expected<int64_t> GpuBackend::run_decode(const StepPlan& plan) {
  if (!graphs_enabled_) return run_body(plan, LogitsFor::kLastToken, nullptr);
  DecodeGraph& g = graphs_[{plan.n_seqs, plan.max_blocks}];
  if (g.exec == nullptr && !g.warmed) {
    g.warmed = true;
    return run_body(plan, LogitsFor::kLastToken, nullptr);
  }
  if (g.exec == nullptr) {
    cudaGraph_t graph = nullptr;
    TERN_CUDA_CHECK(cudaStreamBeginCapture(ctx_.stream(), cudaStreamCaptureModeThreadLocal));
    const Expected<int64_t> body = run_body(plan, LogitsFor::kLastToken, nullptr);
    const cudaError_t ended = cudaStreamEndCapture(ctx_.stream(), &graph);
    cudaError_t made = ended;
    if (body && ended == cudaSuccess) made = cudaGraphInstantiate(&g.exec, graph, 0);
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (!body || made != cudaSuccess) {
      (void)cudaGetLastError();
      g.exec = nullptr;
      graphs_enabled_ = false;
      spdlog::warn(
          "CUDA graph capture of a decode step ({} sequences) failed ({}); decode steps run eagerly from "
          "now on",
          plan.n_seqs, body ? cudaGetErrorString(made) : body.error().message);
      return run_body(plan, LogitsFor::kLastToken, nullptr);
    }
  }
  TERN_CUDA_CHECK(cudaGraphLaunch(g.exec, ctx_.stream()));
  return plan.n_seqs;
}

Expected<std::vector<float>> GpuBackend::forward(std::span<const SequenceInput> batch, LogitsFor which,
                                                 const Tracer* tracer) {
  const bool decode =
      which == LogitsFor::kLastToken && tracer == nullptr &&
      std::all_of(batch.begin(), batch.end(), [](const SequenceInput& in) { return in.tokens.size() == 1; });
  TERN_ASSIGN_OR_RETURN(StepPlan plan, plan_step(batch, decode));
  if (plan.tokens == 0) return std::vector<float>{};
  upload_plan(plan);
  TERN_ASSIGN_OR_RETURN(const int64_t n, decode ? run_decode(plan) : run_body(plan, which, tracer));
  const size_t logit_bytes = static_cast<size_t>(n * vocab_) * 2;
  logits_host_.resize(static_cast<size_t>(n * vocab_));
  TERN_CUDA_CHECK(cudaMemcpyAsync(logits_host_.data(), logits_.data(), logit_bytes, cudaMemcpyDeviceToHost,
                                  ctx_.stream()));
  const cudaError_t status = cudaStreamSynchronize(ctx_.stream());
  if (status != cudaSuccess) return make_error("CUDA error in the forward step: {}", cudaGetErrorString(status));
  std::vector<float> logits(logits_host_.size());
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = bf16_to_float(logits_host_[i]);
  return logits;
}

Expected<SampleResults> GpuBackend::forward_sample(std::span<const SequenceInput> batch,
                                                   std::span<const SampleRow> rows) {
  for (const SampleRow& r : rows) {
    if (r.sampler != nullptr) TERN_TRY(sampling_params_validate(r.sampler->params()));
  }
  const bool decode =
      std::all_of(batch.begin(), batch.end(), [](const SequenceInput& in) { return in.tokens.size() == 1; });
  TERN_ASSIGN_OR_RETURN(StepPlan plan, plan_step(batch, decode));
  if (plan.tokens == 0) return make_error("forward_sample: the step has no tokens");
  upload_plan(plan);
  TERN_TRY(sampler_.upload(ctx_, rows));
  TERN_ASSIGN_OR_RETURN(const int64_t n, decode ? run_decode(plan) : run_body(plan, LogitsFor::kLastToken, nullptr));
  TERN_TRY(sampler_.launch(ctx_, logits_.as<uint16_t>(), n));
  return sampler_.download(ctx_, rows, logits_.as<uint16_t>(), n);
}

}  // namespace

int gpu_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

Expected<std::unique_ptr<ForwardBackend>> gpu_backend_create(const CausalLm& model, const DeviceModelOptions& options) {
  const int n_devices = gpu_device_count();
  if (n_devices == 0) return make_error("--device cuda: no CUDA device is available");
  if (options.device < 0 || options.device >= n_devices) {
    return make_error("--device cuda: device {} does not exist ({} present)", options.device, n_devices);
  }
  if (options.max_batch_tokens < 1 || options.max_sequences < 1 || options.kv_block_size < 8 ||
      (options.kv_block_size & (options.kv_block_size - 1)) != 0) {
    return make_error("bad device options: max_batch_tokens {} and max_sequences {} must be >= 1, kv_block_size {} a "
                      "power of two >= 8", options.max_batch_tokens, options.max_sequences, options.kv_block_size);
  }
  auto backend = std::make_unique<GpuBackend>(model, options);
  TERN_TRY(backend->build(model));
  return std::unique_ptr<ForwardBackend>(std::move(backend));
}

}  // namespace tern
