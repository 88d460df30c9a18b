// Decoders of tokenizer.json ("decoder" field): turn the token strings of a sequence of ids back into text.
// Each stage rewrites the list of token strings (Rust `tokenizers` decode_chain); the result is their
// concatenation.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

#include "core/error.h"

namespace tern {

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

// Parses a decoder object; a JSON null gives nullptr (tokens are then joined with spaces).
Expected<std::unique_ptr<Decoder>> decoder_from_json(const nlohmann::json& json);

// The full decode: the chain, then concatenation; without a decoder, tokens joined with single spaces.
std::string decoder_run(const Decoder* decoder, std::vector<std::string> tokens);

}  // namespace tern
