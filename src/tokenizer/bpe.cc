#include "tokenizer/bpe.h"

#include <algorithm>
#include <array>
#include <mutex>

#include "tokenizer/json_fields.h"
#include "tokenizer/unicode.h"

namespace tern {

// Word -> ids, sharded so concurrent encoders rarely contend. A full shard is simply cleared: the cache only
// saves work, it never changes results.
struct BpeModel::Cache {
  static constexpr size_t kShards = 64;
  static constexpr size_t kEntriesPerShard = 4096;
  static constexpr size_t kMaxWordBytes = 256;
  struct Shard {
    std::mutex mutex;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> entries;
  };
  std::array<Shard, kShards> shards;
};

Expected<BpeModel> BpeModel::from_json(const nlohmann::json& model) {
  TERN_ASSIGN_OR_RETURN(std::string type, json_string(model, "type"));
  if (type != "BPE") return make_error("model.type is '{}'; only BPE models are supported", type);
  BpeModel bpe;
  const auto vocab = model.find("vocab");
  if (vocab == model.end() || !vocab->is_object()) return make_error("model.vocab must be an object");
  int64_t max_id = -1;
  for (const auto& [token, id] : vocab->items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= kTokenizerMaxId) {
      return make_error("model.vocab['{}'] must be a non-negative integer id below {} (tern's limit)", token,
                        kTokenizerMaxId);
    }
    bpe.vocab_.emplace(token, id.get<int32_t>());
    max_id = std::max<int64_t>(max_id, id.get<int64_t>());
  }
  bpe.id_to_token_.resize(static_cast<size_t>(max_id + 1));
  bpe.id_present_.resize(static_cast<size_t>(max_id + 1));
  for (const auto& [token, id] : bpe.vocab_) {
    bpe.id_to_token_[id] = token;
    bpe.id_present_[id] = true;
  }
  auto optional_string = [&](const char* key) -> std::string {
    const auto it = model.find(key);
    return it != model.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  bpe.continuing_subword_prefix_ = optional_string("continuing_subword_prefix");
  bpe.end_of_word_suffix_ = optional_string("end_of_word_suffix");
  if (const std::string unk = optional_string("unk_token"); !unk.empty()) {
    const auto it = bpe.vocab_.find(unk);
    if (it == bpe.vocab_.end()) return make_error("model.unk_token '{}' is not in the vocabulary", unk);
    bpe.unk_id_ = it->second;
  }
  TERN_ASSIGN_OR_RETURN(bpe.fuse_unk_, json_bool(model, "fuse_unk", false));
  TERN_ASSIGN_OR_RETURN(bpe.byte_fallback_, json_bool(model, "byte_fallback", false));
  TERN_ASSIGN_OR_RETURN(bpe.ignore_merges_, json_bool(model, "ignore_merges", false));
  if (const auto dropout = model.find("dropout"); dropout != model.end() && !dropout->is_null()) {
    if (!dropout->is_number() || (dropout->get<double>() != 0.0 && dropout->get<double>() != 1.0)) {
      return make_error("model.dropout {} is not supported (encoding must be deterministic)", dropout->dump());
    }
  }
  const auto merges = model.find("merges");
  if (merges != model.end() && !merges->is_null()) {
    TERN_TRY(bpe.load_merges(*merges));
  }
  bpe.cache_ = std::make_shared<Cache>();
  return bpe;
}

Expected<void> BpeModel::load_merges(const nlohmann::json& merges) {
  if (!merges.is_array()) return make_error("model.merges must be a list");
  merges_.reserve(merges.size());
  std::string left, right;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& merge = merges[rank];
    if (merge.is_string()) {
      // The reference splits on every space and wants exactly two parts.
      const std::string& line = merge.get_ref<const std::string&>();
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        return make_error("model.merges[{}] '{}' must be two tokens separated by one space", rank, line);
      }
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      left = merge[0].get<std::string>();
      right = merge[1].get<std::string>();
    } else {
      return make_error("model.merges[{}] must be \"a b\" or [\"a\", \"b\"], got {}", rank, merge.dump());
    }
    const auto a = vocab_.find(left), b = vocab_.find(right);
    if (a == vocab_.end() || b == vocab_.end()) {
      return make_error("model.merges[{}] names token '{}' that is not in the vocabulary", rank,
                        a == vocab_.end() ? left : right);
    }
    const size_t skip = std::min(continuing_subword_prefix_.size(), right.size());
    const std::string merged = left + right.substr(skip);
    const auto m = vocab_.find(merged);
    if (m == vocab_.end()) {
      return make_error("model.merges[{}] produces token '{}' that is not in the vocabulary", rank, merged);
    }
    // Like the reference's HashMap collect, a repeated pair keeps the last rank.
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(a->second)) << 32) | static_cast<uint32_t>(b->second);
    merges_[key] = Merge{static_cast<int32_t>(rank), m->second};
  }
  return {};
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  const auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size() || !id_present_[id]) return nullptr;
  return &id_to_token_[id];
}

const BpeModel::Merge* BpeModel::find_merge(int32_t left, int32_t right) const {
  const auto it = merges_.find((static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right));
  return it == merges_.end() ? nullptr : &it->second;
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (const auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= Cache::kMaxWordBytes;
  auto& shard = cache_->shards[StringHash{}(word) % Cache::kShards];
  if (cacheable) {
    std::lock_guard<std::mutex> lock(shard.mutex);
    if (const auto it = shard.entries.find(word); it != shard.entries.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::vector<int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
    std::lock_guard<std::mutex> lock(shard.mutex);
    if (shard.entries.size() >= Cache::kEntriesPerShard) shard.entries.clear();
    shard.entries.emplace(std::string(word), std::move(ids));
  }
}

}  // namespace tern

namespace tern {

std::optional<size_t> BpeModel::max_bytes_per_token(bool byte_level_input) const {
  size_t longest = 4;  // an unknown token stands for one character
  for (const auto& [token, id] : vocab_) longest = std::max(longest, token.size());
  auto has_all = [&](auto&& name_of) {
    for (int b = 0; b < 256; ++b) {
      if (!vocab_.contains(name_of(b))) return false;
    }
    return true;
  };
  if (byte_fallback_ && has_all([](int b) { return fmt::format("<0x{:02X}>", b); })) return longest;
  if (unk_id_ && !fuse_unk_) return longest;
  const bool plain = continuing_subword_prefix_.empty() && end_of_word_suffix_.empty();
  if (byte_level_input && plain && has_all([](int b) { return byte_level_alphabet().byte_to_utf8[b]; })) {
    return longest;
  }
  return std::nullopt;
}

void BpeModel::initial_symbols(std::string_view word, std::vector<int32_t>& ids, std::vector<uint32_t>& lengths) const {
  std::optional<std::pair<int32_t, uint32_t>> unk;  // pending unknown run: id, bytes
  std::string piece;
  for (size_t i = 0; i < word.size();) {
    const size_t len = std::min(utf8_sequence_length(static_cast<unsigned char>(word[i])), word.size() - i);
    piece.clear();
    if (i > 0) piece.append(continuing_subword_prefix_);
    piece.append(word.substr(i, len));
    if (i + len == word.size()) piece.append(end_of_word_suffix_);
    i += len;
    if (const auto it = vocab_.find(piece); it != vocab_.end()) {
      if (unk) ids.push_back(unk->first), lengths.push_back(unk->second), unk.reset();
      ids.push_back(it->second);
      lengths.push_back(static_cast<uint32_t>(len));
      continue;
    }
    if (byte_fallback_) {
      std::vector<int32_t> bytes;
      for (const char ch : piece) {
        const auto it = vocab_.find(fmt::format("<0x{:02X}>", static_cast<unsigned char>(ch)));
        if (it == vocab_.end()) break;
        bytes.push_back(it->second);
      }
      if (bytes.size() == piece.size()) {
        // The reference does not flush a pending unknown run here; it is emitted with the next known character.
        for (const int32_t id : bytes) ids.push_back(id), lengths.push_back(1);
        continue;
      }
    }
    if (!unk_id_) continue;  // the reference fails the whole encode here; tern drops the character
    if (unk && fuse_unk_) {
      unk->second += static_cast<uint32_t>(len);
    } else {
      if (unk) ids.push_back(unk->first), lengths.push_back(unk->second);
      unk = std::make_pair(*unk_id_, static_cast<uint32_t>(len));
    }
  }
  if (unk) ids.push_back(unk->first), lengths.push_back(unk->second);
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id, prev, next;
    bool alive;
  };
  struct Candidate {
    int32_t rank, pos, new_id;
    bool operator<(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }  // min-heap
  };
  thread_local std::vector<int32_t> ids;
  thread_local std::vector<uint32_t> lengths;
  thread_local std::vector<Symbol> symbols;
  thread_local std::vector<Candidate> heap;
  ids.clear();
  lengths.clear();
  initial_symbols(word, ids, lengths);
  const int32_t n = static_cast<int32_t>(ids.size());
  symbols.clear();
  heap.clear();
  for (int32_t i = 0; i < n; ++i) symbols.push_back({ids[i], i - 1, i + 1 < n ? i + 1 : -1, true});
  auto push_pair = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    if (const Merge* m = find_merge(symbols[pos].id, symbols[next].id)) {
      heap.push_back({m->rank, pos, m->new_id});
      std::push_heap(heap.begin(), heap.end());
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    const Merge* current = find_merge(left.id, symbols[left.next].id);
    if (current == nullptr || current->new_id != top.new_id) continue;  // stale entry
    Symbol& right = symbols[left.next];
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(top.pos);
  }
  for (int32_t i = 0; i < n && i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
}

}  // namespace tern
