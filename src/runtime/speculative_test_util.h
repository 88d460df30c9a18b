// What the speculative-decoding tests share (speculative_test.cc on the CPU, cuda_speculative_test.cc on a GPU):
// the trained demo model's held-out text as prompts, plain greedy decoding, and a loop that decodes several
// sequences with speculation, prompts in chunks.
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "core/formats.h"
#include "io/safetensors.h"
#include "runtime/model_runner.h"
#include "runtime/speculative.h"
#include "tokenizer/tokenizer.h"

namespace tern::spec_test {

inline const std::string kDemo = std::string(TERN_DEMO_DIR) + "/tern-demo-bf16";

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The held-out text's tokens (the demo's tokenizer is byte-identical to the Rust tokenizers library).
inline const std::vector<int32_t>& heldout_tokens() {
  static const std::vector<int32_t> tokens = [] {
    auto tok = Tokenizer::load(kDemo);
    EXPECT_TRUE(tok.has_value());
    return tok ? tok->encode(read_file(std::string(TERN_DEMO_DIR) + "/heldout.txt")) : std::vector<int32_t>{};
  }();
  return tokens;
}

// The GLM-5 fixture with an MTP layer (decoder layer 3, DeepSeek's layout): enorm, hnorm, eh_proj and
// shared_head.norm random, the decoder layer a copy of layer 2 with every weight multiplied by random factors in
// [0.5, 1.5] (the router's correction bias kept), and the copies of embedding and lm_head the checkpoint carries there;
// config num_nextn_predict_layers 1. Values stay bf16. `negate` names weights written with their signs flipped
// (model.norm.weight, and of the MTP layer hnorm.weight or shared_head.norm.weight), which an RMSNorm turns into
// exactly negated outputs: the tests of which hidden state the layer reads use it.
inline std::filesystem::path glm_with_mtp(const std::string& name, const std::set<std::string>& negate = {}) {
  namespace fs = std::filesystem;
  const fs::path src = fs::path(TERN_FIXTURES_DIR) / "glm_moe_dsa";
  const fs::path dir = fs::path(testing::TempDir()) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto set = SafetensorsSet::open_dir(src);
  EXPECT_TRUE(set.has_value()) << set.error().message;
  std::mt19937 rng(0x6170);
  std::deque<std::vector<std::byte>> storage;
  std::vector<TensorToWrite> out;
  // bf16 values times factor(i), rounded to bf16.
  auto scaled = [&](const TensorView& t, const std::function<float(size_t)>& factor) {
    std::vector<std::byte> bytes(t.data.size());
    for (size_t i = 0; i < bytes.size() / 2; ++i) {
      uint16_t b;
      std::memcpy(&b, t.data.data() + 2 * i, 2);
      const uint16_t v = float_to_bf16(bf16_to_float(b) * factor(i));
      std::memcpy(&bytes[2 * i], &v, 2);
    }
    storage.push_back(std::move(bytes));
    return std::span<const std::byte>(storage.back());
  };
  auto random_bf16 = [&](std::vector<int64_t> shape, float lo, float hi) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<std::byte> bytes(static_cast<size_t>(2 * n));
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t v = float_to_bf16(u(rng));
      std::memcpy(&bytes[2 * i], &v, 2);
    }
    storage.push_back(std::move(bytes));
    return std::span<const std::byte>(storage.back());
  };
  std::uniform_real_distribution<float> layer_factor(0.5f, 1.5f);
  auto negated = [&](const std::string& tensor, std::span<const std::byte> bytes) {
    if (!negate.contains(tensor)) return bytes;
    std::vector<std::byte> flipped(bytes.begin(), bytes.end());
    for (size_t i = 1; i < flipped.size(); i += 2) flipped[i] ^= std::byte{0x80};  // bf16's sign bit, little-endian
    storage.push_back(std::move(flipped));
    return std::span<const std::byte>(storage.back());
  };
  const std::string from = "model.layers.2.", to = "model.layers.3.";
  int64_t hidden = 0;
  for (const TensorView* t : set->tensors()) {
    out.push_back({t->name, t->dtype, t->shape, negated(t->name, t->data)});
    if (t->name == "model.norm.weight") hidden = t->shape[0];
    const std::string copy_of = t->name == "model.embed_tokens.weight" ? "embed_tokens.weight"
                                : t->name == "lm_head.weight"        ? "shared_head.head.weight"
                                                                     : "";
    if (!copy_of.empty()) out.push_back({to + copy_of, t->dtype, t->shape, t->data});
    if (!t->name.starts_with(from)) continue;
    const std::string copy = to + t->name.substr(from.size());
    if (t->dtype != DType::kBF16) {
      out.push_back({copy, t->dtype, t->shape, t->data});
    } else {
      out.push_back({copy, t->dtype, t->shape, scaled(*t, [&](size_t) { return layer_factor(rng); })});
    }
  }
  EXPECT_GT(hidden, 0);
  out.push_back({to + "enorm.weight", DType::kBF16, {hidden}, random_bf16({hidden}, 0.5f, 1.5f)});
  out.push_back({to + "hnorm.weight", DType::kBF16, {hidden},
                 negated(to + "hnorm.weight", random_bf16({hidden}, 0.5f, 1.5f))});
  out.push_back({to + "shared_head.norm.weight", DType::kBF16, {hidden},
                 negated(to + "shared_head.norm.weight", random_bf16({hidden}, 0.5f, 1.5f))});
  out.push_back({to + "eh_proj.weight", DType::kBF16, {hidden, 2 * hidden}, random_bf16({hidden, 2 * hidden}, -0.15f,
                                                                                          0.15f)});
  std::stable_sort(out.begin(), out.end(), [](const TensorToWrite& a, const TensorToWrite& b) {
    return dtype_size(a.dtype) > dtype_size(b.dtype);  // aligned elements (safetensors_write)
  });
  EXPECT_TRUE(safetensors_write(dir / "model.safetensors", out).has_value());
  auto config = nlohmann::json::parse(read_file(src / "config.json"));
  config["num_nextn_predict_layers"] = 1;
  std::ofstream(dir / "config.json") << config.dump();
  fs::copy_file(src / "generation_config.json", dir / "generation_config.json");
  return dir;
}

// Random token ids in [0, vocab) (prompts for the fixtures, whose vocabularies are not the demo's).
inline std::vector<int32_t> random_prompt(size_t n, uint32_t seed, int32_t vocab) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> id(0, vocab - 1);
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = id(rng);
  return p;
}

// Prompts cut from the held-out text: real text, so the drafts are right often enough to test acceptance.
inline std::vector<int32_t> prompt(size_t offset, size_t length) {
  const auto& t = heldout_tokens();
  return {t.begin() + static_cast<ptrdiff_t>(offset), t.begin() + static_cast<ptrdiff_t>(offset + length)};
}

inline int32_t argmax(std::span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

inline std::vector<double> log_softmax(std::span<const float> row) {
  const double max = *std::max_element(row.begin(), row.end());
  double sum = 0.0;
  for (float x : row) sum += std::exp(double{x} - max);
  std::vector<double> out;
  for (float x : row) out.push_back(double{x} - max - std::log(sum));
  return out;
}

// Plain greedy decoding, one token per step.
inline std::vector<int32_t> plain_greedy(ModelRunner& runner, const std::vector<int32_t>& prompt_ids, int n) {
  SequenceCache cache = runner.new_sequence();
  std::vector<int32_t> out;
  std::vector<int32_t> next = prompt_ids;
  for (int i = 0; i < n; ++i) {
    const std::vector<SequenceInput> batch{{&cache, next}};
    auto logits = runner.forward(batch, LogitsFor::kLastToken);
    EXPECT_TRUE(logits.has_value()) << logits.error().message;
    if (!logits) return out;
    out.push_back(argmax(*logits));
    next = {out.back()};
  }
  return out;
}

// One sequence decoded with speculation: its prompt in chunks of `chunk` tokens, then steps of 1 + drafts.
struct SpecRun {
  std::vector<int32_t> prompt, output;
  SequenceCache cache;
  Sampler sampler;
  std::vector<int32_t> drafts;
  int64_t prompt_done = 0;
  int64_t drafted = 0, accepted = 0;
  SpecRun(ModelRunner& runner, std::vector<int32_t> p, SamplingParams params)
      : prompt(std::move(p)), cache(runner.new_sequence()), sampler(params) {}
  std::vector<int32_t> all() const {
    std::vector<int32_t> t = prompt;
    t.insert(t.end(), output.begin(), output.end());
    return t;
  }
};

// Runs `runs` together until each has `n` output tokens. `override_drafts`, if set, replaces each sequence's drafts
// before every step (the test's forced acceptance or rejection).
inline void run_speculative(ModelRunner& runner, std::vector<SpecRun>& runs, int n, int steps, int64_t chunk,
                     const std::function<void(size_t, SpecRun&)>& override_drafts = nullptr) {
  for (int guard = 0; guard < 10 * n + 100; ++guard) {
    std::vector<SpecSequence> seqs;
    std::vector<size_t> which;
    std::vector<std::vector<int32_t>> known(runs.size());
    for (size_t i = 0; i < runs.size(); ++i) {
      SpecRun& r = runs[i];
      if (static_cast<int>(r.output.size()) >= n) continue;
      known[i] = r.all();
      const int64_t begin = r.cache.length;
      const int64_t count = std::min<int64_t>(chunk, static_cast<int64_t>(known[i].size()) - begin);
      const bool samples = begin + count == static_cast<int64_t>(known[i].size());
      if (override_drafts && samples && !r.output.empty()) override_drafts(i, r);
      SpecSequence s;
      s.input = {&r.cache, std::span<const int32_t>(known[i]).subspan(static_cast<size_t>(begin),
                                                                         static_cast<size_t>(count))};
      s.following = std::span<const int32_t>(known[i]).subspan(static_cast<size_t>(begin + 1));
      if (samples) s.sample = {&r.sampler, r.prompt, r.output};
      s.drafts = &r.drafts;
      seqs.push_back(s);
      which.push_back(i);
    }
    if (seqs.empty()) return;
    auto outcomes = speculative_step(runner, seqs, steps);
    ASSERT_TRUE(outcomes.has_value()) << outcomes.error().message;
    for (size_t k = 0; k < which.size(); ++k) {
      SpecRun& r = runs[which[k]];
      const SpecOutcome& o = (*outcomes)[k];
      ASSERT_FALSE(o.error) << o.error->message;
      r.drafted += o.drafted;
      r.accepted += o.accepted;
      for (const SampledToken& t : o.tokens) r.output.push_back(t.id);
      if (!o.tokens.empty()) {
        ASSERT_EQ(r.cache.length + 1, static_cast<int64_t>(r.all().size()));
      }
    }
  }
  FAIL() << "the runs did not finish";
}

// Greedy decoding with drafts forced to be the true continuation (every one accepted) and then forced wrong (none
// accepted, so every step keeps one row): both give the plain greedy output.
inline void expect_forced_drafts_keep_greedy_output(ModelRunner& runner) {
  const std::vector<int32_t> p = prompt(1500, 9);
  const int n = 40, steps = 3;
  const std::vector<int32_t> want = plain_greedy(runner, p, n + steps + 1);
  std::vector<SpecRun> right;
  right.emplace_back(runner, p, SamplingParams{.temperature = 0.0f});
  run_speculative(runner, right, n, steps, 64, [&](size_t, SpecRun& r) {
    r.drafts.assign(want.begin() + static_cast<ptrdiff_t>(r.output.size()),
                    want.begin() + static_cast<ptrdiff_t>(r.output.size() + steps));
  });
  EXPECT_EQ(right[0].accepted, right[0].drafted);
  EXPECT_GT(right[0].drafted, 0);
  right[0].output.resize(n);
  EXPECT_EQ(right[0].output, std::vector<int32_t>(want.begin(), want.begin() + n));
  std::vector<SpecRun> wrong;
  wrong.emplace_back(runner, p, SamplingParams{.temperature = 0.0f});
  run_speculative(runner, wrong, n, steps, 64, [&](size_t, SpecRun& r) {
    const int32_t truth = want[r.output.size()];
    r.drafts.assign(steps, (truth + 17) % static_cast<int32_t>(runner.config().vocab_size));
  });
  EXPECT_EQ(wrong[0].accepted, 0);
  EXPECT_GT(wrong[0].drafted, 0);
  wrong[0].output.resize(n);
  EXPECT_EQ(wrong[0].output, std::vector<int32_t>(want.begin(), want.begin() + n));
}

// The second output token (the first a draft can propose) over many seeds, sampled with speculation, against the
// model's own distribution after the most frequent first token (a chi-square test on the top 6).
inline void expect_sampling_keeps_the_models_distribution(ModelRunner& runner) {
  // top_k 6 keeps the support small: the distribution given the first token must be softmax(logits / T) over the
  // model's top 6.
  const std::vector<int32_t> p = prompt(9000, 6);
  const SamplingParams base{.temperature = 0.8f, .top_k = 6};
  const int draws = 2000;
  std::map<int32_t, std::map<int32_t, int>> second;  // first token -> second token -> count
  int64_t accepted = 0;
  for (int seed = 0; seed < draws; ++seed) {
    SamplingParams params = base;
    params.seed = 1000 + seed;
    std::vector<SpecRun> runs;
    runs.emplace_back(runner, p, params);
    run_speculative(runner, runs, 2, 1, 64);
    ++second[runs[0].output[0]][runs[0].output[1]];
    accepted += runs[0].accepted;
  }
  // The most frequent first token, and the model's distribution after it.
  int32_t first = -1;
  int most = 0;
  for (const auto& [token, counts] : second) {
    int total = 0;
    for (const auto& [t, c] : counts) total += c;
    if (total > most) most = total, first = token;
  }
  ASSERT_GT(most, 200);
  std::vector<int32_t> context = p;
  context.push_back(first);
  SequenceCache cache = runner.new_sequence();
  const std::vector<SequenceInput> batch{{&cache, context}};
  auto logits = runner.forward(batch, LogitsFor::kLastToken);
  ASSERT_TRUE(logits.has_value());
  std::vector<std::pair<float, int32_t>> ranked;
  for (size_t i = 0; i < logits->size(); ++i) ranked.push_back({(*logits)[i], static_cast<int32_t>(i)});
  std::partial_sort(ranked.begin(), ranked.begin() + 6, ranked.end(), std::greater<>());
  double z = 0.0;
  for (int k = 0; k < 6; ++k) z += std::exp((double{ranked[k].first} - ranked[0].first) / base.temperature);
  double chi2 = 0.0;
  int inside = 0;
  for (int k = 0; k < 6; ++k) {
    const double q = std::exp((double{ranked[k].first} - ranked[0].first) / base.temperature) / z;
    const int seen = second[first].contains(ranked[k].second) ? second[first][ranked[k].second] : 0;
    inside += seen;
    const double expected = q * most;
    chi2 += (seen - expected) * (seen - expected) / expected;
  }
  EXPECT_EQ(inside, most) << "a token outside the top 6 was sampled";
  // 5 degrees of freedom: P(chi2 > 25.7) = 1e-4.
  EXPECT_LT(chi2, 25.7) << "after token " << first << " (" << most << " draws)";
  EXPECT_GT(accepted, 0);
}

// The draft module over the held-out text with demo/eval.json's protocol (tools/train_demo.py): windows of 512 tokens
// every 256; in each, the draft module at row j runs on the model's hidden state at j and the token j + 1,
// predicting j + 2; targets t in [max(prev_e, b + 2), e). Sums of the NLL and of top-1 hits, and the count.
struct DraftHeldout {
  double nll = 0.0;
  int64_t hits = 0, scored = 0;
};

inline DraftHeldout draft_module_on_heldout_text(ModelRunner& runner) {
  DraftHeldout r;
  const auto& tokens = heldout_tokens();
  const int64_t T = static_cast<int64_t>(tokens.size()), context = 512, stride = 256;
  const size_t vocab = static_cast<size_t>(runner.config().vocab_size);
  int64_t prev_e = 0;
  for (int64_t b = 0;; b += stride) {
    const int64_t e = std::min(b + context, T);
    const std::span<const int32_t> window(tokens.data() + b, static_cast<size_t>(e - b));
    SequenceCache cache = runner.new_sequence();
    const std::vector<SequenceInput> batch{{&cache, window}};
    EXPECT_TRUE(runner.forward(batch, LogitsFor::kLastToken).has_value());
    SequenceInput next{&cache, window.subspan(1)};
    const std::vector<DraftInput> rows{{next, 0, DraftHidden::kModel, 0}};
    auto logits = runner.draft(rows, LogitsFor::kAllTokens);
    EXPECT_TRUE(logits.has_value()) << logits.error().message;
    if (!logits || logits->size() != (window.size() - 1) * vocab) {
      ADD_FAILURE() << "no draft logits for the window at " << b;
      return r;
    }
    for (int64_t t = std::max(prev_e, b + 2); t < e; ++t) {
      const std::span<const float> row = std::span<const float>(*logits).subspan((t - 2 - b) * vocab, vocab);
      for (float x : row) EXPECT_TRUE(std::isfinite(x));
      r.nll -= log_softmax(row)[tokens[t]];
      r.hits += argmax(row) == tokens[t] ? 1 : 0;
      ++r.scored;
    }
    prev_e = e;
    if (e == T) break;
  }
  return r;
}

}  // namespace tern::spec_test
