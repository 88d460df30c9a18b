#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tokenizer/unicode.h"

namespace tern {

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

namespace {

// Per-thread match state: one match-data block and a JIT stack large enough for long whitespace runs.
// Regex objects are shared between threads, so nothing mutable may live in them.
struct MatchScratch {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* jit_stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
  MatchScratch() { pcre2_jit_stack_assign(context, nullptr, jit_stack); }
  ~MatchScratch() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

MatchScratch& match_scratch() {
  thread_local MatchScratch scratch;
  return scratch;
}

// Oniguruma's Unicode \w (the reference's engine) is Alphabetic + Mark + Decimal_Number + Connector_Punctuation +
// Join_Control, while PCRE2 10.42's is only letters, numbers and '_'. The difference shows on decomposed text
// (NFD), so \w and \W are rewritten into explicit classes. Alphabetic symbols outside L/Nl/M are the circled
// and squared Latin letters.
constexpr std::string_view kWordClass =
    R"(\p{L}\p{Nl}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}\x{24B6}-\x{24E9}\x{1F130}-\x{1F149}\x{1F150}-\x{1F169}\x{1F170}-\x{1F189})";

std::string rewrite_word_classes(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size());
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[++i];
      if (next == 'w') {
        out += in_class ? std::string(kWordClass) : "[" + std::string(kWordClass) + "]";
      } else if (next == 'W' && !in_class) {
        out += "[^" + std::string(kWordClass) + "]";
      } else {
        out += c;
        out += next;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' (or '^]') right after the opening bracket is a literal, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

Expected<Regex> Regex::compile(std::string_view pattern) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  const std::string rewritten = rewrite_word_classes(pattern);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return make_error("invalid regex '{}' at offset {}: {}", pattern, error_offset,
                      reinterpret_cast<const char*>(message));
  }
  auto owned = std::make_shared<Code>();
  owned->code = code;
  // Without JIT the interpreter still gives identical results, only slower, so a JIT failure is not an error.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  Regex regex;
  regex.code_ = std::move(owned);
  regex.pattern_ = std::string(pattern);
  return regex;
}

bool Regex::search(std::string_view text, size_t pos, size_t* start, size_t* end) const {
  MatchScratch& scratch = match_scratch();
  const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos,
                             PCRE2_NO_UTF_CHECK, scratch.data, scratch.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  // rc == 0 only means the one-pair vector had no room for capture groups; the whole match is still there.
  TERN_CHECK(rc >= 0, "pcre2_match failed with code {} on pattern '{}'", rc, pattern_);
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(scratch.data);
  *start = ovector[0];
  *end = ovector[1];
  return true;
}

size_t Regex::utf8_step(std::string_view text, size_t pos) {
  return utf8_sequence_length(static_cast<unsigned char>(text[pos]));
}

std::string replace_matches(std::string_view text, const std::optional<Regex>& regex, std::string_view literal,
                            std::string_view content) {
  std::string out;
  size_t last = 0;
  auto on_match = [&](size_t start, size_t end) {
    out.append(text, last, start - last);
    out.append(content);
    last = end;
  };
  if (regex) {
    regex->find_all(text, on_match);
  } else if (!literal.empty()) {
    for (size_t pos = text.find(literal); pos != std::string_view::npos; pos = text.find(literal, last)) {
      on_match(pos, pos + literal.size());
    }
  }
  out.append(text, last, std::string_view::npos);
  return out;
}

}  // namespace tern
