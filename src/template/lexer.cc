#include "template/lexer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "template/value.h"

namespace tern::jinja {
namespace {

// Length of the Python whitespace character (str.isspace) at `pos`, or 0.
size_t space_len(std::string_view s, size_t pos) {
  if (pos >= s.size()) return 0;
  const auto c = static_cast<unsigned char>(s[pos]);
  if (c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f)) return 1;
  if (c < 0x80) return 0;
  const std::string_view rest = s.substr(pos);
  static constexpr const char* kWide[] = {"\xc2\x85", "\xc2\xa0", "\xe1\x9a\x80", "\xe2\x80\xa8", "\xe2\x80\xa9",
                                          "\xe2\x80\xaf", "\xe2\x81\x9f", "\xe3\x80\x80"};
  for (const char* w : kWide)
    if (rest.substr(0, std::strlen(w)) == w) return std::strlen(w);
  // U+2000..U+200A
  if (rest.size() >= 3 && rest[0] == '\xe2' && rest[1] == '\x80' && static_cast<unsigned char>(rest[2]) >= 0x80 &&
      static_cast<unsigned char>(rest[2]) <= 0x8a)
    return 3;
  return 0;
}

size_t skip_spaces(std::string_view s, size_t pos) {
  while (size_t n = space_len(s, pos)) pos += n;
  return pos;
}

// Python's str.rstrip() length.
size_t rstrip_len(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
    if (space_len(s, start) != end - start) break;
    end = start;
  }
  return end;
}

bool all_spaces(std::string_view s) { return !s.empty() && skip_spaces(s, 0) == s.size(); }

bool starts_with(std::string_view s, size_t pos, std::string_view prefix) { return s.substr(pos, prefix.size()) == prefix; }

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

class Lexer {
 public:
  explicit Lexer(std::string_view source) {
    // Jinja2 splits on \r\n, \r and \n, drops one trailing newline and joins with \n.
    std::vector<std::string> lines(1);
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r' || source[i] == '\n') {
        if (source[i] == '\r' && i + 1 < source.size() && source[i + 1] == '\n') ++i;
        lines.emplace_back();
      } else {
        lines.back() += source[i];
      }
    }
    if (lines.size() > 1 && lines.back().empty()) lines.pop_back();
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i) src_ += '\n';
      src_ += lines[i];
    }
  }

  std::vector<Token> run() {
    while (pos_ < src_.size()) lex_root();
    push(TokenType::kEof, "", src_.size());
    return std::move(tokens_);
  }

 private:
  int line_at(size_t pos) {
    if (!newlines_ready_) {
      for (size_t i = 0; i < src_.size(); ++i)
        if (src_[i] == '\n') newlines_.push_back(i);
      newlines_ready_ = true;
    }
    return 1 + static_cast<int>(std::lower_bound(newlines_.begin(), newlines_.end(), pos) - newlines_.begin());
  }

  [[noreturn]] void error(const std::string& message, size_t pos) { throw TemplateFailure(message, line_at(pos)); }

  Token& push(TokenType type, std::string value, size_t at) {
    tokens_.push_back(Token{type, std::move(value), line_at(at)});
    return tokens_.back();
  }

  // Applies '-' and lstrip_blocks to the text before a tag, then emits it.
  void emit_text(size_t start, size_t end, char sign, bool lstrip_allowed) {
    std::string_view text(src_.data() + start, end - start);
    if (sign == '-') {
      text = text.substr(0, rstrip_len(text));
    } else if (sign != '+' && lstrip_allowed) {
      const size_t nl = text.rfind('\n');
      const size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting_) && all_spaces(text.substr(l_pos))) text = text.substr(0, l_pos);
    }
    if (!text.empty()) push(TokenType::kData, std::string(text), start);
  }

  // Matches `\s*raw\s*(-%}\s*|%})` after "{%" and a sign; returns the end or npos.
  size_t match_raw_begin(size_t p) {
    p = skip_spaces(src_, p);
    if (!starts_with(src_, p, "raw")) return std::string_view::npos;
    p = skip_spaces(src_, p + 3);
    if (starts_with(src_, p, "-%}")) return skip_spaces(src_, p + 3);
    if (starts_with(src_, p, "%}")) return p + 2;
    return std::string_view::npos;
  }

  // A closing "%}" with its whitespace control: "+%}", "-%}\s*" or "%}\n?" (trim_blocks). Returns end or npos.
  size_t match_block_end(size_t p, char close) {
    if (src_[p] == '+' && starts_with(src_, p + 1, std::string(1, close) + "}")) return p + 3;
    if (src_[p] == '-' && starts_with(src_, p + 1, std::string(1, close) + "}")) return skip_spaces(src_, p + 3);
    if (src_[p] == close && p + 1 < src_.size() && src_[p + 1] == '}') {
      p += 2;
      if (p < src_.size() && src_[p] == '\n') ++p;
      return p;
    }
    return std::string_view::npos;
  }

  void lex_root() {
    size_t p = pos_;
    while (true) {
      p = src_.find('{', p);
      if (p == std::string::npos || p + 1 >= src_.size()) {
        push(TokenType::kData, src_.substr(pos_), pos_);
        pos_ = src_.size();
        return;
      }
      const char c = src_[p + 1];
      if (c == '{' || c == '%' || c == '#') break;
      ++p;
    }
    const char kind = src_[p + 1];
    size_t after = p + 2;
    char sign = 0;
    if (after < src_.size() && (src_[after] == '-' || src_[after] == '+')) sign = src_[after++];
    if (kind == '%') {
      const size_t raw_end = match_raw_begin(after);
      if (raw_end != std::string_view::npos) {
        emit_text(pos_, p, sign, true);
        line_starting_ = src_[raw_end - 1] == '\n';
        lex_raw(raw_end);
        return;
      }
    }
    emit_text(pos_, p, sign, kind != '{');
    line_starting_ = false;
    if (kind == '#') {
      lex_comment(after, p);
    } else {
      push(kind == '{' ? TokenType::kVariableBegin : TokenType::kBlockBegin, "", p);
      lex_tag(after, kind == '{' ? '}' : '%');
    }
  }

  void lex_comment(size_t p, size_t begin) {
    for (size_t q = p; q < src_.size(); ++q) {
      size_t end = std::string_view::npos;
      if (src_[q] == '+' && starts_with(src_, q + 1, "#}")) end = q + 3;
      else if (src_[q] == '-' && starts_with(src_, q + 1, "#}")) end = skip_spaces(src_, q + 3);
      else if (starts_with(src_, q, "#}")) end = (q + 2 < src_.size() && src_[q + 2] == '\n') ? q + 3 : q + 2;
      if (end != std::string_view::npos) {
        line_starting_ = src_[end - 1] == '\n';
        pos_ = end;
        return;
      }
    }
    error("Missing end of comment tag", begin);
  }

  void lex_raw(size_t p) {
    for (size_t q = p; q + 1 < src_.size(); ++q) {
      if (src_[q] != '{' || src_[q + 1] != '%') continue;
      size_t r = q + 2;
      char sign = 0;
      if (r < src_.size() && (src_[r] == '-' || src_[r] == '+')) sign = src_[r++];
      r = skip_spaces(src_, r);
      if (!starts_with(src_, r, "endraw")) continue;
      r = skip_spaces(src_, r + 6);
      if (r >= src_.size()) continue;
      const size_t end = match_block_end(r, '%');
      if (end == std::string_view::npos) continue;
      emit_text(p, q, sign, true);
      line_starting_ = src_[end - 1] == '\n';
      pos_ = end;
      return;
    }
    error("Missing end of raw directive", p);
  }

  void lex_tag(size_t p, char close) {
    std::vector<char> balance;
    while (true) {
      if (p >= src_.size()) {  // Jinja2 stops here; the parser reports the unexpected end
        pos_ = p;
        return;
      }
      if (balance.empty()) {
        size_t end = std::string_view::npos;
        if (close == '%') {
          end = match_block_end(p, '%');
        } else if (src_[p] == '-' && starts_with(src_, p + 1, "}}")) {
          end = skip_spaces(src_, p + 3);
        } else if (starts_with(src_, p, "}}")) {
          end = p + 2;
        }
        if (end != std::string_view::npos) {
          push(close == '%' ? TokenType::kBlockEnd : TokenType::kVariableEnd, "", p);
          line_starting_ = src_[end - 1] == '\n';
          pos_ = end;
          return;
        }
      }
      if (size_t n = skip_spaces(src_, p); n != p) {
        p = n;
        continue;
      }
      p = lex_tag_token(p, balance);
    }
  }

  size_t lex_number(size_t p) {
    const char c = src_[p];
    auto digits = [&](size_t q, auto accept) {  // (_?[digit])+ runs, returns end
      size_t r = q;
      while (r < src_.size()) {
        size_t s = r;
        if (src_[s] == '_' && s > q) ++s;
        if (s < src_.size() && accept(src_[s])) r = s + 1;
        else break;
      }
      return r;
    };
    auto dec = [](char ch) { return is_digit(ch); };
    // float: digits ((.digits)? e[+-]?digits | .digits)
    if (is_digit(c) && (p == 0 || src_[p - 1] != '.')) {
      size_t q = digits(p, dec);
      size_t frac_end = q;
      bool has_frac = false;
      if (q + 1 < src_.size() && src_[q] == '.' && is_digit(src_[q + 1])) {
        frac_end = digits(q + 1, dec);
        has_frac = true;
      }
      size_t exp_end = std::string_view::npos;
      if (frac_end < src_.size() && (src_[frac_end] == 'e' || src_[frac_end] == 'E')) {
        size_t e = frac_end + 1;
        if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
        if (e < src_.size() && is_digit(src_[e])) exp_end = digits(e, dec);
      }
      size_t end = exp_end != std::string_view::npos ? exp_end : (has_frac ? frac_end : std::string_view::npos);
      if (end != std::string_view::npos) {
        std::string text;
        for (size_t i = p; i < end; ++i)
          if (src_[i] != '_') text += src_[i];
        push(TokenType::kFloat, text, p).float_value = std::strtod(text.c_str(), nullptr);
        return end;
      }
    }
    int base = 10;
    size_t start = p, end = p;
    const char x = p + 1 < src_.size() ? static_cast<char>(src_[p + 1] | 0x20) : 0;
    if (c == '0' && (x == 'b' || x == 'o' || x == 'x')) {
      base = x == 'b' ? 2 : x == 'o' ? 8 : 16;
      start = p + 2;
      end = digits(start, [base](char ch) {
        if (base == 2) return ch == '0' || ch == '1';
        if (base == 8) return ch >= '0' && ch <= '7';
        return is_digit(ch) || ((ch | 0x20) >= 'a' && (ch | 0x20) <= 'f');
      });
      if (end == start) error(fmt::format("unexpected char '{}'", c), p);  // "0x" alone
    } else if (c == '0') {
      end = digits(p, [](char ch) { return ch == '0'; });
    } else {
      end = digits(p, dec);
    }
    std::string text;
    for (size_t i = start; i < end; ++i)
      if (src_[i] != '_') text += src_[i];
    errno = 0;
    const long long v = std::strtoll(text.c_str(), nullptr, base);
    if (errno == ERANGE) error("integer literal is too large", p);
    push(TokenType::kInteger, src_.substr(p, end - p), p).int_value = v;
    return end;
  }

  size_t lex_string(size_t p) {
    const char quote = src_[p];
    std::string out;
    size_t q = p + 1;
    while (q < src_.size() && src_[q] != quote) {
      if (src_[q] != '\\') {
        out += src_[q++];
        continue;
      }
      if (q + 1 >= src_.size()) break;
      q = decode_escape(q, out);
    }
    if (q >= src_.size()) error(fmt::format("unexpected char '{}' at {}", quote, p), p);
    push(TokenType::kString, out, p);
    return q + 1;
  }

  // Python's unicode-escape decoding of one backslash sequence at q; returns the position after it.
  size_t decode_escape(size_t q, std::string& out) {
    const char e = src_[q + 1];
    auto hex = [&](size_t start, int n) -> char32_t {
      char32_t v = 0;
      for (int i = 0; i < n; ++i) {
        const char h = start + i < src_.size() ? src_[start + i] : 0;
        int d = is_digit(h) ? h - '0' : ((h | 0x20) >= 'a' && (h | 0x20) <= 'f') ? (h | 0x20) - 'a' + 10 : -1;
        if (d < 0) error("invalid \\x, \\u or \\U escape in a string literal", q);
        v = v * 16 + d;
      }
      return v;
    };
    switch (e) {
      case '\n': return q + 2;
      case '\\': out += '\\'; return q + 2;
      case '\'': out += '\''; return q + 2;
      case '"': out += '"'; return q + 2;
      case 'a': out += '\a'; return q + 2;
      case 'b': out += '\b'; return q + 2;
      case 'f': out += '\f'; return q + 2;
      case 'n': out += '\n'; return q + 2;
      case 'r': out += '\r'; return q + 2;
      case 't': out += '\t'; return q + 2;
      case 'v': out += '\v'; return q + 2;
      case 'x': utf8_append(out, hex(q + 2, 2)); return q + 4;
      case 'u': utf8_append(out, hex(q + 2, 4)); return q + 6;
      case 'U': {
        const char32_t cp = hex(q + 2, 8);
        if (cp > 0x10ffff) error("invalid \\U escape in a string literal", q);
        utf8_append(out, cp);
        return q + 10;
      }
      default:
        if (e >= '0' && e <= '7') {
          char32_t v = 0;
          size_t r = q + 1;
          for (int i = 0; i < 3 && r < src_.size() && src_[r] >= '0' && src_[r] <= '7'; ++i, ++r) v = v * 8 + (src_[r] - '0');
          utf8_append(out, v);
          return r;
        }
        out += '\\';
        return q + 1;
    }
  }

  size_t lex_tag_token(size_t p, std::vector<char>& balance) {
    const char c = src_[p];
    if (is_digit(c)) return lex_number(p);
    if (is_name_start(c)) {
      size_t q = p;
      while (q < src_.size() && is_name_char(src_[q])) ++q;
      push(TokenType::kName, src_.substr(p, q - p), p);
      return q;
    }
    if (c == '\'' || c == '"') return lex_string(p);
    static constexpr const char* kTwo[] = {"//", "**", "==", "!=", "<=", ">="};
    for (const char* op : kTwo)
      if (starts_with(src_, p, op)) {
        push(TokenType::kOperator, op, p);
        return p + 2;
      }
    if (!std::strchr("+-/*%~[](){}<>=.:|,;", c)) error(fmt::format("unexpected char '{}' at {}", c, p), p);
    if (c == '(' || c == '[' || c == '{') {
      balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    } else if (c == ')' || c == ']' || c == '}') {
      if (balance.empty()) error(fmt::format("unexpected '{}'", c), p);
      if (balance.back() != c) error(fmt::format("unexpected '{}', expected '{}'", c, balance.back()), p);
      balance.pop_back();
    }
    push(TokenType::kOperator, std::string(1, c), p);
    return p + 1;
  }

  std::string src_;
  size_t pos_ = 0;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
  std::vector<size_t> newlines_;  // positions of '\n', for line numbers
  bool newlines_ready_ = false;
};

}  // namespace

std::vector<Token> lex_template(std::string_view source) { return Lexer(source).run(); }

}  // namespace tern::jinja
