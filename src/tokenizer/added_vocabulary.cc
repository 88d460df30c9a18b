#include "tokenizer/added_vocabulary.h"

#include <algorithm>

#include "tokenizer/unicode.h"

namespace tern {

int32_t TokenTrie::child(int32_t node, unsigned char byte) const {
  const auto& children = nodes_[node].children;
  const auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{-1}));
  return it != children.end() && it->first == byte ? it->second : -1;
}

void TokenTrie::insert(std::string_view pattern, int32_t value) {
  if (pattern.empty()) return;
  first_byte_[static_cast<unsigned char>(pattern[0])] = true;
  int32_t node = 0;
  for (const char ch : pattern) {
    const auto byte = static_cast<unsigned char>(ch);
    int32_t next = child(node, byte);
    if (next < 0) {
      next = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
      auto& children = nodes_[node].children;
      children.insert(std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{-1})),
                      {byte, next});
    }
    node = next;
  }
  // With duplicate contents the first token keeps the pattern, as the reference's matcher does.
  if (nodes_[node].value < 0) nodes_[node].value = value;
}

bool TokenTrie::find(std::string_view text, size_t from, size_t* start, size_t* end, int32_t* value) const {
  for (size_t i = from; i < text.size(); ++i) {
    if (!first_byte_[static_cast<unsigned char>(text[i])]) continue;
    int32_t node = 0;
    size_t best_end = 0;
    for (size_t j = i; j < text.size(); ++j) {
      node = child(node, static_cast<unsigned char>(text[j]));
      if (node < 0) break;
      if (nodes_[node].value >= 0) {
        best_end = j + 1;
        *value = nodes_[node].value;
      }
    }
    if (best_end > 0) {
      *start = i;
      *end = best_end;
      return true;
    }
  }
  return false;
}

AddedVocabulary::AddedVocabulary(std::vector<AddedToken> tokens, const std::vector<std::string>& normalized_contents)
    : tokens_(std::move(tokens)) {
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (tokens_[i].normalized) normalized_trie_.insert(normalized_contents[i], static_cast<int32_t>(i));
    else raw_trie_.insert(tokens_[i].content, static_cast<int32_t>(i));
  }
}

namespace {

char32_t char_before(std::string_view text, size_t pos) {
  size_t start = pos - 1;
  while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
  size_t len = 0;
  return utf8_decode_at(text, start, &len);
}

// Start of the whitespace run that ends at `pos` (regex \s*$ on text[..pos]).
size_t whitespace_run_start(std::string_view text, size_t pos) {
  while (pos > 0) {
    size_t start = pos - 1;
    while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
    size_t len = 0;
    if (!unicode_is_whitespace(utf8_decode_at(text, start, &len))) break;
    pos = start;
  }
  return pos;
}

// End of the whitespace run that starts at `pos` (regex ^\s* on text[pos..]).
size_t whitespace_run_end(std::string_view text, size_t pos) {
  size_t len = 0;
  while (pos < text.size() && unicode_is_whitespace(utf8_decode_at(text, pos, &len))) pos += len;
  return pos;
}

}  // namespace

void AddedVocabulary::split(Piece&& piece, bool normalized, std::vector<Piece>& out) const {
  const TokenTrie& trie = normalized ? normalized_trie_ : raw_trie_;
  const std::string_view text = piece.text;
  size_t start = 0, stop = 0, search = 0, emitted = 0;
  int32_t index = -1;
  bool matched = false;
  while (!trie.empty() && trie.find(text, search, &start, &stop, &index)) {
    search = stop;  // the reference's matcher resumes after the match even when the match is discarded below
    const AddedToken& token = tokens_[index];
    if (token.single_word) {
      size_t len = 0;
      const bool word_before = start > 0 && unicode_is_word(char_before(text, start));
      const bool word_after = stop < text.size() && unicode_is_word(utf8_decode_at(text, stop, &len));
      if (word_before || word_after) continue;
    }
    if (token.lstrip) start = std::max(whitespace_run_start(text, start), emitted);
    if (token.rstrip) stop = whitespace_run_end(text, stop);
    matched = true;
    if (emitted < start) {
      out.push_back(Piece{std::string(text.substr(emitted, start - emitted)), -1, piece.at_start && emitted == 0});
    }
    out.push_back(Piece{std::string(), token.id, false});
    emitted = stop;
  }
  if (!matched) {
    if (!piece.text.empty()) out.push_back(std::move(piece));
    return;
  }
  if (emitted < text.size()) out.push_back(Piece{std::string(text.substr(emitted)), -1, false});
}

}  // namespace tern
