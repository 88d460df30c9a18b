// Internal state of a loaded Tokenizer, shared by tokenizer.cc (encode/decode) and tokenizer_load.cc (parsing).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tokenizer/added_vocabulary.h"
#include "tokenizer/bpe.h"
#include "tokenizer/decoder.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace tern {

// One post-processing step for a single sequence: its items in order, where nullopt stands for the sequence
// itself and a list of ids for template tokens. A Sequence post-processor is several steps.
using PostProcessStep = std::vector<std::optional<std::vector<int32_t>>>;

struct Tokenizer::Impl {
  BpeModel model;
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Decoder> decoder;
  std::vector<PostProcessStep> post_process;
  AddedVocabulary added;
  std::unordered_map<int32_t, std::string> added_id_to_token;
  TokenMap added_token_to_id;
  std::unordered_set<std::string> special_contents;
  size_t vocab_size = 0;
  std::optional<size_t> max_bytes_per_token;
  std::optional<std::string> chat_template;
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token;

  const std::string* token_of(int32_t id) const;
};

}  // namespace tern
