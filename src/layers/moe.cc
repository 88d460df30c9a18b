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

// DeepSeek-V3 / GLM-5 (noaux_tc): sigmoid scores; selection on score + bias within the best topk_group groups (a
// group's worth: the sum of its two best biased scores); weights the unbiased scores, renormalised (+ 1e-20),
// times routed_scaling. Ties to the lower index.
Routing route_sigmoid(const std::vector<float>& logits, int64_t rows, int64_t n_experts, const MoeShape& s,
                      const std::vector<float>& bias) {
  const int64_t top_k = s.top_k, per_group = n_experts / s.n_group;
  Routing r{std::vector<int32_t>(rows * top_k), std::vector<float>(rows * top_k)};
  std::vector<float> score(n_experts), choice(n_experts), group_worth(s.n_group);
  std::vector<int32_t> order(n_experts), groups(s.n_group);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t e = 0; e < n_experts; ++e) {
      score[e] = 1.0f / (1.0f + std::exp(-logits[i * n_experts + e]));
      choice[e] = score[e] + (bias.empty() ? 0.0f : bias[e]);
    }
    for (int64_t g = 0; g < s.n_group; ++g) {
      std::vector<float> members(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
      std::partial_sort(members.begin(), members.begin() + std::min<int64_t>(2, per_group), members.end(),
                        std::greater<>());
      group_worth[g] = members[0] + (per_group > 1 ? members[1] : 0.0f);
    }
    std::iota(groups.begin(), groups.end(), 0);
    std::partial_sort(groups.begin(), groups.begin() + s.topk_group, groups.end(), [&](int32_t a, int32_t b) {
      return group_worth[a] > group_worth[b] || (group_worth[a] == group_worth[b] && a < b);
    });
    std::vector<bool> kept(s.n_group, false);
    for (int64_t g = 0; g < s.topk_group; ++g) kept[groups[g]] = true;
    for (int64_t e = 0; e < n_experts; ++e) {
      if (!kept[e / per_group]) choice[e] = -INFINITY;
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int32_t a, int32_t b) {
      return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
    });
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) sum += score[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      const float w = s.renormalize ? score[order[j]] / (sum + 1e-20f) : score[order[j]];
      r.expert[i * top_k + j] = order[j];
      r.weight[i * top_k + j] = w * s.routed_scaling;
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
  const Routing routing = s_.sigmoid ? route_sigmoid(logits, rows, n_experts, s_, w_.correction_bias)
                                     : route(logits, rows, n_experts, s_.top_k, s_.renormalize);

  std::fill(y, y + rows * hidden, 0.0f);
  // This rank's experts in index order, each over the rows routed to it, so every row sums its experts in the same
  // order whatever else is in the batch.
  std::vector<float> xs, out;
  for (int64_t local = 0; local < static_cast<int64_t>(w_.experts.size()); ++local) {
    const int64_t e = w_.first_expert + local;
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
    mlp_forward(w_.experts[local], xs.data(), n, out.data());
    for (int64_t j = 0; j < n; ++j) {
      float* dst = y + hit_rows[j] * hidden;
      for (int64_t d = 0; d < hidden; ++d) dst[d] += out[j * hidden + d] * hit_weights[j];
    }
  }
  if (!w_.shared_expert) return;
  std::vector<float> shared(rows * hidden), gate(rows, 0.0f);
  w_.shared_expert->forward(x, shared.data(), rows, trace_prefix, nullptr);
  if (s_.shared_gate) w_.shared_expert_gate.forward(x, rows, gate.data());
  for (int64_t i = 0; i < rows; ++i) {
    const float g = s_.shared_gate ? 1.0f / (1.0f + std::exp(-gate[i])) : 1.0f;
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
  if (!s_.shared_gate) return {&w_.shared_expert->weights().gate_proj, &w_.shared_expert->weights().up_proj, &w_.router};
  const MlpWeights& s = w_.shared_expert->weights();
  return {&s.gate_proj, &s.up_proj, &w_.router, &w_.shared_expert_gate};
}

}  // namespace tern
