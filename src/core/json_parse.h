// Parsing JSON that comes from outside (request bodies, config.json, tokenizer.json, quantization and tokenizer
// configs): the nesting depth is checked on the raw text before anything recursive sees it (nlohmann's copies, the
// template engine's values), and an error says where.
//
//   TERN_ASSIGN_OR_RETURN(nlohmann::json doc, json_parse_untrusted(text));
//   // "nested deeper than 128 arrays/objects at byte 131 (tern's limit)" or "syntax error at byte 12: ..."
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <filesystem>
#include <string_view>

#include "core/error.h"

namespace tern {

// Deeper than any request, model config or tokenizer file (they nest at most ~20 levels, a JSON schema in a tool
// definition included), shallow enough for every recursive consumer.
constexpr int kJsonMaxDepth = 128;

// The byte offset of the first '[' or '{' (outside strings) that opens level max_depth + 1, or npos when the text
// never nests deeper than max_depth. Linear, no allocation; malformed text is left to the parser.
size_t json_too_deep_at(std::string_view text, int max_depth = kJsonMaxDepth);

// Strict JSON (RFC 8259, as Python's json module without NaN/Infinity), at most kJsonMaxDepth levels deep.
Expected<nlohmann::json> json_parse_untrusted(std::string_view text);
Expected<nlohmann::ordered_json> json_parse_untrusted_ordered(std::string_view text);

// A file parsed as json_parse_untrusted does; errors start with the path: "<path>: cannot open <what>" or "<path>: not
// valid JSON: <where and why>".
Expected<nlohmann::json> json_read_file(const std::filesystem::path& path, std::string_view what = "the file");

}  // namespace tern
