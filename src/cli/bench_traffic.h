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
// The embedding table is not read as a matrix (only the batch's rows) and is left out.
#pragma once

#include <cstdint>

#include "models/causal_lm.h"

namespace tern {

struct StepTraffic {
  double dense_weight_bytes = 0;  // read whatever the batch size
  double expert_bytes = 0;        // one routed expert's gate, up and down (summed over MoE layers: per layer)
  int64_t moe_layers = 0, n_experts = 0, top_k = 0;
  double kv_bytes_per_token = 0;          // K and V of one position over all attention layers
  double state_bytes_per_sequence = 0;    // Gated DeltaNet recurrent + conv state over all GDN layers
  double linear_flops_per_token = 0;      // 2 x active linear parameters
  double attention_flops_per_token2 = 0;  // causal attention FLOPs / tokens^2 (summed over attention layers)
};

StepTraffic step_traffic_of(const CausalLm& model);

// Expected distinct experts hit by `tokens` tokens choosing top_k of n_experts evenly.
double expected_distinct_experts(int64_t n_experts, int64_t top_k, int64_t tokens);

// Bytes one decode step of `batch` sequences at `context` cached tokens each must move.
double decode_step_bytes(const StepTraffic& t, int64_t batch, double context);

// FLOPs of a prefill of `tokens` tokens in one sequence.
double prefill_flops(const StepTraffic& t, int64_t tokens);

}  // namespace tern
