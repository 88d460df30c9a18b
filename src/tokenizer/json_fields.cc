#include "tokenizer/json_fields.h"

namespace tern {

Expected<std::string> json_string(const nlohmann::json& object, std::string_view key) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_string()) return make_error("field '{}' must be a string", key);
  return it->get<std::string>();
}

Expected<bool> json_bool(const nlohmann::json& object, std::string_view key, bool fallback) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return make_error("field '{}' must be true or false", key);
  return it->get<bool>();
}

Expected<int64_t> json_int(const nlohmann::json& object, std::string_view key, int64_t fallback) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_number_integer()) return make_error("field '{}' must be an integer", key);
  return it->get<int64_t>();
}

Expected<std::string> json_type(const nlohmann::json& object) {
  if (!object.is_object()) return make_error("expected an object with a 'type' field, got {}", object.type_name());
  return json_string(object, "type");
}

Expected<std::string> json_pattern(const nlohmann::json& object, std::string_view key, bool* is_regex) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_object()) return make_error("field '{}' must be a {{\"String\"|\"Regex\": ...}} object", key);
  if (it->contains("Regex")) {
    *is_regex = true;
    return json_string(*it, "Regex");
  }
  *is_regex = false;
  return json_string(*it, "String");
}

}  // namespace tern
