#include "server/tool_parser.h"

#include <gtest/gtest.h>

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

TEST(ToolFormat, NamesAndDetection) {
  EXPECT_EQ(tool_format_from_name("qwen3"), ToolFormat::kQwen3Json);
  EXPECT_EQ(tool_format_from_name("qwen3_coder"), ToolFormat::kQwen3Xml);
  EXPECT_EQ(tool_format_from_name("glm45"), ToolFormat::kGlm45);
  EXPECT_FALSE(tool_format_from_name("llama"));
  EXPECT_EQ(tool_format_detect("{{ '<tool_call>\\n<function=' }}"), ToolFormat::kQwen3Xml);
  EXPECT_EQ(tool_format_detect("<tool_call>{{ name }}<arg_key>"), ToolFormat::kGlm45);
  EXPECT_EQ(tool_format_detect("<tool_call>\\n{\"name\""), ToolFormat::kQwen3Json);
  EXPECT_EQ(tool_format_detect("no tools"), ToolFormat::kNone);
}

}  // namespace
}  // namespace tern
