// Values of the chat-template engine. They follow Python's object model as Jinja2 sees it: None, bool, int,
// float, str, list/tuple (and the dict views and range that print differently), dict keeping insertion order,
// callables (macros, globals, bound methods), objects with attributes (namespace(), loop) and Jinja2's
// Undefined. Containers are shared by reference, as in Python, so a namespace mutated inside a macro is seen
// by its caller.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tern::jinja {

// Raised inside the engine for template errors; ChatTemplate turns it into a tern::Error at the boundary.
// (Deeply nested evaluation would otherwise need an Expected check at every one of hundreds of call sites.)
class TemplateFailure : public std::runtime_error {
 public:
  explicit TemplateFailure(const std::string& message, int line = 0) : std::runtime_error(message), line(line) {}
  int line;
};

[[noreturn]] void fail(const std::string& message);

// The most a template string may hold, and the widest field a format may pad to or the most digits it may print:
// every operation that grows a string checks the size it is about to build against it (a hostile template, or a
// request's values, must not make the server allocate gigabytes).
constexpr uint64_t kMaxStringBytes = 64u << 20;
constexpr int64_t kMaxFormatWidth = 1 << 20;
// Fails naming the operation when `bytes` exceeds kMaxStringBytes.
void check_string_size(uint64_t bytes, std::string_view what);

class Value;
struct CallArgs;
class Renderer;

enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kCallable, kObject };
// How a list-like value prints: [..], (..), dict_items([..]), range(a, b). kGenerator stands for the lazy
// iterators filters like map and select return: always true, no len(), no indexing.
enum class SeqKind { kList, kTuple, kItems, kKeys, kValues, kRange, kGenerator };

struct ListData {
  SeqKind seq = SeqKind::kList;
  std::vector<Value> items;
  int64_t range_args[3] = {0, 0, 1};
};

struct DictData;
struct ObjectData;
using NativeFn = std::function<Value(CallArgs&, Renderer&)>;
struct CallableData {
  std::string name;
  NativeFn fn;
};

class Value {
 public:
  Value() : kind_(Kind::kUndefined) {}
  static Value undefined(std::string hint = {}) {
    Value v;
    v.str_ = std::move(hint);
    return v;
  }
  static Value none() { return Value(Kind::kNone); }
  static Value boolean(bool b) {
    Value v(Kind::kBool);
    v.int_ = b;
    return v;
  }
  static Value integer(int64_t i) {
    Value v(Kind::kInt);
    v.int_ = i;
    return v;
  }
  static Value number(double d) {
    Value v(Kind::kFloat);
    v.float_ = d;
    return v;
  }
  static Value string(std::string s) {
    check_string_size(s.size(), "a string");
    Value v(Kind::kString);
    v.str_ = std::move(s);
    return v;
  }
  static Value list(std::vector<Value> items, SeqKind seq = SeqKind::kList);
  static Value range(std::vector<Value> items, int64_t start, int64_t stop, int64_t step);
  static Value dict();
  static Value dict(std::shared_ptr<DictData> d);
  static Value callable(std::string name, NativeFn fn);
  static Value object(std::shared_ptr<ObjectData> o);
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  // Python's numbers.Number, which includes bool.
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_callable() const { return kind_ == Kind::kCallable; }
  bool is_object() const { return kind_ == Kind::kObject; }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return int_; }  // also for bool
  double as_double() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& str() const { return str_; }  // string contents, or the undefined hint
  const ListData& list_data() const { return *list_; }
  const std::vector<Value>& items() const { return list_->items; }
  const DictData& dict_data() const { return *dict_; }
  DictData& dict_mut() const { return *dict_; }
  const std::shared_ptr<ObjectData>& object_data() const { return object_; }
  const CallableData& callable_data() const { return *callable_; }

  bool truthy() const;
  std::string type_name() const;  // Python's type name: 'dict', 'str', 'NoneType'...

 private:
  explicit Value(Kind k) : kind_(k) {}
  Kind kind_;
  int64_t int_ = 0;
  double float_ = 0.0;
  std::string str_;
  std::shared_ptr<ListData> list_;
  std::shared_ptr<DictData> dict_;
  std::shared_ptr<CallableData> callable_;
  std::shared_ptr<ObjectData> object_;
};

struct DictData {
  std::vector<std::pair<Value, Value>> entries;
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  void set(const Value& key, Value value);
};

// namespace() objects and the loop variable: named attributes, printed as <Namespace {...}>.
struct ObjectData {
  std::string type_name;
  bool is_namespace = false;
  std::vector<std::pair<std::string, Value>> attrs;
  const Value* find(std::string_view name) const;
  void set(const std::string& name, Value value);
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
  int line = 0;
  // Takes argument `index`/`name` (positional first, then keyword); `found` tells whether it was given.
  Value get(size_t index, std::string_view name, bool* found = nullptr);
  // Fails when keyword arguments remain that no get() took, as Python does for unexpected keywords.
  void check_consumed(std::string_view function) const;
  std::vector<bool> used_keyword;
};

// Python semantics.
bool value_equals(const Value& a, const Value& b);
int value_compare(const Value& a, const Value& b);  // <0, 0, >0; fails for unorderable types
std::string value_to_string(const Value& v);        // str(v); Undefined prints empty
std::string value_repr(const Value& v);             // repr(v)
std::string python_float_repr(double d);
std::string python_string_repr(std::string_view s);

struct JsonOptions {
  bool ensure_ascii = false;
  bool has_indent = false;
  std::string indent;
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
// json.dumps(v, ...) exactly as Python writes it.
std::string value_to_json(const Value& v, const JsonOptions& options);

// UTF-8 helpers: code points of a string and back (Python indexes strings by code point).
std::vector<char32_t> utf8_decode(std::string_view s);
std::string utf8_encode(const std::vector<char32_t>& cps);
void utf8_append(std::string& out, char32_t cp);
size_t utf8_length(std::string_view s);

}  // namespace tern::jinja
