// libFuzzer target for the chat-template engine (lexer, parser, renderer): any template source must parse or
// give an Error, and a parsed template must render a typical chat request or give an Error, never a crash, a
// runaway allocation or a hang (libFuzzer's -timeout and -rss_limit_mb turn those into failures).
#include <string_view>

#include "template/template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto tmpl = tern::ChatTemplate::parse(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!tmpl) return 0;
  static const nlohmann::ordered_json kContext = nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "You are helpful."},
      {"role": "user", "content": "What is 2+2? <think>"},
      {"role": "assistant", "content": "4", "reasoning_content": "add",
       "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
      {"role": "tool", "content": "{\"sum\": 4}"},
      {"role": "user", "content": [{"type": "text", "text": "thanks"}]}
    ],
    "tools": [{"type": "function", "function": {"name": "add", "description": "adds",
               "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}],
    "add_generation_prompt": true, "enable_thinking": false, "bos_token": "<s>", "eos_token": "</s>"
  })");
  (void)tmpl->render(kContext);
  return 0;
}
