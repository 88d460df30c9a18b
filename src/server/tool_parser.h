// Tool calls in generated text, turned into OpenAI tool_calls. All supported formats wrap each call in
// <tool_call>...</tool_call>; they differ in the body:
//   kQwen3Json  {"name": "f", "arguments": {"a": 1}}                                  (Qwen3, Qwen2.5)
//   kQwen3Xml   <function=f><parameter=a>1</parameter></function>                      (Qwen3-Coder, Qwen3.5)
//   kGlm45      f\n<arg_key>a</arg_key><arg_value>1</arg_value>                        (GLM-4.5 and later)
// Fed incrementally (any split gives the same result); a block that does not parse, names an unknown tool or is
// never closed stays text. Whitespace around calls is dropped once a call has been seen.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tern {

enum class ToolFormat { kNone, kQwen3Json, kQwen3Xml, kGlm45 };

// "qwen3" | "qwen3_coder" | "glm45" | "none"; nothing for another name.
std::optional<ToolFormat> tool_format_from_name(std::string_view name);
// The format a chat template emits, from the markers in its text (kNone when it has no tool calls).
ToolFormat tool_format_detect(std::string_view chat_template);

struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object, serialised
};

// One block body (between the markers). `tools`: the request's tools array (names and parameter types).
std::optional<ToolCall> tool_call_parse_body(ToolFormat format, std::string_view body,
                                             const nlohmann::ordered_json& tools);

struct ToolDelta {
  std::string content;
  std::vector<ToolCall> calls;
};

class ToolCallParser {
 public:
  ToolCallParser(ToolFormat format, nlohmann::ordered_json tools) : format_(format), tools_(std::move(tools)) {}
  ToolDelta feed(std::string_view text);
  ToolDelta finish();
  int num_calls() const { return num_calls_; }

 private:
  void emit_text(ToolDelta& out, std::string_view text);

  ToolFormat format_;
  nlohmann::ordered_json tools_;
  std::string buffer_;
  std::string pending_space_;  // trailing whitespace held back: dropped if a call follows
  bool inside_ = false;
  int num_calls_ = 0;
};

}  // namespace tern
