// Jinja2's built-in filters, tests, globals, operators and the Python methods of str, list and dict that
// templates call, with the semantics of Python Jinja2 3.1 in transformers' ImmutableSandboxedEnvironment.
#pragma once

#include <string>
#include <string_view>

#include "template/value.h"

namespace tern::jinja {

// Variable name that filter blocks and `{% set x | f %}` bind their rendered body to (not a valid identifier).
inline constexpr const char* kBodyVariable = "\x01body";

bool builtin_has_filter(std::string_view name);
bool builtin_has_test(std::string_view name);
Value builtin_filter(std::string_view name, const Value& input, CallArgs& args, Renderer& renderer);
bool builtin_test(std::string_view name, const Value& input, CallArgs& args, Renderer& renderer);
// raise_exception, strftime_now, range, namespace, dict, cycler, joiner.
void builtin_add_globals(DictData& globals);

// Python semantics of the operators; op is one of + - * / // % ** ~.
Value binary_op(std::string_view op, const Value& a, const Value& b);
bool contains_op(const Value& container, const Value& item);  // `item in container`
// Jinja2's environment.getattr (attribute first, then item) and getitem (item first, then attribute).
Value get_attr(const Value& obj, std::string_view name);
Value get_item(const Value& obj, const Value& key);
Value slice_value(const Value& obj, const Value& start, const Value& stop, const Value& step);
// The elements `for` iterates over: list items, dict keys, string characters; Undefined gives none.
std::vector<Value> iterate(const Value& v);
// Fails with the undefined value's message when v is Undefined.
void require_defined(const Value& v);
int64_t python_len(const Value& v);

}  // namespace tern::jinja
