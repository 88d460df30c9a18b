// Python str methods on UTF-8 strings, indexing by code point as Python does.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tern::jinja {

bool py_isspace_cp(char32_t cp);
std::string py_strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right);
std::vector<std::string> py_split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit);
std::vector<std::string> py_rsplit(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit);
std::vector<std::string> py_splitlines(std::string_view s, bool keepends);
std::string py_replace(std::string_view s, std::string_view old, std::string_view replacement, int64_t count);
std::string py_upper(std::string_view s);
std::string py_lower(std::string_view s);
std::string py_title(std::string_view s);       // str.title()
std::string py_capitalize(std::string_view s);  // str.capitalize()
int64_t py_find(std::string_view s, std::string_view sub, bool reverse);  // code-point index or -1
int64_t py_count(std::string_view s, std::string_view sub);
// Predicates over every character (false for the empty string), as str.isdigit() etc.
bool py_is_all(std::string_view s, std::string_view predicate);
bool py_islower(std::string_view s);
bool py_isupper(std::string_view s);

}  // namespace tern::jinja
