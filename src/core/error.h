// Errors at tern's public boundaries (loading files, parsing requests) travel as values: an Expected<T> holds either
// a T or an Error whose message names what was wrong and where (file, tensor, field). Internal invariants that
// cannot fail on user input use TERN_CHECK, which aborts with file:line.
#pragma once

#include <fmt/format.h>

#include <string>
#include <tl/expected.hpp>
#include <utility>

namespace tern {

struct Error {
  std::string message;
};

template <class T>
using Expected = tl::expected<T, Error>;

// make_error("{}: tensor '{}' is truncated", path, name) -> an unexpected value convertible to any Expected<T>.
template <class... Args>
tl::unexpected<Error> make_error(fmt::format_string<Args...> format, Args&&... args) {
  return tl::unexpected<Error>(Error{fmt::format(format, std::forward<Args>(args)...)});
}

// Prefixes context ("while reading X: ") to an error travelling up.
inline tl::unexpected<Error> wrap_error(const Error& inner, std::string_view context) {
  return tl::unexpected<Error>(Error{fmt::format("{}: {}", context, inner.message)});
}

[[noreturn]] void check_failed(const char* file, int line, const char* expr, const std::string& message);

}  // namespace tern

#define TERN_CHECK(cond, ...)                                                                                 \
  do {                                                                                                        \
    if (!(cond)) ::tern::check_failed(__FILE__, __LINE__, #cond, ::fmt::format("" __VA_ARGS__));              \
  } while (0)

#define TERN_CONCAT_INNER(a, b) a##b
#define TERN_CONCAT(a, b) TERN_CONCAT_INNER(a, b)

// TERN_TRY(expr): returns the error of an Expected<void> (or any Expected) from the enclosing function.
#define TERN_TRY(expr)                                                                                        \
  do {                                                                                                        \
    auto&& tern_try_result_ = (expr);                                                                         \
    if (!tern_try_result_) return ::tl::unexpected<::tern::Error>(std::move(tern_try_result_).error());       \
  } while (0)

// TERN_ASSIGN_OR_RETURN(auto x, expr): binds the value of an Expected or returns its error.
#define TERN_ASSIGN_OR_RETURN(lhs, expr) TERN_ASSIGN_OR_RETURN_IMPL(TERN_CONCAT(tern_result_, __LINE__), lhs, expr)
#define TERN_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr)                                                            \
  auto tmp = (expr);                                                                                          \
  if (!tmp) return ::tl::unexpected<::tern::Error>(std::move(tmp).error());                                   \
  lhs = std::move(*tmp)
