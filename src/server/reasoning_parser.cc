#include "server/reasoning_parser.h"

namespace tern {
namespace {

size_t leading_space(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) ++i;
  return i;
}

}  // namespace

size_t marker_prefix_suffix(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n) {
    if (marker.starts_with(text.substr(text.size() - n))) return n;
  }
  return 0;
}

ReasoningParser::ReasoningParser(bool starts_in_reasoning, std::string start, std::string end)
    : start_(std::move(start)), end_(std::move(end)),
      state_(starts_in_reasoning ? State::kReasoningStart : State::kStart) {}

ReasoningDelta ReasoningParser::feed(std::string_view text) {
  buffer_ += text;
  ReasoningDelta out;
  step(out);
  return out;
}

// Advances through the states as far as the buffered text allows.
void ReasoningParser::step(ReasoningDelta& out) {
  for (;;) {
    if (state_ == State::kStart) {
      const std::string_view rest = std::string_view(buffer_).substr(leading_space(buffer_));
      if (rest.starts_with(start_)) {
        buffer_.erase(0, buffer_.size() - rest.size() + start_.size());
        state_ = State::kReasoningStart;
      } else if (std::string_view(start_).starts_with(rest)) {
        return;  // still possibly the opening marker
      } else {
        state_ = State::kContent;
      }
    } else if (state_ == State::kReasoningStart || state_ == State::kAfterEnd) {
      const size_t n = leading_space(buffer_);
      buffer_.erase(0, n);
      if (buffer_.empty()) return;
      state_ = state_ == State::kReasoningStart ? State::kReasoning : State::kContent;
    } else if (state_ == State::kReasoning) {
      const size_t end = buffer_.find(end_);
      if (end == std::string::npos) {
        const size_t keep = marker_prefix_suffix(buffer_, end_);
        out.reasoning += buffer_.substr(0, buffer_.size() - keep);
        buffer_.erase(0, buffer_.size() - keep);
        return;
      }
      out.reasoning += buffer_.substr(0, end);
      buffer_.erase(0, end + end_.size());
      state_ = State::kAfterEnd;
    } else {
      out.content += buffer_;
      buffer_.clear();
      return;
    }
  }
}

ReasoningDelta ReasoningParser::finish() {
  ReasoningDelta out;
  if (state_ == State::kReasoning || state_ == State::kReasoningStart) {
    out.reasoning = std::move(buffer_);
  } else if (state_ == State::kStart || state_ == State::kContent) {
    out.content = std::move(buffer_);
  }
  buffer_.clear();
  return out;
}

}  // namespace tern
