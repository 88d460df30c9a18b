// What one forward step must move through memory and compute, from a loaded model's layers: the numbers `tern
// bench` divides by the measured step time.
//
//   decode bytes = every weight read once per step (all linears outside the routed experts, lm_head)
//                + per MoE layer, the experts the batch routes to: E * (1 - (1 - k/E)^B) expected distinct experts
//                  for B tokens with top-k routing spread evenly over E experts (what random dummy weights give)
//                + the KV cache each sequence reads (context x K and V rows of every attention layer)
//                + the Gated DeltaNet state of each sequence, read and written (fp32 state, bf16 conv window)
//   prefill FLOPs = 2 x active linear parameters per token x tokens (routed experts: top-k of them)
//                 + causal attention: 2 x 2 x heads x head_dim x tokens^2 / 2 per attention layer
// Weights count as the device stores them: BF16 2 bytes per element, NVFP4 half a byte plus one e4m3 scale per 16.
// The embedding table is not read as a matrix (only the batch's rows) and is left out of the bytes per step; it is in
// what a rank holds (weight_bytes). Norms, GDN's conv1d / A_log / dt_bias and NVFP4's scalar scales are left out of
// both (well under 0.1% of any model here).
//
// Tensor parallelism: counted from the blocks of one rank's slice (a TpRunner's model() is rank 0's), every number
// here is per rank: its heads, its columns of every expert, its vocabulary rows; a replicated tensor (KV heads when
// fewer than the ranks, routers, norms) counts whole on every rank. The collectives a step adds are computed from
// the same blocks (step_collectives), never measured.
#pragma once

#include <cstdint>
#include <optional>

#include "io/quant_config.h"
#include "models/causal_lm.h"
#include "models/weight_schema.h"

namespace tern {

struct StepTraffic {
  double dense_weight_bytes = 0;  // read whatever the batch size
  double expert_bytes = 0;        // one routed expert's gate, up and down (summed over MoE layers: per layer)
  int64_t moe_layers = 0, top_k = 0;
  int64_t n_experts = 0;       // routed experts this rank holds per MoE layer (a share of them: expert parallelism)
  int64_t router_experts = 0;  // routed experts the router chooses among
  double kv_bytes_per_token = 0;          // K and V of one position over all attention layers (bf16)
  double state_bytes_per_sequence = 0;    // Gated DeltaNet recurrent (fp32) + conv (bf16) state over all GDN layers
  double linear_flops_per_token = 0;      // 2 x active linear parameters
  double attention_flops_per_token2 = 0;  // causal attention FLOPs / tokens^2 (summed over attention layers)
  double embedding_bytes = 0;  // this rank's rows of the embedding table (0 more when lm_head is the same matrix)
  int64_t hidden = 0;          // the residual stream's width
  int64_t vocab = 0;           // the whole vocabulary (every rank's logits after the gather)
  int64_t summed_blocks = 0;   // blocks whose output is summed over the ranks: the embedding, every mixer and FFN
};

StepTraffic step_traffic_of(const CausalLm& model);

// What one rank holds: every linear (routed experts of every MoE layer included) and its embedding rows.
double weight_bytes(const StepTraffic& t);

// Memory one rank needs for `batch` sequences of `context` tokens: weights, KV cache and Gated DeltaNet state (no
// activations, workspaces, CUDA graphs or KV block rounding).
double rank_memory_bytes(const StepTraffic& t, int64_t batch, int64_t context);

// The collectives of one step of `tokens` tokens whose `logit_rows` rows want logits (decode: both the batch size),
// over `world` ranks, as the CUDA runner moves them (bf16): computed from the blocks, not measured. None at world 1.
struct StepCollectives {
  int64_t all_reduces = 0;        // one per summed block (2 per layer + the embedding)
  double all_reduce_bytes = 0;    // the buffer each sums: tokens x hidden x 2
  double all_gather_bytes = 0;    // the gathered logits: logit_rows x vocab_shard_rows(vocab, world) x world x 2
  double bytes_per_step() const { return static_cast<double>(all_reduces) * all_reduce_bytes + all_gather_bytes; }
};
StepCollectives step_collectives(const StepTraffic& t, int64_t world, int64_t tokens, int64_t logit_rows);

// What one rank holds by the weight schema's shard declarations alone (models/weight_schema.h), with the formats a
// dummy store gives (NVFP4 where `quant` does not exclude the module): for architectures tern has no blocks for yet
// (GLM-5), and as a second count of what step_traffic_of counts from the blocks. Errors name a tensor that cannot
// be split `rank.world` ways.
struct SchemaRankBytes {
  double linear_bytes = 0;              // every linear, routed experts included; lm_head unless tied
  double expert_bytes = 0;              // of which the routed experts
  double embedding_bytes = 0;           // this rank's rows of embed_tokens
  double cache_bytes_per_token = 0;     // the per-position caches (KV, MLA latent, DSA indexer keys), bf16
  double state_bytes_per_sequence = 0;  // Gated DeltaNet recurrent (fp32) and conv (bf16) states
  double weight_bytes() const { return linear_bytes + embedding_bytes; }
};
Expected<SchemaRankBytes> schema_rank_bytes(const WeightSchema& schema, const std::optional<QuantConfig>& quant,
                                            ShardRank rank);

// Expected distinct experts hit by `tokens` tokens choosing top_k of n_experts evenly.
double expected_distinct_experts(int64_t n_experts, int64_t top_k, int64_t tokens);
// Under expert parallelism (`ranks` holding n_experts / ranks consecutive experts each): the expected distinct
// experts the busiest rank holds of those the tokens hit, whose reads the step waits for. Uniform routing, drawn
// (kExpertDraws draws from a fixed seed, so the same arguments give the same value).
inline constexpr int kExpertDraws = 4096;
double expected_busiest_rank_experts(int64_t n_experts, int64_t ranks, int64_t top_k, int64_t tokens);

// Bytes one decode step of `batch` sequences at `context` cached tokens each must move on one rank (under expert
// parallelism the busiest rank's routed experts).
double decode_step_bytes(const StepTraffic& t, int64_t batch, double context);

// FLOPs of a prefill of `tokens` tokens in one sequence.
double prefill_flops(const StepTraffic& t, int64_t tokens);

}  // namespace tern
