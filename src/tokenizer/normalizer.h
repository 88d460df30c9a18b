// Normalizers of tokenizer.json ("normalizer" field): each rewrites one piece of text before pre-tokenization.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>

#include "core/error.h"

namespace tern {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& text) const = 0;
  // At most how many bytes of input one byte of output stands for; 0 when the normalizer can delete text
  // without bound (Strip, Replace). Unicode normalization and lowercasing shrink at most 3x (a Hangul L+V+T
  // jamo triple, 9 bytes, composes to one 3-byte syllable; KELVIN SIGN, 3 bytes, lowercases to 'k').
  virtual size_t shrink_factor() const { return 1; }
};

// Parses a normalizer object; a JSON null gives nullptr (no normalisation).
Expected<std::unique_ptr<Normalizer>> normalizer_from_json(const nlohmann::json& json);

}  // namespace tern
