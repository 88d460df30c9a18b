// Hugging Face tokenizer.json tokenizers, encoding and decoding exactly as the Rust `tokenizers` library (0.22)
// does: added tokens are matched first (longest first), the rest is normalised, pre-tokenized and encoded by the
// BPE model; post-processing adds template tokens only when asked to.
//
//   TERN_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::load("/models/qwen3"));  // a dir means dir/tokenizer.json
//   std::vector<int32_t> ids = tok.encode("Hello world");
//   std::string text = tok.decode(ids);
//
// A Tokenizer is cheap to copy (it shares its immutable tables) and safe to use from many threads at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tern {

class Tokenizer {
 public:
  // Loads tokenizer.json (or dir/tokenizer.json) and, when present next to it, tokenizer_config.json (bos/eos
  // tokens, chat template, extra added tokens) and chat_template.jinja.
  static Expected<Tokenizer> load(const std::filesystem::path& file_or_dir);

  // Invalid UTF-8 in `text` is first replaced by U+FFFD (the reference only accepts valid strings).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // Ids that are not in the vocabulary are skipped, as the reference does.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token's string (in the model's alphabet, e.g. "Ġhello"); empty for an unknown id.
  std::string id_to_token(int32_t id) const;
  // Number of distinct tokens, added tokens included (the reference's get_vocab_size(true)).
  size_t vocab_size() const;
  // True for added tokens marked "special" (those skip_special_tokens removes).
  bool is_special(int32_t id) const;

  // At most this many bytes of text (before normalization) become one token, so `text` encodes to at least
  // text.size() / max_bytes_per_token() tokens: a caller can refuse a text too long for its context before
  // encoding it. The longest token's bytes times the normalizers' shrink factor; nullopt where this tokenizer can
  // drop text without bound (Strip or Replace normalizers, Removed splits, characters with no token).
  std::optional<size_t> max_bytes_per_token() const;

  std::optional<std::string> chat_template() const;
  std::optional<std::string> bos_token() const;
  std::optional<std::string> eos_token() const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace tern
