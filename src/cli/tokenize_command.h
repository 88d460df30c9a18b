// `tern tokenize` and `tern detokenize`: encode text to ids and decode ids to text with a tokenizer.json.
#pragma once

#include <CLI/CLI.hpp>

namespace tern {

void register_tokenize_commands(CLI::App& app);

}  // namespace tern
