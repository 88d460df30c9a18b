// Python methods of str, list and dict as templates call them (`s.startswith('x')`, `d.items()`), with the
// immutable sandbox's rule that mutating methods (list.append, dict.update...) are unsafe.
#pragma once

#include <string>
#include <string_view>

#include "template/value.h"

namespace tern::jinja {

// The bound method `obj.name`; Undefined with an empty hint when the type has no such method, or Undefined
// whose hint is the sandbox's message when the method is unsafe.
Value bound_method(const Value& obj, std::string_view name);
// `format % args` (printf-style), and str.format / format-spec formatting.
std::string python_percent_format(const std::string& format, const Value& args);
std::string python_str_format(const std::string& format, const CallArgs& args);
std::string python_format_spec(const Value& v, std::string_view spec);

}  // namespace tern::jinja
