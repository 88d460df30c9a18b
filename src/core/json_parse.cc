#include "core/json_parse.h"

#include <fstream>
#include <sstream>

#include <string>

namespace tern {

size_t json_too_deep_at(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return i;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return std::string_view::npos;
}

namespace {

template <class Json>
Expected<Json> parse(std::string_view text) {
  if (const size_t at = json_too_deep_at(text); at != std::string_view::npos) {
    return make_error("nested deeper than {} arrays/objects at byte {} (tern's limit)", kJsonMaxDepth, at);
  }
  try {
    return Json::parse(text);
  } catch (const typename Json::parse_error& e) {
    // what() is "[json.exception.parse_error.101] parse error at line 1, column 12: syntax error while parsing
    // value - ..."; keep the part after the exception's id, and say the byte too.
    std::string what = e.what();
    if (const size_t close = what.find("] "); close != std::string::npos) what = what.substr(close + 2);
    return make_error("{} (byte {})", what, e.byte);
  } catch (const typename Json::exception& e) {
    return make_error("{}", e.what());
  }
}

}  // namespace

Expected<nlohmann::json> json_parse_untrusted(std::string_view text) { return parse<nlohmann::json>(text); }
Expected<nlohmann::ordered_json> json_parse_untrusted_ordered(std::string_view text) {
  return parse<nlohmann::ordered_json>(text);
}

Expected<nlohmann::json> json_read_file(const std::filesystem::path& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error("{}: cannot open {}", path.string(), what);
  std::stringstream buffer;
  buffer << in.rdbuf();
  auto document = json_parse_untrusted(buffer.str());
  if (!document) return make_error("{}: not valid JSON: {}", path.string(), document.error().message);
  return document;
}

}  // namespace tern
