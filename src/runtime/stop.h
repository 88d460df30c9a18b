// When a sequence ends, and which of its text the client sees. Fed one token at a time with the text that token
// added (the incremental detokenizer's delta), a StopChecker
//   - ends on a stop token id (finish_reason "stop"); the stop token's own text is not emitted (vLLM's default,
//     include_stop_str_in_output = false). Put the model's EOS ids in stop_token_ids.
//   - ends on a stop string (finish_reason "stop"); the text is cut just before it, as OpenAI and vLLM do, or just
//     after it with include_stop_string (vLLM's include_stop_str_in_output).
//     Text that could still become the start of a stop string is held back until it can no longer match.
//   - ends after max_tokens tokens (finish_reason "length"), unless the last token completed a stop string.
//   - with min_tokens (vLLM's), neither a stop token id nor a stop string ends it until more than min_tokens
//     tokens are out; a stop string may then end it that began earlier, but not one that lay wholly in them (the
//     engine also keeps the stop ids from being sampled before then: SamplingParams::banned_ids).
//   - never cuts inside a UTF-8 character: a trailing incomplete sequence is held back like a stop-string prefix.
// When it finishes, everything held back (up to a stop string) is emitted with the final update.
//
//   StopChecker stop(criteria);
//   for each sampled id: StopUpdate u = stop.feed(id, detok.push(id)); send(u.text); if (u.finished) break;
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tern {

struct StopCriteria {
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop_strings;
  int32_t max_tokens = 16;
  int32_t min_tokens = 0;  // [0, max_tokens]
  bool include_stop_string = false;  // the matched stop string stays in the text
};

// max_tokens >= 1, 0 <= min_tokens <= max_tokens; stop strings non-empty and valid UTF-8. Errors name the field and
// the index.
Expected<void> stop_criteria_validate(const StopCriteria& criteria);

struct StopUpdate {
  std::string text;  // text the client may see now
  bool finished = false;
  std::string_view finish_reason;  // "stop" or "length" once finished, empty before
  // What ended the sequence with "stop" (OpenAI/vLLM's stop_reason): the matched string or the token id.
  std::optional<std::string> stop_string;
  std::optional<int32_t> stop_token_id;
};

class StopChecker {
 public:
  explicit StopChecker(StopCriteria criteria);

  // One generated token and the text it added. After the sequence finished, returns an empty finished update.
  StopUpdate feed(int32_t token_id, std::string_view text_delta);

  // Everything still held back, for a sequence that ends for a reason the checker does not see (the context
  // length, an abort); the checker counts as finished afterwards.
  std::string flush();

  bool finished() const { return finished_; }
  int32_t num_tokens() const { return num_tokens_; }

 private:
  StopUpdate finish(std::string_view reason, size_t emit_bytes);
  size_t held_back_bytes() const;

  StopCriteria criteria_;
  std::string pending_;  // text received but not yet emitted: a possible stop-string start or an incomplete char
  int32_t num_tokens_ = 0;
  bool finished_ = false;
  std::string_view finish_reason_;
};

}  // namespace tern
