// Streaming detokenization: fed one id at a time, returns the new text. A delta never ends inside a UTF-8
// character (text is held back while the decode ends in U+FFFD, i.e. an incomplete byte sequence), and the
// deltas followed by finish() concatenate to exactly Tokenizer::decode(all ids).
//
//   IncrementalDetokenizer detok(tokenizer, /*skip_special_tokens=*/true);
//   for (int32_t id : generated) send(detok.push(id));
//   send(detok.finish());
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace tern {

class IncrementalDetokenizer {
 public:
  // `tokenizer` must outlive this object.
  IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens);

  // Text that became final with this id (often empty while a character is incomplete).
  std::string push(int32_t id);
  // Text still held back at the end of the stream (e.g. a trailing incomplete character, as U+FFFD).
  std::string finish();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  // Ids whose text is not yet fully emitted, preceded by the ids already emitted since the last window cut,
  // which keep decoders that look at neighbouring tokens (Metaspace, ByteLevel across a character) consistent.
  std::vector<int32_t> window_;
  std::string prefix_;     // decode(window_[0, prefix_end_)): text already emitted
  size_t prefix_end_ = 0;  // ids at the front of window_ that only serve as context
  bool in_byte_run_ = false;  // the last decoded token is a "<0xNN>" byte-fallback token
};

}  // namespace tern
