#include "template/value.h"

#include <fmt/format.h>
#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <cmath>

namespace tern::jinja {

void fail(const std::string& message) { throw TemplateFailure(message); }

void check_string_size(uint64_t bytes, std::string_view what) {
  if (bytes > kMaxStringBytes) {
    fail(fmt::format("{} of {} bytes is more than a template string may hold ({} MiB)", what, bytes,
                     kMaxStringBytes >> 20));
  }
}

Value Value::list(std::vector<Value> items, SeqKind seq) {
  Value v(Kind::kList);
  v.list_ = std::make_shared<ListData>();
  v.list_->seq = seq;
  v.list_->items = std::move(items);
  return v;
}

Value Value::range(std::vector<Value> items, int64_t start, int64_t stop, int64_t step) {
  Value v = list(std::move(items), SeqKind::kRange);
  v.list_->range_args[0] = start;
  v.list_->range_args[1] = stop;
  v.list_->range_args[2] = step;
  return v;
}

Value Value::dict() { return dict(std::make_shared<DictData>()); }

Value Value::dict(std::shared_ptr<DictData> d) {
  Value v(Kind::kDict);
  v.dict_ = std::move(d);
  return v;
}

Value Value::callable(std::string name, NativeFn fn) {
  Value v(Kind::kCallable);
  v.callable_ = std::make_shared<CallableData>(CallableData{std::move(name), std::move(fn)});
  return v;
}

Value Value::object(std::shared_ptr<ObjectData> o) {
  Value v(Kind::kObject);
  v.object_ = std::move(o);
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return none();
    case nlohmann::json::value_t::boolean: return boolean(j.get<bool>());
    case nlohmann::json::value_t::number_integer: return integer(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) fail(fmt::format("integer {} is too large", u));
      return integer(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float: return number(j.get<double>());
    case nlohmann::json::value_t::string: return string(j.get<std::string>());
    case nlohmann::json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      auto d = std::make_shared<DictData>();
      d->entries.reserve(j.size());
      for (const auto& [k, e] : j.items()) d->entries.emplace_back(string(k), from_json(e));
      return dict(std::move(d));
    }
    default: fail("unsupported JSON value (binary)");
  }
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool:
    case Kind::kInt: return int_ != 0;
    case Kind::kFloat: return float_ != 0.0;
    case Kind::kString: return !str_.empty();
    case Kind::kList: return list_->seq == SeqKind::kGenerator || !list_->items.empty();
    case Kind::kDict: return !dict_->entries.empty();
    default: return true;
  }
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "NoneType";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kList:
      switch (list_->seq) {
        case SeqKind::kTuple: return "tuple";
        case SeqKind::kItems: return "dict_items";
        case SeqKind::kKeys: return "dict_keys";
        case SeqKind::kValues: return "dict_values";
        case SeqKind::kRange: return "range";
        case SeqKind::kGenerator: return "generator";
        default: return "list";
      }
    case Kind::kDict: return "dict";
    case Kind::kCallable: return "function";
    case Kind::kObject: return object_->type_name;
  }
  return "object";
}

// Python hashes 1, 1.0 and True alike, so they are the same dict key.
const Value* DictData::find(const Value& key) const {
  for (const auto& [k, v] : entries)
    if (value_equals(k, key)) return &v;
  return nullptr;
}

const Value* DictData::find(std::string_view key) const {
  for (const auto& [k, v] : entries)
    if (k.is_string() && k.str() == key) return &v;
  return nullptr;
}

void DictData::set(const Value& key, Value value) {
  for (auto& [k, v] : entries)
    if (value_equals(k, key)) {
      v = std::move(value);
      return;
    }
  entries.emplace_back(key, std::move(value));
}

const Value* ObjectData::find(std::string_view name) const {
  for (const auto& [k, v] : attrs)
    if (k == name) return &v;
  return nullptr;
}

void ObjectData::set(const std::string& name, Value value) {
  for (auto& [k, v] : attrs)
    if (k == name) {
      v = std::move(value);
      return;
    }
  attrs.emplace_back(name, std::move(value));
}

Value CallArgs::get(size_t index, std::string_view name, bool* found) {
  if (used_keyword.size() != keyword.size()) used_keyword.assign(keyword.size(), false);
  if (found) *found = true;
  if (index < positional.size()) return positional[index];
  for (size_t i = 0; i < keyword.size(); ++i)
    if (keyword[i].first == name) {
      used_keyword[i] = true;
      return keyword[i].second;
    }
  if (found) *found = false;
  return Value::undefined();
}

void CallArgs::check_consumed(std::string_view function) const {
  for (size_t i = 0; i < keyword.size(); ++i)
    if (i >= used_keyword.size() || !used_keyword[i])
      fail(fmt::format("{}() got an unexpected keyword argument '{}'", function, keyword[i].first));
}

// --- comparison ---

bool value_equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Kind::kUndefined:
    case Kind::kNone: return true;
    case Kind::kString: return a.str() == b.str();
    case Kind::kList: {
      const bool a_tuple = a.list_data().seq == SeqKind::kTuple, b_tuple = b.list_data().seq == SeqKind::kTuple;
      if (a_tuple != b_tuple) return false;
      const auto &x = a.items(), &y = b.items();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!value_equals(x[i], y[i])) return false;
      return true;
    }
    case Kind::kDict: {
      const auto &x = a.dict_data(), &y = b.dict_data();
      if (x.entries.size() != y.entries.size()) return false;
      for (const auto& [k, v] : x.entries) {
        const Value* other = y.find(k);
        if (!other || !value_equals(v, *other)) return false;
      }
      return true;
    }
    case Kind::kCallable: return &a.callable_data() == &b.callable_data();
    case Kind::kObject: return a.object_data() == b.object_data();
    default: return false;
  }
}

int value_compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      const double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    return a.as_int() < b.as_int() ? -1 : (a.as_int() > b.as_int() ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) return a.str().compare(b.str()) < 0 ? -1 : (a.str() == b.str() ? 0 : 1);
  if (a.is_list() && b.is_list() && (a.list_data().seq == SeqKind::kTuple) == (b.list_data().seq == SeqKind::kTuple)) {
    const auto &x = a.items(), &y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (value_equals(x[i], y[i])) continue;
      return value_compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  fail(fmt::format("'<' not supported between instances of '{}' and '{}'", a.type_name(), b.type_name()));
}

// --- printing ---

std::string python_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  // Shortest round-trip digits in scientific form, then laid out by Python's repr rules.
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  const size_t e_pos = sci.find('e');
  std::string mantissa = sci.substr(0, e_pos);
  const int exponent = std::stoi(sci.substr(e_pos + 1));
  std::string sign;
  if (mantissa[0] == '-') {
    sign = "-";
    mantissa.erase(0, 1);
  }
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits += c;
  const int decpt = exponent + 1;  // position of the decimal point relative to the digits
  std::string out;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out = "0." + std::string(-decpt, '0') + digits;
    } else if (static_cast<size_t>(decpt) >= digits.size()) {
      out = digits + std::string(decpt - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, decpt) + "." + digits.substr(decpt);
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    const int e = decpt - 1;
    out += fmt::format("e{}{:02d}", e < 0 ? '-' : '+', std::abs(e));
  }
  return sign + out;
}

// Python's str.isprintable() for one code point.
static bool is_printable(char32_t cp) {
  if (cp == ' ') return true;
  if (cp < 0x20 || cp == 0x7f) return false;
  if (cp < 0x7f) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS: return false;
    default: return true;
  }
}

std::string python_string_repr(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t cp : utf8_decode(s)) {
    if (cp == static_cast<char32_t>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (is_printable(cp)) {
      utf8_append(out, cp);
    } else if (cp < 0x100) {
      out += fmt::format("\\x{:02x}", static_cast<uint32_t>(cp));
    } else if (cp < 0x10000) {
      out += fmt::format("\\u{:04x}", static_cast<uint32_t>(cp));
    } else {
      out += fmt::format("\\U{:08x}", static_cast<uint32_t>(cp));
    }
  }
  out += quote;
  return out;
}

// repr() and str() recurse into containers and namespaces; a namespace can hold itself (`{% set ns.x = ns %}`), so
// the depth is bounded (Python prints such a cycle as {...}; tern fails with the reason instead of overflowing the
// stack).
namespace {
thread_local int repr_depth = 0;
struct ReprDepth {
  ReprDepth() {
    if (++repr_depth > 200) {
      repr_depth = 0;
      fail("a value nested too deeply to print (a namespace that contains itself?)");
    }
  }
  ~ReprDepth() { repr_depth = repr_depth > 0 ? repr_depth - 1 : 0; }
};
}  // namespace

static std::string join_reprs(const std::vector<Value>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ", ";
    out += value_repr(items[i]);
  }
  return out;
}

std::string value_repr(const Value& v) {
  const ReprDepth guard;
  switch (v.kind()) {
    case Kind::kString: return python_string_repr(v.str());
    case Kind::kUndefined: return "Undefined";
    case Kind::kList: {
      const ListData& l = v.list_data();
      switch (l.seq) {
        case SeqKind::kTuple: return l.items.size() == 1 ? "(" + value_repr(l.items[0]) + ",)" : "(" + join_reprs(l.items) + ")";
        case SeqKind::kItems: return "dict_items([" + join_reprs(l.items) + "])";
        case SeqKind::kKeys: return "dict_keys([" + join_reprs(l.items) + "])";
        case SeqKind::kValues: return "dict_values([" + join_reprs(l.items) + "])";
        case SeqKind::kGenerator: return "<generator object>";
        case SeqKind::kRange:
          if (l.range_args[2] == 1) return fmt::format("range({}, {})", l.range_args[0], l.range_args[1]);
          return fmt::format("range({}, {}, {})", l.range_args[0], l.range_args[1], l.range_args[2]);
        default: return "[" + join_reprs(l.items) + "]";
      }
    }
    case Kind::kDict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, e] : v.dict_data().entries) {
        if (!first) out += ", ";
        first = false;
        out += value_repr(k) + ": " + value_repr(e);
      }
      return out + "}";
    }
    default: return value_to_string(v);
  }
}

std::string value_to_string(const Value& v) {
  const ReprDepth guard;
  switch (v.kind()) {
    case Kind::kUndefined: return "";
    case Kind::kNone: return "None";
    case Kind::kBool: return v.as_bool() ? "True" : "False";
    case Kind::kInt: return std::to_string(v.as_int());
    case Kind::kFloat: return python_float_repr(v.as_double());
    case Kind::kString: return v.str();
    case Kind::kCallable: return "<function " + v.callable_data().name + ">";
    case Kind::kObject: {
      const ObjectData& o = *v.object_data();
      if (!o.is_namespace) return "<" + o.type_name + ">";
      std::string out = "<Namespace {";
      for (size_t i = 0; i < o.attrs.size(); ++i) {
        if (i) out += ", ";
        out += python_string_repr(o.attrs[i].first) + ": " + value_repr(o.attrs[i].second);
      }
      return out + "}>";
    }
    default: return value_repr(v);
  }
}

// --- JSON ---

static void json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  for (char32_t cp : utf8_decode(s)) {
    switch (cp) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (cp < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<uint32_t>(cp));
        } else if (ensure_ascii && cp > 0x7e) {
          if (cp >= 0x10000) {
            const uint32_t c = cp - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", 0xd800 + (c >> 10), 0xdc00 + (c & 0x3ff));
          } else {
            out += fmt::format("\\u{:04x}", static_cast<uint32_t>(cp));
          }
        } else {
          utf8_append(out, cp);
        }
    }
  }
  out += '"';
}

static std::string json_float(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return python_float_repr(d);
}

static std::string json_key(const Value& k) {
  switch (k.kind()) {
    case Kind::kString: return k.str();
    case Kind::kNone: return "null";
    case Kind::kBool: return k.as_bool() ? "true" : "false";
    case Kind::kInt: return std::to_string(k.as_int());
    case Kind::kFloat: return json_float(k.as_double());
    default: fail(fmt::format("keys must be str, int, float, bool or None, not {}", k.type_name()));
  }
}

static void json_value(std::string& out, const Value& v, const JsonOptions& o, int depth) {
  if (depth > 500) fail("maximum recursion depth exceeded while encoding a JSON object");
  const std::string newline = o.has_indent ? "\n" : "";
  auto indent_to = [&](int level) {
    if (!o.has_indent) return;
    out += '\n';
    for (int i = 0; i < level; ++i) out += o.indent;
  };
  switch (v.kind()) {
    case Kind::kNone: out += "null"; return;
    case Kind::kBool: out += v.as_bool() ? "true" : "false"; return;
    case Kind::kInt: out += std::to_string(v.as_int()); return;
    case Kind::kFloat: out += json_float(v.as_double()); return;
    case Kind::kString: json_string(out, v.str(), o.ensure_ascii); return;
    case Kind::kList: {
      if (v.list_data().seq == SeqKind::kRange || v.list_data().seq == SeqKind::kKeys || v.list_data().seq == SeqKind::kGenerator ||
          v.list_data().seq == SeqKind::kValues || v.list_data().seq == SeqKind::kItems)
        fail(fmt::format("Object of type {} is not JSON serializable", v.type_name()));
      const auto& items = v.items();
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += o.item_separator;
        indent_to(depth + 1);
        json_value(out, items[i], o, depth + 1);
      }
      indent_to(depth);
      out += ']';
      return;
    }
    case Kind::kDict: {
      std::vector<std::pair<std::string, const Value*>> entries;
      for (const auto& [k, e] : v.dict_data().entries) {
        if (o.sort_keys && !k.is_string())
          fail(fmt::format("'<' not supported between instances of '{}' and 'str'", k.type_name()));
        entries.emplace_back(json_key(k), &e);
      }
      if (entries.empty()) {
        out += "{}";
        return;
      }
      if (o.sort_keys)
        std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += o.item_separator;
        indent_to(depth + 1);
        json_string(out, entries[i].first, o.ensure_ascii);
        out += o.key_separator;
        json_value(out, *entries[i].second, o, depth + 1);
      }
      indent_to(depth);
      out += '}';
      return;
    }
    default: fail(fmt::format("Object of type {} is not JSON serializable", v.type_name()));
  }
}

std::string value_to_json(const Value& v, const JsonOptions& options) {
  std::string out;
  json_value(out, v, options, 0);
  return out;
}

// --- UTF-8 ---

std::vector<char32_t> utf8_decode(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) {  // invalid byte: keep it as a Latin-1 code point
      out.push_back(c);
      ++i;
      continue;
    }
    char32_t cp = n == 1 ? c : c & (0x7f >> n);
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    out.push_back(cp);
    i += n;
  }
  return out;
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

std::string utf8_encode(const std::vector<char32_t>& cps) {
  std::string out;
  out.reserve(cps.size());
  for (char32_t cp : cps) utf8_append(out, cp);
  return out;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (char c : s)
    if ((static_cast<unsigned char>(c) & 0xc0) != 0x80) ++n;
  return n;
}

}  // namespace tern::jinja
