#include "core/json_parse.h"

#include <gtest/gtest.h>

#include <string>

namespace tern {
namespace {

std::string nested(int depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

TEST(JsonParse, TheDeepestAllowedNestingParses) {
  auto doc = json_parse_untrusted(nested(kJsonMaxDepth));
  ASSERT_TRUE(doc) << doc.error().message;
  const nlohmann::json* v = &*doc;
  for (int i = 0; i < kJsonMaxDepth; ++i) v = &(*v)[0];
  EXPECT_EQ(*v, 1);
}

TEST(JsonParse, OneLevelDeeperIsAnErrorNamingTheByte) {
  auto doc = json_parse_untrusted(nested(kJsonMaxDepth + 1));
  ASSERT_FALSE(doc);
  EXPECT_NE(doc.error().message.find("nested deeper than 128"), std::string::npos) << doc.error().message;
  // Bytes 0..127 open levels 1..128; byte 128 opens level 129.
  EXPECT_NE(doc.error().message.find("at byte 128"), std::string::npos) << doc.error().message;
}

TEST(JsonParse, AHostileDepthIsRefusedWithoutRecursing) {
  std::string objects;
  for (int i = 0; i < 200000; ++i) objects += "{\"a\":";
  auto doc = json_parse_untrusted_ordered(objects + "1" + std::string(200000, '}'));
  ASSERT_FALSE(doc);
  EXPECT_NE(doc.error().message.find("nested deeper"), std::string::npos);
}

TEST(JsonParse, BracketsInsideStringsDoNotCount) {
  const std::string deep_string = "\"" + std::string(1000, '[') + "\\\"" + std::string(1000, '{') + "\"";
  auto doc = json_parse_untrusted("[" + deep_string + "]");
  ASSERT_TRUE(doc) << doc.error().message;
  EXPECT_EQ((*doc)[0].get<std::string>().size(), 2001u);
  EXPECT_EQ(json_too_deep_at("[\"\\\\\"]", 1), std::string_view::npos);  // an escaped backslash ends the string
  EXPECT_EQ(json_too_deep_at("[\"\\\\\", [[", 2), 8u);
}

TEST(JsonParse, SyntaxErrorsSayWhere) {
  auto doc = json_parse_untrusted("{\"a\": 1,, \"b\": 2}");
  ASSERT_FALSE(doc);
  EXPECT_NE(doc.error().message.find("byte 9"), std::string::npos) << doc.error().message;
  EXPECT_FALSE(json_parse_untrusted("[NaN]"));
  EXPECT_FALSE(json_parse_untrusted(""));
}

}  // namespace
}  // namespace tern
