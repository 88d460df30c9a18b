// Splits generated text into reasoning and answer for models that think between <think> and </think> (Qwen3,
// Qwen3.5, GLM-4.5+). Fed incrementally (any split of the text gives the same concatenated result); text that
// could still become a marker is held back until it can no longer match.
//
// `starts_in_reasoning`: the prompt already opened the block (templates that end the generation prompt with
// "<think>\n"); otherwise reasoning is recognised only when the output starts with "<think>".
#pragma once

#include <string>
#include <string_view>

namespace tern {

struct ReasoningDelta {
  std::string reasoning;
  std::string content;
};

class ReasoningParser {
 public:
  explicit ReasoningParser(bool starts_in_reasoning, std::string start = "<think>", std::string end = "</think>");
  ReasoningDelta feed(std::string_view text);
  ReasoningDelta finish();

 private:
  enum class State { kStart, kReasoningStart, kReasoning, kAfterEnd, kContent };
  void step(ReasoningDelta& out);

  std::string start_, end_;
  State state_;
  std::string buffer_;
};

// Length of the longest suffix of `text` that is a proper prefix of `marker` (text to hold back).
size_t marker_prefix_suffix(std::string_view text, std::string_view marker);

}  // namespace tern
