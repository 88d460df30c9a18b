// OpenAI request bodies (/v1/chat/completions, /v1/completions) checked and turned into what the engine needs.
// Every problem is an ApiError with the HTTP status and an OpenAI-style body naming the parameter.
#pragma once

#include <tl/expected.hpp>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/sampler.h"
#include "runtime/stop.h"

namespace tern {

struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // empty: null
  std::string code;   // empty: null
};

std::string api_error_body(const ApiError& error);

// The most choices one request may ask for: 'n', times the prompts of a batched completions request.
inline constexpr int32_t kApiMaxChoices = 128;

// One completions prompt: token ids, or text.
struct ApiPrompt {
  std::optional<std::vector<int32_t>> ids;
  std::optional<std::string> text;
};

struct ApiRequest {
  bool chat = true;
  std::string model;  // empty: not given (the served model, as vLLM, SGLang and llama.cpp take it)
  // Choices to generate from the prompt, each its own sequence ('n'). With a seed, choice i samples with seed + i
  // (vLLM's rule), so choice i equals the one-choice request with that seed.
  int32_t n = 1;
  // chat: what the chat template sees (messages, tools, chat_template_kwargs flattened in).
  nlohmann::ordered_json template_request;
  nlohmann::ordered_json tools = nlohmann::ordered_json::array();
  bool tools_enabled = false;  // tools given and tool_choice is not "none"
  bool separate_reasoning = true;
  // completions: the prompts (several: a batch, as vLLM takes a list of strings or of token-id lists); prompt p's
  // choices have the indices p * n .. p * n + n - 1.
  std::vector<ApiPrompt> prompts;
  bool echo = false;
  SamplingParams sampling;
  std::vector<std::string> stop_strings;
  bool include_stop_string = false;  // vLLM's include_stop_str_in_output
  std::vector<int32_t> stop_token_ids;
  std::optional<int32_t> max_tokens;
  int32_t min_tokens = 0;  // vLLM's: no stop id or stop string ends a choice before this many tokens
  bool ignore_eos = false;
  bool skip_special_tokens = true;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;  // chat: logprobs; completions: logprobs given (>= 0)
  // completions with echo and logprobs: the prompt tokens' logprobs too, with this many top ones (-1: none).
  int32_t prompt_logprobs = -1;
};

// `body`: the raw request body. `chat` selects the endpoint's schema.
tl::expected<ApiRequest, ApiError> api_request_parse(std::string_view body, bool chat);

// POST /tokenize (vLLM's and SGLang's route): a text prompt, {"prompt": "...", "add_special_tokens": true}, or chat
// messages with the chat request's fields ({"messages": [...], "tools": ..., "chat_template_kwargs": ...}), which
// are rendered by the chat template as a chat completion's prompt is.
struct TokenizeRequest {
  std::string model;  // empty: not given
  std::optional<std::string> prompt;
  bool add_special_tokens = true;
  std::optional<ApiRequest> chat;  // the messages form
};
tl::expected<TokenizeRequest, ApiError> api_tokenize_parse(std::string_view body);

// POST /detokenize: {"tokens": [ids]}, decoded with special tokens kept (vLLM's default).
struct DetokenizeRequest {
  std::string model;
  std::vector<int32_t> tokens;
};
tl::expected<DetokenizeRequest, ApiError> api_detokenize_parse(std::string_view body);

// Checks the prompt length and max_tokens against the context; fills max_tokens when absent (the rest of the
// context, as vLLM does).
tl::expected<int32_t, ApiError> api_request_max_tokens(const ApiRequest& request, int64_t prompt_tokens,
                                                      int64_t context_length);

}  // namespace tern
