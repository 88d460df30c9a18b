#include "template/pystr.h"

#include <utf8proc.h>

#include <algorithm>

#include "template/value.h"

namespace tern::jinja {
namespace {

using U32 = std::vector<char32_t>;

std::string encode_range(const U32& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) utf8_append(out, cps[i]);
  return out;
}

utf8proc_category_t category(char32_t cp) { return utf8proc_category(static_cast<utf8proc_int32_t>(cp)); }

bool is_cased_upper(char32_t cp) { return category(cp) == UTF8PROC_CATEGORY_LU; }
bool is_cased_lower(char32_t cp) { return category(cp) == UTF8PROC_CATEGORY_LL; }
bool is_cased(char32_t cp) {
  const auto c = category(cp);
  return c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT;
}
char32_t to_upper(char32_t cp) { return static_cast<char32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(cp))); }
char32_t to_lower(char32_t cp) { return static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))); }
char32_t to_title(char32_t cp) { return static_cast<char32_t>(utf8proc_totitle(static_cast<utf8proc_int32_t>(cp))); }

size_t cp_index(std::string_view s, size_t byte_index) { return utf8_length(s.substr(0, byte_index)); }

}  // namespace

bool py_isspace_cp(char32_t cp) {
  if (cp == ' ' || (cp >= '\t' && cp <= '\r') || (cp >= 0x1c && cp <= 0x1f)) return true;
  if (cp < 0x80) return false;
  return cp == 0x85 || cp == 0xa0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 ||
         cp == 0x2029 || cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

std::string py_strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right) {
  const U32 cps = utf8_decode(s);
  const U32 set = chars ? utf8_decode(*chars) : U32{};
  auto strip_me = [&](char32_t cp) {
    return chars ? std::find(set.begin(), set.end(), cp) != set.end() : py_isspace_cp(cp);
  };
  size_t begin = 0, end = cps.size();
  if (left)
    while (begin < end && strip_me(cps[begin])) ++begin;
  if (right)
    while (end > begin && strip_me(cps[end - 1])) --end;
  return encode_range(cps, begin, end);
}

std::vector<std::string> py_split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (maxsplit < 0) maxsplit = INT64_MAX;
  if (sep) {
    if (sep->empty()) fail("empty separator");
    size_t start = 0;
    while (maxsplit-- > 0) {
      const size_t at = s.find(*sep, start);
      if (at == std::string_view::npos) break;
      out.emplace_back(s.substr(start, at - start));
      start = at + sep->size();
    }
    out.emplace_back(s.substr(start));
    return out;
  }
  const U32 cps = utf8_decode(s);
  size_t i = 0;
  const size_t n = cps.size();
  while (true) {
    while (i < n && py_isspace_cp(cps[i])) ++i;
    if (i >= n) break;
    if (maxsplit-- <= 0) {
      out.push_back(encode_range(cps, i, n));
      break;
    }
    size_t j = i;
    while (j < n && !py_isspace_cp(cps[j])) ++j;
    out.push_back(encode_range(cps, i, j));
    i = j;
  }
  return out;
}

std::vector<std::string> py_rsplit(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (maxsplit < 0) maxsplit = INT64_MAX;
  if (sep) {
    if (sep->empty()) fail("empty separator");
    size_t end = s.size();
    while (maxsplit-- > 0) {
      if (end < sep->size()) break;
      const size_t at = s.rfind(*sep, end - sep->size());
      if (at == std::string_view::npos) break;
      out.emplace_back(s.substr(at + sep->size(), end - at - sep->size()));
      end = at;
    }
    out.emplace_back(s.substr(0, end));
    std::reverse(out.begin(), out.end());
    return out;
  }
  const U32 cps = utf8_decode(s);
  size_t i = cps.size();
  while (true) {
    while (i > 0 && py_isspace_cp(cps[i - 1])) --i;
    if (i == 0) break;
    if (maxsplit-- <= 0) {
      out.push_back(encode_range(cps, 0, i));
      break;
    }
    size_t j = i;
    while (j > 0 && !py_isspace_cp(cps[j - 1])) --j;
    out.push_back(encode_range(cps, j, i));
    i = j;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> py_splitlines(std::string_view s, bool keepends) {
  const U32 cps = utf8_decode(s);
  std::vector<std::string> out;
  size_t start = 0, i = 0;
  while (i < cps.size()) {
    const char32_t c = cps[i];
    const bool brk = c == '\n' || c == '\r' || c == '\v' || c == '\f' || c == 0x1c || c == 0x1d || c == 0x1e ||
                     c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!brk) {
      ++i;
      continue;
    }
    size_t eol = i + 1;
    if (c == '\r' && eol < cps.size() && cps[eol] == '\n') ++eol;
    out.push_back(encode_range(cps, start, keepends ? eol : i));
    start = i = eol;
  }
  if (start < cps.size()) out.push_back(encode_range(cps, start, cps.size()));
  return out;
}

std::string py_replace(std::string_view s, std::string_view old, std::string_view replacement, int64_t count) {
  if (count < 0) count = INT64_MAX;
  std::string out;
  if (old.empty()) {
    const U32 cps = utf8_decode(s);
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count > 0) {
        out += replacement;
        --count;
      }
      if (i < cps.size()) utf8_append(out, cps[i]);
    }
    return out;
  }
  size_t start = 0;
  while (count > 0) {
    const size_t at = s.find(old, start);
    if (at == std::string_view::npos) break;
    out += s.substr(start, at - start);
    out += replacement;
    start = at + old.size();
    --count;
  }
  out += s.substr(start);
  return out;
}

std::string py_upper(std::string_view s) {
  std::string out;
  for (char32_t cp : utf8_decode(s)) {
    if (cp == 0xdf) out += "SS";  // the one full case mapping common in text; utf8proc maps only 1:1
    else utf8_append(out, to_upper(cp));
  }
  return out;
}

std::string py_lower(std::string_view s) {
  std::string out;
  for (char32_t cp : utf8_decode(s)) utf8_append(out, to_lower(cp));
  return out;
}

std::string py_title(std::string_view s) {
  std::string out;
  bool previous_cased = false;
  for (char32_t cp : utf8_decode(s)) {
    utf8_append(out, previous_cased ? to_lower(cp) : to_title(cp));
    previous_cased = is_cased(cp);
  }
  return out;
}

std::string py_capitalize(std::string_view s) {
  const U32 cps = utf8_decode(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); ++i) utf8_append(out, i == 0 ? to_title(cps[i]) : to_lower(cps[i]));
  return out;
}

int64_t py_find(std::string_view s, std::string_view sub, bool reverse) {
  const size_t at = reverse ? s.rfind(sub) : s.find(sub);
  return at == std::string_view::npos ? -1 : static_cast<int64_t>(cp_index(s, at));
}

int64_t py_count(std::string_view s, std::string_view sub) {
  if (sub.empty()) return static_cast<int64_t>(utf8_length(s)) + 1;
  int64_t n = 0;
  for (size_t at = s.find(sub); at != std::string_view::npos; at = s.find(sub, at + sub.size())) ++n;
  return n;
}

bool py_is_all(std::string_view s, std::string_view predicate) {
  const U32 cps = utf8_decode(s);
  if (cps.empty()) return false;
  for (char32_t cp : cps) {
    const auto c = category(cp);
    const bool letter = c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO;
    const bool digit = c == UTF8PROC_CATEGORY_ND;
    const bool numeric = digit || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
    bool ok = false;
    if (predicate == "isdigit" || predicate == "isdecimal") ok = digit;
    else if (predicate == "isnumeric") ok = numeric;
    else if (predicate == "isalpha") ok = letter;
    else if (predicate == "isalnum") ok = letter || numeric;
    else if (predicate == "isspace") ok = py_isspace_cp(cp);
    if (!ok) return false;
  }
  return true;
}

bool py_islower(std::string_view s) {
  bool any = false;
  for (char32_t cp : utf8_decode(s)) {
    if (is_cased_upper(cp) || category(cp) == UTF8PROC_CATEGORY_LT) return false;
    any = any || is_cased_lower(cp);
  }
  return any;
}

bool py_isupper(std::string_view s) {
  bool any = false;
  for (char32_t cp : utf8_decode(s)) {
    if (is_cased_lower(cp) || category(cp) == UTF8PROC_CATEGORY_LT) return false;
    any = any || is_cased_upper(cp);
  }
  return any;
}

}  // namespace tern::jinja
