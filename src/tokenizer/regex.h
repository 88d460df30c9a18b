// PCRE2 regular expressions with the Oniguruma-compatible options the Rust `tokenizers` patterns need (UTF + UCP),
// JIT-compiled. Subjects must be valid UTF-8: the caller validates once, and matching skips PCRE2's per-call check
// (which otherwise makes a find-all loop quadratic in the subject length).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "core/error.h"

namespace tern {

class Regex {
 public:
  static Expected<Regex> compile(std::string_view pattern);

  // Calls on_match(start, end) for each non-overlapping non-empty match, left to right. After an empty match the
  // search resumes one character later, as Oniguruma's find-all does.
  template <class F>
  void find_all(std::string_view text, F&& on_match) const {
    size_t pos = 0;
    size_t start = 0, end = 0;
    while (pos <= text.size() && search(text, pos, &start, &end)) {
      if (end > start) {
        on_match(start, end);
        pos = end;
      } else {
        pos = start + (start < text.size() ? utf8_step(text, start) : 1);
      }
    }
  }

  // First match at or after `pos`; false when there is none.
  bool search(std::string_view text, size_t pos, size_t* start, size_t* end) const;
  const std::string& pattern() const { return pattern_; }

 private:
  static size_t utf8_step(std::string_view text, size_t pos);
  struct Code;
  std::shared_ptr<const Code> code_;
  std::string pattern_;
};

// The Replace component of normalizers and decoders: every match of `regex` (or, without one, every occurrence of a
// non-empty `literal`) in `text` replaced by `content`.
std::string replace_matches(std::string_view text, const std::optional<Regex>& regex, std::string_view literal,
                            std::string_view content);

}  // namespace tern
