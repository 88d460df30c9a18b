// GPU sampling against the CPU Sampler (kernels/cpu/sampler.h, itself tested against hand-worked sets and a double
// log_softmax) on the same bf16 logits, widened exactly to float for the CPU, and the same uniform draws: each row's
// Sampler and a SamplerRng are seeded identically, and a random step hands the GPU the rng's next value, which the
// CPU Sampler takes as its one draw of the step (checked by CpuSamplerTakesOneDrawPerRandomStep). Every batch runs
// two steps, so a Sampler that took another number of draws would fall out of step with the GPU.
//
// Sampled ids must be equal. The only allowed difference is a draw or cut that lies within 1e-6 (relative) of a
// boundary, recomputed here in double (draw_is_near_a_cut): the GPU's expf is within 2 ulp and glibc's within 0.502
// ulp, so a token's weight, and every mass sum built from them, may differ by ~3e-7 of itself; such cases are
// counted, printed and must stay rare. Logprobs: |gpu - cpu| <= 1e-6 + 3e-7 |cpu| (the CPU's own bound against
// double, 5e-7 + 2e-7 |x|, plus the GPU's expf terms, 2.4e-7 on the normaliser, and its float rounding); top-N ids
// must be identical (raw bf16 values tie exactly and both sides break ties by id). Outputs are poisoned before each
// call, the workspace is filled with garbage. Batches of fewer rows than the device has SMs take the split first
// walk (sample_partials_kernel), larger ones the single kernel: the cases cover both (large_batch_rows). Label: gpu.
#include "kernels/cuda/sampling/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/formats.h"

namespace tern {
namespace {

constexpr int kTop = kSampleMaxTopLogprobs;

struct Batch {
  int64_t vocab = 0;
  int64_t stride = 0;
  std::vector<uint16_t> logits;  // [rows, stride] bf16
  std::vector<SamplingParams> params;
  std::vector<std::vector<int32_t>> prompts, outputs;
  int64_t rows() const { return static_cast<int64_t>(params.size()); }
  std::vector<float> row(int64_t r) const {
    std::vector<float> out(static_cast<size_t>(vocab));
    for (int64_t i = 0; i < vocab; ++i) out[i] = bf16_to_float(logits[r * stride + i]);
    return out;
  }
};

struct RowOut {
  int32_t id, status;
  float logprob;
  std::array<int32_t, kTop> top_ids;
  std::array<float, kTop> top_logprobs;
};

// A logits row like a language model's: a broad N(0, spread) body and a few strong candidates, rounded to bf16.
void fill_row(Batch& b, int64_t r, std::mt19937& gen, float spread, int n_peaks) {
  std::normal_distribution<float> body(0.0f, spread);
  std::uniform_real_distribution<float> peak(6.0f, 14.0f);
  std::uniform_int_distribution<int64_t> any_id(0, b.vocab - 1);
  uint16_t* row = b.logits.data() + r * b.stride;
  for (int64_t i = 0; i < b.vocab; ++i) row[i] = float_to_bf16(body(gen));
  for (int i = 0; i < n_peaks; ++i) row[any_id(gen)] = float_to_bf16(peak(gen));
}

Batch make_batch(int64_t vocab, const std::vector<SamplingParams>& params, uint32_t seed, int64_t stride = 0) {
  Batch b;
  b.vocab = vocab;
  b.stride = stride > 0 ? stride : vocab;
  b.params = params;
  b.logits.assign(static_cast<size_t>(b.rows() * b.stride), float_to_bf16(-7.0f));
  b.prompts.resize(params.size());
  b.outputs.resize(params.size());
  std::mt19937 gen(seed);
  for (int64_t r = 0; r < b.rows(); ++r) fill_row(b, r, gen, 1.0f + static_cast<float>(r % 4), static_cast<int>(r % 7) * 3);
  return b;
}

std::vector<RowOut> run_gpu(const DeviceContext& ctx, const Batch& b, const std::vector<double>& uniforms) {
  const int64_t rows = b.rows();
  std::vector<SamplingRow> host_rows;
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < rows; ++r) {
    const auto begin = static_cast<int32_t>(ids.size());
    ids.insert(ids.end(), b.prompts[r].begin(), b.prompts[r].end());
    const auto prompt_end = static_cast<int32_t>(ids.size());
    ids.insert(ids.end(), b.outputs[r].begin(), b.outputs[r].end());
    host_rows.push_back(sampling_row_make(b.params[r], uniforms[r], begin, prompt_end, static_cast<int32_t>(ids.size())));
  }
  ids.push_back(0);  // never empty, so the buffer is never null
  DeviceBuffer d_logits(b.logits.size() * 2), d_rows(host_rows.size() * sizeof(SamplingRow)), d_ids(ids.size() * 4);
  DeviceBuffer d_id(rows * 4), d_lp(rows * 4), d_top_ids(rows * kTop * 4), d_top_lp(rows * kTop * 4), d_status(rows * 4);
  DeviceBuffer d_ws(sampling_workspace_bytes(rows, b.vocab));
  d_logits.upload(b.logits.data(), b.logits.size() * 2);
  d_rows.upload(host_rows.data(), d_rows.size_bytes());
  d_ids.upload(ids.data(), ids.size() * 4);
  for (const DeviceBuffer* out : {&d_id, &d_lp, &d_top_ids, &d_top_lp, &d_status}) {
    out->fill(0x7B);  // poison: id 0x7B7B7B7B, logprob 1.3e36
  }
  d_ws.fill(0xA5);
  const SampleArgs args{.logits = d_logits.as<uint16_t>(), .logits_stride = b.stride,
                        .rows_params = d_rows.as<SamplingRow>(), .penalty_ids = d_ids.as<int32_t>(), .rows = rows,
                        .vocab = b.vocab, .out_id = d_id.as<int32_t>(), .out_logprob = d_lp.as<float>(),
                        .out_top_ids = d_top_ids.as<int32_t>(), .out_top_logprobs = d_top_lp.as<float>(),
                        .out_status = d_status.as<int32_t>(), .workspace = d_ws.data(),
                        .workspace_bytes = d_ws.size_bytes()};
  const auto launched = sample_rows(ctx, args);
  EXPECT_TRUE(launched.has_value()) << launched.error().message;
  ctx.synchronize();
  std::vector<int32_t> id(rows), status(rows), top_ids(rows * kTop);
  std::vector<float> lp(rows), top_lp(rows * kTop);
  TERN_CUDA_CHECK(cudaMemcpy(id.data(), d_id.data(), rows * 4, cudaMemcpyDeviceToHost));
  TERN_CUDA_CHECK(cudaMemcpy(status.data(), d_status.data(), rows * 4, cudaMemcpyDeviceToHost));
  TERN_CUDA_CHECK(cudaMemcpy(lp.data(), d_lp.data(), rows * 4, cudaMemcpyDeviceToHost));
  TERN_CUDA_CHECK(cudaMemcpy(top_ids.data(), d_top_ids.data(), rows * kTop * 4, cudaMemcpyDeviceToHost));
  TERN_CUDA_CHECK(cudaMemcpy(top_lp.data(), d_top_lp.data(), rows * kTop * 4, cudaMemcpyDeviceToHost));
  std::vector<RowOut> out(rows);
  for (int64_t r = 0; r < rows; ++r) {
    out[r] = RowOut{id[r], status[r], lp[r], {}, {}};
    std::copy_n(top_ids.begin() + r * kTop, kTop, out[r].top_ids.begin());
    std::copy_n(top_lp.begin() + r * kTop, kTop, out[r].top_logprobs.begin());
  }
  return out;
}

// Whether the CPU's kept set or draw for `u` lies within 1e-6 (relative) of a cut, recomputed in double on the
// penalised row: a min_p or mass > 0 cut at some token's weight, the top_p cut at a cumulative mass or between two
// unequal but nearly equal weights, or the draw at a cumulative mass of the kept set in id order.
bool draw_is_near_a_cut(const std::vector<float>& penalised, const SamplingParams& p, double u) {
  constexpr double kRel = 1e-6;
  const auto vocab = static_cast<int64_t>(penalised.size());
  const double max = *std::max_element(penalised.begin(), penalised.end());
  double threshold = -INFINITY;
  if (p.top_k > 0 && p.top_k < vocab) {
    std::vector<float> sorted = penalised;
    std::nth_element(sorted.begin(), sorted.begin() + (p.top_k - 1), sorted.end(), std::greater<float>());
    threshold = sorted[p.top_k - 1];
  }
  const double scale = std::ldexp(1.0, 62 - static_cast<int>(std::bit_width(static_cast<uint64_t>(vocab))));
  std::vector<std::pair<double, int64_t>> kept;  // (weight, id)
  for (int64_t i = 0; i < vocab; ++i) {
    if (penalised[i] < threshold) continue;
    const double w = std::exp((penalised[i] - max) / p.temperature);
    if (p.min_p > 0.0f && std::abs(w - p.min_p) <= kRel * p.min_p) return true;
    if (std::abs(w * scale - 1.0) <= kRel) return true;
    if (w >= p.min_p && w * scale >= 1.0) kept.emplace_back(w, i);
  }
  double total = 0.0;
  for (const auto& k : kept) total += k.first;
  if (p.top_p < 1.0f) {
    std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    const double need = p.top_p * total;
    double cumulative = 0.0;
    size_t n = 0;
    while (n < kept.size() && cumulative < need) cumulative += kept[n++].first;
    if (std::abs(cumulative - need) <= kRel * total || std::abs(cumulative - kept[n - 1].first - need) <= kRel * total) {
      return true;
    }
    if (n < kept.size() && kept[n].first != kept[n - 1].first && kept[n].first >= kept[n - 1].first * (1 - kRel)) {
      return true;
    }
    kept.resize(n);
    total = cumulative;
    std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  }
  double cumulative = 0.0;
  for (const auto& k : kept) {
    cumulative += k.first;
    if (std::abs(u * total - cumulative) <= kRel * total) return true;
  }
  return false;
}

bool is_greedy(const SamplingParams& p) { return p.temperature < kSamplingGreedyTemperature; }

void expect_logprob_near(float gpu, float cpu, const std::string& what) {
  EXPECT_NEAR(gpu, cpu, 1e-6 + 3e-7 * std::abs(cpu)) << what;
}

// Runs `steps` steps of every row on the GPU and through each row's CPU Sampler and compares them; returns how
// many random rows differed only at a cut (see draw_is_near_a_cut).
int check_batch(const DeviceContext& ctx, const Batch& b, int steps = 2) {
  std::vector<Sampler> samplers;
  std::vector<SamplerRng> rngs;
  for (int64_t r = 0; r < b.rows(); ++r) {
    SamplingParams p = b.params[r];
    p.seed = 1000 + static_cast<uint64_t>(r);
    samplers.emplace_back(p);
    rngs.emplace_back(*p.seed);
  }
  int near_cut = 0;
  for (int step = 0; step < steps; ++step) {
    std::vector<double> uniforms(b.rows(), 0.0);
    for (int64_t r = 0; r < b.rows(); ++r) uniforms[r] = is_greedy(b.params[r]) ? 0.0 : rngs[r].next_unit();
    const std::vector<RowOut> gpu = run_gpu(ctx, b, uniforms);
    for (int64_t r = 0; r < b.rows(); ++r) {
      const std::string what = "vocab " + std::to_string(b.vocab) + " row " + std::to_string(r) + " step " +
                               std::to_string(step);
      const std::vector<float> row = b.row(r);
      const auto cpu = samplers[r].sample(row, b.prompts[r], b.outputs[r]);
      if (!cpu.has_value() || gpu[r].status != kSampleStatusOk) {
        ADD_FAILURE() << what << ": cpu " << (cpu ? "ok" : cpu.error().message) << ", gpu status " << gpu[r].status;
        continue;
      }
      if (gpu[r].id != cpu->id) {
        std::vector<float> penalised = row;
        EXPECT_TRUE(sampling_apply_penalties(b.params[r], penalised, b.prompts[r], b.outputs[r]));
        const bool excused = !is_greedy(b.params[r]) && draw_is_near_a_cut(penalised, b.params[r], uniforms[r]);
        EXPECT_TRUE(excused) << what << ": gpu id " << gpu[r].id << ", cpu id " << cpu->id;
        if (excused) {
          std::printf("%s: ids %d (gpu) and %d (cpu) differ at a cut within 1e-6, skipped\n", what.c_str(), gpu[r].id,
                      cpu->id);
          ++near_cut;
        }
        continue;
      }
      expect_logprob_near(gpu[r].logprob, cpu->logprob, what + " logprob");
      const size_t n = cpu->top_logprobs.size();
      for (size_t i = 0; i < static_cast<size_t>(kTop); ++i) {
        if (i < n) {
          EXPECT_EQ(gpu[r].top_ids[i], cpu->top_logprobs[i].first) << what << " rank " << i;
          expect_logprob_near(gpu[r].top_logprobs[i], cpu->top_logprobs[i].second, what + " rank " + std::to_string(i));
        } else {
          EXPECT_EQ(gpu[r].top_ids[i], -1) << what << " unused slot " << i;
          EXPECT_EQ(gpu[r].top_logprobs[i], -INFINITY) << what << " unused slot " << i;
        }
      }
    }
  }
  return near_cut;
}

const std::vector<int64_t> kVocabs = {512, 151936, 154880};

// A row count that takes the single-kernel path (at least one row per SM).
int64_t large_batch_rows(const DeviceContext& ctx) {
  return ctx.props().num_sms + 3;
}

// Prompt and output ids for row r, drawn mostly from the row's 64 best tokens (where penalties change the outcome),
// with repeats.
void fill_penalty_ids(Batch& b, int64_t r, std::mt19937& gen) {
  std::vector<int32_t> best(static_cast<size_t>(b.vocab));
  std::iota(best.begin(), best.end(), 0);
  const std::vector<float> row = b.row(r);
  const size_t n_best = std::min<size_t>(64, best.size());
  std::partial_sort(best.begin(), best.begin() + n_best, best.end(),
                    [&](int32_t x, int32_t y) { return row[x] > row[y]; });
  std::uniform_int_distribution<int> pick(0, static_cast<int>(n_best) - 1), length(0, 300);
  std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(b.vocab - 1));
  for (auto* list : {&b.prompts[r], &b.outputs[r]}) {
    const int n = length(gen);
    for (int i = 0; i < n; ++i) list->push_back(i % 3 == 0 ? any(gen) : best[pick(gen)]);
  }
}

bool has_penalty(const SamplingParams& p) {
  return p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
}

// --- The CPU premise: one draw per random step ---

TEST(CudaSampling, CpuSamplerTakesOneDrawPerRandomStep) {
  // After a random step on a random row, a probe row of 4096 equal logits (every filter below keeps all of it)
  // maps the next draw u to token floor(u * 4096) exactly (mass 2^49 each, total 2^61): so the probe reveals
  // which draw the Sampler is at.
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const std::vector<float> probe(4096, 0.0f);
  for (const SamplingParams& base :
       {SamplingParams{}, SamplingParams{.temperature = 0.7f, .top_k = 50},
        SamplingParams{.temperature = 1.3f, .min_p = 0.1f, .repetition_penalty = 1.2f, .frequency_penalty = 0.5f}}) {
    SamplingParams p = base;
    p.seed = 77;
    Sampler sampler(p);
    SamplerRng rng(77);
    for (int step = 0; step < 20; ++step) {
      std::vector<float> row(1000);
      for (float& x : row) x = normal(gen);
      ASSERT_TRUE(sampler.sample(row, std::vector<int32_t>{1, 2}, std::vector<int32_t>{3}).has_value());
      rng.next_unit();
      const auto token = sampler.sample(probe, {}, {});
      ASSERT_TRUE(token.has_value());
      EXPECT_EQ(token->id, static_cast<int32_t>(rng.next_unit() * 4096.0)) << "step " << step;
    }
  }
}

// --- Greedy ---

void check_greedy_ties(const DeviceContext& ctx, int64_t rows) {
  for (int64_t vocab : kVocabs) {
    std::vector<SamplingParams> params;
    for (int r = 0; r < rows; ++r)
      params.push_back({.temperature = r % 2 ? 0.0f : 9e-6f, .top_k = 5, .top_p = 0.5f, .logprobs = r % 5});
    Batch b = make_batch(vocab, params, 11);
    // Rows 0..7: the maximum appears at several ids, the lowest one written last, so no scan order finds it first.
    for (int64_t r = 0; r < 8; ++r) {
      uint16_t* row = b.logits.data() + r * b.stride;
      const uint16_t top = float_to_bf16(20.0f);
      for (int64_t id : {vocab - 1, vocab / 2, int64_t{300} + r, int64_t{3} + r}) row[id] = top;
    }
    check_batch(ctx, b);
    const std::vector<RowOut> gpu = run_gpu(ctx, b, std::vector<double>(b.rows(), 0.0));
    for (int64_t r = 0; r < 8; ++r) EXPECT_EQ(gpu[r].id, 3 + r) << "vocab " << vocab << " row " << r;
  }
}

TEST(CudaSampling, GreedyMatchesCpuIncludingTies) {
  DeviceContext ctx;
  check_greedy_ties(ctx, 24);
  check_greedy_ties(ctx, large_batch_rows(ctx));
}

// --- Random sampling ---

std::vector<SamplingParams> random_params(int64_t vocab) {
  const auto k_big = static_cast<int32_t>(vocab - 1);
  return {
      {},
      {.temperature = 0.7f, .top_p = 0.9f},
      {.top_k = 1},
      {.top_k = 50},
      {.top_k = k_big},
      {.top_k = static_cast<int32_t>(vocab + 5)},
      {.min_p = 0.05f},
      {.top_p = 0.8f, .min_p = 0.3f},
      {.temperature = 1.5f, .top_k = 200, .top_p = 0.95f, .min_p = 0.02f, .logprobs = 3},
      {.temperature = 0.2f, .top_p = 0.5f},
      {.temperature = 3.0f, .top_k = 1000},
      {.top_p = 1e-6f},
      {.temperature = 1e-4f},
      {.temperature = 1000.0f, .top_k = 20},
      {.temperature = 2.0f, .top_p = 0.99f, .logprobs = 20},
      {.temperature = 0.0f, .logprobs = 1},
  };
}

TEST(CudaSampling, RandomSamplingMatchesCpu) {
  DeviceContext ctx;
  int cases = 0, near_cut = 0;
  for (int64_t vocab : kVocabs) {
    const std::vector<SamplingParams> combos = random_params(vocab);
    for (int64_t rows : {1, 5, 64}) {
      std::vector<SamplingParams> params;
      for (int64_t r = 0; r < rows; ++r) params.push_back(combos[(r * 7 + rows) % combos.size()]);
      near_cut += check_batch(ctx, make_batch(vocab, params, static_cast<uint32_t>(vocab + rows)));
      cases += 2 * static_cast<int>(rows);
    }
  }
  EXPECT_LE(near_cut, std::max(1, cases / 100)) << "too many draws at a cut: " << near_cut << " of " << cases;
}

TEST(CudaSampling, FlatRowsKeepLargeSets) {
  // Nearly uniform rows: top_p and min_p keep tens of thousands of tokens, ties in bf16 are everywhere.
  DeviceContext ctx;
  std::vector<SamplingParams> params = {{.top_p = 0.5f}, {.top_p = 0.97f, .min_p = 0.5f}, {.top_k = 40000},
                                        {.temperature = 0.5f, .top_k = 100000, .top_p = 0.3f}, {.min_p = 0.9f}};
  Batch b = make_batch(151936, params, 3);
  std::mt19937 gen(4);
  std::uniform_real_distribution<float> flat(-0.25f, 0.25f);
  for (uint16_t& x : b.logits) x = float_to_bf16(flat(gen));
  EXPECT_LE(check_batch(ctx, b), 1);
}

TEST(CudaSampling, UnalignedAndStridedRows) {
  DeviceContext ctx;
  const std::vector<SamplingParams> params = {{.top_k = 10, .logprobs = 4}, {.top_p = 0.9f}, {.temperature = 0.0f}};
  EXPECT_LE(check_batch(ctx, make_batch(1001, params, 5, 1003)), 1);  // rows not 16-byte aligned, odd tail
  EXPECT_LE(check_batch(ctx, make_batch(7, params, 6)), 1);
}

// --- Every kind of row at 1, 2 and 8 rows (split first walk) and at a large batch (single kernel) ---

std::vector<SamplingParams> mixed_params() {
  return {
      {.temperature = 0.0f},
      {.temperature = 0.0f, .logprobs = 5},
      {.temperature = 0.6f, .top_k = 20, .top_p = 0.95f},
      {.top_k = 50, .logprobs = 20},
      {.temperature = 0.7f, .top_p = 0.9f},
      {.min_p = 0.05f, .logprobs = 1},
      {.temperature = 0.8f,
       .top_p = 0.95f,
       .repetition_penalty = 1.1f,
       .presence_penalty = 0.5f,
       .frequency_penalty = 0.2f},
      {.temperature = 0.0f, .repetition_penalty = 1.3f, .frequency_penalty = 0.4f, .logprobs = 3},
      {.temperature = 0.0f, .presence_penalty = -2.0f},  // raises the output ids: the argmax can move to one of them
      {.temperature = 1.2f, .top_k = 1000, .top_p = 0.8f, .min_p = 0.01f, .repetition_penalty = 0.8f, .logprobs = 20},
  };
}

void check_mixed(const DeviceContext& ctx, int64_t vocab, int64_t stride, int64_t rows, size_t first, uint32_t seed,
                 int& cases, int& near_cut) {
  const std::vector<SamplingParams> combos = mixed_params();
  std::vector<SamplingParams> params;
  for (int64_t r = 0; r < rows; ++r) params.push_back(combos[(first + static_cast<size_t>(r)) % combos.size()]);
  Batch b = make_batch(vocab, params, seed, stride);
  std::mt19937 gen(seed + 1);
  for (int64_t r = 0; r < rows; ++r) {
    if (has_penalty(params[r])) fill_penalty_ids(b, r, gen);
  }
  near_cut += check_batch(ctx, b);
  cases += 2 * static_cast<int>(rows);
}

TEST(CudaSampling, SmallAndLargeBatchesMatchCpu) {
  DeviceContext ctx;
  const size_t n_combos = mixed_params().size();
  int cases = 0, near_cut = 0;
  uint32_t seed = 100;
  // (vocab, stride): aligned rows, a vocabulary with a tail past the last 16-byte group, unaligned strided rows.
  for (const auto& [vocab, stride] :
       std::vector<std::pair<int64_t, int64_t>>{{151936, 151936}, {154883, 154883}, {1001, 1003}, {512, 512}}) {
    for (const int64_t rows : {int64_t{1}, int64_t{2}, int64_t{8}}) {
      // Every combination at every row count, starting each batch at the next one.
      for (size_t first = 0; first < n_combos; first += static_cast<size_t>(rows)) {
        check_mixed(ctx, vocab, stride, rows, first, seed++, cases, near_cut);
      }
    }
    check_mixed(ctx, vocab, stride, large_batch_rows(ctx), 0, seed++, cases, near_cut);
  }
  EXPECT_LE(near_cut, std::max(1, cases / 100)) << "too many draws at a cut: " << near_cut << " of " << cases;
}

// --- Penalties ---

TEST(CudaSampling, PenaltiesMatchCpu) {
  DeviceContext ctx;
  for (int64_t vocab : kVocabs) {
    std::vector<SamplingParams> params;
    const float repetition[] = {1.0f, 1.3f, 0.8f, 2.0f};
    const float presence[] = {0.0f, 0.5f, -1.0f, 2.0f};
    const float frequency[] = {0.0f, 0.3f, 1.5f, -0.7f};
    for (int r = 0; r < 32; ++r) {
      params.push_back({.temperature = r % 3 == 0 ? 0.0f : 0.9f, .top_k = r % 4 == 1 ? 40 : -1,
                        .top_p = r % 5 == 2 ? 0.9f : 1.0f, .repetition_penalty = repetition[r % 4],
                        .presence_penalty = presence[(r / 4) % 4], .frequency_penalty = frequency[(r / 2) % 4],
                        .logprobs = r % 3});
    }
    Batch b = make_batch(vocab, params, 21);
    std::mt19937 gen(22);
    for (int64_t r = 0; r < b.rows(); ++r) fill_penalty_ids(b, r, gen);
    check_batch(ctx, b);
  }
}

// --- Failures ---

// Five special rows, then plain rows up to `rows` in all.
void check_non_finite_rows(const DeviceContext& ctx, int64_t rows) {
  std::vector<SamplingParams> params = {
      {}, {.temperature = 0.0f, .logprobs = 3}, {.top_k = 5}, {.logprobs = 2}, {.repetition_penalty = 1.3f}};
  while (static_cast<int64_t>(params.size()) < rows) params.push_back({.temperature = 0.0f, .logprobs = 1});
  Batch b = make_batch(151936, params, 31);
  const float nan = std::nanf("");
  b.logits[1 * b.stride + 123] = float_to_bf16(nan);
  b.logits[1 * b.stride + 500] = float_to_bf16(INFINITY);
  b.logits[3 * b.stride + 151935] = float_to_bf16(-INFINITY);
  b.logits[4 * b.stride + 7] = float_to_bf16(INFINITY);
  b.prompts[4] = {1, 2, 151935};
  b.outputs[4] = {5};
  const std::vector<RowOut> gpu = run_gpu(ctx, b, std::vector<double>(b.rows(), 0.25));
  const int32_t expected_status[] = {0, 124, 0, 151936, 8};
  const char* expected_message[] = {"", "logits contain NaN at id 123", "", "logits contain -inf at id 151935",
                                    "logits contain +inf at id 7"};
  for (int64_t r = 0; r < b.rows(); ++r) {
    if (r >= 5) {  // plain greedy rows: the CPU's token
      const auto cpu = Sampler(b.params[r]).sample(b.row(r), {}, {});
      ASSERT_TRUE(cpu.has_value());
      EXPECT_EQ(gpu[r].status, kSampleStatusOk) << "row " << r;
      EXPECT_EQ(gpu[r].id, cpu->id) << "row " << r;
      continue;
    }
    EXPECT_EQ(gpu[r].status, expected_status[r]) << "row " << r;
    if (expected_status[r] == 0) {
      EXPECT_GE(gpu[r].id, 0);
      EXPECT_LT(gpu[r].id, b.vocab);
      EXPECT_TRUE(std::isfinite(gpu[r].logprob));
      continue;
    }
    const std::vector<float> row = b.row(r);
    const auto check = sampling_status_check(gpu[r].status, row.data(), b.vocab);
    ASSERT_FALSE(check.has_value());
    EXPECT_EQ(check.error().message, expected_message[r]);
    Sampler cpu(b.params[r]);
    const auto cpu_result = cpu.sample(row, b.prompts[r], b.outputs[r]);
    ASSERT_FALSE(cpu_result.has_value());
    EXPECT_EQ(cpu_result.error().message, expected_message[r]);
    EXPECT_EQ(gpu[r].id, -1);
    EXPECT_TRUE(std::isnan(gpu[r].logprob));
    for (int i = 0; i < kTop; ++i) {
      EXPECT_EQ(gpu[r].top_ids[i], -1);
      EXPECT_TRUE(std::isnan(gpu[r].top_logprobs[i]));
    }
  }
}

TEST(CudaSampling, NonFiniteLogitsFailOnlyTheirRow) {
  DeviceContext ctx;
  check_non_finite_rows(ctx, 5);
  check_non_finite_rows(ctx, large_batch_rows(ctx));
}

TEST(CudaSampling, NonFiniteLogitsInOneOrTwoRows) {
  // The split first walk's smallest batches: a non-finite logit in a single row and in the second of two rows.
  DeviceContext ctx;
  for (const int64_t rows : {1, 2}) {
    const std::vector<SamplingParams> params(static_cast<size_t>(rows),
                                             SamplingParams{.temperature = 0.0f, .logprobs = 2});
    Batch b = make_batch(151936, params, 33);
    const int64_t bad_row = rows - 1;
    b.logits[bad_row * b.stride + 151930] = float_to_bf16(-INFINITY);  // a later non-finite id does not hide the first
    b.logits[bad_row * b.stride + 77777] = float_to_bf16(std::nanf(""));
    const std::vector<RowOut> gpu = run_gpu(ctx, b, std::vector<double>(b.rows(), 0.0));
    EXPECT_EQ(gpu[bad_row].status, 77778) << "rows " << rows;
    EXPECT_EQ(gpu[bad_row].id, -1);
    EXPECT_TRUE(std::isnan(gpu[bad_row].logprob));
    const auto cpu_bad = Sampler(b.params[bad_row]).sample(b.row(bad_row), {}, {});
    ASSERT_FALSE(cpu_bad.has_value());
    const std::vector<float> row = b.row(bad_row);
    const auto check = sampling_status_check(gpu[bad_row].status, row.data(), b.vocab);
    ASSERT_FALSE(check.has_value());
    EXPECT_EQ(check.error().message, cpu_bad.error().message);
    if (rows == 2) {
      const auto cpu = Sampler(b.params[0]).sample(b.row(0), {}, {});
      ASSERT_TRUE(cpu.has_value());
      EXPECT_EQ(gpu[0].status, kSampleStatusOk);
      EXPECT_EQ(gpu[0].id, cpu->id);
      expect_logprob_near(gpu[0].logprob, cpu->logprob, "row 0 logprob");
    }
  }
}

TEST(CudaSampling, PenaltyFailuresAreReported) {
  DeviceContext ctx;
  const std::vector<SamplingParams> params = {
      {.repetition_penalty = 1e-3f},                       // 1e36 / 1e-3 overflows at ids 40 and 9
      {.frequency_penalty = 1.0f},                         // output id == vocab
      {.repetition_penalty = 1.1f},                        // prompt id -1
      {.presence_penalty = 1.0f},                          // prompt id -1 is not read without repetition
      {}};
  Batch b = make_batch(4096, params, 41);
  b.logits[0 * b.stride + 40] = float_to_bf16(1e36f);
  b.logits[0 * b.stride + 9] = float_to_bf16(2e36f);
  b.prompts[0] = {40, 3, 9};
  b.outputs[1] = {2, 4096};
  b.prompts[2] = {-1};
  b.prompts[3] = {-1};
  b.outputs[3] = {17};
  const std::vector<RowOut> gpu = run_gpu(ctx, b, std::vector<double>(b.rows(), 0.5));
  EXPECT_EQ(gpu[0].status, -(1 + 9));
  EXPECT_EQ(gpu[1].status, kSampleStatusBadPenaltyId);
  EXPECT_EQ(gpu[2].status, kSampleStatusBadPenaltyId);
  EXPECT_EQ(gpu[3].status, kSampleStatusOk);
  EXPECT_EQ(gpu[4].status, kSampleStatusOk);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(gpu[r].id, -1);
    Sampler cpu(b.params[r]);
    EXPECT_FALSE(cpu.sample(b.row(r), b.prompts[r], b.outputs[r]).has_value()) << "row " << r;
  }
  const auto message = sampling_status_check(gpu[0].status, nullptr, b.vocab);
  ASSERT_FALSE(message.has_value());
  EXPECT_EQ(message.error().message, "logits at id 9 became non-finite after the penalties");
}

TEST(CudaSampling, RejectsBadArguments) {
  DeviceContext ctx;
  DeviceBuffer buf(1 << 20);
  const SampleArgs good{.logits = buf.as<uint16_t>(), .logits_stride = 1000, .rows_params = buf.as<SamplingRow>(),
                        .rows = 2, .vocab = 1000, .out_id = buf.as<int32_t>(), .out_logprob = buf.as<float>(),
                        .out_top_ids = buf.as<int32_t>(), .out_top_logprobs = buf.as<float>(),
                        .out_status = buf.as<int32_t>(), .workspace = buf.data(),
                        .workspace_bytes = sampling_workspace_bytes(2, 1000)};
  const auto expect_error = [&](SampleArgs a, const std::string& needle) {
    const auto r = sample_rows(ctx, a);
    ASSERT_FALSE(r.has_value()) << needle;
    EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  };
  auto a = good;
  a.logits = nullptr;
  expect_error(a, "logits is null");
  a = good;
  a.logits_stride = 999;
  expect_error(a, "logits_stride=999");
  a = good;
  a.vocab = 0;
  expect_error(a, "vocab=0");
  a = good;
  a.rows = -1;
  expect_error(a, "rows=-1");
  a = good;
  a.workspace_bytes -= 1;
  expect_error(a, "workspace_bytes");
  a = good;
  a.workspace = static_cast<char*>(buf.data()) + 4;
  expect_error(a, "workspace is not 16-byte aligned");
  a = good;
  a.out_status = nullptr;
  expect_error(a, "out_status");
  a = good;
  a.vocab = a.logits_stride = int64_t{1} << 30;
  a.workspace_bytes = sampling_workspace_bytes(2, a.vocab);
  expect_error(a, "shared memory");
  a = good;
  a.rows = 0;
  EXPECT_TRUE(sample_rows(ctx, a).has_value());
}

}  // namespace
}  // namespace tern
