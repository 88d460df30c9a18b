#include "runtime/stop.h"

#include <algorithm>
#include <utility>

namespace tern {
namespace {

constexpr std::string_view kFinishStop = "stop";
constexpr std::string_view kFinishLength = "length";

bool utf8_is_continuation(char byte) {
  return (static_cast<unsigned char>(byte) & 0xC0) == 0x80;
}

// Length of the sequence a lead byte announces, 0 for a byte that cannot start one (RFC 3629 table).
size_t utf8_sequence_length(char byte) {
  const auto lead = static_cast<unsigned char>(byte);
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

// RFC 3629 well-formedness: no stray continuation bytes, no overlong forms, surrogates or values above U+10FFFF.
bool utf8_is_valid(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8_sequence_length(text[i]);
    if (n == 0 || i + n > text.size()) return false;
    for (size_t j = 1; j < n; ++j) {
      if (!utf8_is_continuation(text[i + j])) return false;
    }
    const auto lead = static_cast<unsigned char>(text[i]);
    const auto second = n > 1 ? static_cast<unsigned char>(text[i + 1]) : 0;
    if ((lead == 0xE0 && second < 0xA0) || (lead == 0xED && second > 0x9F) || (lead == 0xF0 && second < 0x90) ||
        (lead == 0xF4 && second > 0x8F)) {
      return false;
    }
    i += n;
  }
  return true;
}

// Bytes at the end of `text` that start a character whose remaining bytes have not arrived yet.
size_t utf8_incomplete_tail(std::string_view text) {
  const size_t max_back = std::min<size_t>(3, text.size());
  for (size_t back = 1; back <= max_back; ++back) {
    const char byte = text[text.size() - back];
    if (!utf8_is_continuation(byte)) return utf8_sequence_length(byte) > back ? back : 0;
  }
  return 0;
}

}  // namespace

Expected<void> stop_criteria_validate(const StopCriteria& criteria) {
  if (criteria.max_tokens < 1) return make_error("max_tokens must be at least 1, got {}", criteria.max_tokens);
  if (criteria.min_tokens < 0 || criteria.min_tokens > criteria.max_tokens) {
    return make_error("min_tokens must be in [0, max_tokens = {}], got {}", criteria.max_tokens, criteria.min_tokens);
  }
  for (size_t i = 0; i < criteria.stop_strings.size(); ++i) {
    if (criteria.stop_strings[i].empty()) return make_error("stop[{}] is an empty string", i);
    if (!utf8_is_valid(criteria.stop_strings[i])) return make_error("stop[{}] is not valid UTF-8", i);
  }
  return {};
}

StopChecker::StopChecker(StopCriteria criteria) : criteria_(std::move(criteria)) {
  // An empty stop string would match everywhere; validation rejects it, and the checker ignores it.
  std::erase_if(criteria_.stop_strings, [](const std::string& s) { return s.empty(); });
}

StopUpdate StopChecker::feed(int32_t token_id, std::string_view text_delta) {
  if (finished_) return StopUpdate{.finished = true, .finish_reason = finish_reason_};
  ++num_tokens_;
  const bool may_stop = num_tokens_ > criteria_.min_tokens;
  const auto& stop_ids = criteria_.stop_token_ids;
  if (may_stop && std::find(stop_ids.begin(), stop_ids.end(), token_id) != stop_ids.end()) {
    StopUpdate update = finish(kFinishStop, pending_.size());
    update.stop_token_id = token_id;
    return update;
  }

  pending_.append(text_delta);
  // Every match starts inside pending_: text was only emitted once no stop string could start in it. The
  // earliest match wins, then the earlier stop string in the list.
  size_t match_at = std::string::npos;
  const std::string* matched = nullptr;
  for (const std::string& stop : criteria_.stop_strings) {
    const size_t at = may_stop ? pending_.find(stop) : std::string::npos;
    if (at < match_at) {
      match_at = at;
      matched = &stop;
    }
  }
  if (matched != nullptr) {
    StopUpdate update = finish(kFinishStop, match_at + (criteria_.include_stop_string ? matched->size() : 0));
    update.stop_string = *matched;
    return update;
  }
  if (num_tokens_ >= criteria_.max_tokens) return finish(kFinishLength, pending_.size());

  size_t emit = pending_.size() - held_back_bytes();
  while (emit > 0 && emit < pending_.size() && utf8_is_continuation(pending_[emit])) --emit;
  StopUpdate update;
  update.text = pending_.substr(0, emit);
  pending_.erase(0, emit);
  return update;
}

std::string StopChecker::flush() {
  finished_ = true;
  return std::exchange(pending_, std::string());
}

StopUpdate StopChecker::finish(std::string_view reason, size_t emit_bytes) {
  finished_ = true;
  finish_reason_ = reason;
  StopUpdate update;
  update.text = pending_.substr(0, emit_bytes);
  update.finished = true;
  update.finish_reason = reason;
  pending_.clear();
  return update;
}

// The longest end of pending_ that is a proper prefix of some stop string (it may still grow into a match), or
// the incomplete character at the end, whichever is longer.
size_t StopChecker::held_back_bytes() const {
  const std::string_view text = pending_;
  size_t hold = utf8_incomplete_tail(text);
  for (const std::string& stop : criteria_.stop_strings) {
    const std::string_view view = stop;
    for (size_t n = std::min(view.size() - 1, text.size()); n > hold; --n) {
      if (text.ends_with(view.substr(0, n))) {
        hold = n;
        break;
      }
    }
  }
  return hold;
}

}  // namespace tern
