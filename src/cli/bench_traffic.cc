#include "cli/bench_traffic.h"

#include <cmath>
#include <initializer_list>

#include "layers/attention.h"
#include "layers/block_ops.h"
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

// Counts what each block moves and computes per token, placed as a device would place it (no blocks made).
class TrafficCounter final : public BlockOps {
 public:
  Expected<std::unique_ptr<Block>> embedding(const CpuMatrix&, VocabRange) override { return nullptr; }  // one row per token
  Expected<std::unique_ptr<Block>> attention(const RmsNorm&, const Attention& a) override {
    const AttentionWeights& w = a.weights();
    add_linears({&w.q_proj, &w.k_proj, &w.v_proj, &w.o_proj}, t_.dense_weight_bytes, dense_params_);
    const AttentionShape& s = a.shape();
    t_.kv_bytes_per_token += 2.0 * static_cast<double>(s.n_kv_heads * s.head_dim) * 2;
    t_.attention_flops_per_token2 += 2.0 * static_cast<double>(s.n_heads * s.head_dim);
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> gated_deltanet(const RmsNorm&, const GatedDeltaNet& g) override {
    const GatedDeltaNetWeights& w = g.weights();
    add_linears({&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a, &w.in_proj_qkvz, &w.in_proj_ba, &w.out_proj},
                t_.dense_weight_bytes, dense_params_);
    const GatedDeltaNetShape& s = g.shape();
    const double state = static_cast<double>(s.n_value_heads * s.key_dim * s.value_dim) * 4;
    const double conv =
        static_cast<double>((2 * s.n_key_heads * s.key_dim + s.n_value_heads * s.value_dim) * (s.conv_kernel - 1)) * 2;
    t_.state_bytes_per_sequence += 2 * (state + conv);  // read and written back
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> mlp(const RmsNorm&, const Mlp& m) override {
    add_mlp(m.weights(), t_.dense_weight_bytes, dense_params_);
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> moe(const RmsNorm&, const Moe& m) override {
    const MoeWeights& w = m.weights();
    add_linears({&w.router}, t_.dense_weight_bytes, dense_params_);
    if (w.shared_expert) {
      add_mlp(w.shared_expert->weights(), t_.dense_weight_bytes, dense_params_);
      add_linears({&w.shared_expert_gate}, t_.dense_weight_bytes, dense_params_);
    }
    if (!w.experts.empty()) {
      double bytes = 0, params = 0;
      add_mlp(w.experts.front(), bytes, params);
      t_.expert_bytes = bytes;
      expert_params_ += params * static_cast<double>(m.shape().top_k);
      t_.n_experts = static_cast<int64_t>(w.experts.size());
      t_.top_k = m.shape().top_k;
      ++t_.moe_layers;
    }
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> lm_head(const RmsNorm&, const Linear& head, VocabRange) override {
    add_linears({&head}, t_.dense_weight_bytes, dense_params_);
    return nullptr;
  }
  Expected<void> trace_output(std::string_view) override { return {}; }

  StepTraffic finish() {
    t_.linear_flops_per_token = 2 * (dense_params_ + expert_params_);
    return t_;
  }

 private:
  StepTraffic t_;
  double dense_params_ = 0, expert_params_ = 0;
};

}  // namespace

StepTraffic step_traffic_of(const CausalLm& model) {
  TrafficCounter counter;
  (void)model.visit_blocks(counter);  // the counter's placements never fail
  return counter.finish();
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
