// Tool calls in generated text, turned into OpenAI tool_calls. All supported formats wrap each call in
// <tool_call>...</tool_call>; they differ in the body:
//   kQwen3Json  {"name": "f", "arguments": {"a": 1}}                                  (Qwen3, Qwen2.5)
//   kQwen3Xml   <function=f><parameter=a>1</parameter></function>                      (Qwen3-Coder, Qwen3.5)
//   kGlm45      f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n                    (GLM-4.5, GLM-4.6)
//   kGlm47      f<arg_key>a</arg_key><arg_value>1</arg_value>                          (GLM-4.7, GLM-5)
// The two GLM formats share one body parser, which reads the function name up to the first newline or <arg_key>
// and allows whitespace between the tags, so either name reads the other's output too.
// Argument values of the XML and GLM formats are typed by the tool's JSON schema (tool_argument_value).
// Fed incrementally (any split gives the same result); a block that does not parse, names an unknown tool or is
// never closed stays text. Whitespace around calls is dropped once a call has been seen.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tern {

enum class ToolFormat { kNone, kQwen3Json, kQwen3Xml, kGlm45, kGlm47 };

// "qwen3" | "qwen3_coder" | "glm45" | "glm47" | "none" (SGLang's --tool-call-parser names); nothing for another
// name.
std::optional<ToolFormat> tool_format_from_name(std::string_view name);
std::string_view tool_format_name(ToolFormat format);
// The format a chat template emits, from the markers in its text (kNone when it has no tool calls): GLM-4.7's when
// the name is followed directly by <arg_key> ("<tool_call>{function-name}<arg_key>"), GLM-4.5's for other
// <arg_key> templates.
ToolFormat tool_format_detect(std::string_view chat_template);

// The value of one XML/GLM argument, `raw` being the text between its tags, typed by the JSON schema of the
// parameter `key` of `function` (a tools[i].function object): a parameter declared "string" (alone) is `raw`
// unchanged, even when it reads as a number; otherwise `raw` parsed as JSON when that gives a value of a declared
// type ("integer": a number without fraction; "number", "boolean", "object", "array", "null"; a type list or the
// branches of anyOf/oneOf declare several). A value that does not parse as a declared type is kept as the string
// `raw`, never dropped. A parameter without a declared type (or unknown to the schema) is JSON when `raw` parses,
// else `raw`.
nlohmann::ordered_json tool_argument_value(const nlohmann::ordered_json& function, const std::string& key,
                                           std::string_view raw);

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
