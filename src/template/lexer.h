// Tokenizer reproducing Jinja2's lexer as transformers configures it (trim_blocks, lstrip_blocks, default
// delimiters, keep_trailing_newline off): the same whitespace control, raw blocks and line numbers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tern::jinja {

enum class TokenType { kData, kVariableBegin, kVariableEnd, kBlockBegin, kBlockEnd, kName, kString, kInteger,
                       kFloat, kOperator, kEof };

struct Token {
  TokenType type;
  std::string value;  // text, name, decoded string literal or operator
  int line = 1;
  int64_t int_value = 0;
  double float_value = 0.0;
};

// Throws TemplateFailure (with the line) on lexical errors.
std::vector<Token> lex_template(std::string_view source);

}  // namespace tern::jinja
