// Typed, strict access to the fields of one JSON object (a config.json or a part of it). Every getter records the
// key as known, so that after parsing, reject_unknown() can name any field nobody asked for. Errors name the file
// and the full field path ("config.json: field 'text_config.hidden_size' must be an integer, got string").
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tern {

class JsonFields {
 public:
  // `object` must outlive this reader. `prefix` is prepended to field names in messages ("text_config.").
  JsonFields(const nlohmann::json& object, std::string_view source, std::string_view prefix = "");

  bool has(std::string_view key) const;        // present, null included
  bool has_value(std::string_view key) const;  // present and not null
  std::string_view source() const { return source_; }
  std::string path(std::string_view key) const { return prefix_ + std::string(key); }

  // Absent -> default; null or a wrong JSON type -> error.
  Expected<int64_t> get_int(std::string_view key, int64_t fallback);
  Expected<double> get_double(std::string_view key, double fallback);
  Expected<bool> get_bool(std::string_view key, bool fallback);
  Expected<std::string> get_string(std::string_view key, std::string_view fallback);
  // Absent or null -> nullopt.
  Expected<std::optional<int64_t>> get_optional_int(std::string_view key);
  Expected<std::optional<double>> get_optional_double(std::string_view key);
  Expected<std::optional<bool>> get_optional_bool(std::string_view key);
  Expected<std::optional<std::string>> get_optional_string(std::string_view key);
  // Lists: absent or null -> false and `out` untouched; otherwise true with `out` filled.
  Expected<bool> get_int_list(std::string_view key, std::vector<int64_t>& out);
  Expected<bool> get_string_list(std::string_view key, std::vector<std::string>& out);
  // The raw value (nullptr when absent); the key counts as known.
  const nlohmann::json* get_raw(std::string_view key);
  // The raw value without marking the key as known.
  const nlohmann::json* peek(std::string_view key) const { return find(key); }

  // Accepts keys whose values are not needed (training-only settings, bookkeeping).
  void accept(std::initializer_list<std::string_view> keys);
  void accept(const std::vector<std::string_view>& keys);
  // Error naming the first field that no getter or accept() covered; `owner` says whose field it would be.
  Expected<void> reject_unknown(std::string_view owner) const;

  // "<source>: field '<prefix><key>'" -- the start of every message about one field.
  std::string where(std::string_view key) const;
  // "<source>: field '<prefix><key>[<index>]'" -- for one element of a list.
  std::string where(std::string_view key, size_t index) const;

 private:
  const nlohmann::json* find(std::string_view key) const;

  const nlohmann::json& object_;
  std::string source_;
  std::string prefix_;
  std::set<std::string, std::less<>> known_;
};

// The JSON type name used in messages ("string", "number", "object", ...).
std::string_view json_type_name(const nlohmann::json& value);

}  // namespace tern
