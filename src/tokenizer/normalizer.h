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
};

// Parses a normalizer object; a JSON null gives nullptr (no normalisation).
Expected<std::unique_ptr<Normalizer>> normalizer_from_json(const nlohmann::json& json);

}  // namespace tern
