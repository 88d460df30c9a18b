#include "server/reasoning_parser.h"

#include <gtest/gtest.h>

namespace tern {
namespace {

// Feeds `text` split at every byte position (two pieces) and byte by byte; every split must give `expected`.
void expect_split_invariant(bool in_reasoning, const std::string& text, const ReasoningDelta& expected) {
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    ReasoningParser p(in_reasoning);
    ReasoningDelta all;
    for (const std::string& piece : {text.substr(0, cut), text.substr(cut)}) {
      ReasoningDelta d = p.feed(piece);
      all.reasoning += d.reasoning;
      all.content += d.content;
    }
    ReasoningDelta d = p.finish();
    EXPECT_EQ(all.reasoning + d.reasoning, expected.reasoning) << "cut at " << cut;
    EXPECT_EQ(all.content + d.content, expected.content) << "cut at " << cut;
  }
  ReasoningParser p(in_reasoning);
  ReasoningDelta all;
  for (char c : text) {
    ReasoningDelta d = p.feed(std::string(1, c));
    all.reasoning += d.reasoning;
    all.content += d.content;
  }
  ReasoningDelta d = p.finish();
  EXPECT_EQ(all.reasoning + d.reasoning, expected.reasoning);
  EXPECT_EQ(all.content + d.content, expected.content);
}

TEST(ReasoningParser, SplitsAThinkBlockFromTheAnswer) {
  expect_split_invariant(false, "<think>\nLet me add: 2+2=4.\n</think>\n\nThe answer is 4.",
                         {"Let me add: 2+2=4.\n", "The answer is 4."});
}

TEST(ReasoningParser, PromptThatOpenedTheBlock) {
  expect_split_invariant(true, "hmm, x < y </think>\n\nYes.", {"hmm, x < y ", "Yes."});
}

TEST(ReasoningParser, NoThinkBlockIsAllContent) {
  expect_split_invariant(false, "Plain <thin answer", {"", "Plain <thin answer"});
  expect_split_invariant(false, "<thinking is not a marker>", {"", "<thinking is not a marker>"});
}

TEST(ReasoningParser, UnfinishedReasoningStaysReasoning) {
  expect_split_invariant(false, "<think>still going </thi", {"still going </thi", ""});
}

TEST(ReasoningParser, EmptyThinkBlockFromDisabledThinking) {
  expect_split_invariant(false, "<think>\n\n</think>\n\nHi", {"", "Hi"});
}

// GLM-5: the template's generation prompt ends "<|assistant|><think>" (so the server starts the parser inside the
// block) and the model writes no newlines around the markers; a tool call may follow the answer, for the tool-call
// parser to take from the content.
TEST(ReasoningParser, Glm5AfterTheTemplatesThinkTag) {
  expect_split_invariant(true, "User wants a week.</think>Checking now!<tool_call>get_forecast<arg_key>days</arg_key>",
                         {"User wants a week.", "Checking now!<tool_call>get_forecast<arg_key>days</arg_key>"});
  expect_split_invariant(true, "</think>Paris.", {"", "Paris."});
  expect_split_invariant(true, "Still thinking </thin", {"Still thinking </thin", ""});  // cut by max_tokens
}

TEST(MarkerPrefixSuffix, LongestProperPrefix) {
  EXPECT_EQ(marker_prefix_suffix("abc</th", "</think>"), 4u);
  EXPECT_EQ(marker_prefix_suffix("abc<", "</think>"), 1u);
  EXPECT_EQ(marker_prefix_suffix("abc", "</think>"), 0u);
  EXPECT_EQ(marker_prefix_suffix("", "</think>"), 0u);
}

}  // namespace
}  // namespace tern
