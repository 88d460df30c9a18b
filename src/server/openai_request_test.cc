#include "server/openai_request.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace tern {
namespace {

using Json = nlohmann::ordered_json;

ApiError error_of(const std::string& body, bool chat = true) {
  auto r = api_request_parse(body, chat);
  EXPECT_FALSE(r) << body;
  return r ? ApiError{} : r.error();
}

TEST(ApiRequest, ChatWithPartsToolsAndSampling) {
  auto r = api_request_parse(R"({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
      "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 7, "stop": "END", "max_completion_tokens": 9,
      "include_stop_str_in_output": true,
      "logprobs": true, "top_logprobs": 3, "stream": true, "stream_options": {"include_usage": true},
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
      "chat_template_kwargs": {"enable_thinking": false}})", true);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->template_request["messages"][1]["content"], "Hi there");
  EXPECT_EQ(r->template_request["enable_thinking"], false);
  EXPECT_TRUE(r->tools_enabled);
  EXPECT_FLOAT_EQ(r->sampling.temperature, 0.5f);
  EXPECT_EQ(r->sampling.top_k, 40);
  EXPECT_EQ(r->sampling.seed, 7u);
  EXPECT_EQ(r->sampling.logprobs, 3);
  EXPECT_EQ(r->stop_strings, std::vector<std::string>{"END"});
  EXPECT_TRUE(r->include_stop_string);
  auto biased = api_request_parse(R"({"prompt": [1], "logit_bias": {"300": -100, "7": 2.5}})", false);
  ASSERT_TRUE(biased) << biased.error().message;
  EXPECT_EQ(biased->sampling.logit_bias, (std::vector<std::pair<int32_t, float>>{{7, 2.5f}, {300, -100.0f}}));
  EXPECT_EQ(r->max_tokens, 9);
  EXPECT_TRUE(r->stream && r->include_usage && r->logprobs);
}

TEST(ApiRequest, CompletionPromptForms) {
  auto ids = api_request_parse(R"({"model": "m", "prompt": [1, 2, 3], "echo": true})", false);
  ASSERT_TRUE(ids);
  ASSERT_EQ(ids->prompts.size(), 1u);
  EXPECT_EQ(*ids->prompts[0].ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_TRUE(ids->echo);
  auto text = api_request_parse(R"({"model": "m", "prompt": ["hello"], "logprobs": 2})", false);
  ASSERT_TRUE(text);
  ASSERT_EQ(text->prompts.size(), 1u);
  EXPECT_EQ(*text->prompts[0].text, "hello");
  EXPECT_EQ(text->sampling.logprobs, 2);
  // A batch: strings, or token-id arrays, in order.
  auto batch = api_request_parse(R"({"prompt": ["a", "bc", "d"], "n": 2})", false);
  ASSERT_TRUE(batch) << batch.error().message;
  ASSERT_EQ(batch->prompts.size(), 3u);
  EXPECT_EQ(*batch->prompts[1].text, "bc");
  auto id_batch = api_request_parse(R"({"prompt": [[1, 2], [3]]})", false);
  ASSERT_TRUE(id_batch) << id_batch.error().message;
  ASSERT_EQ(id_batch->prompts.size(), 2u);
  EXPECT_EQ(*id_batch->prompts[1].ids, std::vector<int32_t>{3});
}

// 'model' may be left out (the served model, as vLLM, SGLang and llama.cpp take it); 'n' asks for that many choices.
TEST(ApiRequest, ModelMayBeLeftOutAndNChoices) {
  auto r = api_request_parse(R"({"messages": [{"role": "user", "content": "x"}], "n": 3})", true);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_TRUE(r->model.empty());
  EXPECT_EQ(r->n, 3);
  auto most = api_request_parse(fmt::format(R"({{"prompt": [1], "n": {}}})", kApiMaxChoices), false);
  ASSERT_TRUE(most) << most.error().message;
  EXPECT_EQ(most->n, kApiMaxChoices);
  // Fields that ask for nothing pass.
  auto nothing = api_request_parse(R"({"prompt": [1], "logit_bias": {}, "min_tokens": 0, "use_beam_search": false,
                                      "prompt_logprobs": null})", false);
  EXPECT_TRUE(nothing) << nothing.error().message;
  auto one = api_request_parse(R"({"model": "m", "prompt": [1]})", false);
  ASSERT_TRUE(one);
  EXPECT_EQ(one->n, 1);
  EXPECT_EQ(one->model, "m");
  EXPECT_EQ(one->min_tokens, 0);
  auto min = api_request_parse(R"({"prompt": [1], "min_tokens": 4, "max_tokens": 4})", false);
  ASSERT_TRUE(min) << min.error().message;
  EXPECT_EQ(min->min_tokens, 4);
}

TEST(ApiRequest, ErrorsNameTheParameter) {
  struct Case {
    std::string body;
    std::string param;
    bool chat = true;
  };
  const std::vector<Case> cases{
      {"{", ""},
      {"[1]", ""},
      {R"({"model": 3, "messages": []})", "model"},
      {R"({"model": "m"})", "messages"},
      {R"({"model": "m", "messages": []})", "messages"},
      {R"({"model": "m", "messages": [{"role": "wizard", "content": "x"}]})", "messages[0].role"},
      {R"({"model": "m", "messages": [{"role": "user"}]})", "messages[0].content"},
      {R"({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
       "messages[0].content[0]"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0})", "n"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": -1})", "n"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 129})", "n"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2.5})", "n"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"})", "temperature"},
      // Asked for, not applied: refused rather than ignored.
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": -101}})", "logit_bias"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"x5": 1}})", "logit_bias"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"-1": 1}})", "logit_bias"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": "up"}})", "logit_bias"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": [5]})", "logit_bias"},
      {R"({"model": "m", "prompt": [1], "min_tokens": -1})", "min_tokens", false},
      {R"({"model": "m", "prompt": [1], "min_tokens": 5, "max_tokens": 4})", "min_tokens", false},
      {R"({"model": "m", "prompt": [1], "min_tokens": 1.5})", "min_tokens", false},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "guided_choice": ["a", "b"]})",
       "guided_choice"},
      {R"({"model": "m", "prompt": [1], "use_beam_search": true})", "use_beam_search", false},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3})", "temperature"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0})", "max_tokens"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5})", "max_tokens"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [1]})", "stop"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {}})", "stream_options"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {}})", "tools"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "always"})", "tool_choice"},
      // A "type" that is not a string (the fuzzer's find: an object there threw out of the parser).
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": {"name": "f"}}]})",
       "tools[0]"},
      {R"({"model": "m", "messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]})",
       "messages[0].content[0]"},
      {R"({"model": "m", "messages": [{"role": ["assistant"], "content": null}]})", "messages[0].role"},
      {R"({"model": "m", "prompt": ""})", "prompt", false},
      {R"({"model": "m", "prompt": [1, -2]})", "prompt", false},
      {R"({"model": "m", "prompt": ["a", ""]})", "prompt[1]", false},
      {R"({"model": "m", "prompt": [[1], [2, -3]]})", "prompt[1]", false},
      {R"({"model": "m", "prompt": ["a", 7]})", "prompt[1]", false},
      {R"({"model": "m", "prompt": [[1], [2]], "n": 65})", "prompt", false},
      {R"({"model": "m", "prompt": [1], "logprobs": 50})", "logprobs", false},
      // Numbers that wrap or leave float range: out of range, or refused before the sampler sees them.
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 9223372036854775808})", "n"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 1e300})", "n"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": 18446744073709551615})", "seed"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1e-39})",
       "repetition_penalty"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1e39})",
       "repetition_penalty"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0})", "top_p"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "min_p": 2})", "min_p"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1e39})",
       "presence_penalty"},
  };
  for (const Case& c : cases) {
    ApiError e = error_of(c.body, c.chat);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << " -> " << e.message;
    EXPECT_FALSE(e.message.empty());
    EXPECT_EQ(e.message.find("-9223372036854775808"), std::string::npos) << e.message;  // never wrapped
  }
  EXPECT_NE(error_of(R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0})").message.find(
                "top_p"),
            std::string::npos);
}

TEST(ApiRequest, ContextLimits) {
  ApiRequest r;
  r.max_tokens = 10;
  EXPECT_EQ(api_request_max_tokens(r, 20, 30).value(), 10);
  EXPECT_EQ(api_request_max_tokens(r, 21, 30).error().code, "context_length_exceeded");
  EXPECT_EQ(api_request_max_tokens(r, 30, 30).error().param, "messages");
  r.max_tokens.reset();
  EXPECT_EQ(api_request_max_tokens(r, 20, 30).value(), 10);
}

TEST(ApiError, BodyHasTheOpenAiShape) {
  Json j = Json::parse(api_error_body({404, "no such model", "invalid_request_error", "model", "model_not_found"}));
  EXPECT_EQ(j["error"]["message"], "no such model");
  EXPECT_EQ(j["error"]["param"], "model");
  EXPECT_EQ(j["error"]["code"], "model_not_found");
  EXPECT_TRUE(Json::parse(api_error_body({400, "x"}))["error"]["param"].is_null());
}

}  // namespace
}  // namespace tern

namespace tern {
namespace {

// Untrusted structure nested deeper than any real request (an extra field 20,000 arrays deep, a deep prompt, deep
// tool parameters): a 400 naming the limit, before anything recursive (copies, the template's values) sees it.
TEST(ApiRequest, DeepNestingIsA400NamingTheLimit) {
  const std::string deep = std::string(20000, '[') + std::string(20000, ']');
  const std::vector<std::string> bodies{
      R"({"model": "m", "messages": [{"role": "user", "content": "hi", "extra": )" + deep + "}]}",
      R"({"model": "m", "prompt": )" + deep + "}",
      R"({"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": )" + deep +
          "}}"};
  for (size_t i = 0; i < bodies.size(); ++i) {
    const ApiError e = error_of(bodies[i], i != 1);
    EXPECT_EQ(e.status, 400) << i;
    EXPECT_NE(e.message.find("nested deeper than 128"), std::string::npos) << e.message;
  }
  // A syntax error says where.
  const ApiError e = error_of(R"({"model": "m", "messages": [}])");
  EXPECT_NE(e.message.find("byte"), std::string::npos) << e.message;
}

}  // namespace
}  // namespace tern
