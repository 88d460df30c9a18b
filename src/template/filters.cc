// Jinja2's built-in filters, tests and globals (filters.py, tests.py, defaults.py of Jinja2 3.1), plus
// transformers' tojson, raise_exception and strftime_now.
#include <fmt/format.h>
#include <utf8proc.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <functional>
#include <unordered_map>

#include "template/builtins.h"
#include "template/methods.h"
#include "template/pystr.h"
#include "template/renderer.h"

namespace tern::jinja {
namespace {

using FilterFn = Value (*)(const Value& input, CallArgs& args, Renderer& r);

Value generator(std::vector<Value> items) { return Value::list(std::move(items), SeqKind::kGenerator); }

bool arg_bool(CallArgs& a, size_t i, std::string_view name, bool fallback) {
  bool found = false;
  const Value v = a.get(i, name, &found);
  return found ? v.truthy() : fallback;
}

Value arg_value(CallArgs& a, size_t i, std::string_view name, Value fallback) {
  bool found = false;
  Value v = a.get(i, name, &found);
  return found ? v : fallback;
}

int64_t arg_int(CallArgs& a, size_t i, std::string_view name, int64_t fallback) {
  bool found = false;
  const Value v = a.get(i, name, &found);
  if (!found) return fallback;
  if (!v.is_int() && !v.is_bool()) fail(fmt::format("'{}' object cannot be interpreted as an integer", v.type_name()));
  return v.as_int();
}

std::string str_of(const Value& v) { return value_to_string(v); }

Value ignore_case(const Value& v) { return v.is_string() ? Value::string(py_lower(v.str())) : v; }

// make_attrgetter: "a.b.0" looks up item/attribute a, then b, then index 0.
Value attr_path(const Value& item, const Value& attribute, const Value& fallback = Value::none()) {
  std::vector<Value> parts;
  if (attribute.is_none() || attribute.is_undefined()) return item;
  if (attribute.is_string()) {
    for (const std::string& p : py_split(attribute.str(), std::string("."), -1)) {
      const bool digits = !p.empty() && std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; });
      parts.push_back(digits ? Value::integer(std::stoll(p)) : Value::string(p));
    }
  } else {
    parts.push_back(attribute);
  }
  Value v = item;
  for (const Value& p : parts) {
    v = get_item(v, p);
    if (!fallback.is_none() && v.is_undefined()) v = fallback;
  }
  return v;
}

void sort_values(std::vector<Value>& items, const std::function<Value(const Value&)>& key, bool reverse) {
  std::vector<std::pair<Value, size_t>> keyed;
  for (size_t i = 0; i < items.size(); ++i) keyed.emplace_back(key(items[i]), i);
  std::stable_sort(keyed.begin(), keyed.end(), [reverse](const auto& a, const auto& b) {
    return reverse ? value_compare(b.first, a.first) < 0 : value_compare(a.first, b.first) < 0;
  });
  std::vector<Value> out;
  for (const auto& k : keyed) out.push_back(items[k.second]);
  items = std::move(out);
}

Value f_tojson(const Value& input, CallArgs& a, Renderer&) {
  JsonOptions o;
  o.ensure_ascii = arg_bool(a, 0, "ensure_ascii", false);
  const Value indent = arg_value(a, 1, "indent", Value::none());
  const Value separators = arg_value(a, 2, "separators", Value::none());
  o.sort_keys = arg_bool(a, 3, "sort_keys", false);
  a.check_consumed("tojson");
  if (!indent.is_none()) {
    o.has_indent = true;
    if (indent.is_string()) o.indent = indent.str();
    else if (indent.is_int() || indent.is_bool()) o.indent = std::string(std::max<int64_t>(0, indent.as_int()), ' ');
    else fail("indent must be an integer or a string");
    o.item_separator = ",";
  }
  if (!separators.is_none()) {
    if (!separators.is_list() || separators.items().size() != 2 || !separators.items()[0].is_string() ||
        !separators.items()[1].is_string())
      fail("separators must be a pair of strings");
    o.item_separator = separators.items()[0].str();
    o.key_separator = separators.items()[1].str();
  }
  return Value::string(value_to_json(input, o));
}

Value f_length(const Value& input, CallArgs&, Renderer&) { return Value::integer(python_len(input)); }

Value f_trim(const Value& input, CallArgs& a, Renderer&) {
  const Value chars = arg_value(a, 0, "chars", Value::none());
  std::optional<std::string> c;
  if (!chars.is_none()) c = str_of(chars);
  return Value::string(py_strip(str_of(input), c, true, true));
}

Value f_string(const Value& input, CallArgs&, Renderer&) { return Value::string(str_of(input)); }
Value f_upper(const Value& input, CallArgs&, Renderer&) { return Value::string(py_upper(str_of(input))); }
Value f_lower(const Value& input, CallArgs&, Renderer&) { return Value::string(py_lower(str_of(input))); }
Value f_capitalize(const Value& input, CallArgs&, Renderer&) { return Value::string(py_capitalize(str_of(input))); }

Value f_title(const Value& input, CallArgs&, Renderer&) {
  // Jinja2 capitalizes after runs of '-', whitespace and opening brackets, unlike str.title().
  const auto cps = utf8_decode(str_of(input));
  std::string out;
  bool word_start = true;
  for (char32_t cp : cps) {
    const bool delim = cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || py_isspace_cp(cp);
    std::string one;
    utf8_append(one, cp);
    out += delim ? one : (word_start ? py_upper(one) : py_lower(one));
    word_start = delim;
  }
  return Value::string(out);
}

Value f_first(const Value& input, CallArgs&, Renderer&) {
  auto items = iterate(input);
  return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
}

Value f_last(const Value& input, CallArgs&, Renderer&) {
  if (input.is_list() && input.list_data().seq == SeqKind::kGenerator) fail("'generator' object is not reversible");
  auto items = iterate(input);
  return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
}

Value f_join(const Value& input, CallArgs& a, Renderer&) {
  const std::string sep = str_of(arg_value(a, 0, "d", Value::string("")));
  const Value attribute = arg_value(a, 1, "attribute", Value::none());
  std::string out;
  bool first = true;
  for (const Value& v : iterate(input)) {
    if (!first) out += sep;
    first = false;
    out += str_of(attr_path(v, attribute));
  }
  return Value::string(out);
}

Value f_replace(const Value& input, CallArgs& a, Renderer&) {
  const Value old = a.get(0, "old"), rep = a.get(1, "new");
  const Value count = arg_value(a, 2, "count", Value::none());
  return Value::string(py_replace(str_of(input), str_of(old), str_of(rep), count.is_none() ? -1 : count.as_int()));
}

Value f_items(const Value& input, CallArgs&, Renderer&) {
  if (input.is_undefined()) return generator({});
  if (!input.is_dict()) fail("Can only get item pairs from a mapping.");
  std::vector<Value> out;
  for (const auto& [k, v] : input.dict_data().entries) out.push_back(Value::list({k, v}, SeqKind::kTuple));
  return generator(std::move(out));
}

Value f_list(const Value& input, CallArgs&, Renderer&) { return Value::list(iterate(input)); }

Value f_default(const Value& input, CallArgs& a, Renderer&) {
  const Value fallback = arg_value(a, 0, "default_value", Value::string(""));
  const bool boolean = arg_bool(a, 1, "boolean", false);
  return input.is_undefined() || (boolean && !input.truthy()) ? fallback : input;
}

Value f_map(const Value& input, CallArgs& a, Renderer& r) {
  std::vector<Value> out;
  if (a.positional.empty()) {
    const Value attribute = arg_value(a, 0, "attribute", Value::undefined());
    if (attribute.is_undefined()) fail("map requires a filter argument");
    const Value fallback = arg_value(a, 1, "default", Value::none());
    a.check_consumed("map");
    for (const Value& v : iterate(input)) out.push_back(attr_path(v, attribute, fallback));
    return generator(std::move(out));
  }
  const std::string name = str_of(a.positional[0]);
  if (!builtin_has_filter(name)) fail(fmt::format("No filter named '{}'.", name));
  for (const Value& v : iterate(input)) {
    CallArgs inner;
    inner.positional.assign(a.positional.begin() + 1, a.positional.end());
    inner.keyword = a.keyword;
    out.push_back(builtin_filter(name, v, inner, r));
  }
  return generator(std::move(out));
}

Value select_impl(const Value& input, CallArgs& a, Renderer& r, bool keep, bool by_attr) {
  std::vector<Value> out;
  if (!input.truthy()) return generator({});
  size_t off = 0;
  Value attribute = Value::none();
  if (by_attr) {
    if (a.positional.empty()) fail("Missing parameter for attribute name");
    attribute = a.positional[0];
    off = 1;
  }
  const bool has_test = a.positional.size() > off;
  const std::string test = has_test ? str_of(a.positional[off]) : "";
  if (has_test && !builtin_has_test(test)) fail(fmt::format("No test named '{}'.", test));
  for (const Value& item : iterate(input)) {
    const Value subject = by_attr ? attr_path(item, attribute) : item;
    bool ok;
    if (has_test) {
      CallArgs inner;
      inner.positional.assign(a.positional.begin() + off + 1, a.positional.end());
      inner.keyword = a.keyword;
      ok = builtin_test(test, subject, inner, r);
    } else {
      ok = subject.truthy();
    }
    if (ok == keep) out.push_back(item);
  }
  return generator(std::move(out));
}

Value f_select(const Value& i, CallArgs& a, Renderer& r) { return select_impl(i, a, r, true, false); }
Value f_reject(const Value& i, CallArgs& a, Renderer& r) { return select_impl(i, a, r, false, false); }
Value f_selectattr(const Value& i, CallArgs& a, Renderer& r) { return select_impl(i, a, r, true, true); }
Value f_rejectattr(const Value& i, CallArgs& a, Renderer& r) { return select_impl(i, a, r, false, true); }

Value f_unique(const Value& input, CallArgs& a, Renderer&) {
  const bool case_sensitive = arg_bool(a, 0, "case_sensitive", false);
  const Value attribute = arg_value(a, 1, "attribute", Value::none());
  std::vector<Value> seen, out;
  for (const Value& item : iterate(input)) {
    Value key = attr_path(item, attribute);
    if (!case_sensitive) key = ignore_case(key);
    if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return value_equals(s, key); })) continue;
    seen.push_back(key);
    out.push_back(item);
  }
  return generator(std::move(out));
}

Value to_int(const Value& input, CallArgs& a, Renderer&) {
  const Value fallback = arg_value(a, 0, "default", Value::integer(0));
  const int64_t base = arg_int(a, 1, "base", 10);
  require_defined(input);  // Undefined.__int__ raises
  if (input.is_int() || input.is_bool()) return Value::integer(input.as_int());
  if (input.is_float()) {
    if (!std::isfinite(input.as_double())) return fallback;
    return Value::integer(static_cast<int64_t>(input.as_double()));
  }
  if (!input.is_string()) return fallback;
  std::string s;
  for (char c : py_strip(input.str(), std::nullopt, true, true))
    if (c != '_') s += c;
  if (!s.empty()) {
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, static_cast<int>(base));
    if (errno == 0 && end && *end == 0) return Value::integer(v);
    const double d = std::strtod(s.c_str(), &end);
    if (end && *end == 0 && std::isfinite(d)) return Value::integer(static_cast<int64_t>(d));
  }
  return fallback;
}

Value to_float(const Value& input, CallArgs& a, Renderer&) {
  const Value fallback = arg_value(a, 0, "default", Value::number(0.0));
  require_defined(input);
  if (input.is_number()) return Value::number(input.as_double());
  if (!input.is_string()) return fallback;
  const std::string s = py_strip(input.str(), std::nullopt, true, true);
  char* end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (!s.empty() && end && *end == 0 && s.find_first_of("xXpP") == std::string::npos) return Value::number(d);
  return fallback;
}

Value f_abs(const Value& input, CallArgs&, Renderer&) {
  require_defined(input);
  if (input.is_float()) return Value::number(std::fabs(input.as_double()));
  if (!input.is_number()) fail(fmt::format("bad operand type for abs(): '{}'", input.type_name()));
  if (input.as_int() == INT64_MIN) fail("integer overflow");
  return Value::integer(std::llabs(input.as_int()));
}

Value f_round(const Value& input, CallArgs& a, Renderer&) {
  const int64_t precision = arg_int(a, 0, "precision", 0);
  const std::string method = str_of(arg_value(a, 1, "method", Value::string("common")));
  require_defined(input);
  if (!input.is_number()) fail(fmt::format("type {} doesn't define __round__ method", input.type_name()));
  if (method != "common" && method != "ceil" && method != "floor") fail("method must be common, ceil or floor");
  if (method != "common") {
    const double scale = std::pow(10.0, static_cast<double>(precision));
    const double x = input.as_double() * scale;
    return Value::number((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
  }
  if (!input.is_float()) return Value::integer(input.as_int());  // round(int, n >= 0) is the int itself
  // Python rounds the exact binary value half-to-even at `precision` decimals, as printf does.
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(std::clamp<int64_t>(precision, 0, 300)), input.as_double());
  return Value::number(precision >= 0 ? std::strtod(buf, nullptr) : input.as_double());
}

Value f_sort(const Value& input, CallArgs& a, Renderer&) {
  const bool reverse = arg_bool(a, 0, "reverse", false);
  const bool case_sensitive = arg_bool(a, 1, "case_sensitive", false);
  const Value attribute = arg_value(a, 2, "attribute", Value::none());
  std::vector<Value> items = iterate(input);
  sort_values(items, [&](const Value& v) {
    Value k = attr_path(v, attribute);
    return case_sensitive ? k : ignore_case(k);
  }, reverse);
  return Value::list(std::move(items));
}

Value f_dictsort(const Value& input, CallArgs& a, Renderer&) {
  const bool case_sensitive = arg_bool(a, 0, "case_sensitive", false);
  const std::string by = str_of(arg_value(a, 1, "by", Value::string("key")));
  const bool reverse = arg_bool(a, 2, "reverse", false);
  require_defined(input);
  if (!input.is_dict()) fail(fmt::format("'{}' object has no attribute 'items'", input.type_name()));
  if (by != "key" && by != "value") fail("You can only sort by either \"key\" or \"value\"");
  std::vector<Value> items;
  for (const auto& [k, v] : input.dict_data().entries) items.push_back(Value::list({k, v}, SeqKind::kTuple));
  const size_t pos = by == "key" ? 0 : 1;
  sort_values(items, [&](const Value& v) { return case_sensitive ? v.items()[pos] : ignore_case(v.items()[pos]); }, reverse);
  return Value::list(std::move(items));
}

Value f_reverse(const Value& input, CallArgs&, Renderer&) {
  if (input.is_string()) {
    auto cps = utf8_decode(input.str());
    std::reverse(cps.begin(), cps.end());
    return Value::string(utf8_encode(cps));
  }
  auto items = iterate(input);
  std::reverse(items.begin(), items.end());
  return generator(std::move(items));
}

Value f_batch(const Value& input, CallArgs& a, Renderer&) {
  const int64_t n = arg_int(a, 0, "linecount", 0);
  const Value fill = arg_value(a, 1, "fill_with", Value::none());
  std::vector<Value> out, row;
  for (const Value& v : iterate(input)) {
    if (static_cast<int64_t>(row.size()) == n) {
      out.push_back(Value::list(std::move(row)));
      row.clear();
    }
    row.push_back(v);
  }
  if (!row.empty()) {
    if (!fill.is_none())
      while (static_cast<int64_t>(row.size()) < n) row.push_back(fill);
    out.push_back(Value::list(std::move(row)));
  }
  return generator(std::move(out));
}

Value f_indent(const Value& input, CallArgs& a, Renderer&) {
  const Value width = arg_value(a, 0, "width", Value::integer(4));
  const bool first = arg_bool(a, 1, "first", false), blank = arg_bool(a, 2, "blank", false);
  require_defined(input);
  if (!input.is_string()) fail(fmt::format("unsupported operand type(s) for +=: '{}' and 'str'", input.type_name()));
  const int64_t spaces = width.is_string() ? 0 : std::max<int64_t>(0, width.as_int());
  check_string_size(static_cast<uint64_t>(spaces) + input.str().size(), "indent()");
  const std::string indention = width.is_string() ? width.str() : std::string(spaces, ' ');
  const std::vector<std::string> lines = py_splitlines(input.str() + "\n", false);
  check_string_size(indention.size() * lines.size() + input.str().size(), "indent()");
  std::string rv;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i) rv += "\n";
    rv += (i > 0 && (blank || !lines[i].empty())) ? indention + lines[i] : lines[i];
  }
  return Value::string(first ? indention + rv : rv);
}

Value f_wordcount(const Value& input, CallArgs&, Renderer&) {
  int64_t n = 0;
  bool in_word = false;
  for (char32_t cp : utf8_decode(str_of(input))) {
    const auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
    const bool word = cp == '_' || (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) ||
                      (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO);
    if (word && !in_word) ++n;
    in_word = word;
  }
  return Value::integer(n);
}

Value f_escape(const Value& input, CallArgs&, Renderer&) {
  std::string out;
  for (char c : str_of(input)) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return Value::string(out);
}

Value f_format(const Value& input, CallArgs& a, Renderer&) {
  if (!a.positional.empty() && !a.keyword.empty()) fail("can't handle positional and keyword arguments at the same time");
  if (!a.keyword.empty()) {
    auto d = Value::dict();
    for (auto& [k, v] : a.keyword) d.dict_mut().set(Value::string(k), v);
    return Value::string(python_percent_format(str_of(input), d));
  }
  return Value::string(python_percent_format(str_of(input), Value::list(a.positional, SeqKind::kTuple)));
}

Value min_max(const Value& input, CallArgs& a, bool want_max) {
  const bool case_sensitive = arg_bool(a, 0, "case_sensitive", false);
  const Value attribute = arg_value(a, 1, "attribute", Value::none());
  const auto items = iterate(input);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  auto key = [&](const Value& v) {
    Value k = attr_path(v, attribute);
    return case_sensitive ? k : ignore_case(k);
  };
  size_t best = 0;
  Value best_key = key(items[0]);
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = key(items[i]);
    const int c = value_compare(k, best_key);
    if (want_max ? c > 0 : c < 0) {
      best = i;
      best_key = k;
    }
  }
  return items[best];
}

Value f_min(const Value& i, CallArgs& a, Renderer&) { return min_max(i, a, false); }
Value f_max(const Value& i, CallArgs& a, Renderer&) { return min_max(i, a, true); }

Value f_sum(const Value& input, CallArgs& a, Renderer&) {
  const Value attribute = arg_value(a, 0, "attribute", Value::none());
  Value total = arg_value(a, 1, "start", Value::integer(0));
  for (const Value& v : iterate(input)) total = binary_op("+", total, attr_path(v, attribute));
  return total;
}

Value f_attr(const Value& input, CallArgs& a, Renderer&) {
  const std::string name = str_of(a.get(0, "name"));
  require_defined(input);
  if (input.is_object()) return get_attr(input, name);
  Value m = bound_method(input, name);
  if (!m.is_undefined() || !m.str().empty()) return m;
  return Value::undefined(fmt::format("'{} object' has no attribute '{}'", input.type_name(), name));
}

Value f_center(const Value& input, CallArgs& a, Renderer& r) {
  CallArgs inner;
  inner.positional.push_back(Value::integer(arg_int(a, 0, "width", 80)));
  return r.call(get_attr(Value::string(str_of(input)), "center"), inner);
}

const std::unordered_map<std::string_view, FilterFn>& filter_table() {
  static const std::unordered_map<std::string_view, FilterFn> table = {
      {"tojson", f_tojson},     {"length", f_length},         {"count", f_length},       {"trim", f_trim},
      {"safe", f_string},       {"string", f_string},         {"first", f_first},        {"last", f_last},
      {"upper", f_upper},       {"lower", f_lower},           {"capitalize", f_capitalize}, {"title", f_title},
      {"join", f_join},         {"replace", f_replace},       {"items", f_items},        {"list", f_list},
      {"default", f_default},   {"d", f_default},             {"map", f_map},            {"select", f_select},
      {"reject", f_reject},     {"selectattr", f_selectattr}, {"rejectattr", f_rejectattr}, {"unique", f_unique},
      {"int", to_int},          {"float", to_float},          {"abs", f_abs},            {"round", f_round},
      {"sort", f_sort},         {"reverse", f_reverse},       {"batch", f_batch},        {"indent", f_indent},
      {"wordcount", f_wordcount}, {"dictsort", f_dictsort},   {"e", f_escape},           {"escape", f_escape},
      {"forceescape", f_escape}, {"format", f_format},        {"min", f_min},            {"max", f_max},
      {"sum", f_sum},           {"attr", f_attr},             {"center", f_center},
  };
  return table;
}

// --- tests ---

using TestFn = bool (*)(const Value& v, CallArgs& a);

Value test_arg(CallArgs& a) {
  if (a.positional.empty() && a.keyword.empty()) fail("test expects an argument");
  return a.positional.empty() ? a.keyword[0].second : a.positional[0];
}

bool number_mod(const Value& v, const Value& d, int64_t want_mod) {
  require_defined(v);
  const Value m = binary_op("%", v, d);
  return value_equals(m, Value::integer(want_mod));
}

const std::unordered_map<std::string_view, TestFn>& test_table() {
  static const std::unordered_map<std::string_view, TestFn> table = {
      {"defined", [](const Value& v, CallArgs&) { return !v.is_undefined(); }},
      {"undefined", [](const Value& v, CallArgs&) { return v.is_undefined(); }},
      {"none", [](const Value& v, CallArgs&) { return v.is_none(); }},
      {"boolean", [](const Value& v, CallArgs&) { return v.is_bool(); }},
      {"true", [](const Value& v, CallArgs&) { return v.is_bool() && v.as_bool(); }},
      {"false", [](const Value& v, CallArgs&) { return v.is_bool() && !v.as_bool(); }},
      {"integer", [](const Value& v, CallArgs&) { return v.is_int(); }},
      {"float", [](const Value& v, CallArgs&) { return v.is_float(); }},
      {"number", [](const Value& v, CallArgs&) { return v.is_number(); }},
      {"string", [](const Value& v, CallArgs&) { return v.is_string(); }},
      {"mapping", [](const Value& v, CallArgs&) { return v.is_dict(); }},
      {"iterable", [](const Value& v, CallArgs&) { return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict(); }},
      {"sequence", [](const Value& v, CallArgs&) {
         if (v.is_list()) return v.list_data().seq != SeqKind::kGenerator && v.list_data().seq != SeqKind::kKeys &&
                                 v.list_data().seq != SeqKind::kValues && v.list_data().seq != SeqKind::kItems;
         return v.is_undefined() || v.is_string() || v.is_dict();
       }},
            // Undefined defines __call__ (to raise), so Python's callable() is true for it.
      {"callable", [](const Value& v, CallArgs&) { return v.is_callable() || v.is_undefined(); }},
      {"lower", [](const Value& v, CallArgs&) { return py_islower(value_to_string(v)); }},
      {"upper", [](const Value& v, CallArgs&) { return py_isupper(value_to_string(v)); }},
      {"odd", [](const Value& v, CallArgs&) { return number_mod(v, Value::integer(2), 1); }},
      {"even", [](const Value& v, CallArgs&) { return number_mod(v, Value::integer(2), 0); }},
      {"divisibleby", [](const Value& v, CallArgs& a) { return number_mod(v, test_arg(a), 0); }},
      {"in", [](const Value& v, CallArgs& a) { return contains_op(test_arg(a), v); }},
      {"escaped", [](const Value&, CallArgs&) { return false; }},
      {"sameas", [](const Value& v, CallArgs& a) {
         const Value o = test_arg(a);
         if (v.kind() != o.kind()) return false;
         if (v.is_list() || v.is_dict() || v.is_callable() || v.is_object() || v.is_float()) return &v == &o;
         return value_equals(v, o);
       }},
      {"filter", [](const Value& v, CallArgs&) { return v.is_string() && builtin_has_filter(v.str()); }},
      {"test", [](const Value& v, CallArgs&) { return v.is_string() && builtin_has_test(v.str()); }},
      {"eq", [](const Value& v, CallArgs& a) { return value_equals(v, test_arg(a)); }},
      {"ne", [](const Value& v, CallArgs& a) { return !value_equals(v, test_arg(a)); }},
      {"lt", [](const Value& v, CallArgs& a) { return value_compare(v, test_arg(a)) < 0; }},
      {"le", [](const Value& v, CallArgs& a) { return value_compare(v, test_arg(a)) <= 0; }},
      {"gt", [](const Value& v, CallArgs& a) { return value_compare(v, test_arg(a)) > 0; }},
      {"ge", [](const Value& v, CallArgs& a) { return value_compare(v, test_arg(a)) >= 0; }},
  };
  return table;
}

std::string_view test_alias(std::string_view name) {
  if (name == "==" || name == "equalto") return "eq";
  if (name == "!=") return "ne";
  if (name == "<" || name == "lessthan") return "lt";
  if (name == "<=") return "le";
  if (name == ">" || name == "greaterthan") return "gt";
  if (name == ">=") return "ge";
  return name;
}

}  // namespace

bool builtin_has_filter(std::string_view name) { return filter_table().count(name) > 0; }
bool builtin_has_test(std::string_view name) { return test_table().count(test_alias(name)) > 0; }

Value builtin_filter(std::string_view name, const Value& input, CallArgs& args, Renderer& renderer) {
  const auto it = filter_table().find(name);
  if (it == filter_table().end()) fail(fmt::format("No filter named '{}'.", name));
  return it->second(input, args, renderer);
}

bool builtin_test(std::string_view name, const Value& input, CallArgs& args, Renderer&) {
  const auto it = test_table().find(test_alias(name));
  if (it == test_table().end()) fail(fmt::format("No test named '{}'.", name));
  const std::string_view n = it->first;
  if (n == "lt" || n == "le" || n == "gt" || n == "ge") {
    require_defined(input);
    require_defined(test_arg(args));
  }
  return it->second(input, args);
}

// --- globals ---

namespace {

Value g_range(CallArgs& a, Renderer&) {
  std::vector<int64_t> n;
  for (const Value& v : a.positional) {
    require_defined(v);
    if (!v.is_int() && !v.is_bool()) fail(fmt::format("'{}' object cannot be interpreted as an integer", v.type_name()));
    n.push_back(v.as_int());
  }
  if (n.empty() || n.size() > 3) fail("range expected 1 to 3 arguments");
  const int64_t start = n.size() == 1 ? 0 : n[0], stop = n.size() == 1 ? n[0] : n[1], step = n.size() == 3 ? n[2] : 1;
  if (step == 0) fail("range() arg 3 must not be zero");
  std::vector<Value> items;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    // The sandbox's MAX_RANGE.
    if (items.size() >= 100000) fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    items.push_back(Value::integer(i));
  }
  return Value::range(std::move(items), start, stop, step);
}

Value g_namespace(CallArgs& a, Renderer&) {
  auto ns = std::make_shared<ObjectData>();
  ns->type_name = "Namespace";
  ns->is_namespace = true;
  for (const Value& p : a.positional) {
    if (!p.is_dict()) fail("namespace() positional argument must be a mapping");
    for (const auto& [k, v] : p.dict_data().entries) ns->set(value_to_string(k), v);
  }
  for (const auto& [k, v] : a.keyword) ns->set(k, v);
  return Value::object(ns);
}

Value g_dict(CallArgs& a, Renderer&) {
  auto d = Value::dict();
  for (const Value& p : a.positional) {
    if (!p.is_dict()) fail("dict() positional argument must be a mapping");
    for (const auto& [k, v] : p.dict_data().entries) d.dict_mut().set(k, v);
  }
  for (const auto& [k, v] : a.keyword) d.dict_mut().set(Value::string(k), v);
  return d;
}

Value g_raise_exception(CallArgs& a, Renderer&) {
  fail(a.positional.empty() ? std::string() : value_to_string(a.positional[0]));
}

Value g_strftime_now(CallArgs& a, Renderer&) {
  const std::string format = a.positional.empty() ? "" : value_to_string(a.positional[0]);
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[512];
  const size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &local);
  return Value::string(std::string(buf, n));
}

}  // namespace

void builtin_add_globals(DictData& globals) {
  globals.set(Value::string("range"), Value::callable("range", g_range));
  globals.set(Value::string("namespace"), Value::callable("namespace", g_namespace));
  globals.set(Value::string("dict"), Value::callable("dict", g_dict));
  globals.set(Value::string("raise_exception"), Value::callable("raise_exception", g_raise_exception));
  globals.set(Value::string("strftime_now"), Value::callable("strftime_now", g_strftime_now));
}

}  // namespace tern::jinja
