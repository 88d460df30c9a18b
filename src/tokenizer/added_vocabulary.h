// Added tokens (tokenizer.json "added_tokens"): found in the text before the model runs, leftmost first and
// longest at a position, honouring single_word / lstrip / rstrip like the Rust AddedVocabulary.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/pre_tokenizer.h"

namespace tern {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

// A byte trie over token strings.
class TokenTrie {
 public:
  void insert(std::string_view pattern, int32_t value);
  bool empty() const { return nodes_.size() <= 1; }
  // Leftmost match at or after `from`, longest at that position; false when there is none.
  bool find(std::string_view text, size_t from, size_t* start, size_t* end, int32_t* value) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
    int32_t value = -1;
  };
  int32_t child(int32_t node, unsigned char byte) const;
  std::vector<Node> nodes_ = std::vector<Node>(1);
  bool first_byte_[256] = {};
};

class AddedVocabulary {
 public:
  // `normalized_contents[i]` is tokens[i].content after the tokenizer's normalizer (used when normalized is set).
  AddedVocabulary(std::vector<AddedToken> tokens, const std::vector<std::string>& normalized_contents);
  AddedVocabulary() = default;

  // Splits `piece` on tokens with normalized == false (raw) or true (normalized), appending to `out`.
  void split(Piece&& piece, bool normalized, std::vector<Piece>& out) const;
  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  std::vector<AddedToken> tokens_;
  TokenTrie raw_trie_;
  TokenTrie normalized_trie_;
};

}  // namespace tern
