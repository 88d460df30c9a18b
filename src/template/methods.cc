#include "template/methods.h"

#include <fmt/format.h>

#include <cmath>
#include <optional>

#include "template/builtins.h"
#include "template/pystr.h"

namespace tern::jinja {
namespace {

std::optional<std::string> opt_string(CallArgs& args, size_t i, std::string_view name, std::string_view method) {
  bool found = false;
  Value v = args.get(i, name, &found);
  if (!found || v.is_none()) return std::nullopt;
  if (!v.is_string()) fail(fmt::format("{}() argument must be str or None, not {}", method, v.type_name()));
  return v.str();
}

std::string req_string(CallArgs& args, size_t i, std::string_view name, std::string_view method) {
  bool found = false;
  Value v = args.get(i, name, &found);
  if (!found) fail(fmt::format("{}() missing required argument '{}'", method, name));
  if (!v.is_string()) fail(fmt::format("{}() argument must be str, not {}", method, v.type_name()));
  return v.str();
}

int64_t opt_int(CallArgs& args, size_t i, std::string_view name, int64_t fallback) {
  bool found = false;
  Value v = args.get(i, name, &found);
  if (!found) return fallback;
  if (!v.is_int() && !v.is_bool()) fail(fmt::format("'{}' object cannot be interpreted as an integer", v.type_name()));
  return v.as_int();
}

Value string_list(std::vector<std::string> parts) {
  std::vector<Value> out;
  out.reserve(parts.size());
  for (auto& p : parts) out.push_back(Value::string(std::move(p)));
  return Value::list(std::move(out));
}

// startswith/endswith with a str or a tuple of str.
bool affix_match(const std::string& s, const Value& affix, bool prefix, std::string_view method) {
  auto one = [&](const Value& a) {
    if (!a.is_string())
      fail(fmt::format("{} first arg must be str or a tuple of str, not {}", method, a.type_name()));
    const std::string& x = a.str();
    if (x.size() > s.size()) return false;
    return prefix ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (affix.is_list() && affix.list_data().seq == SeqKind::kTuple) {
    for (const Value& a : affix.items())
      if (one(a)) return true;
    return false;
  }
  return one(affix);
}

Value str_method(const Value& obj, std::string_view name);
Value list_method(const Value& obj, std::string_view name);
Value dict_method(const Value& obj, std::string_view name);

Value method(const Value& obj, std::string_view name, std::function<Value(CallArgs&)> fn) {
  return Value::callable(fmt::format("{}.{}", obj.type_name(), name),
                         [fn = std::move(fn)](CallArgs& args, Renderer&) { return fn(args); });
}

Value str_method(const Value& obj, std::string_view name) {
  const std::string s = obj.str();
  const std::string n(name);
  if (n == "startswith" || n == "endswith")
    return method(obj, name, [s, n](CallArgs& a) {
      if (a.positional.empty()) fail(fmt::format("{}() takes at least 1 argument (0 given)", n));
      return Value::boolean(affix_match(s, a.positional[0], n == "startswith", n));
    });
  if (n == "split" || n == "rsplit")
    return method(obj, name, [s, n](CallArgs& a) {
      auto sep = opt_string(a, 0, "sep", n);
      const int64_t maxsplit = opt_int(a, 1, "maxsplit", -1);
      a.check_consumed(n);
      return string_list(n == "split" ? py_split(s, sep, maxsplit) : py_rsplit(s, sep, maxsplit));
    });
  if (n == "splitlines")
    return method(obj, name, [s](CallArgs& a) {
      bool found = false;
      const Value keep = a.get(0, "keepends", &found);
      return string_list(py_splitlines(s, found && keep.truthy()));
    });
  if (n == "strip" || n == "lstrip" || n == "rstrip")
    return method(obj, name, [s, n](CallArgs& a) {
      auto chars = opt_string(a, 0, "chars", n);
      return Value::string(py_strip(s, chars, n != "rstrip", n != "lstrip"));
    });
  if (n == "upper") return method(obj, name, [s](CallArgs&) { return Value::string(py_upper(s)); });
  if (n == "lower") return method(obj, name, [s](CallArgs&) { return Value::string(py_lower(s)); });
  if (n == "title") return method(obj, name, [s](CallArgs&) { return Value::string(py_title(s)); });
  if (n == "capitalize") return method(obj, name, [s](CallArgs&) { return Value::string(py_capitalize(s)); });
  if (n == "replace")
    return method(obj, name, [s](CallArgs& a) {
      const std::string old = req_string(a, 0, "old", "replace"), rep = req_string(a, 1, "new", "replace");
      const int64_t count = opt_int(a, 2, "count", -1);
      if (rep.size() > old.size()) {  // the result's size, before building it
        uint64_t hits = old.empty() ? utf8_length(s) + 1 : static_cast<uint64_t>(py_count(s, old));
        if (count >= 0) hits = std::min<uint64_t>(hits, static_cast<uint64_t>(count));
        check_string_size(s.size() + hits * (rep.size() - old.size()), "replace()");
      }
      return Value::string(py_replace(s, old, rep, count));
    });
  if (n == "format") return method(obj, name, [s](CallArgs& a) { return Value::string(python_str_format(s, a)); });
  if (n == "find" || n == "rfind" || n == "index" || n == "rindex")
    return method(obj, name, [s, n](CallArgs& a) {
      const int64_t at = py_find(s, req_string(a, 0, "sub", n), n[0] == 'r');
      if (at < 0 && (n == "index" || n == "rindex")) fail("substring not found");
      return Value::integer(at);
    });
  if (n == "count")
    return method(obj, name, [s](CallArgs& a) { return Value::integer(py_count(s, req_string(a, 0, "sub", "count"))); });
  if (n == "join")
    return method(obj, name, [s](CallArgs& a) {
      if (a.positional.empty()) fail("join() takes exactly one argument (0 given)");
      std::string out;
      bool first = true;
      for (const Value& v : iterate(a.positional[0])) {
        if (!v.is_string()) fail(fmt::format("sequence item: expected str instance, {} found", v.type_name()));
        if (!first) out += s;
        first = false;
        out += v.str();
      }
      return Value::string(std::move(out));
    });
  if (n == "isdigit" || n == "isalpha" || n == "isalnum" || n == "isspace" || n == "isdecimal" || n == "isnumeric")
    return method(obj, name, [s, n](CallArgs&) { return Value::boolean(py_is_all(s, n)); });
  if (n == "islower") return method(obj, name, [s](CallArgs&) { return Value::boolean(py_islower(s)); });
  if (n == "isupper") return method(obj, name, [s](CallArgs&) { return Value::boolean(py_isupper(s)); });
  if (n == "zfill" || n == "center" || n == "ljust" || n == "rjust")
    return method(obj, name, [s, n](CallArgs& a) {
      const int64_t width = opt_int(a, 0, "width", 0);
      const std::string fill = n == "zfill" ? "0" : opt_string(a, 1, "fillchar", n).value_or(" ");
      if (width > 0) check_string_size(static_cast<uint64_t>(width) * std::max<size_t>(fill.size(), 1) + s.size(), n);
      const int64_t len = static_cast<int64_t>(utf8_length(s));
      if (width <= len) return Value::string(s);
      const int64_t pad = width - len;
      auto rep = [&](int64_t k) {
        std::string out;
        for (int64_t i = 0; i < k; ++i) out += fill;
        return out;
      };
      if (n == "ljust") return Value::string(s + rep(pad));
      if (n == "rjust") return Value::string(rep(pad) + s);
      if (n == "zfill") {
        if (!s.empty() && (s[0] == '-' || s[0] == '+')) return Value::string(s.substr(0, 1) + rep(pad) + s.substr(1));
        return Value::string(rep(pad) + s);
      }
      const int64_t left = pad / 2 + (pad & width & 1);
      return Value::string(rep(left) + s + rep(pad - left));
    });
  return Value::undefined();
}

Value list_method(const Value& obj, std::string_view name) {
  if (name == "index")
    return method(obj, name, [obj](CallArgs& a) {
      if (a.positional.empty()) fail("index expected at least 1 argument, got 0");
      const auto& items = obj.items();
      for (size_t i = 0; i < items.size(); ++i)
        if (value_equals(items[i], a.positional[0])) return Value::integer(static_cast<int64_t>(i));
      fail(fmt::format("{} is not in list", value_repr(a.positional[0])));
    });
  if (name == "count")
    return method(obj, name, [obj](CallArgs& a) {
      if (a.positional.empty()) fail("count() takes exactly one argument (0 given)");
      int64_t n = 0;
      for (const Value& v : obj.items()) n += value_equals(v, a.positional[0]);
      return Value::integer(n);
    });
  if (name == "copy" && obj.list_data().seq == SeqKind::kList)
    return method(obj, name, [obj](CallArgs&) { return Value::list(obj.items()); });
  static constexpr const char* kUnsafe[] = {"append", "clear", "extend", "insert", "pop", "remove", "reverse", "sort"};
  if (obj.list_data().seq == SeqKind::kList)
    for (const char* u : kUnsafe)
      if (name == u) return Value::undefined(fmt::format("access to attribute '{}' of 'list' object is unsafe.", name));
  return Value::undefined();
}

Value dict_items(const Value& obj, SeqKind seq) {
  std::vector<Value> out;
  for (const auto& [k, v] : obj.dict_data().entries) {
    if (seq == SeqKind::kKeys) out.push_back(k);
    else if (seq == SeqKind::kValues) out.push_back(v);
    else out.push_back(Value::list({k, v}, SeqKind::kTuple));
  }
  return Value::list(std::move(out), seq);
}

Value dict_method(const Value& obj, std::string_view name) {
  if (name == "items") return method(obj, name, [obj](CallArgs&) { return dict_items(obj, SeqKind::kItems); });
  if (name == "keys") return method(obj, name, [obj](CallArgs&) { return dict_items(obj, SeqKind::kKeys); });
  if (name == "values") return method(obj, name, [obj](CallArgs&) { return dict_items(obj, SeqKind::kValues); });
  if (name == "get")
    return method(obj, name, [obj](CallArgs& a) {
      if (a.positional.empty()) fail("get expected at least 1 argument, got 0");
      if (const Value* v = obj.dict_data().find(a.positional[0])) return *v;
      return a.positional.size() > 1 ? a.positional[1] : Value::none();
    });
  if (name == "copy")
    return method(obj, name, [obj](CallArgs&) { return Value::dict(std::make_shared<DictData>(obj.dict_data())); });
  static constexpr const char* kUnsafe[] = {"clear", "pop", "popitem", "setdefault", "update"};
  for (const char* u : kUnsafe)
    if (name == u) return Value::undefined(fmt::format("access to attribute '{}' of 'dict' object is unsafe.", name));
  return Value::undefined();
}

}  // namespace

Value bound_method(const Value& obj, std::string_view name) {
  switch (obj.kind()) {
    case Kind::kString: return str_method(obj, name);
    case Kind::kList: return list_method(obj, name);
    case Kind::kDict: return dict_method(obj, name);
    default: return Value::undefined();
  }
}

// --- formatting ---

namespace {

struct Spec {
  std::string fill = " ";
  char align = 0;
  char sign = '-';
  bool alternate = false;
  bool grouping = false;
  int64_t width = -1;
  int64_t precision = -1;
  char type = 0;
};

Spec parse_spec(std::string_view spec) {
  Spec s;
  const auto cps = utf8_decode(spec);
  size_t i = 0;
  auto is_align = [](char32_t c) { return c == '<' || c == '>' || c == '^' || c == '='; };
  if (cps.size() >= 2 && is_align(cps[1])) {
    s.fill.clear();
    utf8_append(s.fill, cps[0]);
    s.align = static_cast<char>(cps[1]);
    i = 2;
  } else if (!cps.empty() && is_align(cps[0])) {
    s.align = static_cast<char>(cps[0]);
    i = 1;
  }
  if (i < cps.size() && (cps[i] == '+' || cps[i] == '-' || cps[i] == ' ')) s.sign = static_cast<char>(cps[i++]);
  if (i < cps.size() && cps[i] == '#') s.alternate = (++i, true);
  if (i < cps.size() && cps[i] == '0') {
    if (!s.align) {
      s.fill = "0";
      s.align = '=';
    }
    ++i;
  }
  auto number = [&]() {
    int64_t v = 0;
    while (i < cps.size() && cps[i] >= '0' && cps[i] <= '9') {
      v = v * 10 + (cps[i++] - '0');
      if (v > kMaxFormatWidth) fail(fmt::format("a format width or precision above {} (tern's limit)", kMaxFormatWidth));
    }
    return v;
  };
  if (i < cps.size() && cps[i] >= '0' && cps[i] <= '9') s.width = number();
  if (i < cps.size() && (cps[i] == ',' || cps[i] == '_')) s.grouping = (++i, true);
  if (i < cps.size() && cps[i] == '.') {
    ++i;
    s.precision = number();
  }
  if (i < cps.size()) s.type = static_cast<char>(cps[i++]);
  if (i != cps.size()) fail("Invalid format specifier");
  return s;
}

std::string group_digits(const std::string& digits) {
  std::string out;
  const size_t n = digits.size();
  for (size_t i = 0; i < n; ++i) {
    if (i && (n - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string pad(std::string body, std::string sign, const Spec& s, char default_align) {
  const char align = s.align ? s.align : default_align;
  const int64_t len = static_cast<int64_t>(utf8_length(body) + sign.size());
  if (s.width <= len) return sign + body;
  std::string fill;
  for (int64_t i = 0; i < s.width - len; ++i) fill += s.fill;
  if (align == '<') return sign + body + fill;
  if (align == '>') return fill + sign + body;
  if (align == '=') return sign + fill + body;
  const size_t half = (s.width - len) / 2;
  std::string left, right;
  for (size_t i = 0; i < half; ++i) left += s.fill;
  for (int64_t i = static_cast<int64_t>(half); i < s.width - len; ++i) right += s.fill;
  return left + sign + body + right;
}

std::string c_format_double(double d, char type, int64_t precision, bool alternate) {
  const std::string f = fmt::format("%{}.{}{}", alternate ? "#" : "", precision < 0 ? 6 : precision, type);
  char buf[512];
  std::snprintf(buf, sizeof(buf), f.c_str(), d);
  return buf;
}

}  // namespace

std::string python_format_spec(const Value& v, std::string_view spec_text) {
  const Spec s = parse_spec(spec_text);
  if (v.is_string() || v.is_none() || v.is_undefined() || v.is_list() || v.is_dict()) {
    if (!v.is_string() && !spec_text.empty() && s.type != 's' && s.type != 0)
      fail(fmt::format("unsupported format string passed to {}.__format__", v.type_name()));
    std::string body = value_to_string(v);
    if (s.precision >= 0) {
      auto cps = utf8_decode(body);
      if (static_cast<int64_t>(cps.size()) > s.precision) cps.resize(s.precision);
      body = utf8_encode(cps);
    }
    return pad(body, "", s, '<');
  }
  if (!v.is_number()) fail(fmt::format("unsupported format string passed to {}.__format__", v.type_name()));
  const bool as_int = !v.is_float() && (s.type == 0 || std::string_view("dxXobcn").find(s.type) != std::string_view::npos);
  std::string body, sign;
  if (as_int) {
    if (v.is_bool() && s.type == 0 && spec_text.empty()) return v.as_bool() ? "True" : "False";
    const int64_t x = v.as_int();
    const uint64_t mag = x < 0 ? 0 - static_cast<uint64_t>(x) : static_cast<uint64_t>(x);
    if (s.type == 'x' || s.type == 'X') body = s.type == 'x' ? fmt::format("{:x}", mag) : fmt::format("{:X}", mag);
    else if (s.type == 'o') body = fmt::format("{:o}", mag);
    else if (s.type == 'b') body = fmt::format("{:b}", mag);
    else if (s.type == 'c') body = std::string(1, static_cast<char>(mag));
    else body = std::to_string(mag);
    if (s.grouping) body = group_digits(body);
    if (s.alternate && (s.type == 'x' || s.type == 'X' || s.type == 'o' || s.type == 'b'))
      body = std::string("0") + s.type + body;
    sign = x < 0 ? "-" : s.sign == '+' ? "+" : s.sign == ' ' ? " " : "";
  } else {
    const double d = v.as_double();
    const double mag = std::fabs(d);
    if (s.type == 0 && s.precision < 0) body = python_float_repr(mag);
    else if (s.type == '%') body = c_format_double(mag * 100.0, 'f', s.precision, s.alternate) + "%";
    else body = c_format_double(mag, s.type == 0 ? 'g' : s.type, s.precision, s.alternate);
    if (s.grouping) {
      const size_t dot = body.find_first_not_of("0123456789");
      body = group_digits(body.substr(0, dot)) + (dot == std::string::npos ? "" : body.substr(dot));
    }
    sign = std::signbit(d) ? "-" : s.sign == '+' ? "+" : s.sign == ' ' ? " " : "";
  }
  return pad(body, sign, s, '>');
}

std::string python_str_format(const std::string& format, const CallArgs& args) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < format.size(); ++i) {
    const char c = format[i];
    if (c == '}') {
      if (i + 1 < format.size() && format[i + 1] == '}') ++i;
      else fail("Single '}' encountered in format string");
      out += '}';
      continue;
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < format.size() && format[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    const size_t close = format.find('}', i);
    if (close == std::string::npos) fail("Single '{' encountered in format string");
    std::string field = format.substr(i + 1, close - i - 1);
    i = close;
    std::string spec, conversion;
    if (const size_t colon = field.find(':'); colon != std::string::npos) {
      spec = field.substr(colon + 1);
      field.resize(colon);
    }
    if (const size_t bang = field.find('!'); bang != std::string::npos) {
      conversion = field.substr(bang + 1);
      field.resize(bang);
    }
    Value v;
    if (field.empty() || std::isdigit(static_cast<unsigned char>(field[0]))) {
      const size_t index = field.empty() ? auto_index++ : std::stoul(field);
      if (index >= args.positional.size()) fail(fmt::format("Replacement index {} out of range for positional args tuple", index));
      v = args.positional[index];
    } else {
      bool found = false;
      for (const auto& [k, kv] : args.keyword)
        if (k == field) {
          v = kv;
          found = true;
        }
      if (!found) fail(fmt::format("'{}'", field));
    }
    if (conversion == "r") v = Value::string(value_repr(v));
    else if (conversion == "s") v = Value::string(value_to_string(v));
    out += python_format_spec(v, spec);
  }
  return out;
}

std::string python_percent_format(const std::string& format, const Value& args) {
  std::vector<Value> positional;
  if (args.is_list() && args.list_data().seq == SeqKind::kTuple) positional = args.items();
  else positional.push_back(args);
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      out += format[i];
      continue;
    }
    size_t j = i + 1;
    Value v;
    bool keyed = false;
    if (j < format.size() && format[j] == '(') {
      const size_t close = format.find(')', j);
      if (close == std::string::npos || !args.is_dict()) fail("format requires a mapping");
      const Value* found = args.dict_data().find(format.substr(j + 1, close - j - 1));
      if (!found) fail(fmt::format("'{}'", format.substr(j + 1, close - j - 1)));
      v = *found;
      keyed = true;
      j = close + 1;
    }
    std::string flags;
    while (j < format.size() && std::string_view("-+ #0").find(format[j]) != std::string_view::npos) flags += format[j++];
    std::string width, precision;
    while (j < format.size() && std::isdigit(static_cast<unsigned char>(format[j]))) width += format[j++];
    if (j < format.size() && format[j] == '.') {
      ++j;
      precision = ".";
      while (j < format.size() && std::isdigit(static_cast<unsigned char>(format[j]))) precision += format[j++];
    }
    if (j >= format.size()) fail("incomplete format");
    if (width.size() > 7 || precision.size() > 8 || (!width.empty() && std::stoll(width) > kMaxFormatWidth) ||
        (precision.size() > 1 && std::stoll(precision.substr(1)) > kMaxFormatWidth)) {
      fail(fmt::format("a format width or precision above {} (tern's limit)", kMaxFormatWidth));
    }
    const char conv = format[j];
    i = j;
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (!keyed) {
      if (next >= positional.size()) fail("not enough arguments for format string");
      v = positional[next++];
    }
    std::string body;
    if (conv == 's' || conv == 'r' || conv == 'a') {
      body = conv == 's' ? value_to_string(v) : value_repr(v);
      if (precision.size() > 1) {
        auto cps = utf8_decode(body);
        cps.resize(std::min(cps.size(), static_cast<size_t>(std::stoul(precision.substr(1)))));
        body = utf8_encode(cps);
      }
      const int64_t w = width.empty() ? 0 : std::stoll(width);
      const int64_t len = static_cast<int64_t>(utf8_length(body));
      if (w > len) body = flags.find('-') != std::string::npos ? body + std::string(w - len, ' ') : std::string(w - len, ' ') + body;
    } else if (std::string_view("diouxXeEfFgGc").find(conv) != std::string_view::npos) {
      if (!v.is_number()) fail(fmt::format("%{} format: a real number is required, not {}", conv, v.type_name()));
      char buf[512];
      const std::string f = "%" + flags + width + precision;
      if (std::string_view("diouxXc").find(conv) != std::string_view::npos) {
        const long long x = v.is_float() ? static_cast<long long>(v.as_double()) : v.as_int();
        std::snprintf(buf, sizeof(buf), (f + "ll" + (conv == 'i' || conv == 'u' ? 'd' : conv)).c_str(), x);
      } else {
        std::snprintf(buf, sizeof(buf), (f + conv).c_str(), v.as_double());
      }
      body = buf;
    } else {
      fail(fmt::format("unsupported format character '{}'", conv));
    }
    out += body;
  }
  if (next < positional.size() && !(positional.size() == 1 && args.is_dict()))
    fail("not all arguments converted during string formatting");
  return out;
}

}  // namespace tern::jinja
