#include "cli/bench_traffic.h"

#include <cmath>
#include <initializer_list>

#include "layers/attention.h"
#include "layers/gated_deltanet.h"
#include "layers/moe.h"

namespace tern {
namespace {

double matrix_bytes(const Linear& l) {
  const CpuMatrix& m = l.matrix();
  const double elements = static_cast<double>(m.rows) * static_cast<double>(m.cols);
  return m.format == CpuWeightFormat::kNvfp4 ? elements / 2 + elements / 16 : elements * 2;
}

double matrix_params(const Linear& l) {
  return static_cast<double>(l.out_features()) * static_cast<double>(l.in_features());
}

// Bytes and parameters of the linears given, summed.
void add_linears(std::initializer_list<const Linear*> linears, double& bytes, double& params) {
  for (const Linear* l : linears) {
    bytes += matrix_bytes(*l);
    params += matrix_params(*l);
  }
}

void add_mlp(const MlpWeights& w, double& bytes, double& params) {
  add_linears({&w.gate_proj, &w.up_proj, &w.down_proj}, bytes, params);
}

}  // namespace

StepTraffic step_traffic_of(const CausalLm& model) {
  StepTraffic t;
  double dense_params = 0, expert_params = 0;
  add_linears({&model.lm_head}, t.dense_weight_bytes, dense_params);
  for (const DecoderLayer& layer : model.layers) {
    if (const auto* a = dynamic_cast<const Attention*>(layer.mixer.get())) {
      const AttentionWeights& w = a->weights();
      add_linears({&w.q_proj, &w.k_proj, &w.v_proj, &w.o_proj}, t.dense_weight_bytes, dense_params);
      const AttentionShape& s = a->shape();
      t.kv_bytes_per_token += 2.0 * static_cast<double>(s.n_kv_heads * s.head_dim) * 2;
      t.attention_flops_per_token2 += 2.0 * static_cast<double>(s.n_heads * s.head_dim);
    } else if (const auto* g = dynamic_cast<const GatedDeltaNet*>(layer.mixer.get())) {
      const GatedDeltaNetWeights& w = g->weights();
      add_linears(
          {&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a, &w.in_proj_qkvz, &w.in_proj_ba, &w.out_proj},
          t.dense_weight_bytes, dense_params);
      const GatedDeltaNetShape& s = g->shape();
      const double state = static_cast<double>(s.n_value_heads * s.key_dim * s.value_dim) * 4;
      const double conv =
          static_cast<double>((2 * s.n_key_heads * s.key_dim + s.n_value_heads * s.value_dim) * (s.conv_kernel - 1)) *
          2;
      t.state_bytes_per_sequence += 2 * (state + conv);  // read and written back
    }
    if (const auto* m = dynamic_cast<const Mlp*>(layer.ffn.get())) {
      add_mlp(m->weights(), t.dense_weight_bytes, dense_params);
    } else if (const auto* m = dynamic_cast<const Moe*>(layer.ffn.get())) {
      const MoeWeights& w = m->weights();
      add_linears({&w.router}, t.dense_weight_bytes, dense_params);
      if (w.shared_expert) {
        add_mlp(w.shared_expert->weights(), t.dense_weight_bytes, dense_params);
        add_linears({&w.shared_expert_gate}, t.dense_weight_bytes, dense_params);
      }
      if (!w.experts.empty()) {
        double bytes = 0, params = 0;
        add_mlp(w.experts.front(), bytes, params);
        t.expert_bytes = bytes;
        expert_params += params * static_cast<double>(m->shape().top_k);
        t.n_experts = static_cast<int64_t>(w.experts.size());
        t.top_k = m->shape().top_k;
        ++t.moe_layers;
      }
    }
  }
  t.linear_flops_per_token = 2 * (dense_params + expert_params);
  return t;
}

double expected_distinct_experts(int64_t n_experts, int64_t top_k, int64_t tokens) {
  if (n_experts <= 0) return 0;
  const double e = static_cast<double>(n_experts);
  return e * (1.0 - std::pow(1.0 - static_cast<double>(top_k) / e, static_cast<double>(tokens)));
}

double decode_step_bytes(const StepTraffic& t, int64_t batch, double context) {
  const double experts = expected_distinct_experts(t.n_experts, t.top_k, batch);
  return t.dense_weight_bytes + static_cast<double>(t.moe_layers) * experts * t.expert_bytes +
         static_cast<double>(batch) * (context * t.kv_bytes_per_token + t.state_bytes_per_sequence);
}

double prefill_flops(const StepTraffic& t, int64_t tokens) {
  const double n = static_cast<double>(tokens);
  return t.linear_flops_per_token * n + t.attention_flops_per_token2 * n * n;
}

}  // namespace tern
