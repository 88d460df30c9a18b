#include "tokenizer/detokenizer.h"

namespace tern {

namespace {

bool ends_with_replacement_char(const std::string& text) {
  return text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0;
}

// ByteFallback decodes a run of "<0xNN>" tokens as one unit: a byte that is valid UTF-8 on its own becomes U+FFFD
// when an invalid byte follows it. Text is therefore held back while the stream ends in such a token.
bool is_byte_fallback_token(const std::string& token) {
  auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); };
  return token.size() == 6 && token.compare(0, 3, "<0x") == 0 && token[5] == '>' && hex(token[3]) && hex(token[4]);
}

}  // namespace

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string IncrementalDetokenizer::push(int32_t id) {
  window_.push_back(id);
  // Unknown ids and skipped special tokens never reach the decoder, so they do not end a run of byte tokens.
  const std::string token = tokenizer_->id_to_token(id);
  if (!token.empty() && !(skip_special_tokens_ && tokenizer_->is_special(id))) {
    in_byte_run_ = is_byte_fallback_token(token);
  }
  if (in_byte_run_) return {};
  std::string text = tokenizer_->decode(window_, skip_special_tokens_);
  if (text.size() <= prefix_.size() || ends_with_replacement_char(text)) return {};
  // Decoders used with tokenizer.json only ever append to the text of a window, so the emitted prefix is a
  // prefix of `text`; the golden tests check this for every case.
  std::string delta = text.substr(prefix_.size());
  // Keep the ids emitted just now as context for the next window; drop the older ones.
  window_.erase(window_.begin(), window_.begin() + static_cast<std::ptrdiff_t>(prefix_end_));
  prefix_end_ = window_.size();
  prefix_ = tokenizer_->decode(window_, skip_special_tokens_);
  return delta;
}

std::string IncrementalDetokenizer::finish() {
  std::string text = tokenizer_->decode(window_, skip_special_tokens_);
  std::string delta = text.size() > prefix_.size() ? text.substr(prefix_.size()) : std::string();
  window_.clear();
  prefix_.clear();
  in_byte_run_ = false;
  prefix_end_ = 0;
  return delta;
}

}  // namespace tern
