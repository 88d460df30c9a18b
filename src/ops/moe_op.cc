#include "ops/moe_op.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/formats.h"
#include "core/nvfp4.h"
#include "ops/harness_util.h"

namespace tern {
namespace {

constexpr uint16_t kBf16Nan = 0x7FC0;
constexpr uint8_t kE4m3Nan = 0x7F;
constexpr int64_t kFp8Block = 128;  // rows and columns of a block-wise FP8 scale block (docs/model-specs.md §1.7)
constexpr float kSigmoidRoutedScaling = 2.5f;  // DeepSeek-V3's and GLM-5's routed_scaling_factor
// Two fp64 choice values or group worths closer than this (relative to the larger, at least 1: a score is in
// (0, 1)) may be ordered either way by an fp32 implementation.
constexpr double kNearTie = 1e-5;
constexpr int kTieRedraws = 64;

int64_t fp8_scale_cols(int64_t cols) { return (cols + kFp8Block - 1) / kFp8Block; }

// scale * uniform(-1, 1), nudged away from zero, rounded to bf16 (ops/harness_util.h); as floats.
std::vector<float> random_values(uint64_t seed, uint64_t stream, int64_t n, float scale) {
  std::vector<float> out(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(hashed_bf16_uncentred(seed, stream, i, scale));
  return out;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]);
  return out;
}

// Block-wise FP8 as DeepSeek-V3's checkpoints are made, of one checkpoint tensor: rows [row0, row0 + rows) of
// w [*, cols], per 128 x 128 block scale = amax / 448 and code = e4m3(w / scale), into the same rows of codes
// [*, cols] and of row_scales [*, ceil(cols / 128)], the scales kept per row (CpuMatrix's and the device's layout).
void fp8_quantize_rows(const std::vector<float>& w, int64_t row0, int64_t rows, int64_t cols, uint8_t* codes,
                       float* row_scales) {
  const int64_t scale_cols = fp8_scale_cols(cols);
  for (int64_t br = row0; br < row0 + rows; br += kFp8Block) {
    const int64_t r_end = std::min(row0 + rows, br + kFp8Block);
    for (int64_t bc = 0; bc < cols; bc += kFp8Block) {
      const int64_t c_end = std::min(cols, bc + kFp8Block);
      float amax = 0.0f;
      for (int64_t r = br; r < r_end; ++r) {
        for (int64_t c = bc; c < c_end; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
      }
      const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
      for (int64_t r = br; r < r_end; ++r) {
        row_scales[r * scale_cols + bc / kFp8Block] = scale;
        for (int64_t c = bc; c < c_end; ++c) codes[r * cols + c] = float_to_e4m3(w[r * cols + c] / scale);
      }
    }
  }
}

// One projection of every expert ([E][rows][cols]) into the inputs' bf16, NVFP4 or FP8 vectors. Experts the routing
// selects get random weights (stream `stream`, scale `scale`); every other expert is NaN (bf16 NaN, NaN e4m3 block
// scales or NaN FP8 row scales), so an implementation that reads an expert it was not routed to cannot pass, and a
// real-size case (hundreds of experts) costs only the experts a few tokens reach. FP8 quantizes each expert's rows
// as checkpoint tensors of tensor_rows rows (gate and up apart).
void store_experts(const MoeInputs& in, const std::vector<bool>& used, uint64_t seed, uint64_t stream, float scale,
                   int64_t rows, int64_t cols, int64_t tensor_rows, std::vector<uint16_t>& bf16,
                   std::vector<uint8_t>& packed, std::vector<uint8_t>& scales, std::vector<float>& global,
                   std::vector<float>& row_scales) {
  const int64_t per_expert = rows * cols, scale_cols = fp8_scale_cols(cols);
  if (in.nvfp4) {
    packed.assign(static_cast<size_t>(in.n_experts * per_expert / 2), 0);
    scales.assign(static_cast<size_t>(in.n_experts * per_expert / kNvfp4BlockSize), kE4m3Nan);
    global.assign(static_cast<size_t>(in.n_experts), 1.0f);
  } else if (in.fp8) {
    packed.assign(static_cast<size_t>(in.n_experts * per_expert), 0);
    row_scales.assign(static_cast<size_t>(in.n_experts * rows * scale_cols), std::numeric_limits<float>::quiet_NaN());
  } else {
    bf16.assign(static_cast<size_t>(in.n_experts * per_expert), kBf16Nan);
  }
  for (int64_t e = 0; e < in.n_experts; ++e) {
    if (!used[e]) continue;
    const std::vector<float> w = random_values(seed ^ static_cast<uint64_t>(e) << 20, stream, per_expert, scale);
    if (in.fp8) {
      for (int64_t r0 = 0; r0 < rows; r0 += tensor_rows) {
        fp8_quantize_rows(w, r0, std::min(tensor_rows, rows - r0), cols, &packed[e * per_expert],
                          &row_scales[e * rows * scale_cols]);
      }
      continue;
    }
    if (!in.nvfp4) {
      for (int64_t i = 0; i < per_expert; ++i) bf16[e * per_expert + i] = float_to_bf16(w[i]);
      continue;
    }
    const Nvfp4Matrix q = nvfp4_quantize_weight(w, rows, cols);
    std::copy(q.packed.begin(), q.packed.end(), packed.begin() + e * per_expert / 2);
    std::copy(q.block_scales.begin(), q.block_scales.end(), scales.begin() + e * per_expert / kNvfp4BlockSize);
    global[e] = q.global_scale;
  }
}

// Token t's router logits in fp64: [n_experts + 1], the last the shared expert gate's.
std::vector<double> token_logits(const MoeInputs& in, int64_t t) {
  const int64_t h = in.hidden;
  std::vector<double> logits(static_cast<size_t>(in.n_experts + 1), 0.0);
  for (int64_t e = 0; e <= in.n_experts; ++e) {
    for (int64_t j = 0; j < h; ++j) logits[e] += bf16_to_float(in.x[t * h + j]) * bf16_to_float(in.router[e * h + j]);
  }
  return logits;
}

// One token's routing in fp64: its top_k experts in selection order with their weights. near_tie (sigmoid router
// only): a choice at the edge of the selection (the last kept group against the first dropped one, the k-th expert
// against the next) is within kNearTie of its neighbour, but not equal (an exact tie comes from equal inputs, which
// every implementation resolves alike).
struct TokenRouting {
  std::vector<int32_t> experts;
  std::vector<double> weights;
  bool near_tie = false;
};

bool near_tie(double a, double b) {
  const double d = std::fabs(a - b);
  return d > 0.0 && d <= kNearTie * std::max({1.0, std::fabs(a), std::fabs(b)});
}

// Softmax top-k (ties to the lower index), renormalised.
TokenRouting route_softmax(const MoeInputs& in, const std::vector<double>& logits) {
  const int64_t n_e = in.n_experts, k = in.top_k;
  const double mx = *std::max_element(logits.begin(), logits.begin() + n_e);
  std::vector<double> p(static_cast<size_t>(n_e));
  for (int64_t e = 0; e < n_e; ++e) p[e] = std::exp(logits[e] - mx);
  std::vector<int32_t> order(static_cast<size_t>(n_e));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });  // ties: lower
  double top_sum = 0.0;
  for (int64_t j = 0; j < k; ++j) top_sum += p[order[j]];
  TokenRouting r;
  for (int64_t j = 0; j < k; ++j) {
    r.experts.push_back(order[j]);
    r.weights.push_back(p[order[j]] / top_sum);
  }
  return r;
}

// layers/moe.cc's route_sigmoid: score = sigmoid(logit), choice = score + bias; the topk_group groups of the best
// two-choice sums, then top-k by choice among their experts (ties to the lower index); weights the renormalised
// scores times routed_scaling.
TokenRouting route_sigmoid(const MoeInputs& in, const std::vector<double>& logits) {
  const int64_t n_e = in.n_experts, k = in.top_k, per_group = n_e / in.n_group;
  std::vector<double> score(static_cast<size_t>(n_e)), choice(static_cast<size_t>(n_e));
  for (int64_t e = 0; e < n_e; ++e) {
    score[e] = 1.0 / (1.0 + std::exp(-logits[e]));
    choice[e] = score[e] + (in.correction_bias.empty() ? 0.0 : double(in.correction_bias[e]));
  }
  std::vector<double> worth(static_cast<size_t>(in.n_group));
  for (int64_t g = 0; g < in.n_group; ++g) {
    std::vector<double> members(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
    std::sort(members.begin(), members.end(), std::greater<>());
    worth[g] = members[0] + (per_group > 1 ? members[1] : 0.0);
  }
  std::vector<int32_t> groups(static_cast<size_t>(in.n_group));
  std::iota(groups.begin(), groups.end(), 0);
  std::stable_sort(groups.begin(), groups.end(), [&](int32_t a, int32_t b) { return worth[a] > worth[b]; });
  TokenRouting r;
  r.near_tie = in.topk_group < in.n_group && near_tie(worth[groups[in.topk_group - 1]], worth[groups[in.topk_group]]);
  std::vector<int32_t> candidates;
  for (int64_t e = 0; e < n_e; ++e) {
    if (std::find(groups.begin(), groups.begin() + in.topk_group, e / per_group) != groups.begin() + in.topk_group) {
      candidates.push_back(static_cast<int32_t>(e));
    }
  }
  std::stable_sort(candidates.begin(), candidates.end(), [&](int32_t a, int32_t b) { return choice[a] > choice[b]; });
  if (static_cast<int64_t>(candidates.size()) > k) {
    r.near_tie = r.near_tie || near_tie(choice[candidates[k - 1]], choice[candidates[k]]);
  }
  double sum = 0.0;
  for (int64_t j = 0; j < k; ++j) sum += score[candidates[j]];
  for (int64_t j = 0; j < k; ++j) {
    r.experts.push_back(candidates[j]);
    r.weights.push_back(score[candidates[j]] / sum * in.routed_scaling);
  }
  return r;
}

TokenRouting route_token(const MoeInputs& in, const std::vector<double>& logits) {
  return in.sigmoid ? route_sigmoid(in, logits) : route_softmax(in, logits);
}

// The experts the implementation holds that the tokens route to, as the reference routes them (the one-hot router
// makes every logit exact in bf16, so an implementation selects the same experts).
std::vector<bool> routed_experts(const MoeInputs& in) {
  std::vector<bool> used(static_cast<size_t>(in.n_experts), false);
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int32_t e : route_token(in, token_logits(in, t)).experts) used[e] = in.holds(e);
  }
  return used;
}

// Sigmoid router: every token whose selection has a near-tie gets a fresh x row (from further streams of the seed),
// until none has one.
Expected<void> redraw_near_ties(MoeInputs& in, uint64_t seed) {
  const int64_t h = in.hidden;
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int attempt = 0; route_token(in, token_logits(in, t)).near_tie; ++attempt) {
      if (attempt == kTieRedraws) return make_error("moe: no input without a near-tie in the routing of token {}", t);
      for (int64_t j = 0; j < h; ++j) {
        in.x[t * h + j] = hashed_bf16_uncentred(seed, 16 + static_cast<uint64_t>(attempt), t * h + j, 2.0f);
      }
    }
  }
  return {};
}

// One-hot rows with 2^{-1, 0, 1} at a random column; the last expert copies expert 1 (an exact tie).
std::vector<uint16_t> make_router(uint64_t seed, int64_t n_experts, int64_t hidden) {
  std::vector<uint16_t> r(static_cast<size_t>((n_experts + 1) * hidden), float_to_bf16(0.0f));
  for (int64_t e = 0; e <= n_experts; ++e) {
    const uint64_t z = hash_bits(seed, 9, e);
    r[e * hidden + static_cast<int64_t>(z % static_cast<uint64_t>(hidden))] =
        float_to_bf16(std::ldexp(1.0f, static_cast<int>((z >> 32) % 3) - 1));
  }
  if (n_experts > 2) std::copy_n(&r[1 * hidden], hidden, &r[(n_experts - 1) * hidden]);
  return r;
}

Expected<std::unique_ptr<OpInputs>> moe_make(const SelfTestCase& c, uint64_t seed) {
  const char* layout =
      "{tokens, hidden, inter, n_experts, top_k, format, shared}, optionally + {sigmoid, n_group, topk_group, bias}, "
      "then optionally + {expert_begin, local_experts}";
  if (c.dims.size() != 7 && c.dims.size() != 11 && c.dims.size() != 13) {
    return make_error("moe case '{}' needs dims {}", c.label, layout);
  }
  std::vector<int64_t> d = c.dims;
  if (d.size() == 7) d.insert(d.end(), {0, 1, 1, 0});
  if (d.size() == 11) d.insert(d.end(), {0, d[3]});
  if (d[11] < 0 || d[12] < 1 || d[11] + d[12] > d[3]) {
    return make_error("moe case '{}': experts [{}, {}) are not a range of the {} experts", c.label, d[11],
                      d[11] + d[12], d[3]);
  }
  if (d[0] < 0 || d[1] < 16 || d[1] % 16 || d[2] < 16 || d[2] % 16 || d[3] < 1 || d[4] < 1 || d[4] > d[3] ||
      d[5] < 0 || d[5] > 2 || d[6] < 0 || d[6] > 2) {
    return make_error("moe case '{}': bad dims (hidden and inter multiples of 16, 1 <= top_k <= n_experts)", c.label);
  }
  const bool sigmoid = d[7] == 1;
  const bool groups_ok = d[8] >= 1 && d[3] % d[8] == 0 && d[9] >= 1 && d[9] <= d[8] && d[4] <= d[9] * (d[3] / d[8]);
  if (d[7] < 0 || d[7] > 1 || d[10] < 0 || d[10] > 1 || !groups_ok ||
      (!sigmoid && (d[8] != 1 || d[9] != 1 || d[10] != 0))) {
    return make_error("moe case '{}': bad routing dims (sigmoid 0 or 1; n_group dividing n_experts, topk_group in "
                      "[1, n_group] keeping at least top_k experts; bias 0 or 1; softmax takes 1, 1, 0)",
                      c.label);
  }
  auto in = std::make_unique<MoeInputs>();
  in->tokens = d[0], in->hidden = d[1], in->inter = d[2], in->n_experts = d[3], in->top_k = d[4];
  in->nvfp4 = d[5] == 1, in->fp8 = d[5] == 2, in->shared = d[6] != 0, in->shared_gate = d[6] != 2;
  in->sigmoid = sigmoid, in->n_group = d[8], in->topk_group = d[9];
  in->routed_scaling = sigmoid ? kSigmoidRoutedScaling : 1.0f;
  in->expert_begin = d[11], in->local_experts = d[12];
  const int64_t h = in->hidden, i = in->inter, e = in->n_experts;
  if (d[10] == 1) {
    // Biases of about the scores' spread move experts across the selection's edge; expert 1's is repeated with its
    // router row (make_router), so the exact tie stays one.
    in->correction_bias = random_values(seed, 6, e, 0.25f);
    if (e > 2) in->correction_bias[e - 1] = in->correction_bias[1];
  }
  in->x = to_bf16(random_values(seed, 1, in->tokens * h, 2.0f));
  in->router = make_router(seed, e, h);
  if (in->sigmoid) TERN_TRY(redraw_near_ties(*in, seed));
  // Uniform weights of variance 1 / fan-in keep every intermediate O(1).
  const float gu_scale = std::sqrt(3.0f / static_cast<float>(h)), down_scale = std::sqrt(3.0f / static_cast<float>(i));
  const std::vector<bool> used = routed_experts(*in);
  store_experts(*in, used, seed, 2, gu_scale, 2 * i, h, i, in->gate_up_bf16, in->gate_up_packed,
                in->gate_up_scales, in->gate_up_global, in->gate_up_row_scales);
  store_experts(*in, used, seed, 3, down_scale, h, i, h, in->down_bf16, in->down_packed, in->down_scales,
                in->down_global, in->down_row_scales);
  if (in->shared) {
    in->shared_gate_up = to_bf16(random_values(seed, 4, 2 * i * h, gu_scale));
    in->shared_down = to_bf16(random_values(seed, 5, h * i, down_scale));
  }
  return in;
}

// Row `row` of projection [E][rows][cols] of expert e, as floats (NVFP4 dequantized as core/nvfp4 does, FP8 as
// e4m3 * scale).
void expert_row(const MoeInputs& in, bool gate_up, int64_t e, int64_t row, float* out) {
  const int64_t rows = gate_up ? 2 * in.inter : in.hidden, cols = gate_up ? in.hidden : in.inter;
  const int64_t r = e * rows + row;
  if (in.fp8) {
    const uint8_t* codes = &(gate_up ? in.gate_up_packed : in.down_packed)[r * cols];
    const float* scales = &(gate_up ? in.gate_up_row_scales : in.down_row_scales)[r * fp8_scale_cols(cols)];
    for (int64_t k = 0; k < cols; ++k) out[k] = e4m3_to_float(codes[k]) * scales[k / kFp8Block];
    return;
  }
  if (!in.nvfp4) {
    const std::vector<uint16_t>& w = gate_up ? in.gate_up_bf16 : in.down_bf16;
    for (int64_t k = 0; k < cols; ++k) out[k] = bf16_to_float(w[r * cols + k]);
    return;
  }
  const std::vector<uint8_t>& packed = gate_up ? in.gate_up_packed : in.down_packed;
  const std::vector<uint8_t>& scales = gate_up ? in.gate_up_scales : in.down_scales;
  const float global = (gate_up ? in.gate_up_global : in.down_global)[e];
  nvfp4_dequantize_row(&packed[r * cols / 2], &scales[r * cols / kNvfp4BlockSize], global, cols, out);
}

// fp64 SwiGLU: out[hidden] = down . (silu(gate . x) * (up . x)), weights [2I, H] (gate rows first) and [H, I].
void swiglu_f64(const std::vector<double>& x, const float* gate_up, const float* down, int64_t hidden, int64_t inter,
                std::vector<double>& out) {
  std::vector<double> act(static_cast<size_t>(inter));
  for (int64_t i = 0; i < inter; ++i) {
    double g = 0.0, u = 0.0;
    for (int64_t k = 0; k < hidden; ++k) {
      g += x[k] * gate_up[i * hidden + k];
      u += x[k] * gate_up[(inter + i) * hidden + k];
    }
    act[i] = g / (1.0 + std::exp(-g)) * u;
  }
  for (int64_t d = 0; d < hidden; ++d) {
    double s = 0.0;
    for (int64_t i = 0; i < inter; ++i) s += act[i] * down[d * inter + i];
    out[d] = s;
  }
}

std::vector<float> moe_reference(const OpInputs& base) {
  const auto& in = static_cast<const MoeInputs&>(base);
  const int64_t h = in.hidden, inter = in.inter, n_e = in.n_experts, k = in.top_k;
  // Every routed expert dequantized once, packed by its slot: [slots][2I][H] and [slots][H][I] (the others are
  // never read).
  const std::vector<bool> used = routed_experts(in);
  std::vector<int64_t> slot(static_cast<size_t>(n_e), -1), expert_of;
  for (int64_t e = 0; e < n_e; ++e) {
    if (used[e]) {
      slot[e] = static_cast<int64_t>(expert_of.size());
      expert_of.push_back(e);
    }
  }
  const auto n_used = static_cast<int64_t>(expert_of.size());
  std::vector<float> gate_up(static_cast<size_t>(n_used * 2 * inter * h)), down(static_cast<size_t>(n_used * h * inter));
#pragma omp parallel for schedule(static)
  for (int64_t u = 0; u < n_used; ++u) {
    for (int64_t r = 0; r < 2 * inter; ++r) expert_row(in, true, expert_of[u], r, &gate_up[(u * 2 * inter + r) * h]);
    for (int64_t r = 0; r < h; ++r) expert_row(in, false, expert_of[u], r, &down[(u * h + r) * inter]);
  }
  std::vector<float> shared_gu(in.shared_gate_up.size()), shared_down(in.shared_down.size());
  for (size_t i = 0; i < shared_gu.size(); ++i) shared_gu[i] = bf16_to_float(in.shared_gate_up[i]);
  for (size_t i = 0; i < shared_down.size(); ++i) shared_down[i] = bf16_to_float(in.shared_down[i]);
  std::vector<float> y(static_cast<size_t>(in.tokens * h));
#pragma omp parallel for schedule(dynamic)
  for (int64_t t = 0; t < in.tokens; ++t) {
    std::vector<double> x(static_cast<size_t>(h)), out(static_cast<size_t>(h));
    std::vector<double> acc(static_cast<size_t>(h), 0.0);
    for (int64_t j = 0; j < h; ++j) x[j] = bf16_to_float(in.x[t * h + j]);
    const std::vector<double> logits = token_logits(in, t);
    const TokenRouting routing = route_token(in, logits);
    for (int64_t j = 0; j < k; ++j) {
      if (!in.holds(routing.experts[j])) continue;  // another expert-parallel rank's
      const int64_t u = slot[routing.experts[j]];
      swiglu_f64(x, &gate_up[u * 2 * inter * h], &down[u * h * inter], h, inter, out);
      for (int64_t d = 0; d < h; ++d) acc[d] += routing.weights[j] * out[d];
    }
    if (in.shared) {
      swiglu_f64(x, shared_gu.data(), shared_down.data(), h, inter, out);
      const double g = in.shared_gate ? 1.0 / (1.0 + std::exp(-logits[n_e])) : 1.0;
      for (int64_t d = 0; d < h; ++d) acc[d] += g * out[d];
    }
    for (int64_t d = 0; d < h; ++d) y[t * h + d] = static_cast<float>(acc[d]);
  }
  return y;
}

CpuMatrix expert_matrix(const MoeInputs& in, bool gate_up, int64_t e, int64_t row0, int64_t rows) {
  const int64_t all_rows = gate_up ? 2 * in.inter : in.hidden, cols = gate_up ? in.hidden : in.inter;
  const int64_t r = e * all_rows + row0;
  CpuMatrix m{.rows = rows, .cols = cols};
  if (in.fp8) {
    m.format = CpuWeightFormat::kFp8Block128;
    m.data = &(gate_up ? in.gate_up_packed : in.down_packed)[r * cols];
    m.row_block_scales = &(gate_up ? in.gate_up_row_scales : in.down_row_scales)[r * fp8_scale_cols(cols)];
    return m;
  }
  if (!in.nvfp4) {
    m.format = CpuWeightFormat::kBf16;
    m.data = &(gate_up ? in.gate_up_bf16 : in.down_bf16)[r * cols];
    return m;
  }
  m.format = CpuWeightFormat::kNvfp4;
  m.data = &(gate_up ? in.gate_up_packed : in.down_packed)[r * cols / 2];
  m.block_scales = &(gate_up ? in.gate_up_scales : in.down_scales)[r * cols / kNvfp4BlockSize];
  m.global_scale = (gate_up ? in.gate_up_global : in.down_global)[e];
  return m;
}

CpuMatrix bf16_matrix(const uint16_t* data, int64_t rows, int64_t cols) {
  return CpuMatrix{.format = CpuWeightFormat::kBf16, .rows = rows, .cols = cols, .data = data};
}

Expected<RunOutput> moe_cpu(const OpInputs& base) {
  const auto& in = static_cast<const MoeInputs&>(base);
  const std::unique_ptr<Moe> layer = moe_cpu_layer(in);
  std::vector<float> x(in.x.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_to_float(in.x[i]);
  RunOutput out{.values = std::vector<float>(static_cast<size_t>(in.tokens * in.hidden))};
  poison_f32(out.values);
  const auto start = std::chrono::steady_clock::now();
  layer->forward(x.data(), out.values.data(), in.tokens, "", nullptr);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace

std::unique_ptr<Moe> moe_cpu_layer(const MoeInputs& in) {
  const int64_t h = in.hidden, inter = in.inter;
  MoeWeights w{.router = Linear("router", bf16_matrix(in.router.data(), in.n_experts, h))};
  w.first_expert = in.expert_begin;
  for (int64_t e = in.expert_begin; e < in.expert_begin + in.held(); ++e) {
    w.experts.push_back(MlpWeights{Linear("gate_proj", expert_matrix(in, true, e, 0, inter)),
                                   Linear("up_proj", expert_matrix(in, true, e, inter, inter)),
                                   Linear("down_proj", expert_matrix(in, false, e, 0, h))});
  }
  if (in.shared) {
    w.shared_expert = std::make_unique<Mlp>(
        MlpWeights{Linear("shared_gate_proj", bf16_matrix(in.shared_gate_up.data(), inter, h)),
                   Linear("shared_up_proj", bf16_matrix(in.shared_gate_up.data() + inter * h, inter, h)),
                   Linear("shared_down_proj", bf16_matrix(in.shared_down.data(), h, inter))});
    if (in.shared_gate) {
      w.shared_expert_gate = Linear("shared_expert_gate", bf16_matrix(in.router.data() + in.n_experts * h, 1, h));
    }
  }
  w.correction_bias = in.correction_bias;
  return std::make_unique<Moe>(MoeShape{.top_k = in.top_k,
                                        .renormalize = true,
                                        .sigmoid = in.sigmoid,
                                        .n_group = in.n_group,
                                        .topk_group = in.topk_group,
                                        .routed_scaling = in.routed_scaling,
                                        .shared_gate = in.shared_gate},
                               std::move(w));
}

Expected<void> moe_register_cpu(Registry& registry) {
  TERN_TRY(registry.add_harness(OpHarness{.op = "moe", .make_inputs = moe_make, .reference = moe_reference}));
  // fp32 against fp64 through two chained dot products (hidden, then inter terms) and a k-term sum: a few 1e-7 of
  // the output's scale; 1e-5 leaves margin and still rejects a missing expert or gate by orders of magnitude.
  return registry.add(Implementation{
      .op = "moe",
      .name = "cpu",
      .backend = Backend::kCpu,
      .tolerance = {.rel = 1e-5, .abs = 0.0},
      .unsupported_reason = [](const DeviceDescription& d, const SelfTestCase&) -> std::string {
        return d.backend == Backend::kCpu ? "" : "runs on the CPU backend only";
      },
      .run = moe_cpu,
  });
}

SelfTestCase moe_case(int64_t tokens, int64_t hidden, int64_t inter, int64_t n_experts, int64_t top_k,
                      MoeCaseFormat format, bool shared, const MoeCaseRouting& routing) {
  const int64_t shared_dim = !shared ? 0 : routing.shared_gate ? 1 : 2;
  const char* name = format == MoeCaseFormat::kNvfp4 ? "nvfp4" : format == MoeCaseFormat::kFp8 ? "fp8" : "bf16";
  std::string label = fmt::format("T={} H={} I={} E={} top{} {}{}", tokens, hidden, inter, n_experts, top_k, name,
                                  shared_dim == 0 ? "" : shared_dim == 1 ? " +shared" : " +shared(unweighted)");
  std::vector<int64_t> dims = {tokens, hidden, inter, n_experts, top_k, static_cast<int64_t>(format), shared_dim};
  const bool share = routing.local_experts > 0 && routing.local_experts < n_experts;
  if (routing.sigmoid || share) {
    if (routing.sigmoid) {
      label += fmt::format(" sigmoid groups {}/{}{}", routing.topk_group, routing.n_group,
                           routing.correction_bias ? " +bias" : "");
    }
    dims.insert(dims.end(), {routing.sigmoid ? 1 : 0, routing.n_group, routing.topk_group,
                             routing.correction_bias ? 1 : 0});
  }
  if (share) {
    label += fmt::format(" experts [{}, {})", routing.expert_begin, routing.expert_begin + routing.local_experts);
    dims.insert(dims.end(), {routing.expert_begin, routing.local_experts});
  }
  return {std::move(label), std::move(dims)};
}

SelfTestCase moe_case(int64_t tokens, int64_t hidden, int64_t inter, int64_t n_experts, int64_t top_k, bool nvfp4,
                      bool shared, const MoeCaseRouting& routing) {
  return moe_case(tokens, hidden, inter, n_experts, top_k, nvfp4 ? MoeCaseFormat::kNvfp4 : MoeCaseFormat::kBf16,
                  shared, routing);
}

}  // namespace tern
