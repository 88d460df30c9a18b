#include "cli/generate_command.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>

#include "cli/model_options.h"
#include "template/model_template.h"
#include "tokenizer/tokenizer.h"

namespace tern {
namespace {

struct GenerateOptions {
  ModelCliOptions model;
  std::string prompt, prompt_ids, messages_file;
  int32_t max_tokens = 16;
  float temperature = 1.0f, top_p = 1.0f, min_p = 0.0f;
  int32_t top_k = -1, logprobs = 0;
  std::optional<uint64_t> seed;
  bool json = false;
};

// TODO(sampler): replace with runtime/sampler.h's Sampler once it is merged; this stand-in has its call shape
// (one per sequence; sample(logits, prompt_ids, output_ids) -> id, logprob, top logprobs) but only picks the argmax.
struct SampledToken {
  int32_t id;
  float logprob;
  std::vector<std::pair<int32_t, float>> top_logprobs;
};
class GreedySampler {
 public:
  explicit GreedySampler(int32_t logprobs) : logprobs_(logprobs) {}
  Expected<SampledToken> sample(std::span<const float> logits, std::span<const int32_t>, std::span<const int32_t>) {
    double mx = -INFINITY;
    for (float v : logits) {
      if (!std::isfinite(v)) return make_error("the logits row has a non-finite value");
      mx = std::max(mx, static_cast<double>(v));
    }
    double sum = 0.0;
    for (float v : logits) sum += std::exp(v - mx);
    const double log_z = mx + std::log(sum);
    const int32_t n = static_cast<int32_t>(logits.size());
    const int32_t k = std::clamp(std::max(logprobs_, 1), 1, n);
    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    SampledToken t{order[0], static_cast<float>(logits[order[0]] - log_z), {}};
    for (int32_t j = 0; j < logprobs_ && j < n; ++j) {
      t.top_logprobs.emplace_back(order[j], static_cast<float>(logits[order[j]] - log_z));
    }
    return t;
  }

 private:
  int32_t logprobs_;
};

Expected<std::vector<int32_t>> prompt_tokens(const GenerateOptions& o, const std::optional<Tokenizer>& tokenizer) {
  if (!o.prompt_ids.empty()) return parse_id_list(o.prompt_ids);
  if (!tokenizer) return make_error("{}: no tokenizer.json, so give the prompt as --prompt-ids", o.model.model_dir);
  if (!o.messages_file.empty()) {
    std::ifstream in(o.messages_file);
    if (!in) return make_error("cannot read --messages file '{}'", o.messages_file);
    nlohmann::ordered_json doc = nlohmann::ordered_json::parse(in, nullptr, false);
    if (doc.is_discarded()) return make_error("--messages file '{}' is not valid JSON", o.messages_file);
    nlohmann::ordered_json request = doc.is_array() ? nlohmann::ordered_json{{"messages", doc}} : doc;
    TERN_ASSIGN_OR_RETURN(ChatTemplateSet templates, chat_templates_load_model(o.model.model_dir));
    TERN_ASSIGN_OR_RETURN(std::string text, templates.render_request(request));
    return tokenizer->encode(text, false);
  }
  return tokenizer->encode(o.prompt, true);
}

int fail(const std::string& message) {
  fmt::print(stderr, "tern generate: {}\n", message);
  return 2;
}

int run_generate(const GenerateOptions& o) {
  std::optional<Tokenizer> tokenizer;
  if (std::filesystem::exists(std::filesystem::path(o.model.model_dir) / "tokenizer.json")) {
    auto tok = Tokenizer::load(o.model.model_dir);
    if (!tok) return fail(tok.error().message);
    tokenizer.emplace(std::move(*tok));
  } else {
    fmt::print(stderr, "tern generate: {} has no tokenizer.json; the output text is empty\n", o.model.model_dir);
  }
  auto prompt = prompt_tokens(o, tokenizer);
  if (!prompt) return fail(prompt.error().message);
  if (prompt->empty()) return fail("the prompt is empty");
  auto model = load_model_from_options(o.model);
  if (!model) return fail(model.error().message);
  if (o.temperature > 0.0f) {
    fmt::print(stderr, "tern generate: sampling is not built in yet; decoding greedily (as --temperature 0)\n");
  }
  const auto& eos = (*model)->config().eos_token_ids;
  GreedySampler sampler(o.logprobs);
  SequenceCache seq = (*model)->new_sequence();
  std::vector<int32_t> output;
  std::vector<SampledToken> sampled;
  std::string finish_reason = "length";
  std::vector<int32_t> next = *prompt;
  const auto start = std::chrono::steady_clock::now();
  auto first_token = start;
  while (static_cast<int32_t>(output.size()) < o.max_tokens) {
    const std::vector<SequenceInput> batch{{&seq, next}};
    auto logits = (*model)->forward(batch, LogitsFor::kLastToken);
    if (!logits) return fail(logits.error().message);
    auto token = sampler.sample(*logits, *prompt, output);
    if (!token) return fail(token.error().message);
    if (output.empty()) first_token = std::chrono::steady_clock::now();
    output.push_back(token->id);
    sampled.push_back(*token);
    next = {token->id};
    if (std::find(eos.begin(), eos.end(), token->id) != eos.end()) {
      finish_reason = "stop";
      break;
    }
  }
  const auto end = std::chrono::steady_clock::now();
  const double prefill_s = std::chrono::duration<double>(first_token - start).count();
  const double decode_s = std::chrono::duration<double>(end - first_token).count();
  const size_t n_decoded = output.empty() ? 0 : output.size() - 1;
  fmt::print(stderr, "{} prompt tokens: prefill {:.3f} s; {} decode steps in {:.3f} s ({:.2f} tokens/s)\n",
             prompt->size(), prefill_s, n_decoded, decode_s, n_decoded > 0 ? n_decoded / decode_s : 0.0);
  const std::string text = tokenizer ? tokenizer->decode(output, true) : std::string();
  if (!o.json) {
    fmt::print("{}\n", tokenizer ? text : fmt::format("{}", fmt::join(output, ",")));
    return 0;
  }
  nlohmann::ordered_json j{{"prompt_ids", *prompt}, {"ids", output}, {"text", text}, {"finish_reason", finish_reason}};
  if (o.logprobs > 0) {
    j["logprobs"] = nlohmann::ordered_json::array();
    for (const SampledToken& t : sampled) {
      nlohmann::ordered_json step = nlohmann::ordered_json::array();
      for (auto [id, lp] : t.top_logprobs) step.push_back({{"id", id}, {"logprob", lp}});
      j["logprobs"].push_back(std::move(step));
    }
  }
  fmt::print("{}\n", j.dump());
  return 0;
}

}  // namespace

void register_generate_command(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate a continuation of a prompt");
  add_model_options(*cmd, o->model);
  auto* prompt = cmd->add_option("--prompt", o->prompt, "Prompt text (tokenized with the model's tokenizer)");
  auto* ids = cmd->add_option("--prompt-ids", o->prompt_ids, "Prompt as comma-separated token ids");
  auto* messages = cmd->add_option("--messages", o->messages_file,
                                   "JSON file: a messages array (or a request object), rendered by the chat template");
  prompt->excludes(ids)->excludes(messages);
  ids->excludes(messages);
  cmd->add_option("--max-tokens", o->max_tokens, "Most tokens to generate")->check(CLI::NonNegativeNumber);
  cmd->add_option("--temperature", o->temperature, "Sampling temperature (0: greedy)");
  cmd->add_option("--top-p", o->top_p, "Nucleus sampling mass");
  cmd->add_option("--top-k", o->top_k, "Sample among the K most likely tokens (-1: all)");
  cmd->add_option("--min-p", o->min_p, "Drop tokens below min_p times the top probability");
  cmd->add_option("--seed", o->seed, "Sampling seed");
  cmd->add_option("--logprobs", o->logprobs, "Return the K most likely tokens' logprobs at each step")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--json", o->json, "Print one JSON object");
  cmd->callback([o, prompt, ids, messages] {
    if (prompt->count() + ids->count() + messages->count() == 0) {
      throw CLI::ValidationError("give one of --prompt, --prompt-ids or --messages");
    }
    throw CLI::RuntimeError(run_generate(*o));
  });
}

}  // namespace tern
