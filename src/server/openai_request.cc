#include "server/openai_request.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "core/json_parse.h"

namespace tern {
namespace {

using Json = nlohmann::ordered_json;
using Result = tl::expected<void, ApiError>;

tl::unexpected<ApiError> bad(std::string param, std::string message, int status = 400, std::string code = {}) {
  return tl::unexpected(ApiError{status, std::move(message), "invalid_request_error", std::move(param),
                                 std::move(code)});
}

// Whether object `v` has `key` as the string `want` (a key of another JSON type is not: Json::value would throw).
bool has_string(const Json& v, const char* key, std::string_view want) {
  if (!v.is_object()) return false;
  auto it = v.find(key);
  return it != v.end() && it->is_string() && it->get_ref<const std::string&>() == want;
}

const char* type_name(const Json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  return "an object";
}

// Reads an optional field of the given JSON kind; null counts as absent.
template <typename T>
tl::expected<std::optional<T>, ApiError> field(const Json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::optional<T>();
  const Json& v = *it;
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return bad(name, fmt::format("'{}' must be a boolean, got {}", name, type_name(v)));
  } else if constexpr (std::is_integral_v<T>) {
    // An integer, or a float with an integral value (1.0); compared as integers, so 2^63 is out of range rather
    // than wrapped to a negative number.
    const bool integral = v.is_number_integer() || (v.is_number_float() && std::isfinite(v.get<double>()) &&
                                                     v.get<double>() == std::floor(v.get<double>()));
    if (!integral) return bad(name, fmt::format("'{}' must be an integer, got {}", name, type_name(v)));
    std::optional<int64_t> value;
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) value = v.get<int64_t>();
    } else if (v.is_number_integer()) {
      value = v.get<int64_t>();
    } else if (std::abs(v.get<double>()) < 9.2e18) {
      value = static_cast<int64_t>(v.get<double>());
    }
    if (!value || *value < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
        *value > static_cast<int64_t>(std::numeric_limits<T>::max())) {
      return bad(name, fmt::format("'{}' is out of range: {}", name, v.dump()));
    }
    return std::optional<T>(static_cast<T>(*value));
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) return bad(name, fmt::format("'{}' must be a number, got {}", name, type_name(v)));
  } else {
    if (!v.is_string()) return bad(name, fmt::format("'{}' must be a string, got {}", name, type_name(v)));
  }
  return std::optional<T>(v.get<T>());
}

#define TERN_TRY_API(expr)                            \
  do {                                                \
    auto try_result_ = (expr);                        \
    if (!try_result_) return tl::unexpected(try_result_.error()); \
  } while (0)

#define TERN_API_FIELD(var, T, body, name)   \
  auto var##_r = field<T>(body, name);       \
  if (!var##_r) return tl::unexpected(var##_r.error()); \
  const std::optional<T> var = *var##_r

Result parse_sampling(const Json& body, ApiRequest& r) {
  SamplingParams& s = r.sampling;
  TERN_API_FIELD(temperature, double, body, "temperature");
  TERN_API_FIELD(top_p, double, body, "top_p");
  TERN_API_FIELD(top_k, int32_t, body, "top_k");
  TERN_API_FIELD(min_p, double, body, "min_p");
  TERN_API_FIELD(presence, double, body, "presence_penalty");
  TERN_API_FIELD(frequency, double, body, "frequency_penalty");
  TERN_API_FIELD(repetition, double, body, "repetition_penalty");
  TERN_API_FIELD(seed, int64_t, body, "seed");
  if (temperature && (*temperature < 0 || *temperature > 2)) {
    return bad("temperature", fmt::format("'temperature' must be in [0, 2], got {}", *temperature));
  }
  if (temperature) s.temperature = static_cast<float>(*temperature);
  if (top_p) s.top_p = static_cast<float>(*top_p);
  if (top_k) s.top_k = *top_k;
  if (min_p) s.min_p = static_cast<float>(*min_p);
  if (presence) s.presence_penalty = static_cast<float>(*presence);
  if (frequency) s.frequency_penalty = static_cast<float>(*frequency);
  // A penalty far from 1 divides or multiplies logits out of float range (1e-39 is a denormal float > 0): refused
  // here, as SGLang bounds it, rather than failing the request later as a server error.
  if (repetition && !(*repetition >= 0.01 && *repetition <= 100)) {
    return bad("repetition_penalty", fmt::format("'repetition_penalty' must be in [0.01, 100], got {}", *repetition));
  }
  if (repetition) s.repetition_penalty = static_cast<float>(*repetition);
  if (seed) s.seed = static_cast<uint64_t>(*seed);
  // logit_bias: {"token id": bias}, the ids written as decimal strings (OpenAI's form), kept in id order.
  if (auto lb = body.find("logit_bias"); lb != body.end() && !lb->is_null()) {
    if (!lb->is_object()) return bad("logit_bias", "'logit_bias' must be an object of token ids to biases");
    for (const auto& [key, value] : lb->items()) {
      int64_t id = -1;
      const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
      if (ec != std::errc() || end != key.data() + key.size() || id < 0 || id > INT32_MAX) {
        return bad("logit_bias", fmt::format("'logit_bias' keys must be token ids, got '{}'", key));
      }
      if (!value.is_number()) {
        return bad("logit_bias", fmt::format("'logit_bias' values must be numbers, got {}", type_name(value)));
      }
      s.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(value.get<double>()));
    }
    std::sort(s.logit_bias.begin(), s.logit_bias.end());
  }
  // What the sampler would refuse later (top_p outside (0, 1], min_p outside [0, 1], ...) is a 400 naming the
  // parameter now.
  if (auto valid = sampling_params_validate(s); !valid) {
    const std::string& m = valid.error().message;
    return bad(m.substr(0, m.find(' ')), m);
  }
  return {};
}

Result parse_stop(const Json& body, ApiRequest& r) {
  auto it = body.find("stop");
  if (it != body.end() && !it->is_null()) {
    if (it->is_string()) {
      r.stop_strings.push_back(*it);
    } else if (it->is_array()) {
      for (const Json& s : *it) {
        if (!s.is_string()) return bad("stop", "'stop' must be a string or an array of strings");
        r.stop_strings.push_back(s);
      }
    } else {
      return bad("stop", fmt::format("'stop' must be a string or an array of strings, got {}", type_name(*it)));
    }
  }
  for (const std::string& s : r.stop_strings) {
    if (s.empty()) return bad("stop", "'stop' strings must not be empty");
  }
  auto ids = body.find("stop_token_ids");
  if (ids != body.end() && !ids->is_null()) {
    if (!ids->is_array()) return bad("stop_token_ids", "'stop_token_ids' must be an array of integers");
    for (const Json& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
        return bad("stop_token_ids", "'stop_token_ids' must hold non-negative integers");
      }
      r.stop_token_ids.push_back(id.get<int32_t>());
    }
  }
  return {};
}

Result parse_common(const Json& body, ApiRequest& r) {
  TERN_API_FIELD(model, std::string, body, "model");
  if (model) r.model = *model;
  TERN_API_FIELD(n, int64_t, body, "n");
  if (n && (*n < 1 || *n > kApiMaxChoices)) {
    return bad("n", fmt::format("'n' must be in [1, {}], got {}", kApiMaxChoices, *n));
  }
  if (n) r.n = static_cast<int32_t>(*n);
  TERN_API_FIELD(best_of, int64_t, body, "best_of");
  if (best_of && *best_of != 1) return bad("best_of", "only best_of=1 is supported");
  TERN_API_FIELD(stream, bool, body, "stream");
  r.stream = stream.value_or(false);
  if (auto so = body.find("stream_options"); so != body.end() && !so->is_null()) {
    if (!so->is_object()) return bad("stream_options", "'stream_options' must be an object");
    if (!r.stream) return bad("stream_options", "'stream_options' is only allowed when 'stream' is true");
    TERN_API_FIELD(include_usage, bool, *so, "include_usage");
    r.include_usage = include_usage.value_or(false);
  }
  TERN_API_FIELD(ignore_eos, bool, body, "ignore_eos");
  r.ignore_eos = ignore_eos.value_or(false);
  TERN_API_FIELD(skip_special, bool, body, "skip_special_tokens");
  r.skip_special_tokens = skip_special.value_or(true);
  TERN_API_FIELD(max_tokens, int32_t, body, "max_tokens");
  TERN_API_FIELD(max_completion_tokens, int32_t, body, "max_completion_tokens");
  r.max_tokens = max_completion_tokens ? max_completion_tokens : max_tokens;
  if (r.max_tokens && *r.max_tokens < 1) {
    return bad(max_completion_tokens ? "max_completion_tokens" : "max_tokens",
               fmt::format("the most tokens to generate must be at least 1, got {}", *r.max_tokens));
  }
  TERN_API_FIELD(min_tokens, int32_t, body, "min_tokens");
  r.min_tokens = min_tokens.value_or(0);
  if (r.min_tokens < 0) return bad("min_tokens", fmt::format("'min_tokens' must be at least 0, got {}", r.min_tokens));
  if (r.max_tokens && r.min_tokens > *r.max_tokens) {
    return bad("min_tokens", fmt::format("'min_tokens' ({}) must not exceed the most tokens to generate ({})",
                                         r.min_tokens, *r.max_tokens));
  }
  if (auto it = body.find("response_format"); it != body.end() && !it->is_null()) {
    if (!it->is_object() || it->value("type", "") != "text") {
      return bad("response_format", "'response_format' other than {\"type\": \"text\"} is not supported");
    }
  }
  // Fields that would change what is generated and that tern does not apply are refused, not ignored: vLLM's
  // extras. An empty, null, zero or false value asks for nothing and passes.
  for (const char* name : {"prompt_logprobs", "use_beam_search", "guided_json",
                           "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"}) {
    auto it = body.find(name);
    if (it == body.end() || it->is_null() || (it->is_boolean() && !it->get<bool>()) ||
        (it->is_number() && it->get<double>() == 0) || ((it->is_object() || it->is_array()) && it->empty())) {
      continue;
    }
    return bad(name, fmt::format("'{}' is not supported", name));
  }
  TERN_TRY_API(parse_stop(body, r));
  TERN_API_FIELD(include_stop, bool, body, "include_stop_str_in_output");
  r.include_stop_string = include_stop.value_or(false);
  TERN_TRY_API(parse_sampling(body, r));
  if (auto v = sampling_params_validate(r.sampling); !v) return bad("", v.error().message);
  return {};
}

Result parse_content(const Json& m, size_t i, Json& out) {
  const std::string param = fmt::format("messages[{}].content", i);
  auto it = m.find("content");
  if (it == m.end() || it->is_null()) {
    if (has_string(m, "role", "assistant")) return {};
    return bad(param, fmt::format("'{}' is required", param));
  }
  if (it->is_string()) return {};
  if (!it->is_array()) return bad(param, fmt::format("'{}' must be a string or an array of parts", param));
  std::string text;
  for (size_t k = 0; k < it->size(); ++k) {
    const Json& part = (*it)[k];
    if (!has_string(part, "type", "text") || !part.contains("text") || !part["text"].is_string()) {
      return bad(fmt::format("{}[{}]", param, k),
                 fmt::format("'{}[{}]' must be a text part {{\"type\": \"text\", \"text\": ...}}; other parts are not "
                             "supported", param, k));
    }
    text += part["text"].get<std::string>();
  }
  out["content"] = text;  // parts joined, as the templates of text models expect a string
  return {};
}

Result parse_messages(const Json& body, ApiRequest& r) {
  auto it = body.find("messages");
  if (it == body.end()) return bad("messages", "'messages' is required");
  if (!it->is_array() || it->empty()) return bad("messages", "'messages' must be a non-empty array");
  Json messages = Json::array();
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& m = (*it)[i];
    if (!m.is_object()) return bad(fmt::format("messages[{}]", i), fmt::format("'messages[{}]' must be an object", i));
    auto role = m.find("role");
    static const std::vector<std::string> kRoles{"system", "developer", "user", "assistant", "tool"};
    if (role == m.end() || !role->is_string() ||
        std::find(kRoles.begin(), kRoles.end(), role->get<std::string>()) == kRoles.end()) {
      return bad(fmt::format("messages[{}].role", i),
                 fmt::format("'messages[{}].role' must be one of system, developer, user, assistant, tool", i));
    }
    Json copy = m;
    TERN_TRY_API(parse_content(m, i, copy));
    if (copy.contains("tool_calls")) {  // templates read arguments as objects; clients send JSON strings
      for (Json& call : copy["tool_calls"]) {
        if (call.is_object() && call.contains("function") && call["function"].is_object() &&
            call["function"].contains("arguments") && call["function"]["arguments"].is_string()) {
          auto parsed = json_parse_untrusted_ordered(call["function"]["arguments"].get<std::string>());
          if (parsed) call["function"]["arguments"] = std::move(*parsed);
        }
      }
    }
    messages.push_back(std::move(copy));
  }
  r.template_request["messages"] = std::move(messages);
  return {};
}

Result parse_tools(const Json& body, ApiRequest& r) {
  auto it = body.find("tools");
  if (it != body.end() && !it->is_null()) {
    if (!it->is_array()) return bad("tools", "'tools' must be an array");
    for (size_t i = 0; i < it->size(); ++i) {
      const Json& t = (*it)[i];
      if (!has_string(t, "type", "function") || !t.contains("function") ||
          !t["function"].is_object() || !t["function"].contains("name") || !t["function"]["name"].is_string()) {
        return bad(fmt::format("tools[{}]", i),
                   fmt::format("'tools[{}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", i));
      }
    }
    r.tools = *it;
  }
  std::string choice = "auto";
  auto tc = body.find("tool_choice");
  if (tc != body.end() && !tc->is_null()) {
    if (tc->is_string()) {
      choice = *tc;
      if (choice != "none" && choice != "auto" && choice != "required") {
        return bad("tool_choice", "'tool_choice' must be none, auto, required or a function");
      }
    } else if (tc->is_object() && tc->contains("function") && (*tc)["function"].is_object() &&
               (*tc)["function"].contains("name") && (*tc)["function"]["name"].is_string()) {
      const std::string name = (*tc)["function"]["name"];
      const bool known = std::any_of(r.tools.begin(), r.tools.end(),
                                     [&](const Json& t) { return t["function"]["name"] == name; });
      if (!known) return bad("tool_choice", fmt::format("'tool_choice' names '{}', which is not in 'tools'", name));
    } else {
      return bad("tool_choice", "'tool_choice' must be none, auto, required or a function");
    }
  }
  if ((choice == "required" || (tc != body.end() && tc->is_object())) && r.tools.empty()) {
    return bad("tool_choice", "'tool_choice' needs 'tools'");
  }
  r.tools_enabled = !r.tools.empty() && choice != "none";
  if (!r.tools.empty() && choice != "none") r.template_request["tools"] = r.tools;
  return {};
}

Result parse_chat(const Json& body, ApiRequest& r) {
  TERN_TRY_API(parse_messages(body, r));
  TERN_TRY_API(parse_tools(body, r));
  TERN_API_FIELD(logprobs, bool, body, "logprobs");
  TERN_API_FIELD(top_logprobs, int32_t, body, "top_logprobs");
  r.logprobs = logprobs.value_or(false);
  if (top_logprobs) {
    if (!r.logprobs) return bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    if (*top_logprobs < 0 || *top_logprobs > kSamplingMaxLogprobs) {
      return bad("top_logprobs", fmt::format("'top_logprobs' must be in [0, 20], got {}", *top_logprobs));
    }
    r.sampling.logprobs = *top_logprobs;
  }
  if (auto kw = body.find("chat_template_kwargs"); kw != body.end() && !kw->is_null()) {
    if (!kw->is_object()) return bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    for (const auto& [k, v] : kw->items()) {
      if (k == "messages" || k == "tools") continue;
      r.template_request[k] = v;
    }
  }
  TERN_API_FIELD(separate, bool, body, "separate_reasoning");
  r.separate_reasoning = separate.value_or(true);
  return {};
}

// One prompt: a non-empty string or a non-empty array of token ids; `param` names it in errors.
tl::expected<ApiPrompt, ApiError> parse_one_prompt(const Json& p, const std::string& param) {
  if (p.is_string()) {
    if (p.get<std::string>().empty()) return bad(param, fmt::format("'{}' must not be empty", param));
    return ApiPrompt{.text = p.get<std::string>()};
  }
  if (!p.is_array() || p.empty()) {
    return bad(param, fmt::format("'{}' must be a string or a non-empty array of token ids", param));
  }
  std::vector<int32_t> ids;
  for (const Json& id : p) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
      return bad(param, fmt::format("'{}' token ids must be non-negative integers", param));
    }
    ids.push_back(id.get<int32_t>());
  }
  return ApiPrompt{.ids = std::move(ids)};
}

// 'prompt': a string, an array of token ids, or a batch: an array of strings or of token-id arrays.
Result parse_prompt(const Json& body, ApiRequest& r) {
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return bad("prompt", "'prompt' is required");
  const Json& p = *it;
  const bool batch = p.is_array() && !p.empty() && (p[0].is_string() || p[0].is_array());
  if (!batch) {
    auto one = parse_one_prompt(p, "prompt");
    if (!one) return tl::unexpected(one.error());
    r.prompts.push_back(std::move(*one));
    return {};
  }
  for (size_t k = 0; k < p.size(); ++k) {
    auto one = parse_one_prompt(p[k], fmt::format("prompt[{}]", k));
    if (!one) return tl::unexpected(one.error());
    r.prompts.push_back(std::move(*one));
  }
  return {};
}

Result parse_completion(const Json& body, ApiRequest& r) {
  TERN_TRY_API(parse_prompt(body, r));
  if (static_cast<int64_t>(r.prompts.size()) * r.n > kApiMaxChoices) {
    return bad("prompt", fmt::format("{} prompts times n = {} is more than the {} choices one request may ask for",
                                     r.prompts.size(), r.n, kApiMaxChoices));
  }
  TERN_API_FIELD(echo, bool, body, "echo");
  r.echo = echo.value_or(false);
  TERN_API_FIELD(logprobs, int32_t, body, "logprobs");
  if (logprobs) {
    if (*logprobs < 0 || *logprobs > kSamplingMaxLogprobs) {
      return bad("logprobs", fmt::format("'logprobs' must be in [0, 20], got {}", *logprobs));
    }
    if (r.echo && r.stream) {
      return bad("logprobs", "'logprobs' with 'echo' (the prompt's logprobs) is not available when streaming");
    }
    if (r.echo) r.prompt_logprobs = *logprobs;
    r.logprobs = true;
    r.sampling.logprobs = *logprobs;
  }
  if (auto s = body.find("suffix"); s != body.end() && !s->is_null()) return bad("suffix", "'suffix' is not supported");
  return {};
}

tl::expected<Json, ApiError> body_object(std::string_view body) {
  auto parsed = json_parse_untrusted_ordered(body);
  if (!parsed) return bad("", fmt::format("the request body is not valid JSON: {}", parsed.error().message));
  if (!parsed->is_object()) {
    return bad("", fmt::format("the request body must be a JSON object, got {}", type_name(*parsed)));
  }
  return std::move(*parsed);
}

}  // namespace

std::string api_error_body(const ApiError& e) {
  Json error{{"message", e.message}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param.empty()) error["param"] = e.param;
  if (!e.code.empty()) error["code"] = e.code;
  return Json{{"error", error}}.dump(-1, ' ', false, Json::error_handler_t::replace);
}

tl::expected<ApiRequest, ApiError> api_request_parse(std::string_view body, bool chat) {
  auto parsed = body_object(body);
  if (!parsed) return tl::unexpected(parsed.error());
  Json& j = *parsed;
  ApiRequest r;
  r.chat = chat;
  TERN_TRY_API(parse_common(j, r));
  TERN_TRY_API(chat ? parse_chat(j, r) : parse_completion(j, r));
  return r;
}

tl::expected<TokenizeRequest, ApiError> api_tokenize_parse(std::string_view body) {
  auto j = body_object(body);
  if (!j) return tl::unexpected(j.error());
  TokenizeRequest t;
  if (j->contains("messages")) {
    auto chat = api_request_parse(body, true);
    if (!chat) return tl::unexpected(chat.error());
    t.model = chat->model;
    t.chat = std::move(*chat);
    return t;
  }
  TERN_API_FIELD(model, std::string, *j, "model");
  if (model) t.model = *model;
  TERN_API_FIELD(prompt, std::string, *j, "prompt");
  if (!prompt) return bad("prompt", "'prompt' (a string) or 'messages' is required");
  t.prompt = *prompt;
  TERN_API_FIELD(add_special, bool, *j, "add_special_tokens");
  t.add_special_tokens = add_special.value_or(true);
  return t;
}

tl::expected<DetokenizeRequest, ApiError> api_detokenize_parse(std::string_view body) {
  auto j = body_object(body);
  if (!j) return tl::unexpected(j.error());
  DetokenizeRequest d;
  TERN_API_FIELD(model, std::string, *j, "model");
  if (model) d.model = *model;
  auto it = j->find("tokens");
  if (it == j->end() || !it->is_array()) return bad("tokens", "'tokens' (an array of token ids) is required");
  for (const Json& id : *it) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
      return bad("tokens", "'tokens' must hold non-negative integers");
    }
    d.tokens.push_back(id.get<int32_t>());
  }
  return d;
}

tl::expected<int32_t, ApiError> api_request_max_tokens(const ApiRequest& r, int64_t prompt_tokens,
                                                      int64_t context_length) {
  if (prompt_tokens >= context_length) {
    return bad(r.chat ? "messages" : "prompt",
               fmt::format("the prompt has {} tokens, but the context length is {}", prompt_tokens, context_length),
               400, "context_length_exceeded");
  }
  const int64_t room = context_length - prompt_tokens;
  if (!r.max_tokens) return static_cast<int32_t>(room);
  if (*r.max_tokens > room) {
    return bad("max_tokens",
               fmt::format("max_tokens is {}, but the prompt has {} tokens and the context length is {} (at most {})",
                           *r.max_tokens, prompt_tokens, context_length, room),
               400, "context_length_exceeded");
  }
  return *r.max_tokens;
}

}  // namespace tern
