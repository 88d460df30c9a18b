#include "server/tool_parser.h"

#include <algorithm>
#include <cmath>

#include "core/json_parse.h"
#include "server/reasoning_parser.h"

namespace tern {
namespace {

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";

std::string_view trim(std::string_view s) {
  const auto space = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

const nlohmann::ordered_json* find_tool(const nlohmann::ordered_json& tools, std::string_view name) {
  if (!tools.is_array()) return nullptr;
  for (const auto& t : tools) {
    const auto f = t.find("function");
    if (f != t.end() && f->is_object() && f->value("name", "") == name) return &*f;
  }
  return nullptr;
}

// The JSON types the schema of parameter `key` declares: its "type" (a name or a list of names), else the types of
// its anyOf/oneOf branches. Empty when the schema says nothing (no such parameter, no type).
std::vector<std::string> declared_types(const nlohmann::ordered_json& function, const std::string& key) {
  std::vector<std::string> types;
  const auto p = function.find("parameters");
  if (p == function.end() || !p->is_object()) return types;
  const auto props = p->find("properties");
  if (props == p->end() || !props->is_object()) return types;
  const auto prop = props->find(key);
  if (prop == props->end() || !prop->is_object()) return types;
  const auto add_types = [&types](const nlohmann::ordered_json& schema) {
    const auto t = schema.find("type");
    if (t == schema.end()) return;
    if (t->is_string()) types.push_back(t->get<std::string>());
    if (t->is_array()) {
      for (const auto& name : *t) {
        if (name.is_string()) types.push_back(name.get<std::string>());
      }
    }
  };
  add_types(*prop);
  if (!types.empty()) return types;
  for (const char* keyword : {"anyOf", "oneOf"}) {
    const auto branches = prop->find(keyword);
    if (branches == prop->end() || !branches->is_array()) continue;
    for (const auto& branch : *branches) {
      if (branch.is_object()) add_types(branch);
    }
  }
  return types;
}

bool has_type(const nlohmann::ordered_json& value, std::string_view type) {
  if (type == "integer") {
    if (value.is_number_integer()) return true;
    if (!value.is_number_float()) return false;
    const double d = value.get<double>();
    return std::isfinite(d) && std::floor(d) == d;  // JSON Schema: 3.0 is an integer
  }
  if (type == "number") return value.is_number();
  if (type == "boolean") return value.is_boolean();
  if (type == "object") return value.is_object();
  if (type == "array") return value.is_array();
  if (type == "null") return value.is_null();
  return false;  // "string" values are the raw text, never parsed
}

// Invalid UTF-8 in the model's text becomes U+FFFD rather than an exception.
std::string dump_arguments(const nlohmann::ordered_json& args) {
  return args.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

// The text between `open` and `close` starting at `pos`; advances `pos` past `close`.
std::optional<std::string_view> take_between(std::string_view s, size_t& pos, std::string_view open,
                                             std::string_view close) {
  while (pos < s.size() && (s[pos] == ' ' || s[pos] == '\n' || s[pos] == '\r' || s[pos] == '\t')) ++pos;
  if (!s.substr(pos).starts_with(open)) return std::nullopt;
  const size_t begin = pos + open.size();
  const size_t end = s.find(close, begin);
  if (end == std::string_view::npos) return std::nullopt;
  pos = end + close.size();
  return s.substr(begin, end - begin);
}

std::string_view strip_one_newline(std::string_view v) {
  if (v.starts_with('\n')) v.remove_prefix(1);
  if (v.ends_with('\n')) v.remove_suffix(1);
  return v;
}

std::optional<ToolCall> parse_json_body(std::string_view body, const nlohmann::ordered_json& tools) {
  auto parsed = json_parse_untrusted_ordered(trim(body));
  if (!parsed) return std::nullopt;
  nlohmann::ordered_json& j = *parsed;
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return std::nullopt;
  const std::string name = j["name"];
  if (!find_tool(tools, name)) return std::nullopt;
  nlohmann::ordered_json args = j.contains("arguments") ? j["arguments"] : j.value("parameters", nlohmann::ordered_json::object());
  if (args.is_string()) {
    auto inner = json_parse_untrusted_ordered(args.get<std::string>());
    if (!inner) return std::nullopt;
    args = std::move(*inner);
  }
  if (!args.is_object()) return std::nullopt;
  return ToolCall{name, dump_arguments(args)};
}

std::optional<ToolCall> parse_xml_body(std::string_view body, const nlohmann::ordered_json& tools) {
  body = trim(body);
  if (!body.starts_with("<function=") || !body.ends_with("</function>")) return std::nullopt;
  const size_t name_end = body.find('>');
  if (name_end == std::string_view::npos || name_end + 1 + 11 > body.size()) return std::nullopt;
  const std::string name(trim(body.substr(10, name_end - 10)));
  const nlohmann::ordered_json* function = find_tool(tools, name);
  if (!function) return std::nullopt;
  const std::string_view inner = body.substr(name_end + 1, body.size() - name_end - 1 - 11);
  nlohmann::ordered_json args = nlohmann::ordered_json::object();
  size_t pos = 0;
  while (!trim(inner.substr(pos)).empty()) {
    size_t start = pos;
    while (start < inner.size() && (inner[start] == ' ' || inner[start] == '\n' || inner[start] == '\r')) ++start;
    if (!inner.substr(start).starts_with("<parameter=")) return std::nullopt;
    const size_t key_end = inner.find('>', start);
    const size_t value_end = inner.find("</parameter>", key_end);
    if (key_end == std::string_view::npos || value_end == std::string_view::npos) return std::nullopt;
    const std::string key(trim(inner.substr(start + 11, key_end - start - 11)));
    args[key] = tool_argument_value(*function, key, strip_one_newline(inner.substr(key_end + 1, value_end - key_end - 1)));
    pos = value_end + 12;
  }
  return ToolCall{name, dump_arguments(args)};
}

std::optional<ToolCall> parse_glm_body(std::string_view body, const nlohmann::ordered_json& tools) {
  const size_t name_end = std::min(body.find('\n'), body.find("<arg_key>"));
  const std::string name(trim(body.substr(0, name_end)));
  const nlohmann::ordered_json* function = find_tool(tools, name);
  if (!function) return std::nullopt;
  nlohmann::ordered_json args = nlohmann::ordered_json::object();
  size_t pos = name_end == std::string_view::npos ? body.size() : name_end;
  while (!trim(body.substr(pos)).empty()) {
    auto key = take_between(body, pos, "<arg_key>", "</arg_key>");
    if (!key) return std::nullopt;
    auto value = take_between(body, pos, "<arg_value>", "</arg_value>");
    if (!value) return std::nullopt;
    const std::string k(trim(*key));
    args[k] = tool_argument_value(*function, k, *value);
  }
  return ToolCall{name, dump_arguments(args)};
}

}  // namespace

nlohmann::ordered_json tool_argument_value(const nlohmann::ordered_json& function, const std::string& key,
                                           std::string_view raw) {
  const std::vector<std::string> types = declared_types(function, key);
  if (types.size() == 1 && types[0] == "string") return std::string(raw);
  auto parsed = json_parse_untrusted_ordered(raw);
  if (types.empty()) return parsed ? std::move(*parsed) : nlohmann::ordered_json(std::string(raw));
  if (parsed && std::any_of(types.begin(), types.end(), [&](const std::string& t) { return has_type(*parsed, t); })) {
    return std::move(*parsed);
  }
  return std::string(raw);
}

std::optional<ToolFormat> tool_format_from_name(std::string_view name) {
  if (name == "qwen3") return ToolFormat::kQwen3Json;
  if (name == "qwen3_coder") return ToolFormat::kQwen3Xml;
  if (name == "glm45") return ToolFormat::kGlm45;
  if (name == "glm47") return ToolFormat::kGlm47;
  if (name == "none") return ToolFormat::kNone;
  return std::nullopt;
}

std::string_view tool_format_name(ToolFormat format) {
  switch (format) {
    case ToolFormat::kQwen3Json: return "qwen3";
    case ToolFormat::kQwen3Xml: return "qwen3_coder";
    case ToolFormat::kGlm45: return "glm45";
    case ToolFormat::kGlm47: return "glm47";
    case ToolFormat::kNone: break;
  }
  return "none";
}

ToolFormat tool_format_detect(std::string_view chat_template) {
  if (chat_template.find("<tool_call>{function-name}<arg_key>") != std::string_view::npos) return ToolFormat::kGlm47;
  if (chat_template.find("<arg_key>") != std::string_view::npos) return ToolFormat::kGlm45;
  if (chat_template.find("<function=") != std::string_view::npos) return ToolFormat::kQwen3Xml;
  if (chat_template.find("<tool_call>") != std::string_view::npos) return ToolFormat::kQwen3Json;
  return ToolFormat::kNone;
}

std::optional<ToolCall> tool_call_parse_body(ToolFormat format, std::string_view body,
                                             const nlohmann::ordered_json& tools) {
  switch (format) {
    case ToolFormat::kQwen3Json: return parse_json_body(body, tools);
    case ToolFormat::kQwen3Xml: return parse_xml_body(body, tools);
    case ToolFormat::kGlm45:
    case ToolFormat::kGlm47: return parse_glm_body(body, tools);
    case ToolFormat::kNone: break;
  }
  return std::nullopt;
}

void ToolCallParser::emit_text(ToolDelta& out, std::string_view text) {
  if (text.empty()) return;
  std::string all = pending_space_ + std::string(text);
  pending_space_.clear();
  size_t keep = all.size();
  while (keep > 0 && (all[keep - 1] == ' ' || all[keep - 1] == '\n' || all[keep - 1] == '\r' || all[keep - 1] == '\t')) {
    --keep;
  }
  out.content += all.substr(0, keep);
  pending_space_ = all.substr(keep);
}

ToolDelta ToolCallParser::feed(std::string_view text) {
  buffer_ += text;
  ToolDelta out;
  for (;;) {
    if (!inside_) {
      const size_t open = buffer_.find(kOpen);
      if (open == std::string::npos) {
        const size_t keep = marker_prefix_suffix(buffer_, kOpen);
        emit_text(out, std::string_view(buffer_).substr(0, buffer_.size() - keep));
        buffer_.erase(0, buffer_.size() - keep);
        return out;
      }
      emit_text(out, std::string_view(buffer_).substr(0, open));
      buffer_.erase(0, open + kOpen.size());
      inside_ = true;
    }
    const size_t close = buffer_.find(kClose);
    if (close == std::string::npos) return out;
    const std::string body = buffer_.substr(0, close);
    buffer_.erase(0, close + kClose.size());
    inside_ = false;
    if (auto call = tool_call_parse_body(format_, body, tools_)) {
      pending_space_.clear();
      out.calls.push_back(std::move(*call));
      ++num_calls_;
    } else {
      emit_text(out, std::string(kOpen) + body + std::string(kClose));
    }
  }
}

ToolDelta ToolCallParser::finish() {
  ToolDelta out;
  std::string rest = inside_ ? std::string(kOpen) + buffer_ : buffer_;
  buffer_.clear();
  inside_ = false;
  const std::string all = pending_space_ + rest;
  pending_space_.clear();
  if (num_calls_ == 0 || !std::string(trim(all)).empty()) out.content = num_calls_ == 0 ? all : std::string(trim(all));
  return out;
}

}  // namespace tern
