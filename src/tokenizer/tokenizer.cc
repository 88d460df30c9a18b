#include "tokenizer/tokenizer.h"

#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace tern {

const std::string* Tokenizer::Impl::token_of(int32_t id) const {
  if (const auto it = added_id_to_token.find(id); it != added_id_to_token.end()) return &it->second;
  return model.id_to_token(id);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& impl = *impl_;
  std::vector<Piece> pieces;
  {
    Piece whole{utf8_is_valid(text) ? std::string(text) : utf8_lossy(text), -1, true};
    impl.added.split(std::move(whole), /*normalized=*/false, pieces);
  }
  // Only the text between raw added tokens is normalised; normalised added tokens are then found in it.
  std::vector<Piece> normalized_pieces;
  normalized_pieces.reserve(pieces.size());
  for (auto& piece : pieces) {
    if (piece.token_id >= 0) {
      normalized_pieces.push_back(std::move(piece));
      continue;
    }
    if (impl.normalizer) impl.normalizer->normalize(piece.text);
    impl.added.split(std::move(piece), /*normalized=*/true, normalized_pieces);
  }
  if (impl.pre_tokenizer) impl.pre_tokenizer->apply(normalized_pieces);
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  for (const auto& piece : normalized_pieces) {
    if (piece.token_id >= 0) ids.push_back(piece.token_id);
    else impl.model.tokenize(piece.text, ids);
  }
  if (add_special_tokens) {
    for (const PostProcessStep& step : impl.post_process) {
      std::vector<int32_t> next;
      for (const auto& item : step) {
        if (item) next.insert(next.end(), item->begin(), item->end());
        else next.insert(next.end(), ids.begin(), ids.end());
      }
      ids.swap(next);
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& impl = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int32_t id : ids) {
    const std::string* token = impl.token_of(id);
    if (token == nullptr) continue;
    if (skip_special_tokens && impl.special_contents.count(*token) > 0) continue;
    tokens.push_back(*token);
  }
  return decoder_run(impl.decoder.get(), std::move(tokens));
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = impl_->added_token_to_id.find(token); it != impl_->added_token_to_id.end()) return it->second;
  return impl_->model.token_to_id(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  const std::string* token = impl_->token_of(id);
  return token ? *token : std::string();
}

size_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

bool Tokenizer::is_special(int32_t id) const {
  const std::string* token = impl_->token_of(id);
  return token != nullptr && impl_->special_contents.count(*token) > 0;
}

std::optional<size_t> Tokenizer::max_bytes_per_token() const { return impl_->max_bytes_per_token; }

std::optional<std::string> Tokenizer::chat_template() const { return impl_->chat_template; }
std::optional<std::string> Tokenizer::bos_token() const { return impl_->bos_token; }
std::optional<std::string> Tokenizer::eos_token() const { return impl_->eos_token; }

}  // namespace tern
