// Operators, attribute and item access, slicing and iteration with Python semantics.
#include <fmt/format.h>

#include <cmath>

#include "template/builtins.h"
#include "template/methods.h"
#include "template/pystr.h"

namespace tern::jinja {

void require_defined(const Value& v) {
  if (v.is_undefined()) fail(v.str().empty() ? "value is undefined" : v.str());
}

int64_t python_len(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined: return 0;
    case Kind::kString: return static_cast<int64_t>(utf8_length(v.str()));
    case Kind::kList:
      if (v.list_data().seq == SeqKind::kGenerator) break;
      return static_cast<int64_t>(v.items().size());
    case Kind::kDict: return static_cast<int64_t>(v.dict_data().entries.size());
    default: break;
  }
  fail(fmt::format("object of type '{}' has no len()", v.type_name()));
}

std::vector<Value> iterate(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined: return {};
    case Kind::kList: return v.items();
    case Kind::kDict: {
      std::vector<Value> keys;
      for (const auto& [k, e] : v.dict_data().entries) keys.push_back(k);
      return keys;
    }
    case Kind::kString: {
      std::vector<Value> chars;
      for (char32_t cp : utf8_decode(v.str())) {
        std::string s;
        utf8_append(s, cp);
        chars.push_back(Value::string(std::move(s)));
      }
      return chars;
    }
    default: fail(fmt::format("'{}' object is not iterable", v.type_name()));
  }
}

namespace {

void check_overflow(bool overflow) {
  if (overflow) fail("integer overflow (values beyond 64 bits are not supported)");
}

Value repeat(const Value& seq, int64_t times) {
  if (times < 0) times = 0;
  if (seq.is_string()) {
    if (times > 0 && seq.str().size() * static_cast<uint64_t>(times) > (64u << 20)) fail("string repetition is too large");
    std::string out;
    for (int64_t i = 0; i < times; ++i) out += seq.str();
    return Value::string(std::move(out));
  }
  if (times > 0 && seq.items().size() * static_cast<uint64_t>(times) > (1u << 24)) fail("list repetition is too large");
  std::vector<Value> out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), seq.items().begin(), seq.items().end());
  return Value::list(std::move(out), seq.list_data().seq == SeqKind::kTuple ? SeqKind::kTuple : SeqKind::kList);
}

bool is_plain_seq(const Value& v) {
  return v.is_list() && (v.list_data().seq == SeqKind::kList || v.list_data().seq == SeqKind::kTuple);
}

[[noreturn]] void unsupported(std::string_view op, const Value& a, const Value& b) {
  fail(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, a.type_name(), b.type_name()));
}

Value arithmetic(std::string_view op, const Value& a, const Value& b) {
  const bool ints = !a.is_float() && !b.is_float();
  const int64_t x = a.as_int(), y = b.as_int();
  const double fx = a.as_double(), fy = b.as_double();
  int64_t r = 0;
  if (op == "+" || op == "-" || op == "*") {
    if (!ints) return Value::number(op == "+" ? fx + fy : op == "-" ? fx - fy : fx * fy);
    check_overflow(op == "+"   ? __builtin_add_overflow(x, y, &r)
                   : op == "-" ? __builtin_sub_overflow(x, y, &r)
                               : __builtin_mul_overflow(x, y, &r));
    return Value::integer(r);
  }
  if (op == "/") {
    if (fy == 0.0) fail(ints ? "division by zero" : "float division by zero");
    return Value::number(fx / fy);
  }
  if (op == "//" || op == "%") {
    if (ints) {
      if (y == 0) fail(op == "//" ? "integer division or modulo by zero" : "integer modulo by zero");
      if (x == INT64_MIN && y == -1) fail("integer overflow");
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {
        --q;
        m += y;
      }
      return Value::integer(op == "//" ? q : m);
    }
    if (fy == 0.0) fail(op == "//" ? "float floor division by zero" : "float modulo");
    double m = std::fmod(fx, fy);
    double q = (fx - m) / fy;
    if (m != 0.0 && ((m < 0) != (fy < 0))) {
      m += fy;
      q -= 1.0;
    }
    if (op == "%") return Value::number(m == 0.0 ? std::copysign(0.0, fy) : m);
    double fq = std::floor(q);
    if (q - fq > 0.5) fq += 1.0;
    return Value::number(q == 0.0 ? std::copysign(0.0, fx / fy) : fq);
  }
  // "**"
  if (ints && y >= 0) {
    int64_t result = 1, base = x, e = y;
    while (e > 0) {
      if (e & 1) check_overflow(__builtin_mul_overflow(result, base, &result));
      e >>= 1;
      if (e) check_overflow(__builtin_mul_overflow(base, base, &base));
    }
    return Value::integer(result);
  }
  if (fx == 0.0 && fy < 0) fail("0.0 cannot be raised to a negative power");
  if (fx < 0 && std::floor(fy) != fy) fail("negative number cannot be raised to a fractional power (complex result)");
  return Value::number(std::pow(fx, fy));
}

}  // namespace

Value binary_op(std::string_view op, const Value& a, const Value& b) {
  if (op == "~") {
    std::string left = value_to_string(a);
    const std::string right = value_to_string(b);
    check_string_size(left.size() + right.size(), "'~'");
    return Value::string(std::move(left) + right);
  }
  require_defined(a);
  require_defined(b);
  if (a.is_number() && b.is_number()) return arithmetic(op, a, b);
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      check_string_size(a.str().size() + b.str().size(), "'+'");
      return Value::string(a.str() + b.str());
    }
    if (is_plain_seq(a) && is_plain_seq(b) && a.list_data().seq == b.list_data().seq) {
      std::vector<Value> out = a.items();
      out.insert(out.end(), b.items().begin(), b.items().end());
      return Value::list(std::move(out), a.list_data().seq);
    }
    if (a.is_string() || b.is_string())
      fail(fmt::format("can only concatenate str (not \"{}\") to str", (a.is_string() ? b : a).type_name()));
  }
  if (op == "*") {
    if ((a.is_string() || is_plain_seq(a)) && (b.is_int() || b.is_bool())) return repeat(a, b.as_int());
    if ((b.is_string() || is_plain_seq(b)) && (a.is_int() || a.is_bool())) return repeat(b, a.as_int());
  }
  if (op == "%" && a.is_string()) return Value::string(python_percent_format(a.str(), b));
  unsupported(op, a, b);
}

bool contains_op(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Kind::kUndefined: return false;
    case Kind::kString:
      if (!item.is_string())
        fail(fmt::format("'in <string>' requires string as left operand, not {}", item.type_name()));
      return container.str().find(item.str()) != std::string::npos;
    case Kind::kList:
      for (const Value& v : container.items())
        if (value_equals(v, item)) return true;
      return false;
    case Kind::kDict: return container.dict_data().find(item) != nullptr;
    default: fail(fmt::format("argument of type '{}' is not iterable", container.type_name()));
  }
}

static Value missing_attribute(const Value& obj, const Value& name) {
  const std::string owner = obj.is_none() ? "None" : fmt::format("{} object", obj.type_name());
  if (name.is_string()) return Value::undefined(fmt::format("'{}' has no attribute '{}'", owner, name.str()));
  return Value::undefined(fmt::format("'{}' has no element {}", owner, value_repr(name)));
}

Value get_attr(const Value& obj, std::string_view name) {
  require_defined(obj);
  if (obj.is_object()) {
    if (const Value* v = obj.object_data()->find(name)) return *v;
    return missing_attribute(obj, Value::string(std::string(name)));
  }
  Value method = bound_method(obj, name);
  if (!method.is_undefined() || !method.str().empty()) return method;
  if (obj.is_dict())
    if (const Value* v = obj.dict_data().find(name)) return *v;
  return missing_attribute(obj, Value::string(std::string(name)));
}

static bool index_of(const Value& key, int64_t size, int64_t* index) {
  if (!key.is_int() && !key.is_bool()) return false;
  int64_t i = key.as_int();
  if (i < 0) i += size;
  if (i < 0 || i >= size) return false;
  *index = i;
  return true;
}

Value get_item(const Value& obj, const Value& key) {
  require_defined(obj);
  int64_t i = 0;
  switch (obj.kind()) {
    case Kind::kDict:
      if (const Value* v = obj.dict_data().find(key)) return *v;
      break;
    case Kind::kList:
      if (obj.list_data().seq == SeqKind::kGenerator) fail("'generator' object is not subscriptable");
      if (index_of(key, static_cast<int64_t>(obj.items().size()), &i)) return obj.items()[i];
      break;
    case Kind::kString: {
      const auto cps = utf8_decode(obj.str());
      if (index_of(key, static_cast<int64_t>(cps.size()), &i)) {
        std::string s;
        utf8_append(s, cps[i]);
        return Value::string(std::move(s));
      }
      break;
    }
    default: break;
  }
  if (key.is_string()) {
    if (obj.is_dict()) {
      Value method = bound_method(obj, key.str());
      if (!method.is_undefined() || !method.str().empty()) return method;
      return missing_attribute(obj, key);
    }
    return get_attr(obj, key.str());
  }
  return missing_attribute(obj, key);
}

namespace {

// Python's slice.indices().
void slice_indices(int64_t len, const Value& start, const Value& stop, const Value& step, int64_t* b, int64_t* e,
                   int64_t* s) {
  auto as_index = [](const Value& v, const char* what) {
    if (!v.is_int() && !v.is_bool())
      fail(fmt::format("slice {} must be an integer or None, not {}", what, v.type_name()));
    return v.as_int();
  };
  *s = step.is_none() ? 1 : as_index(step, "step");
  if (*s == 0) fail("slice step cannot be zero");
  const int64_t lower = *s < 0 ? -1 : 0, upper = *s < 0 ? len - 1 : len;
  auto clamp = [&](const Value& v, int64_t fallback) {
    if (v.is_none()) return fallback;
    int64_t x = as_index(v, "index");
    if (x < 0) {
      x += len;
      if (x < lower) x = lower;
    } else if (x > upper) {
      x = upper;
    }
    return x;
  };
  *b = clamp(start, *s < 0 ? upper : lower);
  *e = clamp(stop, *s < 0 ? lower : upper);
}

template <class T>
std::vector<T> take_slice(const std::vector<T>& items, int64_t b, int64_t e, int64_t s) {
  std::vector<T> out;
  if (s > 0)
    for (int64_t i = b; i < e; i += s) out.push_back(items[i]);
  else
    for (int64_t i = b; i > e; i += s) out.push_back(items[i]);
  return out;
}

}  // namespace

Value slice_value(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  require_defined(obj);
  int64_t b, e, s;
  if (obj.is_string()) {
    const auto cps = utf8_decode(obj.str());
    slice_indices(static_cast<int64_t>(cps.size()), start, stop, step, &b, &e, &s);
    return Value::string(utf8_encode(take_slice(cps, b, e, s)));
  }
  if (obj.is_list()) {
    slice_indices(static_cast<int64_t>(obj.items().size()), start, stop, step, &b, &e, &s);
    const SeqKind seq = obj.list_data().seq == SeqKind::kTuple ? SeqKind::kTuple : SeqKind::kList;
    return Value::list(take_slice(obj.items(), b, e, s), seq);
  }
  return missing_attribute(obj, Value::string("slice"));
}

}  // namespace tern::jinja
