#include "server/openai_response.h"

#include <fmt/format.h>

namespace tern {

using Json = nlohmann::ordered_json;

ResponseBuilder::ResponseBuilder(ResponseContext context) : ctx_(std::move(context)) {
  completion_lp_ = Json{{"tokens", Json::array()}, {"token_logprobs", Json::array()},
                        {"top_logprobs", Json::array()}, {"text_offset", Json::array()}};
}

Json ResponseBuilder::chunk(Json delta_or_text, Json logprobs, Json finish_reason) const {
  Json choice{{"index", ctx_.index}};
  if (ctx_.chat) {
    choice["delta"] = std::move(delta_or_text);
  } else {
    choice["text"] = std::move(delta_or_text);
  }
  choice["logprobs"] = std::move(logprobs);
  choice["finish_reason"] = std::move(finish_reason);
  return Json{{"id", ctx_.id}, {"object", ctx_.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", ctx_.created}, {"model", ctx_.model}, {"choices", Json::array({choice})}};
}

std::string ResponseBuilder::text_of(int32_t id) const {
  return ctx_.tokenizer ? ctx_.tokenizer->decode(std::vector<int32_t>{id}) : fmt::format("token_id:{}", id);
}

std::string ResponseBuilder::completion_logprob(int32_t id, std::optional<float> logprob,
                                                const std::vector<std::pair<int32_t, float>>& top, int64_t offset) {
  Json top_json = Json::object();
  for (auto [t, lp] : top) top_json[text_of(t)] = lp;
  std::string token = text_of(id);
  completion_lp_["tokens"].push_back(token);
  completion_lp_["token_logprobs"].push_back(logprob ? Json(*logprob) : Json());
  completion_lp_["top_logprobs"].push_back(logprob ? top_json : Json());
  completion_lp_["text_offset"].push_back(offset);
  return token;
}

Json ResponseBuilder::token_logprobs(const TokenEvent& e) {
  auto bytes_of = [](const std::string& s) {
    Json b = Json::array();
    for (unsigned char c : s) b.push_back(static_cast<int>(c));
    return b;
  };
  if (ctx_.chat) {
    const std::string token = text_of(e.token_id);
    Json top = Json::array();
    for (auto [id, lp] : e.top_logprobs) {
      const std::string t = text_of(id);
      top.push_back({{"token", t}, {"logprob", lp}, {"bytes", bytes_of(t)}});
    }
    Json entry{{"token", token}, {"logprob", e.logprob}, {"bytes", bytes_of(token)}, {"top_logprobs", top}};
    logprobs_.push_back(entry);
    return Json{{"content", Json::array({entry})}};
  }
  const int64_t offset = static_cast<int64_t>(ctx_.echo_text.size() + content_.size());
  const std::string token = completion_logprob(e.token_id, e.logprob, e.top_logprobs, offset);
  return Json{{"tokens", Json::array({token})}, {"token_logprobs", Json::array({e.logprob})},
              {"top_logprobs", Json::array({completion_lp_["top_logprobs"].back()})},
              {"text_offset", Json::array({offset})}};
}

void ResponseBuilder::route_text(const std::string& text, bool final, Json& delta) {
  ReasoningDelta r{"", text};
  if (ctx_.reasoning) {
    r = ctx_.reasoning->feed(text);
    if (final) {
      ReasoningDelta rest = ctx_.reasoning->finish();
      r.reasoning += rest.reasoning;
      r.content += rest.content;
    }
  }
  if (!r.reasoning.empty()) {
    reasoning_ += r.reasoning;
    delta["reasoning_content"] = r.reasoning;
  }
  ToolDelta t{r.content, {}};
  if (ctx_.tools) {
    t = ctx_.tools->feed(r.content);
    if (final) {
      ToolDelta rest = ctx_.tools->finish();
      t.content += rest.content;
    }
  }
  if (!t.content.empty()) {
    content_ += t.content;
    delta["content"] = t.content;
  }
  if (!t.calls.empty()) {
    Json calls = Json::array();
    for (ToolCall& c : t.calls) {
      const int64_t index = static_cast<int64_t>(tool_calls_.size());
      Json call{{"id", fmt::format("call_{}_{}", ctx_.id.substr(ctx_.id.size() > 8 ? ctx_.id.size() - 8 : 0), index)},
                {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}};
      tool_calls_.push_back(call);
      call["index"] = index;
      calls.push_back(call);
    }
    delta["tool_calls"] = calls;
  }
}

std::vector<Json> ResponseBuilder::on_event(const TokenEvent& e) {
  std::vector<Json> out;
  if (!started_) {
    started_ = true;
    if (ctx_.chat) out.push_back(chunk(Json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr));
    if (!ctx_.chat && !ctx_.echo_text.empty()) out.push_back(chunk(ctx_.echo_text, nullptr, nullptr));
    if (!ctx_.echo_ids.empty()) {  // the prompt's first token has no logprob
      prompt_offset_ = static_cast<int64_t>(completion_logprob(ctx_.echo_ids.front(), std::nullopt, {}, 0).size());
    }
  }
  for (const SampledToken& p : e.prompt_logprobs) {
    const std::string token = completion_logprob(p.id, p.logprob, p.top_logprobs, prompt_offset_);
    prompt_offset_ += static_cast<int64_t>(token.size());
  }
  Json lp = nullptr;
  if (e.token_id >= 0) {
    ++num_tokens_;
    if (ctx_.logprobs) lp = token_logprobs(e);
  }
  if (ctx_.chat) {
    Json delta = Json::object();
    route_text(e.text, e.finished, delta);
    if (!delta.empty() || !lp.is_null()) out.push_back(chunk(delta, lp, nullptr));
  } else if (!e.text.empty() || !lp.is_null()) {
    content_ += e.text;
    out.push_back(chunk(e.text, lp, nullptr));
  }
  if (e.finished) {
    finish_reason_ = e.finish_reason;
    error_ = e.error;
    if (finish_reason_ == "stop" && !tool_calls_.empty()) finish_reason_ = "tool_calls";
    out.push_back(chunk(ctx_.chat ? Json::object() : Json(""), nullptr, finish_reason_));
  }
  return out;
}

Json ResponseBuilder::choice() const {
  Json choice{{"index", ctx_.index}};
  if (ctx_.chat) {
    Json message{{"role", "assistant"}, {"content", content_.empty() && !tool_calls_.empty() ? Json() : Json(content_)}};
    if (!reasoning_.empty()) message["reasoning_content"] = reasoning_;
    if (!tool_calls_.empty()) message["tool_calls"] = tool_calls_;
    choice["message"] = message;
    choice["logprobs"] = ctx_.logprobs ? Json{{"content", logprobs_}} : Json();
  } else {
    choice["text"] = ctx_.echo_text + content_;
    choice["logprobs"] = ctx_.logprobs ? completion_lp_ : Json();
  }
  choice["finish_reason"] = finish_reason_;
  return choice;
}

namespace {

Json usage_of(std::span<const ResponseBuilder> choices) {
  int64_t prompt = 0, completion = 0;
  for (const ResponseBuilder& b : choices) {
    if (b.context().counts_prompt) prompt += b.context().num_prompt_tokens;
    completion += b.num_completion_tokens();
  }
  return Json{{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

}  // namespace

Json final_response(std::span<const ResponseBuilder> choices) {
  const ResponseContext& c = choices.front().context();
  Json list = Json::array();
  for (const ResponseBuilder& b : choices) list.push_back(b.choice());
  Json body{{"id", c.id}, {"object", c.chat ? "chat.completion" : "text_completion"}, {"created", c.created},
            {"model", c.model}, {"choices", std::move(list)}, {"usage", usage_of(choices)}};
  for (const ResponseBuilder& b : choices) {
    if (b.error().empty()) continue;
    body["error"] = Json{{"message", b.error()}, {"type", "server_error"}};
    break;
  }
  return body;
}

Json usage_chunk(std::span<const ResponseBuilder> choices) {
  const ResponseContext& c = choices.front().context();
  return Json{{"id", c.id}, {"object", c.chat ? "chat.completion.chunk" : "text_completion"}, {"created", c.created},
              {"model", c.model}, {"choices", Json::array()}, {"usage", usage_of(choices)}};
}

}  // namespace tern
