#include "tokenizer/pre_tokenizer.h"

#include <algorithm>
#include <optional>

#include "tokenizer/json_fields.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace tern {
namespace {

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Span {
  size_t start, end;
  bool is_match;
};

// Turns the alternating match / non-match spans of `piece` into pieces, as NormalizedString::split does.
void split_emit(Piece&& piece, const std::vector<Span>& spans, SplitBehavior behavior, std::vector<Piece>& out) {
  std::vector<Span> kept;
  kept.reserve(spans.size());
  bool previous_match = false;
  if (behavior == SplitBehavior::kMergedWithNext) {
    for (size_t k = spans.size(); k-- > 0;) {
      const Span& s = spans[k];
      if (s.is_match && !previous_match && !kept.empty()) kept.back().start = s.start;
      else kept.push_back({s.start, s.end, false});
      previous_match = s.is_match;
    }
    std::reverse(kept.begin(), kept.end());
  } else {
    for (const Span& s : spans) {
      const bool merge = (behavior == SplitBehavior::kContiguous && s.is_match == previous_match) ||
                         (behavior == SplitBehavior::kMergedWithPrevious && s.is_match && !previous_match);
      if (merge && !kept.empty()) kept.back().end = s.end;
      else kept.push_back({s.start, s.end, behavior == SplitBehavior::kRemoved && s.is_match});
      previous_match = s.is_match;
    }
  }
  if (kept.size() == 1 && !kept[0].is_match && kept[0].start == 0 && kept[0].end == piece.text.size()) {
    if (!piece.text.empty()) out.push_back(std::move(piece));
    return;
  }
  for (const Span& s : kept) {
    if (s.is_match || s.end == s.start) continue;  // removed delimiters and empty pieces are dropped
    out.push_back(Piece{piece.text.substr(s.start, s.end - s.start), -1, piece.at_start && s.start == 0});
  }
}

// Spans for a character predicate: every matching character is its own match.
template <class Predicate>
std::vector<Span> char_spans(const std::string& text, Predicate&& predicate) {
  std::vector<Span> spans;
  size_t last = 0;
  for (size_t i = 0; i < text.size();) {
    size_t len = 0;
    const char32_t c = utf8_decode_at(text, i, &len);
    if (predicate(c)) {
      if (last < i) spans.push_back({last, i, false});
      spans.push_back({i, i + len, true});
      last = i + len;
    }
    i += len;
  }
  if (last < text.size()) spans.push_back({last, text.size(), false});
  return spans;
}

std::vector<Span> regex_spans(const std::string& text, const Regex& regex, bool invert) {
  std::vector<Span> spans;
  size_t last = 0;
  regex.find_all(text, [&](size_t start, size_t end) {
    if (last < start) spans.push_back({last, start, invert});
    spans.push_back({start, end, !invert});
    last = end;
  });
  if (last < text.size()) spans.push_back({last, text.size(), invert});
  return spans;
}

std::vector<Span> literal_spans(const std::string& text, const std::string& literal, bool invert) {
  std::vector<Span> spans;
  size_t last = 0;
  if (!literal.empty()) {
    for (size_t pos = text.find(literal); pos != std::string::npos; pos = text.find(literal, last)) {
      if (last < pos) spans.push_back({last, pos, invert});
      spans.push_back({pos, pos + literal.size(), !invert});
      last = pos + literal.size();
    }
  }
  if (last < text.size()) spans.push_back({last, text.size(), invert});
  return spans;
}

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(std::optional<Regex> regex, std::string literal, SplitBehavior behavior, bool invert)
      : regex_(std::move(regex)), literal_(std::move(literal)), behavior_(behavior), invert_(invert) {}
  void split(Piece&& piece, std::vector<Piece>& out) const override {
    const auto spans = regex_ ? regex_spans(piece.text, *regex_, invert_) : literal_spans(piece.text, literal_, invert_);
    split_emit(std::move(piece), spans, behavior_, out);
  }
  bool drops_text() const override { return behavior_ == SplitBehavior::kRemoved; }

 private:
  std::optional<Regex> regex_;
  std::string literal_;
  SplitBehavior behavior_;
  bool invert_;
};

// Character-class splits: Digits, Punctuation, WhitespaceSplit, CharDelimiterSplit.
template <class Predicate>
class CharSplitPreTokenizer final : public PreTokenizer {
 public:
  CharSplitPreTokenizer(Predicate predicate, SplitBehavior behavior) : predicate_(predicate), behavior_(behavior) {}
  void split(Piece&& piece, std::vector<Piece>& out) const override {
    split_emit(std::move(piece), char_spans(piece.text, predicate_), behavior_, out);
  }
  bool drops_text() const override { return behavior_ == SplitBehavior::kRemoved; }

 private:
  Predicate predicate_;
  SplitBehavior behavior_;
};

template <class Predicate>
std::unique_ptr<PreTokenizer> make_char_split(Predicate predicate, SplitBehavior behavior) {
  return std::make_unique<CharSplitPreTokenizer<Predicate>>(predicate, behavior);
}

// GPT-2's own pattern, used by ByteLevel when use_regex is true.
constexpr const char* kByteLevelPattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::optional<Regex> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}
  void split(Piece&& piece, std::vector<Piece>& out) const override {
    if (add_prefix_space_ && (piece.text.empty() || piece.text[0] != ' ')) piece.text.insert(0, " ");
    const size_t first = out.size();
    if (regex_) {
      split_emit(std::move(piece), regex_spans(piece.text, *regex_, false), SplitBehavior::kIsolated, out);
    } else if (!piece.text.empty()) {
      out.push_back(std::move(piece));
    }
    std::string mapped;
    for (size_t k = first; k < out.size(); ++k) {
      mapped.clear();
      byte_level_encode(out[k].text, mapped);
      out[k].text.swap(mapped);
    }
  }
  bool byte_level() const override { return true; }

 private:
  bool add_prefix_space_;
  std::optional<Regex> regex_;
};

enum class PrependScheme { kAlways, kFirst, kNever };

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void split(Piece&& piece, std::vector<Piece>& out) const override {
    std::string text;
    text.reserve(piece.text.size() + replacement_.size());
    for (const char ch : piece.text) {
      if (ch == ' ') text.append(replacement_);
      else text.push_back(ch);
    }
    const bool starts = text.compare(0, replacement_.size(), replacement_) == 0;
    if (!starts && (scheme_ == PrependScheme::kAlways || (scheme_ == PrependScheme::kFirst && piece.at_start))) {
      text.insert(0, replacement_);
    }
    piece.text = std::move(text);
    if (!split_) {
      if (!piece.text.empty()) out.push_back(std::move(piece));
      return;
    }
    const auto spans = literal_spans(piece.text, replacement_, false);
    split_emit(std::move(piece), spans, SplitBehavior::kMergedWithNext, out);
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  void split(Piece&& piece, std::vector<Piece>& out) const override {
    std::vector<Piece> current;
    current.push_back(std::move(piece));
    apply(current);
    for (auto& p : current) out.push_back(std::move(p));
  }
  void apply(std::vector<Piece>& pieces) const override {
    for (const auto& step : steps_) step->apply(pieces);
  }
  bool drops_text() const override {
    return std::any_of(steps_.begin(), steps_.end(), [](const auto& s) { return s->drops_text(); });
  }
  bool byte_level() const override {
    return std::any_of(steps_.begin(), steps_.end(), [](const auto& s) { return s->byte_level(); });
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

Expected<SplitBehavior> behavior_from_json(const nlohmann::json& json, SplitBehavior fallback) {
  const auto it = json.find("behavior");
  if (it == json.end() || it->is_null()) return fallback;
  const std::string name = it->is_string() ? it->get<std::string>() : "";
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  return make_error("unknown split behavior {} (expected Removed, Isolated, MergedWithPrevious, MergedWithNext or "
                    "Contiguous)",
                    it->dump());
}

Expected<std::unique_ptr<PreTokenizer>> split_from_json(const nlohmann::json& json) {
  bool is_regex = false;
  TERN_ASSIGN_OR_RETURN(std::string pattern, json_pattern(json, "pattern", &is_regex));
  TERN_ASSIGN_OR_RETURN(SplitBehavior behavior, behavior_from_json(json, SplitBehavior::kIsolated));
  TERN_ASSIGN_OR_RETURN(bool invert, json_bool(json, "invert", false));
  std::optional<Regex> regex;
  if (is_regex) {
    TERN_ASSIGN_OR_RETURN(regex, Regex::compile(pattern));
  }
  return std::make_unique<SplitPreTokenizer>(std::move(regex), is_regex ? "" : pattern, behavior, invert);
}

Expected<std::unique_ptr<PreTokenizer>> byte_level_from_json(const nlohmann::json& json) {
  TERN_ASSIGN_OR_RETURN(bool add_prefix_space, json_bool(json, "add_prefix_space", true));
  TERN_ASSIGN_OR_RETURN(bool use_regex, json_bool(json, "use_regex", true));
  std::optional<Regex> regex;
  if (use_regex) {
    TERN_ASSIGN_OR_RETURN(regex, Regex::compile(kByteLevelPattern));
  }
  return std::make_unique<ByteLevelPreTokenizer>(add_prefix_space, std::move(regex));
}

Expected<std::unique_ptr<PreTokenizer>> metaspace_from_json(const nlohmann::json& json) {
  TERN_ASSIGN_OR_RETURN(std::string replacement, json_string(json, "replacement"));
  TERN_ASSIGN_OR_RETURN(bool split, json_bool(json, "split", true));
  TERN_ASSIGN_OR_RETURN(bool add_prefix_space, json_bool(json, "add_prefix_space", true));
  PrependScheme scheme = PrependScheme::kAlways;
  if (const auto it = json.find("prepend_scheme"); it != json.end() && !it->is_null()) {
    const std::string name = it->is_string() ? it->get<std::string>() : "";
    if (name == "always") scheme = PrependScheme::kAlways;
    else if (name == "first") scheme = PrependScheme::kFirst;
    else if (name == "never") scheme = PrependScheme::kNever;
    else return make_error("unknown prepend_scheme {} (expected always, first or never)", it->dump());
  }
  if (!add_prefix_space) scheme = PrependScheme::kNever;
  return std::make_unique<MetaspacePreTokenizer>(std::move(replacement), scheme, split);
}

Expected<std::unique_ptr<PreTokenizer>> sequence_from_json(const nlohmann::json& json) {
  TERN_ASSIGN_OR_RETURN(auto steps, json_component_list<PreTokenizer>(json, "pretokenizers", "pre-tokenizer", pre_tokenizer_from_json));
  return std::make_unique<SequencePreTokenizer>(std::move(steps));
}

}  // namespace

void PreTokenizer::apply(std::vector<Piece>& pieces) const {
  std::vector<Piece> out;
  out.reserve(pieces.size() * 2);
  for (auto& piece : pieces) {
    if (piece.token_id >= 0) out.push_back(std::move(piece));
    else split(std::move(piece), out);
  }
  pieces.swap(out);
}

Expected<std::unique_ptr<PreTokenizer>> pre_tokenizer_from_json(const nlohmann::json& json) {
  if (json.is_null()) return std::unique_ptr<PreTokenizer>();
  TERN_ASSIGN_OR_RETURN(std::string type, json_type(json));
  if (type == "Split") return split_from_json(json);
  if (type == "ByteLevel") return byte_level_from_json(json);
  if (type == "Metaspace") return metaspace_from_json(json);
  if (type == "Sequence") return sequence_from_json(json);
  if (type == "Digits") {
    TERN_ASSIGN_OR_RETURN(bool individual, json_bool(json, "individual_digits", false));
    return make_char_split(unicode_is_numeric, individual ? SplitBehavior::kIsolated : SplitBehavior::kContiguous);
  }
  if (type == "Punctuation") {
    TERN_ASSIGN_OR_RETURN(SplitBehavior behavior, behavior_from_json(json, SplitBehavior::kIsolated));
    return make_char_split(unicode_is_punctuation, behavior);
  }
  if (type == "WhitespaceSplit") return make_char_split(unicode_is_whitespace, SplitBehavior::kRemoved);
  if (type == "Whitespace") {
    TERN_ASSIGN_OR_RETURN(Regex regex, Regex::compile(R"(\w+|[^\w\s]+)"));
    return std::make_unique<SplitPreTokenizer>(std::move(regex), "", SplitBehavior::kRemoved, true);
  }
  if (type == "CharDelimiterSplit") {
    TERN_ASSIGN_OR_RETURN(std::string delimiter, json_string(json, "delimiter"));
    size_t len = 0;
    if (delimiter.empty() || utf8_decode_at(delimiter, 0, &len) == 0 || len != delimiter.size()) {
      return make_error("CharDelimiterSplit delimiter must be one character, got '{}'", delimiter);
    }
    const char32_t c = utf8_decode_at(delimiter, 0, &len);
    return make_char_split([c](char32_t x) { return x == c; }, SplitBehavior::kRemoved);
  }
  return make_error("unsupported pre_tokenizer type '{}' (supported: Split, ByteLevel, Metaspace, Digits, "
                    "Punctuation, Whitespace, WhitespaceSplit, CharDelimiterSplit, Sequence)",
                    type);
}

}  // namespace tern
