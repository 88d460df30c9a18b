#include "server/tool_parser.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace tern {
namespace {

using Json = nlohmann::ordered_json;

Json weather_tools() {
  return Json::parse(R"([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}},
      {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}])");
}

struct Parsed {
  std::string content;
  std::vector<std::pair<std::string, Json>> calls;  // arguments compared as JSON values
};

Parsed feed_pieces(ToolFormat format, const std::vector<std::string>& pieces) {
  ToolCallParser p(format, weather_tools());
  Parsed out;
  auto take = [&](ToolDelta d) {
    out.content += d.content;
    for (auto& c : d.calls) out.calls.emplace_back(c.name, Json::parse(c.arguments));
  };
  for (const std::string& piece : pieces) take(p.feed(piece));
  take(p.finish());
  return out;
}

// Every two-piece split and the byte-by-byte feed must give `expected`.
void expect_parsed(ToolFormat format, const std::string& text, const Parsed& expected) {
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    Parsed got = feed_pieces(format, {text.substr(0, cut), text.substr(cut)});
    EXPECT_EQ(got.content, expected.content) << "cut at " << cut;
    EXPECT_EQ(got.calls, expected.calls) << "cut at " << cut;
  }
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  Parsed got = feed_pieces(format, bytes);
  EXPECT_EQ(got.content, expected.content);
  EXPECT_EQ(got.calls, expected.calls);
}

TEST(ToolCallParser, Qwen3Json) {
  expect_parsed(ToolFormat::kQwen3Json,
                "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
                "\"days\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
                {"Let me check.", {{"get_weather", Json{{"city", "Paris"}, {"days", 3}}}, {"now", Json::object()}}});
}

TEST(ToolCallParser, Qwen3XmlConvertsValuesByTheSchema) {
  expect_parsed(ToolFormat::kQwen3Xml,
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n2\n"
                "</parameter>\n<parameter=zip>\n10001\n</parameter>\n</function>\n</tool_call>",
                {"", {{"get_weather", Json{{"city", "New York"}, {"days", 2}, {"zip", "10001"}}}}});
}

TEST(ToolCallParser, Glm45) {
  expect_parsed(ToolFormat::kGlm45,
                "Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days"
                "</arg_key>\n<arg_value>5</arg_value>\n</tool_call>",
                {"Sure.", {{"get_weather", Json{{"city", "Oslo"}, {"days", 5}}}}});
}

TEST(ToolCallParser, MalformedOutputStaysText) {
  const std::string bad_json = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
  expect_parsed(ToolFormat::kQwen3Json, bad_json, {bad_json, {}});
  const std::string unknown = "<tool_call>{\"name\": \"launch\", \"arguments\": {}}</tool_call>";
  expect_parsed(ToolFormat::kQwen3Json, unknown, {unknown, {}});
  const std::string unclosed = "text <tool_call>{\"name\": \"now\"";
  expect_parsed(ToolFormat::kQwen3Json, unclosed, {unclosed, {}});
  const std::string bad_xml = "<tool_call><function=get_weather><parameter=city>x</function></tool_call>";
  expect_parsed(ToolFormat::kQwen3Xml, bad_xml, {bad_xml, {}});
  const std::string bad_glm = "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>";
  expect_parsed(ToolFormat::kGlm45, bad_glm, {bad_glm, {}});
  expect_parsed(ToolFormat::kQwen3Xml, "<tool_call><function=</function></tool_call>",
                {"<tool_call><function=</function></tool_call>", {}});
}

TEST(ToolCallParser, PlainTextPassesThroughWithItsWhitespace) {
  expect_parsed(ToolFormat::kQwen3Json, "No tools needed.\n", {"No tools needed.\n", {}});
  expect_parsed(ToolFormat::kQwen3Json, "a <tool b", {"a <tool b", {}});
}

// GLM-4.7 / GLM-5: the name directly followed by <arg_key>, no newlines (what glm-5-style.jinja writes).
TEST(ToolCallParser, Glm47) {
  expect_parsed(ToolFormat::kGlm47,
                "Let me look.<tool_call>get_weather<arg_key>city</arg_key><arg_value>New York</arg_value><arg_key>days"
                "</arg_key><arg_value>5</arg_value></tool_call><tool_call>now</tool_call>",
                {"Let me look.", {{"get_weather", Json{{"city", "New York"}, {"days", 5}}}, {"now", Json::object()}}});
  // Either GLM name reads the other's layout.
  expect_parsed(ToolFormat::kGlm47,
                "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>",
                {"", {{"get_weather", Json{{"city", "Oslo"}}}}});
  expect_parsed(ToolFormat::kGlm45, "<tool_call>get_weather<arg_key>zip</arg_key><arg_value>0042</arg_value></tool_call>",
                {"", {{"get_weather", Json{{"zip", "0042"}}}}});
}

// Malformed GLM-4.7 output: never a crash, never a partial call; the text comes back as it was.
TEST(ToolCallParser, Glm47MalformedOutputStaysText) {
  const std::vector<std::string> cases = {
      // the block is never closed (the stream ends inside it)
      "Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>",
      "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo",
      "<tool_call>get_weather<arg_key>ci",
      "<tool_call>",
      // a key without its value, a value without its key
      "<tool_call>get_weather<arg_key>city</arg_key></tool_call>",
      "<tool_call>get_weather<arg_value>Oslo</arg_value></tool_call>",
      // unterminated tags inside a closed block
      "<tool_call>get_weather<arg_key>city<arg_value>Oslo</arg_value></tool_call>",
      "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</tool_call>",
      // text between the pairs, an empty or unknown name
      "<tool_call>get_weather<arg_key>city</arg_key>x<arg_value>Oslo</arg_value></tool_call>",
      "<tool_call><arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",
      "<tool_call>launch_rocket<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",
      // a stray closing marker, a block closed twice
      "</tool_call> plain",
      "<tool_call>get_weather</arg_value></tool_call>",
  };
  for (const std::string& text : cases) {
    SCOPED_TRACE(text);
    expect_parsed(ToolFormat::kGlm47, text, {text, {}});
  }
  // A good call after a bad one is still a call; the bad block stays text.
  expect_parsed(ToolFormat::kGlm47,
                "<tool_call>get_weather<arg_key>city</arg_key></tool_call><tool_call>now</tool_call>",
                {"<tool_call>get_weather<arg_key>city</arg_key></tool_call>", {{"now", Json::object()}}});
}

Json typed_function() {
  return Json::parse(R"({"name": "f", "parameters": {"type": "object", "properties": {
      "zip": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
      "hourly": {"type": "boolean"}, "options": {"type": "object"}, "tags": {"type": "array"},
      "note": {"type": ["string", "null"]}, "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
      "free": {"description": "no type"}}}})");
}

// Values are typed by the parameter's JSON schema; a value that does not parse as its type stays a string.
TEST(ToolArgumentValue, TypedByTheSchema) {
  const Json f = typed_function();
  const auto v = [&](const std::string& key, const std::string& raw) { return tool_argument_value(f, key, raw); };
  EXPECT_EQ(v("zip", "10001"), Json("10001"));          // a string parameter stays a string
  EXPECT_EQ(v("zip", "true"), Json("true"));
  EXPECT_EQ(v("zip", "\"quoted\""), Json("\"quoted\""));
  EXPECT_EQ(v("zip", " padded "), Json(" padded "));
  EXPECT_EQ(v("days", "7"), Json(7));
  EXPECT_EQ(v("days", "3.0"), Json(3.0));                 // JSON Schema: an integer may be written 3.0
  EXPECT_EQ(v("days", "2.5"), Json("2.5"));               // not an integer: kept as the string
  EXPECT_EQ(v("days", "seven"), Json("seven"));
  EXPECT_EQ(v("days", "\"7\""), Json("\"7\""));
  EXPECT_EQ(v("ratio", "0.25"), Json(0.25));
  EXPECT_EQ(v("ratio", "-3"), Json(-3));
  EXPECT_EQ(v("ratio", "1e-05"), Json(1e-05));
  EXPECT_EQ(v("ratio", "NaN"), Json("NaN"));
  EXPECT_EQ(v("hourly", "false"), Json(false));
  EXPECT_EQ(v("hourly", "yes"), Json("yes"));
  EXPECT_EQ(v("hourly", "True"), Json("True"));           // Python's spelling is not JSON
  EXPECT_EQ(v("options", R"({"a": [1, 2], "b": null})"), Json::parse(R"({"a": [1, 2], "b": null})"));
  EXPECT_EQ(v("options", "[1]"), Json("[1]"));            // an array is not an object
  EXPECT_EQ(v("options", "{broken"), Json("{broken"));
  EXPECT_EQ(v("tags", R"(["x", "y"])"), Json::parse(R"(["x", "y"])"));
  EXPECT_EQ(v("tags", "x, y"), Json("x, y"));
  EXPECT_EQ(v("note", "null"), Json(nullptr));           // a type list: null or the raw string
  EXPECT_EQ(v("note", "42"), Json("42"));
  EXPECT_EQ(v("limit", "5"), Json(5));                    // anyOf branches declare the types
  EXPECT_EQ(v("limit", "null"), Json(nullptr));
  EXPECT_EQ(v("limit", "many"), Json("many"));
  EXPECT_EQ(v("free", "42"), Json(42));                   // no declared type: JSON when it parses
  EXPECT_EQ(v("free", "hello"), Json("hello"));
  EXPECT_EQ(v("undeclared", "[true]"), Json::parse("[true]"));
  EXPECT_EQ(tool_argument_value(Json::parse(R"({"name": "g"})"), "x", "1"), Json(1));
}

TEST(ToolCallParser, Glm47TypedArgumentsKeepTheirOrder) {
  ToolCallParser p(ToolFormat::kGlm47, Json::array({Json{{"type", "function"}, {"function", typed_function()}}}));
  ToolDelta d = p.feed(
      "<tool_call>f<arg_key>zip</arg_key><arg_value>02134</arg_value><arg_key>days</arg_key><arg_value>3"
      "</arg_value><arg_key>hourly</arg_key><arg_value>maybe</arg_value><arg_key>options</arg_key><arg_value>"
      "{\"unit\": \"°C\"}</arg_value></tool_call>");
  ASSERT_EQ(d.calls.size(), 1u);
  EXPECT_EQ(d.calls[0].arguments, R"({"zip":"02134","days":3,"hourly":"maybe","options":{"unit":"°C"}})");
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Round trip through the real GLM templates: Python Jinja2 rendered each conversation's assistant tool calls
// (tests/data/templates/golden.json, tools/template_golden/make_golden.py); the parser of the template's format
// must read back every call's name and arguments from that text, typed by the conversation's tool schemas. One
// conversation passes 1e-05 to an "integer" parameter: that value comes back as the text the template wrote.
TEST(ToolCallParser, ReadsBackWhatTheGlmTemplatesWrite) {
  const Json golden = Json::parse(read_text(std::filesystem::path(TERN_SOURCE_DIR) / "tests/data/templates/golden.json"));
  int checked = 0;
  for (const auto& [name, format] : {std::pair{"glm-5-style", ToolFormat::kGlm47}, std::pair{"glm-4.6", ToolFormat::kGlm45}}) {
    for (const Json& c : golden) {
      if (c["template"] != name || !c.contains("text")) continue;
      const Json& context = c["context"];
      std::vector<Json> want;
      for (const Json& m : context["messages"]) {
        if (!m.contains("tool_calls")) continue;
        for (const Json& call : m["tool_calls"]) want.push_back(call.contains("function") ? call["function"] : call);
      }
      if (want.empty()) continue;
      SCOPED_TRACE(std::string(name) + " / " + c["conversation"].get<std::string>());
      // The calls the conversation made: every block after the first user turn (the system prompt's format example
      // comes before it).
      const std::string text = c["text"];
      const size_t user = text.find("<|user|>");
      ASSERT_NE(user, std::string::npos);
      ToolCallParser p(format, context["tools"]);
      std::vector<ToolCall> got = p.feed(text.substr(user)).calls;
      for (ToolCall& call : p.finish().calls) got.push_back(std::move(call));
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(got[i].name, want[i]["name"].get<std::string>());
        Json expected = want[i]["arguments"];
        if (expected.contains("limit") && expected["limit"] == Json(1e-05)) expected["limit"] = "1e-05";
        EXPECT_EQ(Json::parse(got[i].arguments), expected) << got[i].arguments;
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 10);
}

TEST(ToolFormat, NamesAndDetection) {
  EXPECT_EQ(tool_format_from_name("qwen3"), ToolFormat::kQwen3Json);
  EXPECT_EQ(tool_format_from_name("qwen3_coder"), ToolFormat::kQwen3Xml);
  EXPECT_EQ(tool_format_from_name("glm45"), ToolFormat::kGlm45);
  EXPECT_EQ(tool_format_from_name("glm47"), ToolFormat::kGlm47);
  EXPECT_FALSE(tool_format_from_name("llama"));
  EXPECT_FALSE(tool_format_from_name("glm5"));
  for (ToolFormat f : {ToolFormat::kNone, ToolFormat::kQwen3Json, ToolFormat::kQwen3Xml, ToolFormat::kGlm45,
                       ToolFormat::kGlm47}) {
    EXPECT_EQ(tool_format_from_name(tool_format_name(f)), f);
  }
  EXPECT_EQ(tool_format_detect("{{ '<tool_call>\\n<function=' }}"), ToolFormat::kQwen3Xml);
  EXPECT_EQ(tool_format_detect("<tool_call>{{ name }}<arg_key>"), ToolFormat::kGlm45);
  EXPECT_EQ(tool_format_detect("<tool_call>\\n{\"name\""), ToolFormat::kQwen3Json);
  EXPECT_EQ(tool_format_detect("no tools"), ToolFormat::kNone);
  // The real templates: GLM-4.6 writes a newline after the name, the GLM-5 family none.
  const std::filesystem::path templates = std::filesystem::path(TERN_SOURCE_DIR) / "tests/data/templates";
  EXPECT_EQ(tool_format_detect(read_text(templates / "glm-4.6.jinja")), ToolFormat::kGlm45);
  EXPECT_EQ(tool_format_detect(read_text(templates / "glm-5-style.jinja")), ToolFormat::kGlm47);
  EXPECT_EQ(tool_format_detect(read_text(templates / "qwen3.5.jinja")), ToolFormat::kQwen3Xml);
}

}  // namespace
}  // namespace tern
