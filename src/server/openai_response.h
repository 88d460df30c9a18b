// Turns a request's TokenEvents into OpenAI response objects: streamed chunks as the tokens arrive, and the whole
// response at the end. Chat output goes through the reasoning and tool-call parsers when they are enabled. A request
// with n choices has one builder per choice (its index in the context); the whole response and the usage chunk
// gather them.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "server/reasoning_parser.h"
#include "server/tool_parser.h"
#include "tokenizer/tokenizer.h"

namespace tern {

struct ResponseContext {
  bool chat = true;
  std::string id, model;
  int64_t created = 0;
  int64_t index = 0;  // the choice's
  int64_t num_prompt_tokens = 0;
  bool counts_prompt = true;  // the usage counts this choice's prompt (the first choice of each prompt)
  bool logprobs = false;
  const Tokenizer* tokenizer = nullptr;  // for the tokens' text in logprobs
  std::optional<ReasoningParser> reasoning;
  std::optional<ToolCallParser> tools;
  std::string echo_text;  // completions with echo: the prompt, sent first
  // completions with echo and logprobs: the prompt's tokens, whose logprobs (from the second on) arrive in
  // TokenEvent::prompt_logprobs and come first in the choice's logprobs.
  std::vector<int32_t> echo_ids;
};

class ResponseBuilder {
 public:
  explicit ResponseBuilder(ResponseContext context);

  // Stream chunks (JSON objects) this event produces; the first call also yields the role chunk.
  std::vector<nlohmann::ordered_json> on_event(const TokenEvent& event);
  nlohmann::ordered_json choice() const;  // the choice in the non-streaming body
  const ResponseContext& context() const { return ctx_; }
  bool finished() const { return !finish_reason_.empty(); }
  const std::string& finish_reason() const { return finish_reason_; }
  const std::string& error() const { return error_; }  // why the request failed (finish_reason "error")
  int64_t num_completion_tokens() const { return num_tokens_; }

 private:
  nlohmann::ordered_json chunk(nlohmann::ordered_json delta_or_text, nlohmann::ordered_json logprobs,
                               nlohmann::ordered_json finish_reason) const;
  nlohmann::ordered_json token_logprobs(const TokenEvent& event);
  // Appends one token to the completions logprobs (null logprob and top for a prompt's first token); its text.
  std::string completion_logprob(int32_t id, std::optional<float> logprob,
                                 const std::vector<std::pair<int32_t, float>>& top, int64_t offset);
  std::string text_of(int32_t id) const;
  void route_text(const std::string& text, bool final, nlohmann::ordered_json& delta);

  ResponseContext ctx_;
  bool started_ = false;
  int64_t num_tokens_ = 0;
  std::string content_, reasoning_;
  nlohmann::ordered_json tool_calls_ = nlohmann::ordered_json::array();
  nlohmann::ordered_json logprobs_ = nlohmann::ordered_json::array();      // chat: content entries
  nlohmann::ordered_json completion_lp_ = nlohmann::ordered_json::object();  // completions: the four arrays
  std::string finish_reason_, error_;
  int64_t prompt_offset_ = 0;  // text_offset of the next prompt token (echo with logprobs)
};

// The non-streaming body of a request's choices (one builder each, in index order, all finished): every choice, the
// usage (each prompt counted once, the completions' tokens summed) and the first failed choice's error.
nlohmann::ordered_json final_response(std::span<const ResponseBuilder> choices);
// The stream's last chunk with stream_options.include_usage: that usage and no choices.
nlohmann::ordered_json usage_chunk(std::span<const ResponseBuilder> choices);

}  // namespace tern
