#include "io/json_fields.h"

#include <limits>

namespace tern {

std::string_view json_type_name(const nlohmann::json& value) {
  switch (value.type()) {
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::object:
      return "object";
    case nlohmann::json::value_t::array:
      return "array";
    case nlohmann::json::value_t::string:
      return "string";
    case nlohmann::json::value_t::boolean:
      return "boolean";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
      return "integer";
    case nlohmann::json::value_t::number_float:
      return "floating-point number";
    default:
      return "value";
  }
}

namespace {

// The value as written, shortened, so a message shows what was found.
std::string json_excerpt(const nlohmann::json& value) {
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  constexpr size_t kMaxExcerpt = 60;
  if (text.size() > kMaxExcerpt) text = text.substr(0, kMaxExcerpt) + "...";
  return text;
}

// JSON integers (signed or unsigned) that fit int64_t.
std::optional<int64_t> json_to_int(const nlohmann::json& value) {
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  return std::nullopt;
}

}  // namespace

JsonFields::JsonFields(const nlohmann::json& object, std::string_view source, std::string_view prefix)
    : object_(object), source_(source), prefix_(prefix) {}

const nlohmann::json* JsonFields::find(std::string_view key) const {
  if (!object_.is_object()) return nullptr;
  const auto it = object_.find(std::string(key));
  return it == object_.end() ? nullptr : &*it;
}

bool JsonFields::has(std::string_view key) const {
  return find(key) != nullptr;
}

bool JsonFields::has_value(std::string_view key) const {
  const nlohmann::json* value = find(key);
  return value != nullptr && !value->is_null();
}

std::string JsonFields::where(std::string_view key) const {
  return fmt::format("{}: field '{}{}'", source_, prefix_, key);
}

std::string JsonFields::where(std::string_view key, size_t index) const {
  return fmt::format("{}: field '{}{}[{}]'", source_, prefix_, key, index);
}

const nlohmann::json* JsonFields::get_raw(std::string_view key) {
  known_.emplace(key);
  return find(key);
}

Expected<std::optional<int64_t>> JsonFields::get_optional_int(std::string_view key) {
  const nlohmann::json* value = get_raw(key);
  if (value == nullptr || value->is_null()) return std::optional<int64_t>();
  const std::optional<int64_t> number = json_to_int(*value);
  if (!number) {
    return make_error("{} must be an integer, got {} {}", where(key), json_type_name(*value), json_excerpt(*value));
  }
  return number;
}

Expected<std::optional<double>> JsonFields::get_optional_double(std::string_view key) {
  const nlohmann::json* value = get_raw(key);
  if (value == nullptr || value->is_null()) return std::optional<double>();
  if (!value->is_number()) {
    return make_error("{} must be a number, got {} {}", where(key), json_type_name(*value), json_excerpt(*value));
  }
  return std::optional<double>(value->get<double>());
}

Expected<std::optional<bool>> JsonFields::get_optional_bool(std::string_view key) {
  const nlohmann::json* value = get_raw(key);
  if (value == nullptr || value->is_null()) return std::optional<bool>();
  if (!value->is_boolean()) {
    return make_error("{} must be true or false, got {} {}", where(key), json_type_name(*value), json_excerpt(*value));
  }
  return std::optional<bool>(value->get<bool>());
}

Expected<std::optional<std::string>> JsonFields::get_optional_string(std::string_view key) {
  const nlohmann::json* value = get_raw(key);
  if (value == nullptr || value->is_null()) return std::optional<std::string>();
  if (!value->is_string()) {
    return make_error("{} must be a string, got {} {}", where(key), json_type_name(*value), json_excerpt(*value));
  }
  return std::optional<std::string>(value->get<std::string>());
}

Expected<int64_t> JsonFields::get_int(std::string_view key, int64_t fallback) {
  const nlohmann::json* value = find(key);
  if (value != nullptr && value->is_null()) return make_error("{} must be an integer, got null", where(key));
  TERN_ASSIGN_OR_RETURN(const std::optional<int64_t> number, get_optional_int(key));
  return number.value_or(fallback);
}

Expected<double> JsonFields::get_double(std::string_view key, double fallback) {
  const nlohmann::json* value = find(key);
  if (value != nullptr && value->is_null()) return make_error("{} must be a number, got null", where(key));
  TERN_ASSIGN_OR_RETURN(const std::optional<double> number, get_optional_double(key));
  return number.value_or(fallback);
}

Expected<bool> JsonFields::get_bool(std::string_view key, bool fallback) {
  const nlohmann::json* value = find(key);
  if (value != nullptr && value->is_null()) return make_error("{} must be true or false, got null", where(key));
  TERN_ASSIGN_OR_RETURN(const std::optional<bool> flag, get_optional_bool(key));
  return flag.value_or(fallback);
}

Expected<std::string> JsonFields::get_string(std::string_view key, std::string_view fallback) {
  const nlohmann::json* value = find(key);
  if (value != nullptr && value->is_null()) return make_error("{} must be a string, got null", where(key));
  TERN_ASSIGN_OR_RETURN(std::optional<std::string> text, get_optional_string(key));
  return text ? std::move(*text) : std::string(fallback);
}

Expected<bool> JsonFields::get_int_list(std::string_view key, std::vector<int64_t>& out) {
  const nlohmann::json* value = get_raw(key);
  if (value == nullptr || value->is_null()) return false;
  if (!value->is_array()) {
    return make_error("{} must be a list of integers, got {} {}", where(key), json_type_name(*value),
                      json_excerpt(*value));
  }
  out.clear();
  for (size_t i = 0; i < value->size(); ++i) {
    const std::optional<int64_t> number = json_to_int((*value)[i]);
    if (!number) {
      return make_error("{} must be an integer, got {} {}", where(key, i), json_type_name((*value)[i]),
                        json_excerpt((*value)[i]));
    }
    out.push_back(*number);
  }
  return true;
}

Expected<bool> JsonFields::get_string_list(std::string_view key, std::vector<std::string>& out) {
  const nlohmann::json* value = get_raw(key);
  if (value == nullptr || value->is_null()) return false;
  if (!value->is_array()) {
    return make_error("{} must be a list of strings, got {} {}", where(key), json_type_name(*value),
                      json_excerpt(*value));
  }
  out.clear();
  for (size_t i = 0; i < value->size(); ++i) {
    if (!(*value)[i].is_string()) {
      return make_error("{} must be a string, got {} {}", where(key, i), json_type_name((*value)[i]),
                        json_excerpt((*value)[i]));
    }
    out.push_back((*value)[i].get<std::string>());
  }
  return true;
}

void JsonFields::accept(std::initializer_list<std::string_view> keys) {
  for (std::string_view key : keys) known_.emplace(key);
}

void JsonFields::accept(const std::vector<std::string_view>& keys) {
  for (std::string_view key : keys) known_.emplace(key);
}

Expected<void> JsonFields::reject_unknown(std::string_view owner) const {
  if (!object_.is_object()) return {};
  for (const auto& [key, value] : object_.items()) {
    if (known_.find(key) == known_.end()) {
      return make_error("{}: unknown field '{}{}' (not a field of {})", source_, prefix_, key, owner);
    }
  }
  return {};
}

}  // namespace tern
