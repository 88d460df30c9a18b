// Typed access to tokenizer.json fields; errors name the field and say what was expected.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

#include "core/error.h"

namespace tern {

Expected<std::string> json_string(const nlohmann::json& object, std::string_view key);
Expected<bool> json_bool(const nlohmann::json& object, std::string_view key, bool fallback);
Expected<int64_t> json_int(const nlohmann::json& object, std::string_view key, int64_t fallback);
// The "type" of a component object, e.g. "Split".
Expected<std::string> json_type(const nlohmann::json& object);
// A {"String": s} or {"Regex": r} pattern object; is_regex tells which.
Expected<std::string> json_pattern(const nlohmann::json& object, std::string_view key, bool* is_regex);

}  // namespace tern
