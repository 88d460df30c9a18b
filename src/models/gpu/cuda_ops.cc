#include "models/gpu/cuda_ops.h"

#include "models/shard.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/formats.h"
#include "kernels/cuda/elementwise/elementwise.h"
#include "kernels/cuda/gemm/gemm_bf16.h"
#include "kernels/cuda/gemv/gemv_bf16.h"
#include "kernels/cuda/mla/indexer.h"
#include "kernels/cuda/mla/mla.h"
#include "kernels/cuda/moe/moe.h"
#include "layers/attention.h"
#include "layers/gated_deltanet.h"
#include "layers/mla.h"
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
  float rope_attention_factor = 1.0f;
  PagedKvCache cache{};
};

// Multi-head latent attention in the weight-absorbed form (layers/mla.h): kv_b_proj's key rows W_UK (transposed)
// and value rows W_UV per head, so a step reads the latent cache and never expands it.
struct GpuMla {
  MlaShape shape;
  // [q_a_proj | kv_a_proj] over the block's normed input ([q_proj | kv_a_proj] without a query LoRA).
  DeviceProjection in_proj;
  int64_t kv_col = 0;
  GpuNorm q_a_norm;          // with a query LoRA: q_a's output normed, then
  DeviceProjection q_proj;   // q_b_proj of it
  GpuNorm kv_norm;
  const uint16_t* w_uk_t = nullptr;  // [heads, kv_lora_rank, qk_nope_head_dim]
  const uint16_t* w_uv = nullptr;    // [heads, v_head_dim, kv_lora_rank]
  DeviceMatrix o_proj;
  const float* inv_freq = nullptr;   // [qk_rope_head_dim / 2]
  float rope_attention_factor = 1.0f;
  PagedLatentCache cache{};
  // DSA (index_topk > 0). A layer with its own indexer: wk and weights_proj are columns of in_proj, wq_b of q_proj,
  // its keys have a paged cache; a "shared" layer (no indexer) attends the selection its nearest full layer made
  // earlier in the same step.
  bool has_indexer = false;
  int64_t idx_k_col = 0, idx_w_col = 0, idx_q_col = 0;
  const uint16_t* idx_norm_weight = nullptr;
  const uint16_t* idx_norm_bias = nullptr;
  float idx_eps = 1e-6f;
  PagedIndexerKeys idx_cache{};
  int64_t latent() const { return shape.kv_lora_rank + shape.qk_rope_head_dim; }
  int64_t qk() const { return shape.qk_nope_head_dim + shape.qk_rope_head_dim; }
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
  MoeShape shape;  // softmax or sigmoid routing (DeepSeek-V3 / GLM-5), the shared expert gated or not
  int64_t n_experts = 0;     // the router's
  int64_t expert_begin = 0;  // the first of them `experts` holds (expert parallelism; MoeWeights::first_expert)
  // [shared expert gate | shared expert up | router | shared_expert_gate] as one GEMM over the block's input (the
  // shared expert's columns first, so its rows start 16-byte aligned for silu_mul; no shared_expert_gate column when
  // the shared expert is unweighted, Moe::input_projections); without a shared expert, the router.
  DeviceProjection router;
  int64_t logits_col = 0;  // the router's first column
  // Sigmoid routing: the router is not in `router` but its own GEMM with fp32 logits, as DeepSeek-V3 / GLM-5 compute
  // it (transformers' TopkRouter: F.linear in fp32 over the bf16 hidden state and weight).
  std::optional<DeviceMatrix> router_f32;
  const float* correction_bias = nullptr;  // sigmoid routing's e_score_correction_bias [n_experts]; null: none
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

// A block between two norms of the residual stream: its device weights, the CudaOps method that runs it (which
// leaves its output in out_), then the sum of that output over the tensor-parallel ranks.
template <class Device, Expected<void> (CudaOps::*kRun)(const Device&, const GpuNorm&, int64_t)>
class CudaStreamBlock final : public Block {
 public:
  CudaStreamBlock(CudaOps& ops, GpuNorm norm, Device d) : ops_(ops), norm_(norm), d_(std::move(d)) {}
  Expected<void> forward(int64_t layer) const override {
    TERN_TRY((ops_.*kRun)(d_, norm_, layer));
    return ops_.reduce_out();
  }
  Device& device() { return d_; }

 private:
  CudaOps& ops_;
  GpuNorm norm_;
  Device d_;
};

using CudaAttentionBlock = CudaStreamBlock<GpuAttention, &CudaOps::run_attention>;
using CudaMlaBlock = CudaStreamBlock<GpuMla, &CudaOps::run_mla>;
using CudaGdnBlock = CudaStreamBlock<GpuGdn, &CudaOps::run_gdn>;
using CudaMlpBlock = CudaStreamBlock<GpuMlp, &CudaOps::run_mlp>;
using CudaMoeBlock = CudaStreamBlock<GpuMoe, &CudaOps::run_moe>;

class CudaHead final : public Block {
 public:
  CudaHead(CudaOps& ops, GpuNorm norm, DeviceMatrix head) : ops_(ops), norm_(norm), head_(head) {}
  Expected<void> forward(int64_t) const override { return ops_.run_head(head_, norm_); }

 private:
  CudaOps& ops_;
  GpuNorm norm_;
  DeviceMatrix head_;
};

// A draft module's input (BlockOps::draft_input): fc over [norm_embedding(stream) ; norm_hidden(h)] becomes the
// stream. fc is whole on every tensor-parallel rank, so nothing is summed.
class CudaDraftInput final : public Block {
 public:
  CudaDraftInput(CudaOps& ops, GpuNorm norm_embedding, GpuNorm norm_hidden, DeviceMatrix fc)
      : ops_(ops), norm_embedding_(norm_embedding), norm_hidden_(norm_hidden), fc_(fc) {}
  Expected<void> forward(int64_t) const override { return ops_.run_draft_input(norm_embedding_, norm_hidden_, fc_); }

 private:
  CudaOps& ops_;
  GpuNorm norm_embedding_, norm_hidden_;
  DeviceMatrix fc_;
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
      weights_(ctx.stream(), options.kernels.bf16_gemv, options.kernels.nvfp4_w4a4),
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
  if (embed.nvfp4 || embed.fp8) return make_error("embed_tokens: quantized (NVFP4, FP8) embeddings are not supported");
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
  g.rope_attention_factor = a.rope().attention_factor();
  TERN_ASSIGN_OR_RETURN(const GpuNorm n, norm(input_norm));
  auto block = std::make_unique<CudaAttentionBlock>(*this, n, std::move(g));
  attentions_.push_back(&block->device());
  return block;
}

Expected<std::unique_ptr<Block>> CudaOps::mla(const RmsNorm& input_norm, const MlaAttention& a) {
  const MlaShape& s = a.shape();
  const MlaWeights& w = a.weights();
  const std::string& name = w.kv_a_proj.name();
  if (s.index_topk > 0 && s.q_lora_rank == 0) {
    return make_error("{}: a DSA indexer needs the query LoRA (q_lora_rank > 0)", name);
  }
  const int64_t h = s.n_heads, nope = s.qk_nope_head_dim, rope = s.qk_rope_head_dim, vd = s.v_head_dim,
                lora = s.kv_lora_rank;
  // The kernels' limits (mla.h), and 16-byte rows and heads for the batched per-head GEMMs.
  if (lora % 8 != 0 || lora > kMlaMaxLoraRank || rope % 8 != 0 || rope > kMlaMaxRopeDim || nope % 8 != 0 ||
      vd % 8 != 0) {
    return make_error("{}: MLA shapes kv_lora_rank={} qk_rope_head_dim={} qk_nope_head_dim={} v_head_dim={} are not "
                      "supported on CUDA (multiples of 8; kv_lora_rank <= {}, qk_rope_head_dim <= {})",
                      name, lora, rope, nope, vd, kMlaMaxLoraRank, kMlaMaxRopeDim);
  }
  if (!mla_attention_fits(ctx_.props(), lora + rope)) {
    return make_error("{}: the MLA attention kernel's tiles for a {}-value latent need {} bytes of shared memory per "
                      "block; this GPU allows {}", name, lora + rope, mla_attention_smem_bytes(lora + rope),
                      ctx_.props().shared_mem_per_block_optin);
  }
  if (a.rope().rotary_dim() != rope) {
    return make_error("{}: RoPE over {} dims, but qk_rope_head_dim is {}", name, a.rope().rotary_dim(), rope);
  }
  if (s.latent_fp8 && (lora != kMlaFp8LoraRank || rope % 16 != 0 || rope > kMlaFp8MaxRopeDim)) {
    return make_error("{}: the CUDA FP8 latent cache holds kv_lora_rank {} with qk_rope_head_dim a multiple of 16 up "
                      "to {} (GLM-5's and DeepSeek-V3's); this model has {} and {}: use --kv-cache-dtype auto", name,
                      kMlaFp8LoraRank, kMlaFp8MaxRopeDim, lora, rope);
  }
  if (w.kv_b_proj.out_features() != h * (nope + vd) || w.kv_b_proj.in_features() != lora) {
    return make_error("{}: kv_b_proj is [{}, {}], expected [{}, {}]", w.kv_b_proj.name(), w.kv_b_proj.out_features(),
                      w.kv_b_proj.in_features(), h * (nope + vd), lora);
  }
  GpuMla g;
  g.shape = s;
  // The cache's form from the start (its entries' size sizes the pool); allocate_caches adds the memory.
  g.cache = PagedLatentCache{.kv_lora_rank = lora,
                             .rope_dim = rope,
                             .dtype = s.latent_fp8 ? LatentCacheDtype::kFp8 : LatentCacheDtype::kBf16,
                             .pow2_scales = s.latent_fp8 == LatentFp8Scales::kPow2};
  g.has_indexer = s.index_topk > 0 && w.indexer.has_value();
  std::vector<const Linear*> parts{s.q_lora_rank > 0 ? &w.q_a_proj : &w.q_proj, &w.kv_a_proj};
  std::vector<const Linear*> q_parts{&w.q_b_proj};
  if (g.has_indexer) {
    const MlaIndexerWeights& ix = *w.indexer;
    if (s.index_head_dim % 16 != 0 || s.index_head_dim > kIndexerMaxHeadDim || s.index_heads > kIndexerMaxHeads) {
      return make_error("{}: indexer shapes index_n_heads={} index_head_dim={} are not supported on CUDA (head_dim a "
                        "multiple of 16 up to {}, at most {} heads)", name, s.index_heads, s.index_head_dim,
                        kIndexerMaxHeadDim, kIndexerMaxHeads);
    }
    parts.push_back(&ix.wk);
    parts.push_back(&ix.weights_proj);
    q_parts.push_back(&ix.wq_b);
    TERN_ASSIGN_OR_RETURN(g.idx_norm_weight, weights_.vector_bf16(ix.k_norm.weight));
    TERN_ASSIGN_OR_RETURN(g.idx_norm_bias, weights_.vector_bf16(ix.k_norm.bias));
    g.idx_eps = ix.k_norm.eps;
  }
  // Each linear's first column in its projection's output: the widths before it (adjacent BF16 linears become one
  // device matrix, so DeviceProjection::offsets are per matrix, not per linear).
  const auto column = [](const std::vector<const Linear*>& linears, size_t i) {
    int64_t col = 0;
    for (size_t j = 0; j < i; ++j) col += linears[j]->out_features();
    return col;
  };
  TERN_ASSIGN_OR_RETURN(g.in_proj, weights_.projection(parts, 8));
  g.kv_col = column(parts, 1);
  if (g.has_indexer) {
    g.idx_k_col = column(parts, 2);
    g.idx_w_col = column(parts, 3);
  }
  if (s.q_lora_rank > 0) {
    if (s.q_lora_rank % 8 != 0) return make_error("{}: q_lora_rank={} is not a multiple of 8", name, s.q_lora_rank);
    TERN_ASSIGN_OR_RETURN(g.q_a_norm, norm(w.q_a_norm));
    TERN_ASSIGN_OR_RETURN(g.q_proj, weights_.projection(q_parts, 8));
    if (g.has_indexer) g.idx_q_col = column(q_parts, 1);
  }
  TERN_ASSIGN_OR_RETURN(g.kv_norm, norm(w.kv_a_norm));
  // kv_b_proj's rows per head: nope key rows (W_UK), then vd value rows (W_UV); W_UK is stored transposed so both
  // products are x . W^T GEMMs. Dequantized to fp32 on the host first (any stored format), bf16 on the device.
  std::vector<float> row(static_cast<size_t>(lora)), uk_t(static_cast<size_t>(h * lora * nope)),
      uv(static_cast<size_t>(h * vd * lora));
  for (int64_t hd = 0; hd < h; ++hd) {
    for (int64_t i = 0; i < nope; ++i) {
      cpu_matrix_row(w.kv_b_proj.matrix(), hd * (nope + vd) + i, row.data());
      for (int64_t l = 0; l < lora; ++l) uk_t[(hd * lora + l) * nope + i] = row[l];
    }
    for (int64_t i = 0; i < vd; ++i) {
      cpu_matrix_row(w.kv_b_proj.matrix(), hd * (nope + vd) + nope + i, &uv[(hd * vd + i) * lora]);
    }
  }
  TERN_ASSIGN_OR_RETURN(g.w_uk_t, weights_.vector_bf16(uk_t));
  TERN_ASSIGN_OR_RETURN(g.w_uv, weights_.vector_bf16(uv));
  TERN_ASSIGN_OR_RETURN(g.o_proj, weights_.matrix(w.o_proj));
  TERN_ASSIGN_OR_RETURN(g.inv_freq, weights_.vector_f32(a.rope().inv_freq()));
  g.rope_attention_factor = a.rope().attention_factor();
  TERN_ASSIGN_OR_RETURN(const GpuNorm n, norm(input_norm));
  auto block = std::make_unique<CudaMlaBlock>(*this, n, std::move(g));
  mlas_.push_back(&block->device());
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
  GpuMoe m;
  m.shape = moe.shape();
  const MoeWeights& w = moe.weights();
  m.n_experts = w.router.out_features();
  m.expert_begin = w.first_expert;
  if (!w.correction_bias.empty()) {
    if (!m.shape.sigmoid || static_cast<int64_t>(w.correction_bias.size()) != m.n_experts) {
      return make_error("{}: a correction bias of {} values needs sigmoid routing over {} experts", w.router.name(),
                        w.correction_bias.size(), m.n_experts);
    }
    TERN_ASSIGN_OR_RETURN(m.correction_bias, weights_.vector_f32(w.correction_bias));
  }
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
  std::vector<const Linear*> parts = moe.input_projections();
  if (m.shape.sigmoid) {
    parts.erase(std::find(parts.begin(), parts.end(), &w.router));
    TERN_ASSIGN_OR_RETURN(m.router_f32, weights_.matrix(w.router));
    if (m.router_f32->nvfp4 || m.n_experts % 4 != 0) {
      return make_error("{}: a sigmoid router on CUDA must be BF16 with a multiple of 4 experts", w.router.name());
    }
  }
  if (!parts.empty()) {
    TERN_ASSIGN_OR_RETURN(m.router, weights_.projection(parts, 8));
  }
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

Expected<std::unique_ptr<Block>> CudaOps::draft_input(const RmsNorm& norm_embedding, const RmsNorm& norm_hidden,
                                                      const Linear& fc) {
  if (fc.in_features() != 2 * hidden_ || fc.out_features() != hidden_) {
    return make_error("{}: the draft module's fc is [{}, {}], expected [{}, {}]", fc.name(), fc.out_features(),
                      fc.in_features(), hidden_, 2 * hidden_);
  }
  if (options_.verify_rows < 2) {
    return make_error("a draft module needs verifications of at least 2 rows (verify_rows is {})",
                      options_.verify_rows);
  }
  TERN_ASSIGN_OR_RETURN(const DeviceMatrix w, weights_.matrix(fc));
  TERN_ASSIGN_OR_RETURN(const GpuNorm ne, norm(norm_embedding));
  TERN_ASSIGN_OR_RETURN(const GpuNorm nh, norm(norm_hidden));
  has_draft_ = true;
  draft_fc_width_ = 2 * hidden_;
  return std::make_unique<CudaDraftInput>(*this, ne, nh, w);
}

// ---- Buffers and caches ----

Expected<void> CudaOps::allocate() {
  TERN_TRY(reserve_head_rows(graphed_rows(), head_graph_));
  TERN_TRY(allocate_activations());
  return allocate_caches();
}

Expected<void> CudaOps::allocate_caches() {
  const int64_t bs = options_.kv_block_size, slots = state_slots();
  int64_t kv_bytes_per_token = 0;
  for (const GpuAttention* a : attentions_) kv_bytes_per_token += 2 * a->shape.n_kv_heads * a->shape.head_dim * 2;
  for (const GpuMla* a : mlas_) {
    kv_bytes_per_token += a->cache.entry_bytes() + (a->has_indexer ? a->shape.index_head_dim * 2 : 0);
  }
  for (GpuGdn* g : gdns_) {
    const size_t conv = static_cast<size_t>(slots * g->channels() * (g->shape.conv_kernel - 1)) * 2;
    const size_t state =
        static_cast<size_t>(slots * g->shape.n_value_heads * g->shape.key_dim * g->shape.value_dim) * 4;
    DeviceBuffer c, s;
    if (!DeviceBuffer::try_allocate(conv, c) || !DeviceBuffer::try_allocate(state, s)) {
      return make_error(
          "out of device memory for the Gated DeltaNet states of {} sequences ({} bytes per layer{}); "
          "lower --max-running-requests{}",
          options_.max_sequences, conv + state,
          verify_rows() > 0 ? fmt::format(", a state for each of {} verified rows included", verify_rows()) : "",
          verify_rows() > 0 ? " or --speculative-num-steps" : "");
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
  for (GpuMla* a : mlas_) {
    const size_t bytes = static_cast<size_t>((kv_blocks_ + 1) * bs * a->cache.entry_bytes());
    DeviceBuffer c;
    if (!DeviceBuffer::try_allocate(bytes, c)) {
      return make_error("out of device memory for a latent cache of {} tokens; ask for fewer (tern serve: "
                        "--max-total-tokens)", kv_blocks_ * bs);
    }
    a->cache.data = c.data();
    a->cache.n_blocks = kv_blocks_ + 1;  // + spare_block()
    a->cache.block_size = bs;
    cache_buffers_.push_back(std::move(c));
    if (!a->has_indexer) continue;
    DeviceBuffer k;
    const size_t key_bytes = static_cast<size_t>((kv_blocks_ + 1) * bs * a->shape.index_head_dim) * 2;
    if (!DeviceBuffer::try_allocate(key_bytes, k)) {
      return make_error("out of device memory for the indexer key cache of {} tokens; ask for fewer (tern serve: "
                        "--max-total-tokens)", kv_blocks_ * bs);
    }
    a->idx_cache = PagedIndexerKeys{
        .k = k.as<uint16_t>(), .n_blocks = kv_blocks_ + 1, .block_size = bs, .head_dim = a->shape.index_head_dim};
    cache_buffers_.push_back(std::move(k));
  }
  int64_t max_lora = 0;
  for (const GpuMla* a : mlas_) max_lora = std::max(max_lora, a->shape.kv_lora_rank);
  if (max_lora > 0 && !DeviceBuffer::try_allocate(mla_attention_workspace_bytes(ctx_.props(), max_lora), mla_workspace_)) {
    return make_error("out of device memory for the MLA attention workspace");
  }
  // DSA: the selection of a step ([rows, index_topk] key positions) and the indexer's score rows. The graphs' score
  // buffer is sized here for every graphed step (graphed_rows(): a verification's rows too, over the widest graph's
  // max_seq_len, up to twice the context) and never reallocated, since the captured graphs hold its address; a
  // longer prefill grows a buffer of its own.
  for (const GpuMla* a : mlas_) {
    if (a->shape.index_topk <= 0) continue;
    const int64_t topk = a->shape.index_topk;
    if (!DeviceBuffer::try_allocate(static_cast<size_t>(options_.max_batch_tokens * topk) * 4, selected_)) {
      return make_error("out of device memory for the DSA selections of {} rows", options_.max_batch_tokens);
    }
    const int64_t context = options_.max_context_tokens > 0 ? options_.max_context_tokens : kv_blocks_ * bs;
    const int64_t graph_seq_len = decode_graph_max_blocks(context, kv_blocks_, bs) * bs;
    TERN_TRY(reserve_indexer_workspace(indexer_select_workspace_bytes(graphed_rows(), graph_seq_len),
                                       indexer_workspace_));
    break;
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
  int64_t latent = 0;
  for (const GpuMla* a : mlas_) {
    const MlaShape& s = a->shape;
    proj = std::max(proj, a->in_proj.width);
    heads = std::max({heads, s.q_lora_rank, a->q_proj.width, s.n_heads * a->qk(), s.n_heads * s.v_head_dim});
    latent = std::max(latent, s.n_heads * (a->latent() + s.kv_lora_rank) + s.index_heads * s.index_head_dim);
  }
  for (const GpuGdn* g : gdns_) {
    const GatedDeltaNetShape& s = g->shape;
    scratch_bytes_ = std::max(scratch_bytes_, static_cast<size_t>(gdn_chunked_workspace_bytes(
                                                  t, s.n_key_heads, s.n_value_heads, s.key_dim, s.value_dim)));
    proj = std::max(proj, g->in_proj.width);
    conv = std::max(conv, g->channels());
    heads = std::max(heads, g->shape.n_value_heads * g->shape.value_dim);  // the GDN core lands in attn_
  }
  for (const GpuMlp* m : mlps_) {
    proj = std::max(proj, m->gate_up.width);
    act = std::max(act, m->inter);
  }
  int64_t router_f32 = 0;
  for (const GpuMoe* m : moes_) {
    router = std::max(router, m->router.width);
    if (m->router_f32) router_f32 = std::max(router_f32, m->n_experts);
    act = std::max(act, m->shared_inter);
    scratch_bytes_ = std::max(scratch_bytes_,
                              moe_forward_workspace_bytes(t, m->shape.top_k, m->n_experts, m->experts.inter, h));
  }
  proj = std::max(proj, draft_fc_width_);  // a draft step joins its two normed inputs in proj_
  const int64_t kept = has_draft_ ? t * h : 0;
  const auto aligned = [](size_t bytes) { return (std::max<size_t>(bytes, 1) + 255) / 256 * 256; };
  // Every bf16 buffer with its element count, once: sized first, then carved in this order, 256-byte aligned.
  const std::pair<uint16_t**, int64_t> buffers[] = {
      {&x_rows_, t * h},      {&x_row_, h},          {&normed_, t * h},   {&out_, t * h},     {&proj_, t * proj},
      {&q_, t * heads},       {&gate_, t * heads},   {&attn_, t * heads}, {&conv_, t * conv}, {&act_, t * act},
      {&router_, t * router}, {&shared_out_, t * h}, {&last_, t * h},   {&latent_, t * latent},
      {&model_hidden_, kept}, {&draft_hidden_, kept}};
  size_t bytes = aligned(scratch_bytes_) + aligned(8);
  for (const auto& [ptr, count] : buffers) bytes += aligned(static_cast<size_t>(count) * 2);
  if (router_f32 > 0 && !DeviceBuffer::try_allocate(static_cast<size_t>(t * router_f32) * 4, router_f32_)) {
    return make_error("out of device memory for the fp32 router logits of {} rows", t);
  }
  if (!DeviceBuffer::try_allocate(bytes, arena_)) {
    return make_error("out of device memory for {} bytes of activation buffers", bytes);
  }
  char* next = static_cast<char*>(arena_.data());
  for (const auto& [ptr, count] : buffers) {
    *ptr = reinterpret_cast<uint16_t*>(next);
    next += aligned(static_cast<size_t>(count) * 2);
  }
  scratch_ = next;
  next += aligned(scratch_bytes_);
  bad_id_ = reinterpret_cast<unsigned long long*>(next);
  if (!has_draft_) model_hidden_ = draft_hidden_ = nullptr;
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

// Where the GEMV runs the product (gemv_bf16_preferred: one row, or up to four on a small projection), its SiLU
// prologue gives the bits of silu_mul followed by the GEMV (kernels/cuda/gemv tests, every row count).
bool CudaOps::silu_gemv_applies(const DeviceMatrix& w, int64_t ldx, int64_t rows) const {
  return options_.kernels.silu_gemv && !w.nvfp4 && w.gemv && gemv_bf16_preferred(rows, w.n, w.k) && ldx % 8 == 0;
}

Expected<void> CudaOps::silu_forward(const DeviceMatrix& w, const uint16_t* gate_up, int64_t ldx, int64_t rows,
                                     uint16_t* y, int64_t ldy) {
  if (silu_gemv_applies(w, ldx, rows)) {
    return gemv_bf16_silu_mul(
        ctx_, GemmBf16Args{.x = gate_up, .w = w.bf16, .y = y, .m = rows, .n = w.n, .k = w.k, .ldy = ldy}, ldx);
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

Expected<void> CudaOps::run_attention(const GpuAttention& a, const GpuNorm& norm, int64_t) {
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
                                  .attention_factor = a.rope_attention_factor,
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

// q: with a query LoRA, cq = RMSNorm(q_a_proj(x)) (into gate_) and q = q_b_proj(cq) (into q_); without, q_proj(x)
// from the block's projection. The latent of the new tokens goes to the cache, q_pe is roped into the absorbed
// query rows (latent_), W_UK^T of each head's q_nope fills the rest of them; attention over the latent cache; W_UV
// of each head's latent output, then o_proj.
Expected<void> CudaOps::run_mla(const GpuMla& a, const GpuNorm& norm, int64_t layer) {
  const MlaShape& s = a.shape;
  const int64_t t = step_.tokens, h = s.n_heads, lora = s.kv_lora_rank, nope = s.qk_nope_head_dim,
                latent = a.latent(), qk = a.qk();
  TERN_TRY(norm_project(normed_input(norm), a.in_proj, t, proj_));
  stream_started_ = true;
  const uint16_t* q = proj_;
  int64_t q_stride = a.in_proj.width;
  if (s.q_lora_rank > 0) {
    TERN_TRY(rms_norm(ctx_, RmsNormArgs{.x = proj_,
                                        .weight = a.q_a_norm.weight,
                                        .y = gate_,
                                        .x_stride = a.in_proj.width,
                                        .rows = t,
                                        .dim = s.q_lora_rank,
                                        .eps = a.q_a_norm.eps,
                                        .zero_centred = a.q_a_norm.zero_centred}));
    for (size_t i = 0; i < a.q_proj.parts.size(); ++i) {
      TERN_TRY(device_matrix_forward(ctx_, a.q_proj.parts[i], gate_, t, q_ + a.q_proj.offsets[i], a.q_proj.width));
    }
    q = q_;
    q_stride = a.q_proj.width;
  }
  uint16_t* q_latent = latent_;
  uint16_t* out_latent = latent_ + t * h * latent;
  TERN_TRY(mla_prepare(ctx_, MlaPrepareArgs{.kv_a = proj_ + a.kv_col,
                                            .kv_a_stride = a.in_proj.width,
                                            .kv_norm_weight = a.kv_norm.weight,
                                            .eps = a.kv_norm.eps,
                                            .zero_centred = a.kv_norm.zero_centred,
                                            .q = q,
                                            .q_stride = q_stride,
                                            .q_latent = q_latent,
                                            .positions = step_.positions,
                                            .inv_freq = a.inv_freq,
                                            .attention_factor = a.rope_attention_factor,
                                            .interleaved = s.rope_interleaved,
                                            .slot_mapping = step_.slot_mapping,
                                            .cache = a.cache,
                                            .tokens = t,
                                            .n_heads = h,
                                            .nope_dim = nope}));
  // q_lat[t, hd, :lora] = q_nope[t, hd] . W_UK[hd] (as x . (W_UK^T)^T), one product per head.
  TERN_TRY(gemm_bf16(ctx_, GemmBf16Args{.x = q,
                                        .w = a.w_uk_t,
                                        .y = q_latent,
                                        .m = t,
                                        .n = lora,
                                        .k = nope,
                                        .ldy = h * latent,
                                        .ldx = q_stride,
                                        .batch = h,
                                        .x_batch_stride = qk,
                                        .w_batch_stride = lora * nope,
                                        .y_batch_stride = latent}));
  const int32_t* selected = nullptr;
  if (s.index_topk > 0) {
    if (a.has_indexer) TERN_TRY(run_indexer(a, out_latent + t * h * lora));
    selected = selected_.as<int32_t>();
  }
  TERN_TRY(mla_attention(ctx_, MlaAttentionArgs{.q_latent = q_latent,
                                                .out_latent = out_latent,
                                                .cache = a.cache,
                                                .block_tables = step_.block_tables,
                                                .max_blocks_per_seq = step_.max_blocks,
                                                .query_start = step_.query_start,
                                                .seq_lens = step_.seq_lens,
                                                .n_seqs = step_.n_seqs,
                                                .tokens = t,
                                                .n_heads = h,
                                                .selected = selected,
                                                .topk = s.index_topk,
                                                .scale = s.scale,
                                                .max_seq_len = step_.max_seq_len,
                                                .workspace = mla_workspace_.data(),
                                                .workspace_bytes = mla_workspace_.size_bytes()}));
  // attn[t, hd, :vd] = o_lat[t, hd] . W_UV[hd]^T
  TERN_TRY(gemm_bf16(ctx_, GemmBf16Args{.x = out_latent,
                                        .w = a.w_uv,
                                        .y = attn_,
                                        .m = t,
                                        .n = s.v_head_dim,
                                        .k = lora,
                                        .ldy = h * s.v_head_dim,
                                        .ldx = h * lora,
                                        .batch = h,
                                        .x_batch_stride = lora,
                                        .w_batch_stride = s.v_head_dim * lora,
                                        .y_batch_stride = s.v_head_dim}));
  TERN_TRY(trace(trace_name(layer, "attn"), attn_, t, h * s.v_head_dim, h * s.v_head_dim));
  return device_matrix_forward(ctx_, a.o_proj, attn_, t, out_, hidden_);
}

// The DSA indexer of a full layer: its queries (q_ columns from wq_b) and keys (proj_ columns from wk) normed and
// roped, the keys into their cache, then each row's top index_topk keys into selected_. idx_q: [tokens, heads,
// head_dim] scratch.
Expected<void> CudaOps::run_indexer(const GpuMla& a, uint16_t* idx_q) {
  const MlaShape& s = a.shape;
  const int64_t t = step_.tokens;
  TERN_TRY(indexer_prepare(ctx_, IndexerPrepareArgs{.q = q_ + a.idx_q_col,
                                                    .q_stride = a.q_proj.width,
                                                    .q_out = idx_q,
                                                    .k = proj_ + a.idx_k_col,
                                                    .k_stride = a.in_proj.width,
                                                    .k_norm_weight = a.idx_norm_weight,
                                                    .k_norm_bias = a.idx_norm_bias,
                                                    .eps = a.idx_eps,
                                                    .positions = step_.positions,
                                                    .inv_freq = a.inv_freq,
                                                    .rope_dim = s.qk_rope_head_dim,
                                                    .attention_factor = a.rope_attention_factor,
                                                    .interleaved = s.indexer_rope_interleaved,
                                                    .slot_mapping = step_.slot_mapping,
                                                    .cache = a.idx_cache,
                                                    .tokens = t,
                                                    .n_heads = s.index_heads,
                                                    .head_dim = s.index_head_dim}));
  const size_t need = indexer_select_workspace_bytes(t, step_.max_seq_len);
  DeviceBuffer* workspace = &indexer_workspace_;
  if (need > indexer_workspace_.size_bytes()) {
    if (step_.graphed) {
      return make_error("the DSA indexer workspace ({} bytes) is smaller than a decode step needs ({})",
                        indexer_workspace_.size_bytes(), need);
    }
    TERN_TRY(reserve_indexer_workspace(need, indexer_prefill_workspace_));  // never inside a graph capture
    workspace = &indexer_prefill_workspace_;
  }
  return indexer_select(ctx_, IndexerSelectArgs{.q = idx_q,
                                                .weights = proj_ + a.idx_w_col,
                                                .weights_stride = a.in_proj.width,
                                                .cache = a.idx_cache,
                                                .block_tables = step_.block_tables,
                                                .max_blocks_per_seq = step_.max_blocks,
                                                .query_start = step_.query_start,
                                                .seq_lens = step_.seq_lens,
                                                .n_seqs = step_.n_seqs,
                                                .tokens = t,
                                                .n_heads = s.index_heads,
                                                .head_dim = s.index_head_dim,
                                                .topk = s.index_topk,
                                                .max_seq_len = step_.max_seq_len,
                                                .workspace = workspace->data(),
                                                .workspace_bytes = workspace->size_bytes(),
                                                .selected = selected_.as<int32_t>()});
}

Expected<void> CudaOps::reserve_indexer_workspace(size_t bytes, DeviceBuffer& buffer) {
  if (bytes <= buffer.size_bytes()) return {};
  DeviceBuffer grown;
  if (!DeviceBuffer::try_allocate(bytes, grown)) {
    return make_error("out of device memory for the DSA indexer's scores ({} bytes: rows x context x 4); use shorter "
                      "prefill chunks (--max-batch-tokens) or a shorter context", bytes);
  }
  TERN_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream()));  // the old buffer may still be read by queued work
  buffer = std::move(grown);
  return {};
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
                          .max_query_len = step_.max_query_len,
                          .row_slots = step_.row_slots,
                          .max_rows = step_.max_rows};
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
                                           .norm = norm_in_rule ? norm : GdnGatedNorm{},
                                           .workspace = static_cast<float*>(scratch_),
                                           .workspace_bytes = static_cast<int64_t>(scratch_bytes_)},
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

Expected<void> CudaOps::run_mlp(const GpuMlp& m, const GpuNorm& norm, int64_t) {
  const int64_t rows = step_.tokens;
  TERN_TRY(norm_project(normed_input(norm), m.gate_up, rows, proj_));
  stream_started_ = true;
  return silu_forward(m.down, proj_, m.gate_up.width, rows, out_, hidden_);
}

Expected<void> CudaOps::run_moe(const GpuMoe& m, const GpuNorm& norm, int64_t layer) {
  const int64_t tokens = step_.tokens;
  const NormedInput in = normed_input(norm);
  if (!m.router.parts.empty()) {
    TERN_TRY(norm_project(in, m.router, tokens, router_));
  } else {
    TERN_TRY(rms_norm_rows(*in.norm, x_, in.residual, tokens, normed_));
  }
  stream_started_ = true;
  float* logits_f32 = router_f32_.as<float>();
  if (m.router_f32) {
    const DeviceMatrix& r = *m.router_f32;
    TERN_TRY(gemm_bf16(ctx_, GemmBf16Args{.x = normed_, .w = r.bf16, .m = tokens, .n = r.n, .k = r.k,
                                          .y_f32 = logits_f32}));
  }
  // Where the shared expert's down projection is the fused SiLU GEMV (one token, or a few on a small projection:
  // silu_gemv_applies), that GEMV runs last and does the combine in its epilogue (the same bits as silu_forward + the
  // combine launch, two launches fewer; kernels/cuda/moe tests at every row count up to eight).
  const bool fold_combine = m.shared_down && silu_gemv_applies(*m.shared_down, m.router.width, tokens);
  if (m.shared_down && !fold_combine) {
    TERN_TRY(silu_forward(*m.shared_down, router_, m.router.width, tokens, shared_out_, hidden_));
  }
  const DeviceExperts& e = m.experts;
  const MoeForwardArgs args{.x = normed_,
                            .router_logits = m.router_f32 ? nullptr : router_ + m.logits_col,
                            .router_logits_f32 = m.router_f32 ? logits_f32 : nullptr,
                            .logits_stride = m.router_f32 ? m.n_experts : m.router.width,
                            .tokens = tokens,
                            .hidden = hidden_,
                            .inter = e.inter,
                            .n_experts = m.n_experts,
                            .top_k = m.shape.top_k,
                            .expert_begin = m.expert_begin,
                            .renormalize = m.shape.renormalize,
                            .sigmoid = m.shape.sigmoid,
                            .n_group = m.shape.sigmoid ? m.shape.n_group : 1,
                            .topk_group = m.shape.sigmoid ? m.shape.topk_group : 1,
                            .routed_scaling = m.shape.sigmoid ? m.shape.routed_scaling : 1.0f,
                            .correction_bias = m.correction_bias,
                            .gate_up = e.nvfp4 ? e.gate : e.gate_up,
                            .up = e.nvfp4 ? e.up : MoeExpertWeights{},
                            .down = e.down,
                            .shared_out = m.shared_down ? shared_out_ : nullptr,
                            // The shared_expert_gate column follows the router's, when the block has one.
                            .shared_gate = m.shared_down && m.shape.shared_gate
                                               ? router_ + m.logits_col + m.n_experts
                                               : nullptr,
                            .shared_gate_stride = m.router.width,
                            .y = out_,
                            .workspace = scratch_,
                            .workspace_bytes = scratch_bytes_};
  if (!fold_combine) {
    TERN_TRY(moe_forward(ctx_, args));
  } else {
    TERN_ASSIGN_OR_RETURN(const MoeCombineArgs c, moe_forward_experts(ctx_, args));
    const DeviceMatrix& w = *m.shared_down;
    TERN_TRY(gemv_bf16_silu_mul_moe_combine(
        ctx_, GemmBf16Args{.x = router_, .w = w.bf16, .y = c.y, .m = tokens, .n = w.n, .k = w.k, .ldy = hidden_},
        m.router.width, c));
  }
  if (m.router_f32) return trace_f32(trace_name(layer, "router_logits"), logits_f32, tokens, m.n_experts);
  return trace(trace_name(layer, "router_logits"), router_ + m.logits_col, tokens, m.n_experts, m.router.width);
}

Expected<void> CudaOps::run_head(const DeviceMatrix& head, const GpuNorm& norm) {
  const int64_t t = step_.tokens, h = hidden_;
  const NormedInput in = normed_input(norm);
  // Under tensor parallelism this rank's logits go to a HeadLogits pair ([rows, range]) and are gathered into the
  // step's.
  const int64_t rows = step_.n_head_rows;
  HeadLogits* head_pair = nullptr;
  if (comm_) {
    TERN_ASSIGN_OR_RETURN(head_pair, head_logits(rows));
  }
  uint16_t* logits = comm_ ? head_pair->local.as<uint16_t>() : step_.logits;
  const int64_t ld = comm_ ? vocab_shard_rows(vocab_, comm_->world()) : vocab_;
  // Every row's normed hidden state is in normed_ either way (by the norm or the fused GEMV): kept for a draft step
  // when there is a draft module.
  const auto keep_hidden = [&]() -> Expected<void> {
    if (step_.keep_hidden == nullptr) return {};
    TERN_CUDA_CHECK(cudaMemcpyAsync(step_.keep_hidden, normed_,
                                    static_cast<size_t>(t * h) * 2, cudaMemcpyDeviceToDevice, ctx_.stream()));
    return {};
  };
  if (!step_.gathers_head_rows()) {
    TERN_TRY(norm_forward(in, head, t, logits, ld));
    TERN_TRY(keep_hidden());
    if (comm_) TERN_TRY(gather_logits(*head_pair, rows));
    return trace("final_norm", normed_, t, h, h);
  }
  TERN_TRY(rms_norm_rows(*in.norm, x_, in.residual, t, normed_));
  TERN_TRY(keep_hidden());
  TERN_TRY(embedding_lookup(
      ctx_, EmbeddingArgs{
                .ids = step_.head_rows, .table = normed_, .y = last_, .bad = bad_id_, .tokens = rows, .vocab = t,
                .hidden = h}));
  TERN_TRY(trace("final_norm", last_, rows, h, h));
  TERN_TRY(device_matrix_forward(ctx_, head, last_, rows, logits, ld));
  return comm_ ? gather_logits(*head_pair, rows) : Expected<void>{};
}

Expected<void> CudaOps::run_draft_input(const GpuNorm& norm_embedding, const GpuNorm& norm_hidden,
                                        const DeviceMatrix& fc) {
  const int64_t t = step_.tokens, h = hidden_;
  if (step_.hidden_in == nullptr || step_.hidden_rows == nullptr) {
    return make_error("a draft module's step was given no hidden states");
  }
  // [norm_embedding(stream) ; norm_hidden(the hidden rows)] side by side in proj_, then fc's product is the stream.
  TERN_TRY(rms_norm(ctx_, RmsNormArgs{.x = x_, .weight = norm_embedding.weight, .y = proj_, .y_stride = 2 * h,
                                      .rows = t, .dim = h, .eps = norm_embedding.eps,
                                      .zero_centred = norm_embedding.zero_centred}));
  TERN_TRY(embedding_lookup(ctx_, EmbeddingArgs{.ids = step_.hidden_rows, .table = step_.hidden_in, .y = last_,
                                                .bad = bad_id_, .tokens = t, .vocab = options_.max_batch_tokens,
                                                .hidden = h}));
  TERN_TRY(rms_norm(ctx_, RmsNormArgs{.x = last_, .weight = norm_hidden.weight, .y = proj_ + h, .y_stride = 2 * h,
                                      .rows = t, .dim = h, .eps = norm_hidden.eps,
                                      .zero_centred = norm_hidden.zero_centred}));
  TERN_TRY(device_matrix_forward(ctx_, fc, proj_, t, x_, h));
  stream_started_ = false;
  return {};
}

Expected<void> CudaOps::trace_output(std::string_view name) {
  return trace(name, out_, step_.tokens, hidden_, hidden_);
}

Expected<void> CudaOps::trace_f32(std::string_view name, const float* data, int64_t rows, int64_t cols) {
  if (step_.tracer == nullptr) return {};
  std::vector<float> values(static_cast<size_t>(rows * cols));
  TERN_CUDA_CHECK(cudaMemcpyAsync(values.data(), data, values.size() * 4, cudaMemcpyDeviceToHost, ctx_.stream()));
  const cudaError_t status = cudaStreamSynchronize(ctx_.stream());
  if (status != cudaSuccess) return make_error("CUDA error before {}: {}", name, cudaGetErrorString(status));
  (*step_.tracer)(name, values.data(), rows, cols);
  return {};
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
