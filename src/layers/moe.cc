#include "layers/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "layers/norms.h"
#include "layers/block_ops.h"

namespace tern {
namespace {

struct Routing {
  std::vector<int32_t> expert;  // [rows, top_k]
  std::vector<float> weight;    // [rows, top_k]
};

// softmax over the router logits, top-k (ties to the lower index, as torch.topk), optional renormalisation.
Routing route(const std::vector<float>& logits, int64_t rows, int64_t n_experts, int64_t top_k, bool renormalize) {
  Routing r{std::vector<int32_t>(rows * top_k), std::vector<float>(rows * top_k)};
  std::vector<float> p(n_experts);
  std::vector<int32_t> order(n_experts);
  for (int64_t i = 0; i < rows; ++i) {
    const float* l = &logits[i * n_experts];
    const float mx = *std::max_element(l, l + n_experts);
    float sum = 0.0f;
    for (int64_t e = 0; e < n_experts; ++e) sum += (p[e] = std::exp(l[e] - mx));
    for (float& v : p) v /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float top_sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) top_sum += p[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      r.expert[i * top_k + j] = order[j];
      r.weight[i * top_k + j] = renormalize ? p[order[j]] / top_sum : p[order[j]];
    }
  }
  return r;
}

}  // namespace

void mlp_forward(const MlpWeights& w, const float* x, int64_t rows, float* y) {
  const int64_t inter = w.gate_proj.out_features();
  std::vector<float> gate(rows * inter), up(rows * inter);
  w.gate_proj.forward(x, rows, gate.data());
  w.up_proj.forward(x, rows, up.data());
  for (size_t i = 0; i < gate.size(); ++i) gate[i] = silu(gate[i]) * up[i];
  w.down_proj.forward(gate.data(), rows, y);
}

void Mlp::forward(const float* x, float* y, int64_t rows, const std::string&, const Tracer*) const {
  mlp_forward(w_, x, rows, y);
}

void Moe::forward(const float* x, float* y, int64_t rows, const std::string& trace_prefix,
                  const Tracer* tracer) const {
  const int64_t hidden = w_.router.in_features(), n_experts = w_.router.out_features();
  std::vector<float> logits(rows * n_experts);
  w_.router.forward(x, rows, logits.data());
  if (tracer) (*tracer)(trace_prefix + "router_logits", logits.data(), rows, n_experts);
  const Routing routing = route(logits, rows, n_experts, s_.top_k, s_.renormalize);

  std::fill(y, y + rows * hidden, 0.0f);
  // Experts in index order, each over the rows routed to it, so every row sums its experts in the same order
  // whatever else is in the batch.
  std::vector<float> xs, out;
  for (int64_t e = 0; e < n_experts; ++e) {
    std::vector<int64_t> hit_rows;
    std::vector<float> hit_weights;
    for (int64_t i = 0; i < rows * s_.top_k; ++i) {
      if (routing.expert[i] != e) continue;
      hit_rows.push_back(i / s_.top_k);
      hit_weights.push_back(routing.weight[i]);
    }
    if (hit_rows.empty()) continue;
    const int64_t n = static_cast<int64_t>(hit_rows.size());
    xs.resize(n * hidden);
    out.resize(n * hidden);
    for (int64_t j = 0; j < n; ++j) std::copy(x + hit_rows[j] * hidden, x + (hit_rows[j] + 1) * hidden, &xs[j * hidden]);
    mlp_forward(w_.experts[e], xs.data(), n, out.data());
    for (int64_t j = 0; j < n; ++j) {
      float* dst = y + hit_rows[j] * hidden;
      for (int64_t d = 0; d < hidden; ++d) dst[d] += out[j * hidden + d] * hit_weights[j];
    }
  }
  if (!w_.shared_expert) return;
  std::vector<float> shared(rows * hidden), gate(rows);
  w_.shared_expert->forward(x, shared.data(), rows, trace_prefix, nullptr);
  w_.shared_expert_gate.forward(x, rows, gate.data());
  for (int64_t i = 0; i < rows; ++i) {
    const float g = 1.0f / (1.0f + std::exp(-gate[i]));
    for (int64_t d = 0; d < hidden; ++d) y[i * hidden + d] += g * shared[i * hidden + d];
  }
}

Expected<std::unique_ptr<Block>> Mlp::place(BlockOps& ops, const RmsNorm& norm) const {
  return ops.mlp(norm, *this);
}

Expected<std::unique_ptr<Block>> Moe::place(BlockOps& ops, const RmsNorm& norm) const {
  return ops.moe(norm, *this);
}

std::vector<const Linear*> Mlp::input_projections() const { return {&w_.gate_proj, &w_.up_proj}; }

std::vector<const Linear*> Moe::input_projections() const {
  if (!w_.shared_expert) return {&w_.router};
  const MlpWeights& s = w_.shared_expert->weights();
  return {&s.gate_proj, &s.up_proj, &w_.router, &w_.shared_expert_gate};
}

}  // namespace tern
