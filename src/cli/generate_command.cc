#include "cli/generate_command.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli/model_options.h"
#include "runtime/speculative.h"
#include "kernels/cpu/sampler.h"
#include "runtime/stop.h"
#include "template/model_template.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"

namespace tern {
namespace {

struct GenerateOptions {
  ModelCliOptions model;
  std::string prompt, prompt_ids, messages_file;
  SamplingParams sampling;
  StopCriteria stop{.max_tokens = 16};
  bool json = false;
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
  // With speculation a step may write 2 * num_steps positions past the last token (runtime/speculative.h).
  const int64_t total = static_cast<int64_t>(prompt->size()) + std::max<int64_t>(o.stop.max_tokens, 1) +
                        2 * speculative_steps_of(o.model);
  // A step's rows: the prompt, or a verification of the last token and its drafts.
  const int64_t rows = std::max<int64_t>(static_cast<int64_t>(prompt->size()), speculative_steps_of(o.model) + 1);
  auto model = load_model_from_options(
      o.model, DeviceModelOptions{.max_batch_tokens = rows, .max_sequences = 1, .kv_cache_tokens = total});
  if (!model) return fail(model.error().message);
  if (auto valid = sampling_params_validate(o.sampling); !valid) return fail(valid.error().message);
  StopCriteria stop = o.stop;
  for (int64_t id : (*model)->config().eos_token_ids) stop.stop_token_ids.push_back(static_cast<int32_t>(id));
  if (auto valid = stop_criteria_validate(stop); !valid) return fail(valid.error().message);
  Sampler sampler(o.sampling);
  StopChecker stop_checker(stop);
  std::optional<IncrementalDetokenizer> detokenizer;
  if (tokenizer) detokenizer.emplace(*tokenizer, /*skip_special_tokens=*/true);
  SequenceCache seq = (*model)->new_sequence();
  std::vector<int32_t> output;
  std::vector<SampledToken> sampled;
  std::string text, finish_reason = "length";
  const int spec_steps = speculative_steps_of(o.model);
  std::vector<int32_t> drafts;
  int64_t drafted = 0, accepted = 0, steps = 0;
  std::array<int64_t, kMaxSpeculativeSteps> drafted_at{}, accepted_at{};  // by draft position
  // One step: a token, or with speculation the accepted drafts and the token after them.
  auto step = [&]() -> Expected<std::vector<SampledToken>> {
    const std::span<const int32_t> next = output.empty() ? std::span<const int32_t>(*prompt)
                                                         : std::span<const int32_t>(output).last(1);
    const std::vector<SampleRow> rows{{&sampler, *prompt, output}};
    if (spec_steps == 0) {
      const std::vector<SequenceInput> batch{{&seq, next}};
      TERN_ASSIGN_OR_RETURN(SampleResults got, (*model)->forward_sample(batch, rows));
      if (!got[0]) return tl::unexpected<Error>(got[0].error());
      return std::vector<SampledToken>{std::move(*got[0])};
    }
    SpecSequence s{.input = {&seq, next}, .following = next.subspan(1), .sample = rows[0], .drafts = &drafts};
    TERN_ASSIGN_OR_RETURN(std::vector<SpecOutcome> got, speculative_step(**model, {&s, 1}, spec_steps));
    if (got[0].error) return tl::unexpected<Error>(*got[0].error);
    drafted += got[0].drafted;
    accepted += got[0].accepted;
    for (int64_t k = 0; k < got[0].drafted; ++k) {
      ++drafted_at[static_cast<size_t>(k)];
      if (k < got[0].accepted) ++accepted_at[static_cast<size_t>(k)];
    }
    return std::move(got[0].tokens);
  };
  const auto start = std::chrono::steady_clock::now();
  auto first_token = start;
  while (!stop_checker.finished()) {
    auto tokens = step();
    if (!tokens) return fail(tokens.error().message);
    if (output.empty()) first_token = std::chrono::steady_clock::now();
    else ++steps;
    for (const SampledToken& token : *tokens) {
      if (stop_checker.finished()) break;
      output.push_back(token.id);
      sampled.push_back(token);
      const StopUpdate update = stop_checker.feed(token.id, detokenizer ? detokenizer->push(token.id) : "");
      text += update.text;
      // As the serving engine: the detokenizer's tail (U+FFFD for an incomplete character) ends the text, unless a
      // stop string cut it.
      if (update.finished && !update.stop_string && detokenizer) text += detokenizer->finish();
      if (update.finished) finish_reason = std::string(update.finish_reason);
    }
  }
  const auto end = std::chrono::steady_clock::now();
  const double prefill_s = std::chrono::duration<double>(first_token - start).count();
  const double decode_s = std::chrono::duration<double>(end - first_token).count();
  const size_t n_decoded = output.empty() ? 0 : output.size() - 1;
  fmt::print(stderr, "{} prompt tokens: prefill {:.3f} s; {} tokens in {} decode steps in {:.3f} s ({:.2f} tokens/s)\n",
             prompt->size(), prefill_s, n_decoded, steps, decode_s, n_decoded > 0 ? n_decoded / decode_s : 0.0);
  if (spec_steps > 0) {
    std::string by_position;
    for (int k = 0; k < spec_steps; ++k) {
      const auto d = drafted_at[static_cast<size_t>(k)], a = accepted_at[static_cast<size_t>(k)];
      by_position += fmt::format("{}{:.1f}%", k == 0 ? "" : " / ", d > 0 ? 100.0 * a / d : 0.0);
    }
    fmt::print(stderr, "speculative (mtp, {} steps): {} of {} draft tokens accepted ({:.1f}%; by position {}), {:.2f} "
               "tokens per step\n", spec_steps, accepted, drafted, drafted > 0 ? 100.0 * accepted / drafted : 0.0,
               by_position, steps > 0 ? static_cast<double>(n_decoded) / steps : 0.0);
  }
  if (!o.json) {
    fmt::print("{}\n", tokenizer ? text : fmt::format("{}", fmt::join(output, ",")));
    return 0;
  }
  nlohmann::ordered_json j{{"prompt_ids", *prompt}, {"ids", output}, {"text", text}, {"finish_reason", finish_reason}};
  if (spec_steps > 0) {
    // Accepted length: tokens per verification step (accepted drafts + 1), as SGLang reports it.
    j["speculative"] = {{"algorithm", "mtp"}, {"num_steps", spec_steps}, {"decode_steps", steps},
                        {"draft_tokens", drafted}, {"accepted_tokens", accepted},
                        {"mean_accepted_length", steps > 0 ? static_cast<double>(n_decoded) / steps : 0.0}};
    // By draft position: the k-th drafts verified and accepted (a draft chained on the wrong hidden state falls off
    // after the first position, which the totals hide).
    const auto k_end = drafted_at.begin() + spec_steps;
    j["speculative"]["draft_tokens_by_position"] = std::vector<int64_t>(drafted_at.begin(), k_end);
    j["speculative"]["accepted_tokens_by_position"] =
        std::vector<int64_t>(accepted_at.begin(), accepted_at.begin() + spec_steps);
  }
  if (o.sampling.logprobs > 0) {
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
  SamplingParams& p = o->sampling;
  cmd->add_option("--max-tokens", o->stop.max_tokens, "Most tokens to generate");
  cmd->add_option("--temperature", p.temperature, "Sampling temperature (0: greedy)");
  cmd->add_option("--top-p", p.top_p, "Nucleus sampling mass");
  cmd->add_option("--top-k", p.top_k, "Sample among the K most likely tokens (-1: all)");
  cmd->add_option("--min-p", p.min_p, "Drop tokens below min_p times the top probability");
  cmd->add_option("--repetition-penalty", p.repetition_penalty, "Penalise tokens of the prompt and the output (>1)");
  cmd->add_option("--presence-penalty", p.presence_penalty, "Subtract from tokens already generated");
  cmd->add_option("--frequency-penalty", p.frequency_penalty, "Subtract per occurrence in the output");
  cmd->add_option("--seed", p.seed, "Sampling seed (same seed, same output)");
  cmd->add_option("--stop", o->stop.stop_strings, "Stop before this text (repeatable)");
  cmd->add_option("--stop-token-ids", o->stop.stop_token_ids, "Stop after these token ids (besides EOS)")
      ->delimiter(',');
  cmd->add_option("--logprobs", p.logprobs, "Return the K most likely tokens' logprobs at each step");
  cmd->add_flag("--json", o->json, "Print one JSON object");
  add_speculative_options(*cmd, o->model);
  cmd->callback([o, prompt, ids, messages] {
    if (prompt->count() + ids->count() + messages->count() == 0) {
      throw CLI::ValidationError("give one of --prompt, --prompt-ids or --messages");
    }
    throw CLI::RuntimeError(run_generate(*o));
  });
}

}  // namespace tern
