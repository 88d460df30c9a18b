// Pre-tokenizers of tokenizer.json ("pre_tokenizer" field): each splits pieces of text into smaller pieces that
// the model then encodes independently. Split semantics (behaviours, invert, empty pieces dropped) follow the
// Rust `tokenizers` NormalizedString::split.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

#include "core/error.h"

namespace tern {

struct Piece {
  std::string text;
  int32_t token_id = -1;  // >= 0 when the piece is an added token, which later stages leave alone
  bool at_start = false;  // begins at offset 0 of the input (Metaspace's prepend_scheme "first" needs it)
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits `piece` (never an added token) and appends the resulting pieces to `out`.
  virtual void split(Piece&& piece, std::vector<Piece>& out) const = 0;
  // Splits every piece that is not an added token, in place.
  virtual void apply(std::vector<Piece>& pieces) const;
  // True when splitting can drop text (a Removed behaviour: WhitespaceSplit, Whitespace, CharDelimiterSplit...).
  virtual bool drops_text() const { return false; }
  // True when the pieces come out in the byte-level alphabet (ByteLevel), one character per input byte.
  virtual bool byte_level() const { return false; }
};

// Parses a pre-tokenizer object; a JSON null gives nullptr.
Expected<std::unique_ptr<PreTokenizer>> pre_tokenizer_from_json(const nlohmann::json& json);

}  // namespace tern
