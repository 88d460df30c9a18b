// StopChecker tests. Expected texts are written by hand from the OpenAI/vLLM rules (output cut before the first
// stop string, the stop string and a stop token's text excluded, "length" after max_tokens); the randomised test
// compares with std::string::find on the whole text.
#include "runtime/stop.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace tern {
namespace {

struct FeedResult {
  std::vector<std::string> texts;  // text of each update
  std::string emitted;             // all of it
  std::string flushed;             // what flush() returned after the last delta
  StopUpdate last;
};

// Feeds deltas as tokens 100, 101, ... (no stop token ids unless the criteria name them).
FeedResult feed_all(const StopCriteria& criteria, const std::vector<std::string>& deltas) {
  StopChecker checker(criteria);
  FeedResult run;
  for (size_t i = 0; i < deltas.size(); ++i) {
    run.last = checker.feed(static_cast<int32_t>(100 + i), deltas[i]);
    run.texts.push_back(run.last.text);
    run.emitted += run.last.text;
    if (run.last.finished) break;
  }
  run.flushed = checker.flush();
  return run;
}

StopCriteria stops(std::vector<std::string> strings, int32_t max_tokens = 1000) {
  return StopCriteria{.stop_token_ids = {}, .stop_strings = std::move(strings), .max_tokens = max_tokens};
}

// vLLM's min_tokens: no stop id or stop string ends the sequence until more than min_tokens tokens are out. A stop
// string lying wholly in those tokens is passed over (vLLM's test_min_tokens_with_stop: min_tokens 5, stop "e",
// " Lee" passed, " student" cut at "stud"); one that starts in them and ends after may end it.
TEST(StopChecker, MinTokensHoldsOffStops) {
  StopCriteria criteria = stops({"e"});
  criteria.min_tokens = 5;
  const FeedResult run = feed_all(criteria, {" is", " Lee", ",", " and", " I", "'m", " a", " student", " in"});
  EXPECT_EQ(run.emitted, " is Lee, and I'm a stud");
  EXPECT_EQ(run.last.finish_reason, "stop");
  criteria.min_tokens = 0;
  EXPECT_EQ(feed_all(criteria, {" is", " Lee", ","}).emitted, " is L");
  // Spanning the boundary: "STOP" starts in token 2 of min_tokens 2 and ends in token 3.
  StopCriteria spanning = stops({"STOP"});
  spanning.min_tokens = 2;
  const FeedResult span = feed_all(spanning, {"a", "bST", "OPc"});
  EXPECT_EQ(span.emitted, "ab");
  EXPECT_EQ(span.last.stop_string, "STOP");
  // A stop token id: passed over as token 2 of min_tokens 2, ends the sequence as token 3.
  StopCriteria ids{.stop_token_ids = {101, 102}, .max_tokens = 10, .min_tokens = 2};
  const FeedResult by_id = feed_all(ids, {"x", "y", "z", "w"});
  EXPECT_EQ(by_id.emitted, "xy");
  EXPECT_EQ(by_id.last.stop_token_id, 102);
  EXPECT_FALSE(stop_criteria_validate(StopCriteria{.max_tokens = 4, .min_tokens = 5}).has_value());
  EXPECT_FALSE(stop_criteria_validate(StopCriteria{.max_tokens = 4, .min_tokens = -1}).has_value());
  EXPECT_TRUE(stop_criteria_validate(StopCriteria{.max_tokens = 4, .min_tokens = 4}).has_value());
}

TEST(StopChecker, TextPassesThroughWithoutStopStrings) {
  const FeedResult run = feed_all(stops({}), {"Hello", ", ", "world"});
  EXPECT_EQ(run.texts, (std::vector<std::string>{"Hello", ", ", "world"}));
  EXPECT_FALSE(run.last.finished);
  EXPECT_TRUE(run.last.finish_reason.empty());
}

TEST(StopChecker, StopStringSpanningSeveralDeltas) {
  const FeedResult run = feed_all(stops({"STOP"}), {"Hello S", "TO", "P world"});
  EXPECT_EQ(run.texts, (std::vector<std::string>{"Hello ", "", ""}));
  EXPECT_TRUE(run.last.finished);
  EXPECT_EQ(run.last.finish_reason, "stop");
  EXPECT_EQ(run.last.stop_string, "STOP");
  EXPECT_FALSE(run.last.stop_token_id.has_value());
}

// include_stop_string (vLLM's include_stop_str_in_output): the text ends with the stop string, not before it; what
// followed it in the same delta is still dropped.
TEST(StopChecker, IncludedStopStringEndsTheText) {
  StopCriteria criteria = stops({"END", "ST"});
  criteria.include_stop_string = true;
  const FeedResult r = feed_all(criteria, {"abc E", "NDxyz", "more"});
  EXPECT_EQ(r.emitted, "abc END");
  EXPECT_TRUE(r.last.finished);
  EXPECT_EQ(r.last.stop_string, "END");
  EXPECT_EQ(r.flushed, "");
  const FeedResult first = feed_all(criteria, {"ST", "x"});
  EXPECT_EQ(first.emitted, "ST");
}

TEST(StopChecker, HeldBackPrefixIsReleasedWhenItStopsMatching) {
  const FeedResult run = feed_all(stops({"STOP"}), {"ST", "ART", "S", "x"});
  EXPECT_EQ(run.texts, (std::vector<std::string>{"", "START", "", "Sx"}));
  EXPECT_FALSE(run.last.finished);
}

TEST(StopChecker, FlushReturnsTheHeldBackText) {
  const FeedResult run = feed_all(stops({"STOP"}), {"abc ST"});
  EXPECT_EQ(run.texts, (std::vector<std::string>{"abc "}));
  EXPECT_EQ(run.flushed, "ST");
}

TEST(StopChecker, OverlappingPrefixesStillMatch) {
  // "aaab" contains "aab" at offset 1: after "aaa" only the last two a's may start the stop string.
  const FeedResult run = feed_all(stops({"aab"}), {"a", "a", "a", "b"});
  EXPECT_EQ(run.texts, (std::vector<std::string>{"", "", "a", ""}));
  EXPECT_EQ(run.emitted, "a");
  EXPECT_EQ(run.last.finish_reason, "stop");
}

TEST(StopChecker, EarliestOfSeveralStopStringsWins) {
  const FeedResult run = feed_all(stops({"world", "lo w"}), {"hello world"});
  EXPECT_EQ(run.emitted, "hel");
  EXPECT_EQ(run.last.stop_string, "lo w");
}

TEST(StopChecker, HoldsBackForTheLongestPossibleStopString) {
  // "ab" could still become "abcd" (second stop string) though it is not a prefix of "xyz".
  const FeedResult run = feed_all(stops({"xyz", "abcd"}), {"12ab", "c", "d"});
  EXPECT_EQ(run.texts, (std::vector<std::string>{"12", "", ""}));
  EXPECT_EQ(run.last.stop_string, "abcd");
}

TEST(StopChecker, StopStringAtTheVeryStart) {
  const FeedResult run = feed_all(stops({"<end>"}), {"<end>rest of it"});
  EXPECT_EQ(run.texts, (std::vector<std::string>{""}));
  EXPECT_TRUE(run.last.finished);
  EXPECT_EQ(run.last.finish_reason, "stop");
}

TEST(StopChecker, MultiByteCharactersAroundTheStopString) {
  // "。" is E3 80 82; "終" E7 B5 82; "€" E2 82 AC.
  FeedResult run = feed_all(stops({"。"}), {"日本語", "。終"});
  EXPECT_EQ(run.texts, (std::vector<std::string>{"日本語", ""}));
  // A stop string starting with the euro sign: each lone "€" is held back until the next character shows it
  // is not followed by "z".
  run = feed_all(stops({"€z"}), {"€", "€", "y€", "z"});
  EXPECT_EQ(run.texts, (std::vector<std::string>{"", "€", "€y", ""}));
  EXPECT_EQ(run.emitted, "€€y");
  EXPECT_EQ(run.last.stop_string, "€z");
}

TEST(StopChecker, NeverEmitsHalfACharacter) {
  // A delta ending inside "€" (E2 82 | AC) holds the incomplete bytes back.
  const FeedResult run = feed_all(stops({}), {"a\xE2\x82", "\xAC b", "\xF0\x9F", "\x98", "\x80!"});
  EXPECT_EQ(run.texts, (std::vector<std::string>{"a", "€ b", "", "", "😀!"}));
}

TEST(StopChecker, MaxTokensFinishesWithLengthAndFlushesHeldText) {
  const FeedResult run = feed_all(stops({"STOP"}, 3), {"one ", "two ", "ST", "never"});
  EXPECT_EQ(run.texts, (std::vector<std::string>{"one ", "two ", "ST"}));
  EXPECT_TRUE(run.last.finished);
  EXPECT_EQ(run.last.finish_reason, "length");
  EXPECT_FALSE(run.last.stop_string.has_value());
}

TEST(StopChecker, StopStringOnTheLastAllowedTokenIsStop) {
  const FeedResult run = feed_all(stops({"STOP"}, 2), {"x ST", "OP y"});
  EXPECT_EQ(run.emitted, "x ");
  EXPECT_EQ(run.last.finish_reason, "stop");
  EXPECT_EQ(run.last.stop_string, "STOP");
}

TEST(StopChecker, StopTokenEndsWithoutItsTextAndFlushesHeldText) {
  StopChecker checker(StopCriteria{.stop_token_ids = {2, 151645}, .stop_strings = {"STOP"}, .max_tokens = 10});
  EXPECT_EQ(checker.feed(10, "ab S").text, "ab ");
  const StopUpdate update = checker.feed(151645, "<|im_end|>");
  EXPECT_EQ(update.text, "S");
  EXPECT_TRUE(update.finished);
  EXPECT_EQ(update.finish_reason, "stop");
  EXPECT_EQ(update.stop_token_id, 151645);
  EXPECT_FALSE(update.stop_string.has_value());
  EXPECT_EQ(checker.num_tokens(), 2);
}

TEST(StopChecker, FeedingAfterTheEndReturnsNothing) {
  StopChecker checker(stops({}, 1));
  EXPECT_TRUE(checker.feed(1, "a").finished);
  const StopUpdate again = checker.feed(2, "b");
  EXPECT_TRUE(again.finished);
  EXPECT_EQ(again.finish_reason, "length");
  EXPECT_TRUE(again.text.empty());
  EXPECT_EQ(checker.num_tokens(), 1);
}

// Random texts over a small alphabet with multi-byte characters, cut into random deltas at character
// boundaries: the concatenated output must be the text before the first stop string (std::string::find), and
// every update must be whole characters.
TEST(StopChecker, RandomDeltasMatchAWholeTextSearch) {
  const std::vector<std::string> alphabet = {"a", "b", "é", "€", "😀", " "};
  const std::vector<std::string> stop_list = {"ab€", "😀😀", "é a"};
  std::mt19937 gen(17);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<std::string> chars;
    for (int i = 0; i < 30; ++i) chars.push_back(alphabet[gen() % alphabet.size()]);
    std::vector<std::string> deltas(1);
    std::string text;
    for (const std::string& c : chars) {
      text += c;
      deltas.back() += c;
      if (gen() % 3 == 0) deltas.emplace_back();
    }
    size_t cut = std::string::npos;
    for (const std::string& s : stop_list) cut = std::min(cut, text.find(s));

    const FeedResult run = feed_all(stops(stop_list), deltas);
    EXPECT_EQ(run.emitted + run.flushed, text.substr(0, cut)) << "trial " << trial << ": " << text;
    if (cut != std::string::npos) {
      EXPECT_EQ(run.flushed, "");
    }
    EXPECT_EQ(run.last.finished, cut != std::string::npos) << text;
    for (const std::string& piece : run.texts) {
      ASSERT_TRUE(piece.empty() || (static_cast<unsigned char>(piece[0]) & 0xC0) != 0x80) << "split character";
      ASSERT_TRUE(StopChecker(stops({})).feed(0, piece).text == piece) << "piece ends inside a character";
    }
  }
}

TEST(StopCriteria, ValidationNamesTheField) {
  EXPECT_TRUE(stop_criteria_validate(stops({"a", "é"}, 1)).has_value());
  auto r = stop_criteria_validate(stops({}, 0));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().message, "max_tokens must be at least 1, got 0");
  r = stop_criteria_validate(stops({"ok", ""}));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().message, "stop[1] is an empty string");
  for (const char* bad : {"\xE2\x82", "\x80x", "\xC0\xAF", "\xED\xA0\x80", "\xF4\x90\x80\x80"}) {
    r = stop_criteria_validate(stops({bad}));
    ASSERT_FALSE(r) << bad;
    EXPECT_EQ(r.error().message, "stop[0] is not valid UTF-8");
  }
}

}  // namespace
}  // namespace tern
