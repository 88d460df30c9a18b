// Typed access to tokenizer.json fields; errors name the field and say what was expected.
#pragma once

#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tern {

Expected<std::string> json_string(const nlohmann::json& object, std::string_view key);
Expected<bool> json_bool(const nlohmann::json& object, std::string_view key, bool fallback);
Expected<int64_t> json_int(const nlohmann::json& object, std::string_view key, int64_t fallback);
// The "type" of a component object, e.g. "Split".
Expected<std::string> json_type(const nlohmann::json& object);
// A {"String": s} or {"Regex": r} pattern object; is_regex tells which.
Expected<std::string> json_pattern(const nlohmann::json& object, std::string_view key, bool* is_regex);

// The components of a "Sequence" (normalizers, pre_tokenizers, decoders): each element of the list `key` parsed by
// `parse`; null components (a parser's "none") are dropped; errors name the element ("decoders[2]: ...").
template <class T, class Parse>
Expected<std::vector<std::unique_ptr<T>>> json_component_list(const nlohmann::json& object, std::string_view key,
                                                              std::string_view what, Parse parse) {
  const auto it = object.find(std::string(key));
  if (it == object.end() || !it->is_array()) return make_error("Sequence {} needs a '{}' list", what, key);
  std::vector<std::unique_ptr<T>> steps;
  for (size_t i = 0; i < it->size(); ++i) {
    auto step = parse((*it)[i]);
    if (!step) return wrap_error(step.error(), fmt::format("{}[{}]", key, i));
    if (*step) steps.push_back(std::move(*step));
  }
  return steps;
}

}  // namespace tern
