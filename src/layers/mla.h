// Multi-head latent attention (DeepSeek-V3, GLM-5) with GLM-5's DeepSeek Sparse Attention indexer, the CPU
// reference (docs/model-specs.md §3.3; transformers' GlmMoeDsaAttention and GlmMoeDsaIndexer):
//
//   cq = norm_qa(q_a_proj(x))                          q = q_b_proj(cq) per head [nope | rope]
//   [c | k_pe] = kv_a_proj(x), c = norm_kva(c)         the cache keeps c and the roped k_pe per token (the latent)
//   [k_nope | v] = kv_b_proj(c) per head               K = [k_nope | k_pe], scores q.K * qk_head_dim^-0.5
//   attention over the causal positions the indexer selected; o_proj of the heads' outputs
//
// The indexer (DSA): qi = wq_b(cq) per index head [rope | nope], ki = LayerNorm(wk(x)) [rope | nope] (one key head,
// cached per token), w = weights_proj(x) * index_n_heads^-0.5, and for query t and key s <= t
// I(t, s) = sum_h w_h * relu(qi_h . ki_s * index_head_dim^-0.5); each query attends to the top min(index_topk, T)
// of its causal keys (T: the keys, cached and new), ties to the earlier key. A "shared" layer reuses the selection
// of the nearest full layer before it. Without an indexer (DeepSeek-V3) attention is plain causal.
//
// Two forms over the same latent cache (MlaForm), equal up to fp32 rounding:
//   expanded:  K and V of every cached token from kv_b_proj(c), then ordinary attention (a fresh prompt: every
//              token is new anyway);
//   absorbed:  per head, kv_b_proj's key rows W_UK and value rows W_UV are folded into the query and the output,
//              q_lat = W_UK^T q_nope, score = q_lat . c + q_pe . k_pe, o = W_UV (sum_s p_s c_s), so a step reads
//              the 576-value latent of each cached token and never expands it (decode; what devices run).
// kAuto takes the expanded form for a sequence with nothing cached and the absorbed one once it has a cache (decode
// steps, later prefill chunks), as SGLang and vLLM split MLA between prefill and decode.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "layers/blocks.h"
#include "layers/linear.h"
#include "core/latent_fp8.h"
#include "layers/norms.h"
#include "layers/rope.h"

namespace tern {

struct LayerNorm {
  std::vector<float> weight, bias;
  float eps = 1e-6f;
  void forward(const float* x, int64_t rows, float* y) const;  // in place allowed
};

struct MlaIndexerWeights {
  Linear wq_b;          // [index_heads * index_head_dim, q_lora_rank]
  Linear wk;            // [index_head_dim, hidden]
  LayerNorm k_norm;
  Linear weights_proj;  // [index_heads, hidden]
};

struct MlaWeights {
  Linear q_a_proj, q_b_proj;  // with a query LoRA (q_lora_rank > 0)
  Linear q_proj;              // without one
  RmsNorm q_a_norm;
  Linear kv_a_proj;  // [kv_lora_rank + qk_rope_head_dim, hidden]
  RmsNorm kv_a_norm;
  Linear kv_b_proj;  // [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
  Linear o_proj;     // [hidden, heads * v_head_dim]
  std::optional<MlaIndexerWeights> indexer;  // a "full" DSA layer's own indexer
};

enum class MlaForm { kAuto, kExpanded, kAbsorbed };

struct MlaShape {
  int64_t n_heads = 0;  // this rank's
  int64_t q_lora_rank = 0, kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  float scale = 0.0f;                // softmax scale
  bool rope_interleaved = true;      // GPT-J pairs (x[2i], x[2i + 1]) on q_pe and k_pe
  // DSA: index_topk 0 means no indexer at all; a layer with index_topk > 0 and no indexer weights is "shared" and
  // reuses the selection of layer `selection_layer`.
  int64_t index_topk = 0, index_heads = 0, index_head_dim = 0;
  bool indexer_rope_interleaved = true;
  int64_t selection_layer = -1;
  MlaForm form = MlaForm::kAuto;
  // The latent cache's FP8 form (core/latent_fp8.h; kv_lora_rank a multiple of kLatentFp8Tile), when set: each new
  // token's latent is cached as the values its FP8 entry holds, and attention reads every token's latent, the new
  // ones' too, from the cache, so a prefill and the decode steps after it see the same keys. Unset: fp32 as computed.
  std::optional<LatentFp8Scales> latent_fp8;
};

class MlaAttention final : public Mixer {
 public:
  MlaAttention(MlaShape shape, MlaWeights weights, Rope rope)
      : s_(shape), w_(std::move(weights)), rope_(std::move(rope)) {}
  void forward(const float* x, float* y, const Batch& batch, int64_t layer, const Tracer* tracer) const override;
  Expected<std::unique_ptr<Block>> place(BlockOps& ops, const RmsNorm& norm) const override;

  const MlaShape& shape() const { return s_; }
  const MlaWeights& weights() const { return w_; }
  const Rope& rope() const { return rope_; }

 private:
  // The keys each row of one sequence attends to (ascending positions), from the indexer or the shared selection.
  std::vector<std::vector<int32_t>> select(const BatchSlice& seq, LayerCache& cache, const float* x,
                                           const float* cq) const;
  void rope(float* v, int64_t n_vectors, int64_t stride, int64_t position, bool interleaved) const;
  // One sequence's attention output [n_rows, heads * v_head_dim] over the keys `keys` of each row, from the latent
  // cache and the roped queries q [n_rows, heads, qk_head_dim], in either form.
  void attend_expanded(const BatchSlice& seq, const LayerCache& cache, const float* q,
                       const std::vector<std::vector<int32_t>>& keys, float* out) const;
  void attend_absorbed(const BatchSlice& seq, const LayerCache& cache, const float* q,
                       const std::vector<std::vector<int32_t>>& keys, float* out) const;

  MlaShape s_;
  MlaWeights w_;
  Rope rope_;  // over qk_rope_head_dim
};

}  // namespace tern
