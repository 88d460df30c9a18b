#include "tokenizer/unicode.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

#include "core/error.h"

namespace tern {

char32_t utf8_decode_at(std::string_view text, size_t pos, size_t* length) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data()) + pos;
  const size_t n = utf8_sequence_length(s[0]);
  *length = n;
  switch (n) {
    case 1: return s[0];
    case 2: return (char32_t(s[0] & 0x1F) << 6) | (s[1] & 0x3F);
    case 3: return (char32_t(s[0] & 0x0F) << 12) | (char32_t(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    default:
      return (char32_t(s[0] & 0x07) << 18) | (char32_t(s[1] & 0x3F) << 12) | (char32_t(s[2] & 0x3F) << 6) |
             (s[3] & 0x3F);
  }
}

void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

namespace {

// Length of the valid UTF-8 sequence at `s[i]`, or 0 with `*invalid_length` set to the length of the maximal
// prefix of a valid sequence (at least 1), following the Unicode "maximal subpart" rule that Rust uses.
size_t utf8_valid_sequence(const unsigned char* s, size_t n, size_t i, size_t* invalid_length) {
  const unsigned char b = s[i];
  *invalid_length = 1;
  if (b < 0x80) return 1;
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= n) return 0;
    const unsigned char c = s[i + k];
    const bool ok = k == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
    if (!ok) return 0;
    *invalid_length = k + 1;
  }
  return need + 1;
}

}  // namespace

bool utf8_is_valid(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  size_t i = 0, bad = 0;
  while (i < text.size()) {
    if (s[i] < 0x80) {
      ++i;
      continue;
    }
    const size_t len = utf8_valid_sequence(s, text.size(), i, &bad);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::string utf8_lossy(std::string_view bytes) {
  if (utf8_is_valid(bytes)) return std::string(bytes);
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  std::string out;
  out.reserve(bytes.size() + 8);
  size_t i = 0, bad = 0;
  while (i < bytes.size()) {
    const size_t len = utf8_valid_sequence(s, bytes.size(), i, &bad);
    if (len > 0) {
      out.append(bytes.substr(i, len));
      i += len;
    } else {
      out.append("\xEF\xBF\xBD");
      i += bad;
    }
  }
  return out;
}

bool unicode_is_whitespace(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D);
  switch (c) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

bool unicode_is_numeric(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}

bool unicode_is_punctuation(char32_t c) {
  if (c < 0x80) return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) ||
                       (c >= 0x7B && c <= 0x7E);
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat >= UTF8PROC_CATEGORY_PC && cat <= UTF8PROC_CATEGORY_PO;
}

bool unicode_is_word(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (c == 0x200C || c == 0x200D) return true;  // Join_Control is part of \w
  // Alphabetic symbols (circled and squared Latin letters) are word characters too.
  if ((c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F189 && c != 0x1F14A && c != 0x1F14B && c != 0x1F14C &&
                                       c != 0x1F14D && c != 0x1F14E && c != 0x1F14F && c != 0x1F16A && c != 0x1F16B &&
                                       c != 0x1F16C && c != 0x1F16D && c != 0x1F16E && c != 0x1F16F)) {
    return true;
  }
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_ND) || cat == UTF8PROC_CATEGORY_NL ||
         cat == UTF8PROC_CATEGORY_PC;
}

std::string unicode_lowercase(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto b = static_cast<unsigned char>(text[i]);
    if (b < 0x80) {
      out.push_back(static_cast<char>(b >= 'A' && b <= 'Z' ? b + 32 : b));
      ++i;
      continue;
    }
    size_t len = 0;
    const char32_t c = utf8_decode_at(text, i, &len);
    i += len;
    if (c == 0x130) {  // the one unconditional multi-character lower-case mapping (SpecialCasing.txt)
      out.append("i\xCC\x87");
      continue;
    }
    utf8_append(out, static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
  }
  return out;
}

std::string unicode_normalize(std::string_view text, NormalForm form) {
  bool ascii = true;
  for (const char ch : text) ascii = ascii && static_cast<unsigned char>(ch) < 0x80;
  if (ascii) return std::string(text);
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNfc: options |= UTF8PROC_COMPOSE; break;
    case NormalForm::kNfd: options |= UTF8PROC_DECOMPOSE; break;
    case NormalForm::kNfkc: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case NormalForm::kNfkd: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &mapped, static_cast<utf8proc_option_t>(options));
  TERN_CHECK(n >= 0, "utf8proc_map failed on validated UTF-8: {}", utf8proc_errmsg(n));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owner(mapped, &std::free);
  return std::string(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
}

const ByteLevelAlphabet& byte_level_alphabet() {
  static const ByteLevelAlphabet alphabet = [] {
    ByteLevelAlphabet a;
    a.char_to_byte.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const int code = printable ? b : next++;
      utf8_append(a.byte_to_utf8[b], static_cast<char32_t>(code));
      a.char_to_byte[code] = static_cast<int16_t>(b);
    }
    return a;
  }();
  return alphabet;
}

void byte_level_encode(std::string_view bytes, std::string& out) {
  const auto& alphabet = byte_level_alphabet();
  for (const char ch : bytes) out.append(alphabet.byte_to_utf8[static_cast<unsigned char>(ch)]);
}

std::optional<std::string> byte_level_decode(std::string_view token) {
  const auto& alphabet = byte_level_alphabet();
  std::string out;
  out.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    size_t len = 0;
    const auto lead = static_cast<unsigned char>(token[i]);
    if (utf8_sequence_length(lead) > token.size() - i) return std::nullopt;
    const char32_t c = utf8_decode_at(token, i, &len);
    if (c >= 512 || alphabet.char_to_byte[c] < 0) return std::nullopt;
    out.push_back(static_cast<char>(alphabet.char_to_byte[c]));
    i += len;
  }
  return out;
}

}  // namespace tern
