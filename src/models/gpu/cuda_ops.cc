#include "models/gpu/cuda_ops.h"

#include "models/shard.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/formats.h"
#include "kernels/cuda/elementwise/elementwise.h"
#include "kernels/cuda/gemv/gemv_bf16.h"
#include "kernels/cuda/moe/moe.h"
#include "layers/attention.h"
#include "layers/gated_deltanet.h"
#include "layers/moe.h"
#include "layers/norms.h"

namespace tern {

// ---- The blocks as the device holds them ----

struct GpuNorm {
  const uint16_t* weight = nullptr;
  float eps = 1e-6f;
  bool zero_centred = false;
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

namespace {

class CudaEmbedding final : public Block {
 public:
  CudaEmbedding(CudaOps& ops, DeviceMatrix table) : ops_(ops), table_(table) {}
  Expected<void> forward(int64_t) const override { return ops_.run_embedding(table_); }

 private:
  CudaOps& ops_;
  DeviceMatrix table_;
};

class CudaAttentionBlock final : public Block {
 public:
  CudaAttentionBlock(CudaOps& ops, GpuNorm norm, GpuAttention a) : ops_(ops), norm_(norm), a_(std::move(a)) {}
  Expected<void> forward(int64_t) const override {
    TERN_TRY(ops_.run_attention(a_, norm_));
    return ops_.reduce_out();
  }
  GpuAttention& device() { return a_; }

 private:
  CudaOps& ops_;
  GpuNorm norm_;
  GpuAttention a_;
};

class CudaGdnBlock final : public Block {
 public:
  CudaGdnBlock(CudaOps& ops, GpuNorm norm, GpuGdn g) : ops_(ops), norm_(norm), g_(std::move(g)) {}
  Expected<void> forward(int64_t layer) const override {
    TERN_TRY(ops_.run_gdn(g_, norm_, layer));
    return ops_.reduce_out();
  }
  GpuGdn& device() { return g_; }

 private:
  CudaOps& ops_;
  GpuNorm norm_;
  GpuGdn g_;
};

class CudaMlpBlock final : public Block {
 public:
  CudaMlpBlock(CudaOps& ops, GpuNorm norm, GpuMlp m) : ops_(ops), norm_(norm), m_(std::move(m)) {}
  Expected<void> forward(int64_t) const override {
    TERN_TRY(ops_.run_mlp(m_, norm_));
    return ops_.reduce_out();
  }
  const GpuMlp& device() const { return m_; }

 private:
  CudaOps& ops_;
  GpuNorm norm_;
  GpuMlp m_;
};

class CudaMoeBlock final : public Block {
 public:
  CudaMoeBlock(CudaOps& ops, GpuNorm norm, GpuMoe m) : ops_(ops), norm_(norm), m_(std::move(m)) {}
  Expected<void> forward(int64_t layer) const override {
    TERN_TRY(ops_.run_moe(m_, norm_, layer));
    return ops_.reduce_out();
  }
  const GpuMoe& device() const { return m_; }

 private:
  CudaOps& ops_;
  GpuNorm norm_;
  GpuMoe m_;
};

class CudaHead final : public Block {
 public:
  CudaHead(CudaOps& ops, GpuNorm norm, DeviceMatrix head) : ops_(ops), norm_(norm), head_(head) {}
  Expected<void> forward(int64_t) const override { return ops_.run_head(head_, norm_); }

 private:
  CudaOps& ops_;
  GpuNorm norm_;
  DeviceMatrix head_;
};

AttentionVariant attention_variant_of(AttentionChoice c) {
  return c == AttentionChoice::kDecode    ? AttentionVariant::kDecode
         : c == AttentionChoice::kPrefill ? AttentionVariant::kPrefill
                                          : AttentionVariant::kAuto;
}

GdnVariant gdn_variant_of(GdnChoice c) {
  return c == GdnChoice::kRecurrent ? GdnVariant::kRecurrent
         : c == GdnChoice::kChunked ? GdnVariant::kChunked
                                    : GdnVariant::kAuto;
}

}  // namespace

CudaOps::CudaOps(DeviceContext& ctx, const DeviceModelOptions& options, int64_t hidden, DeviceCommunicator* comm)
    : ctx_(ctx),
      comm_(comm != nullptr && comm->world() > 1 ? comm : nullptr),
      options_(options),
      weights_(ctx.stream(), options.kernels.bf16_gemv),
      hidden_(hidden),
      attention_variant_(attention_variant_of(options.kernels.attention)),
      gdn_variant_(gdn_variant_of(options.kernels.gdn)) {}

CudaOps::~CudaOps() = default;

// ---- Making the blocks ----

Expected<GpuNorm> CudaOps::norm(const RmsNorm& n) {
  TERN_ASSIGN_OR_RETURN(const uint16_t* w, weights_.vector_bf16(n.weight));
  return GpuNorm{w, n.eps, n.zero_centred};
}

Expected<std::unique_ptr<Block>> CudaOps::embedding(const CpuMatrix& table, VocabRange vocab) {
  if (comm_ == nullptr && (vocab.begin != 0 || table.rows != vocab.full)) {
    return make_error("embed_tokens: this rank holds vocabulary rows [{}, {}) of {} but has no tensor-parallel group",
                      vocab.begin, vocab.begin + table.rows, vocab.full);
  }
  TERN_ASSIGN_OR_RETURN(const DeviceMatrix embed, weights_.matrix(table, "embed_tokens"));
  if (embed.nvfp4) return make_error("embed_tokens: NVFP4 embeddings are not supported");
  embedding_rows_ = vocab.full;
  vocab_begin_ = vocab.begin;
  return std::make_unique<CudaEmbedding>(*this, embed);
}

Expected<std::unique_ptr<Block>> CudaOps::attention(const RmsNorm& input_norm, const Attention& a) {
  GpuAttention g;
  g.shape = a.shape();
  const AttentionWeights& w = a.weights();
  TERN_ASSIGN_OR_RETURN(g.qkv, weights_.projection(a.input_projections()));
  TERN_ASSIGN_OR_RETURN(g.o_proj, weights_.matrix(w.o_proj));
  if (w.q_norm.weight.empty() || w.k_norm.weight.empty()) {
    return make_error("{}: attention without q/k norms is not supported on CUDA yet", w.q_proj.name());
  }
  TERN_ASSIGN_OR_RETURN(g.q_norm, norm(w.q_norm));
  TERN_ASSIGN_OR_RETURN(g.k_norm, norm(w.k_norm));
  g.rotary_dim = a.rope().rotary_dim();
  TERN_ASSIGN_OR_RETURN(g.inv_freq, weights_.vector_f32(a.rope().inv_freq()));
  TERN_ASSIGN_OR_RETURN(const GpuNorm n, norm(input_norm));
  auto block = std::make_unique<CudaAttentionBlock>(*this, n, std::move(g));
  attentions_.push_back(&block->device());
  return block;
}

Expected<std::unique_ptr<Block>> CudaOps::gated_deltanet(const RmsNorm& input_norm, const GatedDeltaNet& gdn) {
  GpuGdn g;
  g.shape = gdn.shape();
  const GatedDeltaNetWeights& w = gdn.weights();
  if (g.shape.fused_per_key_head) {
    return make_error("{}: the Qwen3-Next fused GDN projections are not supported on CUDA yet", w.out_proj.name());
  }
  TERN_ASSIGN_OR_RETURN(g.in_proj, weights_.projection(gdn.input_projections(), 8));
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
  TERN_ASSIGN_OR_RETURN(const GpuNorm n, norm(input_norm));
  auto block = std::make_unique<CudaGdnBlock>(*this, n, std::move(g));
  gdns_.push_back(&block->device());
  return block;
}

Expected<std::unique_ptr<Block>> CudaOps::mlp(const RmsNorm& post_norm, const Mlp& mlp) {
  const MlpWeights& w = mlp.weights();
  GpuMlp m;
  TERN_ASSIGN_OR_RETURN(m.gate_up, weights_.projection(mlp.input_projections()));
  TERN_ASSIGN_OR_RETURN(m.down, weights_.matrix(w.down_proj));
  m.inter = w.gate_proj.out_features();
  TERN_ASSIGN_OR_RETURN(const GpuNorm n, norm(post_norm));
  auto block = std::make_unique<CudaMlpBlock>(*this, n, std::move(m));
  mlps_.push_back(&block->device());
  return block;
}

Expected<std::unique_ptr<Block>> CudaOps::moe(const RmsNorm& post_norm, const Moe& moe) {
  if (moe.shape().sigmoid || !moe.shape().shared_gate) {
    return make_error("{}: sigmoid-routed MoE (GLM-5, DeepSeek-V3) runs on the CPU only so far (--device cpu)",
                      moe.weights().router.name());
  }
  GpuMoe m;
  m.shape = moe.shape();
  const MoeWeights& w = moe.weights();
  m.n_experts = w.router.out_features();
  if (w.shared_expert) {
    const MlpWeights& s = w.shared_expert->weights();
    m.shared_inter = s.gate_proj.out_features();
    m.logits_col = 2 * m.shared_inter;
    if (m.shared_inter % 8 != 0) {
      return make_error("{}: a shared expert width that is not a multiple of 8 is not supported on CUDA",
                        s.gate_proj.name());
    }
    TERN_ASSIGN_OR_RETURN(m.shared_down, weights_.matrix(s.down_proj));
  }
  // The expert GEMMs take K in steps of 16 (a tensor-parallel rank's slice of each expert included).
  if (!w.experts.empty() && w.experts.front().down_proj.in_features() % 16 != 0) {
    return make_error("{}: an expert width of {} (on this rank) is not a multiple of 16, which the CUDA MoE kernels "
                      "need{}", w.experts.front().down_proj.name(), w.experts.front().down_proj.in_features(),
                      comm_ ? fmt::format("; use fewer than {} tensor-parallel ranks", comm_->world()) : "");
  }
  TERN_ASSIGN_OR_RETURN(m.router, weights_.projection(moe.input_projections(), 8));
  // The experts' name for errors: the router's module ("<prefix>layers.N.mlp.gate") with ".gate" replaced.
  const std::string& router_name = w.router.name();
  const std::string block_name =
      router_name.ends_with(".gate") ? router_name.substr(0, router_name.size() - 5) : router_name;
  TERN_ASSIGN_OR_RETURN(m.experts, weights_.experts(w.experts, block_name + ".experts"));
  TERN_ASSIGN_OR_RETURN(const GpuNorm n, norm(post_norm));
  auto block = std::make_unique<CudaMoeBlock>(*this, n, std::move(m));
  moes_.push_back(&block->device());
  return block;
}

Expected<std::unique_ptr<Block>> CudaOps::lm_head(const RmsNorm& final_norm, const Linear& head, VocabRange vocab) {
  if (comm_ == nullptr && (vocab.begin != 0 || head.out_features() != vocab.full)) {
    return make_error("lm_head: this rank holds part of the vocabulary but has no tensor-parallel group");
  }
  TERN_ASSIGN_OR_RETURN(const DeviceMatrix h, weights_.matrix(head));
  TERN_ASSIGN_OR_RETURN(const GpuNorm n, norm(final_norm));
  vocab_ = vocab.full;
  return std::make_unique<CudaHead>(*this, n, h);
}

// ---- Buffers and caches ----

Expected<void> CudaOps::allocate() {
  TERN_TRY(reserve_head_rows(std::max<int64_t>(options_.max_sequences, 1)));
  TERN_TRY(allocate_activations());
  return allocate_caches();
}

Expected<void> CudaOps::allocate_caches() {
  const int64_t bs = options_.kv_block_size, slots = options_.max_sequences + 1;  // + spare_slot()
  int64_t kv_bytes_per_token = 0;
  for (const GpuAttention* a : attentions_) kv_bytes_per_token += 2 * a->shape.n_kv_heads * a->shape.head_dim * 2;
  for (GpuGdn* g : gdns_) {
    const size_t conv = static_cast<size_t>(slots * g->channels() * (g->shape.conv_kernel - 1)) * 2;
    const size_t state =
        static_cast<size_t>(slots * g->shape.n_value_heads * g->shape.key_dim * g->shape.value_dim) * 4;
    DeviceBuffer c, s;
    if (!DeviceBuffer::try_allocate(conv, c) || !DeviceBuffer::try_allocate(state, s)) {
      return make_error(
          "out of device memory for the Gated DeltaNet states of {} sequences ({} bytes per layer); "
          "lower --max-sequences",
          options_.max_sequences, conv + state);
    }
    g->conv_state = c.as<uint16_t>();
    g->state = s.as<float>();
    cache_buffers_.push_back(std::move(c));
    cache_buffers_.push_back(std::move(s));
  }
  if (kv_bytes_per_token == 0) return {};
  int64_t tokens = options_.kv_cache_tokens;
  if (tokens <= 0) {
    size_t free_bytes = 0, total = 0;
    TERN_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    // Half of what is free, so other processes and cuBLASLt keep room; at most max_sequences full 32k contexts.
    tokens = std::min<int64_t>(static_cast<int64_t>(free_bytes / 2) / kv_bytes_per_token - bs,
                               options_.max_sequences * 32768);
  }
  kv_blocks_ = std::max<int64_t>((tokens + bs - 1) / bs, 1);
  for (GpuAttention* a : attentions_) {
    const size_t bytes = static_cast<size_t>((kv_blocks_ + 1) * bs * a->shape.n_kv_heads * a->shape.head_dim) * 2;
    DeviceBuffer k, v;
    if (!DeviceBuffer::try_allocate(bytes, k) || !DeviceBuffer::try_allocate(bytes, v)) {
      return make_error(
          "out of device memory for a KV cache of {} tokens; ask for fewer (tern serve: "
          "--max-total-tokens)",
          kv_blocks_ * bs);
    }
    a->cache = PagedKvCache{.k = k.as<uint16_t>(),
                            .v = v.as<uint16_t>(),
                            .n_blocks = kv_blocks_ + 1,  // + spare_block()
                            .block_size = bs,
                            .n_kv_heads = a->shape.n_kv_heads,
                            .head_dim = a->shape.head_dim};
    cache_buffers_.push_back(std::move(k));
    cache_buffers_.push_back(std::move(v));
  }
  // The split-K workspace (decode variant only, which kAuto picks for at most kAttentionDecodeMaxQueryLen rows per
  // sequence) depends on the rows of a step and the longest context the cache can hold.
  const int64_t decode_rows =
      attention_variant_ == AttentionVariant::kDecode
          ? options_.max_batch_tokens
          : std::min(options_.max_batch_tokens, kAttentionDecodeMaxQueryLen * options_.max_sequences);
  for (const GpuAttention* a : attentions_) {
    attention_workspace_bytes_ = std::max(attention_workspace_bytes_,
                                          paged_attention_workspace_bytes(ctx_.props(), decode_rows, a->shape.n_heads,
                                                                          a->shape.head_dim, kv_blocks_ * bs));
  }
  DeviceBuffer ws;
  if (!DeviceBuffer::try_allocate(attention_workspace_bytes_, ws)) {
    return make_error("out of device memory for the attention workspace ({} bytes)", attention_workspace_bytes_);
  }
  attention_workspace_ = ws.data();
  cache_buffers_.push_back(std::move(ws));
  return {};
}

Expected<void> CudaOps::allocate_activations() {
  const int64_t t = options_.max_batch_tokens, h = hidden_;
  int64_t proj = 0, heads = 0, conv = 0, act = 0, router = 0;
  for (const GpuAttention* a : attentions_) {
    proj = std::max(proj, a->qkv.width);
    heads = std::max(heads, a->shape.n_heads * a->shape.head_dim);
  }
  for (const GpuGdn* g : gdns_) {
    proj = std::max(proj, g->in_proj.width);
    conv = std::max(conv, g->channels());
    heads = std::max(heads, g->shape.n_value_heads * g->shape.value_dim);  // the GDN core lands in attn_
  }
  for (const GpuMlp* m : mlps_) {
    proj = std::max(proj, m->gate_up.width);
    act = std::max(act, m->inter);
  }
  for (const GpuMoe* m : moes_) {
    router = std::max(router, m->router.width);
    act = std::max(act, m->shared_inter);
    moe_workspace_bytes_ = std::max(moe_workspace_bytes_,
                                    moe_forward_workspace_bytes(t, m->shape.top_k, m->n_experts, m->experts.inter, h));
  }
  const auto aligned = [](size_t bytes) { return (std::max<size_t>(bytes, 1) + 255) / 256 * 256; };
  // Every bf16 buffer with its element count, once: sized first, then carved in this order, 256-byte aligned.
  const std::pair<uint16_t**, int64_t> buffers[] = {
      {&x_rows_, t * h},      {&x_row_, h},          {&normed_, t * h},   {&out_, t * h},     {&proj_, t * proj},
      {&q_, t * heads},       {&gate_, t * heads},   {&attn_, t * heads}, {&conv_, t * conv}, {&act_, t * act},
      {&router_, t * router}, {&shared_out_, t * h}, {&last_, t * h}};
  size_t bytes = aligned(moe_workspace_bytes_) + aligned(8);
  for (const auto& [ptr, count] : buffers) bytes += aligned(static_cast<size_t>(count) * 2);
  if (!DeviceBuffer::try_allocate(bytes, arena_)) {
    return make_error("out of device memory for {} bytes of activation buffers", bytes);
  }
  char* next = static_cast<char*>(arena_.data());
  for (const auto& [ptr, count] : buffers) {
    *ptr = reinterpret_cast<uint16_t*>(next);
    next += aligned(static_cast<size_t>(count) * 2);
  }
  moe_workspace_ = next;
  next += aligned(moe_workspace_bytes_);
  bad_id_ = reinterpret_cast<unsigned long long*>(next);
  return {};
}

// ---- One step ----

Expected<void> CudaOps::rms_norm_rows(const GpuNorm& n, uint16_t* x, const uint16_t* residual, int64_t rows,
                                      uint16_t* y) {
  return rms_norm(ctx_, RmsNormArgs{.x = x,
                                    .residual = residual,
                                    .h_out = residual != nullptr ? x : nullptr,
                                    .weight = n.weight,
                                    .y = y,
                                    .rows = rows,
                                    .dim = hidden_,
                                    .eps = n.eps,
                                    .zero_centred = n.zero_centred});
}

Expected<void> CudaOps::norm_forward(const NormedInput& in, const DeviceMatrix& w, int64_t rows, uint16_t* y,
                                     int64_t ldy) {
  if (!options_.kernels.norm_gemv || rows != 1 || w.nvfp4 || !w.gemv) {
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

Expected<void> CudaOps::norm_project(const NormedInput& in, const DeviceProjection& p, int64_t rows, uint16_t* y) {
  TERN_TRY(norm_forward(in, p.parts.front(), rows, y + p.offsets.front(), p.width));
  for (size_t i = 1; i < p.parts.size(); ++i) {
    TERN_TRY(device_matrix_forward(ctx_, p.parts[i], normed_, rows, y + p.offsets[i], p.width));
  }
  return {};
}

bool CudaOps::silu_gemv_applies(const DeviceMatrix& w, int64_t ldx, int64_t rows) const {
  return options_.kernels.silu_gemv && rows == 1 && !w.nvfp4 && w.gemv && ldx % 8 == 0;
}

Expected<void> CudaOps::silu_forward(const DeviceMatrix& w, const uint16_t* gate_up, int64_t ldx, int64_t rows,
                                     uint16_t* y, int64_t ldy) {
  if (silu_gemv_applies(w, ldx, rows)) {
    return gemv_bf16_silu_mul(
        ctx_, GemmBf16Args{.x = gate_up, .w = w.bf16, .y = y, .m = 1, .n = w.n, .k = w.k, .ldy = ldy}, ldx);
  }
  TERN_TRY(
      silu_mul(ctx_, SiluMulArgs{.gate_up = gate_up, .y = act_, .rows = rows, .inter = w.k, .gate_up_stride = ldx}));
  return device_matrix_forward(ctx_, w, act_, rows, y, ldy);
}

Expected<void> CudaOps::run_embedding(const DeviceMatrix& table) {
  x_ = x_rows_;
  x_spare_ = x_row_;
  stream_started_ = false;
  TERN_TRY(embedding_lookup(ctx_, EmbeddingArgs{.ids = step_.ids,
                                                .table = table.bf16,
                                                .y = x_,
                                                .bad = bad_id_,
                                                .tokens = step_.tokens,
                                                .vocab = embedding_rows_,
                                                .hidden = hidden_,
                                                .table_begin = vocab_begin_,
                                                .table_rows = table.n}));
  if (comm_ == nullptr) return {};
  return comm_->all_reduce_sum_bf16(x_, static_cast<size_t>(step_.tokens * hidden_), ctx_.stream());
}

Expected<void> CudaOps::run_attention(const GpuAttention& a, const GpuNorm& norm) {
  const AttentionShape& s = a.shape;
  const int64_t t = step_.tokens, q_width = s.n_heads * s.head_dim * (s.gated ? 2 : 1),
                kv_width = s.n_kv_heads * s.head_dim;
  TERN_TRY(norm_project(normed_input(norm), a.qkv, t, proj_));
  stream_started_ = true;
  const AttentionPrepareArgs prep{.q_proj = proj_,
                                  .q_proj_stride = a.qkv.width,
                                  .k = proj_ + q_width,
                                  .v = proj_ + q_width + kv_width,
                                  .kv_stride = a.qkv.width,
                                  .q_norm_weight = a.q_norm.weight,
                                  .k_norm_weight = a.k_norm.weight,
                                  .eps = a.q_norm.eps,
                                  .zero_centred = a.q_norm.zero_centred,
                                  .positions = step_.positions,
                                  .inv_freq = a.inv_freq,
                                  .rotary_dim = a.rotary_dim,
                                  .slot_mapping = step_.slot_mapping,
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
                                .block_tables = step_.block_tables,
                                .max_blocks_per_seq = step_.max_blocks,
                                .query_start = step_.query_start,
                                .seq_lens = step_.seq_lens,
                                .n_seqs = step_.n_seqs,
                                .tokens = t,
                                .n_heads = s.n_heads,
                                .max_query_len = step_.max_query_len,
                                .max_seq_len = step_.max_seq_len,
                                .scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                                .workspace = attention_workspace_,
                                .workspace_bytes = attention_workspace_bytes_};
  TERN_TRY(paged_attention(ctx_, args, attention_variant_));
  return device_matrix_forward(ctx_, a.o_proj, attn_, t, out_, hidden_);
}

Expected<void> CudaOps::run_gdn(const GpuGdn& g, const GpuNorm& input_norm, int64_t layer) {
  const GatedDeltaNetShape& s = g.shape;
  const int64_t t = step_.tokens, c = g.channels(), hv = s.n_value_heads;
  TERN_TRY(norm_project(normed_input(input_norm), g.in_proj, t, proj_));
  stream_started_ = true;
  const GdnSequences seqs{.query_start = step_.query_start,
                          .state_slot = step_.state_slot,
                          .seq_past = step_.seq_past,
                          .n_seqs = step_.n_seqs,
                          .tokens = t,
                          .max_query_len = step_.max_query_len};
  TERN_TRY(gdn_conv1d(ctx_, GdnConvArgs{.x = proj_,
                                        .x_stride = g.in_proj.width,
                                        .weight = g.conv_weight,
                                        .conv_state = g.conv_state,
                                        .y = conv_,
                                        .seqs = seqs,
                                        .channels = c,
                                        .kernel = s.conv_kernel}));
  // One sequence of one token: the gated norm in the delta rule's kernel (slower at 8 sequences: see docs/perf/gpu.md
  // §model-path). Not when tracing, which reads the core before the norm.
  const bool norm_in_rule = options_.kernels.gdn_norm_in_rule && step_.decode && step_.n_seqs == 1 &&
                            step_.tracer == nullptr && gdn_variant_ != GdnVariant::kChunked;
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
  TERN_TRY(trace(trace_name(layer, "gdn_core"), attn_, t, hv * s.value_dim, hv * s.value_dim));
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
  return device_matrix_forward(ctx_, g.out_proj, attn_, t, out_, hidden_);
}

Expected<void> CudaOps::run_mlp(const GpuMlp& m, const GpuNorm& norm) {
  const int64_t rows = step_.tokens;
  TERN_TRY(norm_project(normed_input(norm), m.gate_up, rows, proj_));
  stream_started_ = true;
  return silu_forward(m.down, proj_, m.gate_up.width, rows, out_, hidden_);
}

Expected<void> CudaOps::run_moe(const GpuMoe& m, const GpuNorm& norm, int64_t layer) {
  const int64_t tokens = step_.tokens;
  TERN_TRY(norm_project(normed_input(norm), m.router, tokens, router_));
  stream_started_ = true;
  // At one token, with the fused SiLU GEMV for the shared expert's down projection, that GEMV runs last and does the
  // combine in its epilogue (the same bits as silu_forward + the combine launch, one launch fewer).
  const bool fold_combine = m.shared_down && silu_gemv_applies(*m.shared_down, m.router.width, tokens);
  if (m.shared_down && !fold_combine) {
    TERN_TRY(silu_forward(*m.shared_down, router_, m.router.width, tokens, shared_out_, hidden_));
  }
  const DeviceExperts& e = m.experts;
  const MoeForwardArgs args{.x = normed_,
                            .router_logits = router_ + m.logits_col,
                            .logits_stride = m.router.width,
                            .tokens = tokens,
                            .hidden = hidden_,
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
  if (!fold_combine) {
    TERN_TRY(moe_forward(ctx_, args));
  } else {
    TERN_ASSIGN_OR_RETURN(const MoeCombineArgs c, moe_forward_experts(ctx_, args));
    const DeviceMatrix& w = *m.shared_down;
    TERN_TRY(gemv_bf16_silu_mul_moe_combine(
        ctx_, GemmBf16Args{.x = router_, .w = w.bf16, .y = c.y, .m = 1, .n = w.n, .k = w.k, .ldy = hidden_},
        m.router.width, c));
  }
  return trace(trace_name(layer, "router_logits"), router_ + m.logits_col, tokens, m.n_experts, m.router.width);
}

Expected<void> CudaOps::run_head(const DeviceMatrix& head, const GpuNorm& norm) {
  const int64_t t = step_.tokens, h = hidden_;
  const NormedInput in = normed_input(norm);
  // Under tensor parallelism this rank's logits go to head_local_ ([rows, range]) and are gathered into the step's.
  const int64_t rows = step_.logit_rows();
  TERN_TRY(reserve_head_rows(rows));
  uint16_t* logits = comm_ ? head_local_.as<uint16_t>() : step_.logits;
  const int64_t ld = comm_ ? vocab_shard_rows(vocab_, comm_->world()) : vocab_;
  if (!step_.gathers_last_rows()) {
    TERN_TRY(norm_forward(in, head, t, logits, ld));
    if (comm_) TERN_TRY(gather_logits(rows));
    return trace("final_norm", normed_, t, h, h);
  }
  const int64_t n = step_.n_seqs;
  TERN_TRY(rms_norm_rows(*in.norm, x_, in.residual, t, normed_));
  TERN_TRY(embedding_lookup(
      ctx_,
      EmbeddingArgs{
          .ids = step_.last_rows, .table = normed_, .y = last_, .bad = bad_id_, .tokens = n, .vocab = t, .hidden = h}));
  TERN_TRY(trace("final_norm", last_, n, h, h));
  TERN_TRY(device_matrix_forward(ctx_, head, last_, n, logits, ld));
  return comm_ ? gather_logits(rows) : Expected<void>{};
}

Expected<void> CudaOps::trace_output(std::string_view name) {
  return trace(name, out_, step_.tokens, hidden_, hidden_);
}

Expected<void> CudaOps::trace(std::string_view name, const uint16_t* data, int64_t rows, int64_t cols, int64_t ld) {
  if (step_.tracer == nullptr) return {};
  std::vector<uint16_t> bits(static_cast<size_t>(rows * ld));
  TERN_CUDA_CHECK(cudaMemcpyAsync(bits.data(), data, bits.size() * 2, cudaMemcpyDeviceToHost, ctx_.stream()));
  const cudaError_t status = cudaStreamSynchronize(ctx_.stream());
  if (status != cudaSuccess) return make_error("CUDA error before {}: {}", name, cudaGetErrorString(status));
  std::vector<float> values(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) values[r * cols + c] = bf16_to_float(bits[r * ld + c]);
  }
  (*step_.tracer)(name, values.data(), rows, cols);
  return {};
}

}  // namespace tern
