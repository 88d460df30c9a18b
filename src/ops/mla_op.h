// The multi-head latent attention ops of the model path (GLM-5, DeepSeek-V3) in the registry, with bf16 activations.
// Both take a ragged batch as the attention op does: n_seqs sequences, sequence i holding past + 7 * i cached tokens
// before its query_len new ones (which the cache already holds); token rows in sequence order, row i of a sequence
// at position seq_past + i, attending (or scoring) the keys 0..that position.
//
//   mla_attention   dims {n_seqs, query_len, past, n_heads, kv_lora_rank, rope_dim, topk, qk_head_dim[, cache]}: the
//                   weight-absorbed attention over a latent cache (kernels/cuda/mla/mla_launch.h; the CPU layer's
//                   MlaAttention::attend_absorbed). Every cached token is one latent row [kv_lora_rank + rope_dim]
//                   (c | roped k_pe) shared by all heads; each row's head has an absorbed query of the same width
//                   (q_lat | roped q_pe). A row attends its causal keys when topk = 0, else the keys of its selection
//                   list (DSA): a random ascending subset of its causal keys of min(topk, keys) positions, then -1 up
//                   to topk. score_s = q . latent_s * scale with scale = qk_head_dim^-0.5 (the model's softmax scale
//                   without YaRN's mscale), p = softmax(score), output sum_s p_s c_s: [tokens, n_heads, kv_lora_rank].
//                   `cache` (MlaCacheCase, default bf16): with an FP8 one the cache holds each token as the entry of
//                   core/latent_fp8.h made from random fp32 values (tiles of magnitudes 1/64 to 40), and the keys
//                   are the values the entry holds (bf16-exact by that definition), which `latent` then lists.
//   indexer_select  dims {n_seqs, query_len, past, n_heads, head_dim, topk}: GLM-5's DSA lightning indexer's top-k
//                   (kernels/cuda/mla/indexer_launch.h; MlaAttention::select). Inputs: roped queries [tokens, n_heads,
//                   head_dim], weights_proj's output [tokens, n_heads] (mixed signs) and one key of head_dim values
//                   per cached token. I(t, s) = sum_h w_h * n_heads^-0.5 * relu(q_h . k_s * head_dim^-0.5); a row with
//                   n keys selects all of 0..n-1 when n <= topk, else the topk best with ties to the earlier key,
//                   listed ascending, then -1 up to topk. Every fourth key (positions 3, 7, 11, ...) repeats the key
//                   before it, so exact ties occur and the tie rule decides wherever such a pair straddles the k-th
//                   score.
//
// The harnesses draw fresh, non-zero, bf16-exact inputs from the seed; mla_attention's reference is computed in fp64
// from the formula. A selection is judged, not compared entry by entry (an fp32 score within rounding of the k-th one
// may legitimately fall either side of it), so indexer_select's output is one value per row, computed from an
// implementation's [tokens, topk] lists by indexer_select_output against the fp64 scores the harness computes with
// the inputs: the largest amount by which a key left out outscores a key chosen, relative to the row's score range
// (0 when the list is a true top-k); +inf for a list that breaks the format (an entry out of the row's causal range,
// duplicates or a list not ascending, a wrong -1 tail) or an exact tie given to the later key; never-written for a
// row whose list still holds the poison index. Its reference is all zeros. The CPU implementations ("cpu") compute in
// fp32 with straightforward loops, as layers/mla.cc does.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/error.h"
#include "ops/registry.h"

namespace tern {

inline constexpr int64_t kMlaCasePastStep = 7;  // sequence i holds past + 7 * i cached tokens

// The ragged batch both ops share.
struct MlaBatchShape {
  int64_t n_seqs = 0, query_len = 0, past = 0;

  int64_t tokens() const { return n_seqs * query_len; }
  int64_t seq_past(int64_t s) const { return past + kMlaCasePastStep * s; }
  int64_t seq_len(int64_t s) const { return seq_past(s) + query_len; }
  int64_t cache_begin(int64_t s) const;  // first cache row of sequence s
  int64_t row_keys(int64_t t) const;     // causal keys of token row t: its position + 1
};

// How an mla_attention case caches its latent: the values as bf16, or as FP8 entries with fp32 or power-of-two
// scales (core/latent_fp8.h).
enum class MlaCacheCase : int64_t { kBf16 = 0, kFp8 = 1, kFp8Pow2 = 2 };

struct MlaAttentionInputs : OpInputs {
  MlaBatchShape batch;
  int64_t n_heads = 0, kv_lora_rank = 0, rope_dim = 0, topk = 0;
  float scale = 1.0f;             // qk_head_dim^-0.5
  std::vector<uint16_t> q;        // [tokens, n_heads, width] bf16
  std::vector<uint16_t> latent;   // the sequences' caches one after another: [sum of seq_len, width] bf16
  std::vector<int32_t> selected;  // topk > 0: [tokens, topk] positions in the row's sequence, -1 tail
  MlaCacheCase cache = MlaCacheCase::kBf16;
  std::vector<uint8_t> latent_fp8;  // FP8: the entries, [sum of seq_len, latent_fp8_bytes]; `latent` their values

  int64_t width() const { return kv_lora_rank + rope_dim; }
  int64_t tokens() const { return batch.tokens(); }
};

// What implementations fill a selection with before a run: an entry still holding it was never written.
inline constexpr int32_t kIndexerSelectPoison = 0x7FBADBAD;

struct IndexerSelectInputs : OpInputs {
  MlaBatchShape batch;
  int64_t n_heads = 0, head_dim = 0, topk = 0;
  std::vector<uint16_t> q;        // [tokens, n_heads, head_dim] bf16, roped
  std::vector<uint16_t> weights;  // [tokens, n_heads] bf16, unscaled
  std::vector<uint16_t> keys;     // the sequences' key caches one after another: [sum of seq_len, head_dim] bf16
  // The fp64 scores I(t, s) of each row's keys (rows with more keys than topk; empty for the others), from the
  // harness: what indexer_select_output judges a selection by.
  std::vector<std::vector<double>> scores;

  int64_t tokens() const { return batch.tokens(); }
};

// A selection within this fraction of its rows' score range of a true top-k passes: the fp32 scores of a CPU or GPU
// implementation are within ~1e-6 of the range of the fp64 ones (bf16-exact inputs, fp32 sums over head_dim values
// and heads), and a wrong key, head, weight or relu moves the selection by a good part of the range.
inline constexpr Tolerance kIndexerSelectTolerance{.rel = 0.0, .abs = 1e-4};

// The op's output for an implementation's selection [tokens, topk] (the judge described above).
std::vector<float> indexer_select_output(const IndexerSelectInputs& inputs, std::span<const int32_t> selected);

// The CPU implementation's selection [tokens, topk] (fp32 scores, exact top-k with ties to the earlier key).
std::vector<int32_t> indexer_select_cpu(const IndexerSelectInputs& inputs);

// Adds the harnesses of "mla_attention" and "indexer_select" and their CPU implementations ("cpu").
Expected<void> mla_register_cpu(Registry& registry);

// Case builders (labels and dims in the layouts above).
SelfTestCase mla_attention_case(int64_t n_seqs, int64_t query_len, int64_t past, int64_t n_heads, int64_t kv_lora_rank,
                                int64_t rope_dim, int64_t topk, int64_t qk_head_dim,
                                MlaCacheCase cache = MlaCacheCase::kBf16);
SelfTestCase indexer_select_case(int64_t n_seqs, int64_t query_len, int64_t past, int64_t n_heads, int64_t head_dim,
                                 int64_t topk);

}  // namespace tern
