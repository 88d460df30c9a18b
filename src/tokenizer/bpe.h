// Byte-pair-encoding model of tokenizer.json ("model": {"type": "BPE"}), merging like Rust `tokenizers`' Word:
// lowest merge rank first, leftmost on ties, with a bounded cache of whole-word results.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/error.h"

namespace tern {

// Token ids (the vocabulary's and added tokens') must lie below this: tables are sized by the largest id, so a
// tokenizer.json naming one id near 2^30 would allocate gigabytes (2^24: the largest vocab_size config.json may give).
constexpr int64_t kTokenizerMaxId = int64_t{1} << 24;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  static Expected<BpeModel> from_json(const nlohmann::json& model);

  // Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(int32_t id) const;  // nullptr when the id is not in the vocabulary
  const TokenMap& vocab() const { return vocab_; }
  // The most bytes of a pre-tokenized word one token stands for, or nullopt when some input can be dropped or
  // fused without bound: a character with no token (no byte fallback, no unknown token, or `byte_level_input`
  // without the whole byte-level alphabet in the vocabulary) is dropped, and fuse_unk folds a run of any length
  // into one token.
  std::optional<size_t> max_bytes_per_token(bool byte_level_input) const;

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  struct Cache;

  Expected<void> load_merges(const nlohmann::json& merges);
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;
  void initial_symbols(std::string_view word, std::vector<int32_t>& ids, std::vector<uint32_t>& lengths) const;
  const Merge* find_merge(int32_t left, int32_t right) const;

  TokenMap vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> id_present_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_id_;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::shared_ptr<Cache> cache_;
};

}  // namespace tern
