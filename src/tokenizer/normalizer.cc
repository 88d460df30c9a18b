#include "tokenizer/normalizer.h"

#include <algorithm>
#include <vector>

#include "tokenizer/json_fields.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace tern {
namespace {

class UnicodeNormalizer final : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalForm form) : form_(form) {}
  void normalize(std::string& text) const override { text = unicode_normalize(text, form_); }
  size_t shrink_factor() const override { return 3; }

 private:
  NormalForm form_;
};

class LowercaseNormalizer final : public Normalizer {
 public:
  void normalize(std::string& text) const override { text = unicode_lowercase(text); }
  size_t shrink_factor() const override { return 3; }
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  void normalize(std::string& text) const override {
    if (!text.empty()) text.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

class StripNormalizer final : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void normalize(std::string& text) const override {
    size_t begin = 0, end = text.size();
    size_t len = 0;
    while (left_ && begin < end && unicode_is_whitespace(utf8_decode_at(text, begin, &len))) begin += len;
    while (right_ && end > begin) {
      size_t start = end - 1;
      while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
      if (!unicode_is_whitespace(utf8_decode_at(text, start, &len))) break;
      end = start;
    }
    text = text.substr(begin, end - begin);
  }
  size_t shrink_factor() const override { return left_ || right_ ? 0 : 1; }

 private:
  bool left_, right_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(std::optional<Regex> regex, std::string literal, std::string content)
      : regex_(std::move(regex)), literal_(std::move(literal)), content_(std::move(content)) {}
  void normalize(std::string& text) const override { text = replace_matches(text, regex_, literal_, content_); }
  size_t shrink_factor() const override {
    if (regex_ || content_.empty()) return 0;  // a regex match has no bounded length
    return std::max<size_t>(1, (literal_.size() + content_.size() - 1) / content_.size());
  }

 private:
  std::optional<Regex> regex_;
  std::string literal_;
  std::string content_;
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  void normalize(std::string& text) const override {
    for (const auto& step : steps_) step->normalize(text);
  }
  size_t shrink_factor() const override {
    size_t factor = 1;
    for (const auto& step : steps_) {
      // Past 2^20 the bound is useless anyway; call it unbounded rather than overflow.
      if (step->shrink_factor() == 0 || __builtin_mul_overflow(factor, step->shrink_factor(), &factor) ||
          factor > (size_t{1} << 20)) {
        return 0;
      }
    }
    return factor;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

Expected<std::unique_ptr<Normalizer>> replace_from_json(const nlohmann::json& json) {
  bool is_regex = false;
  TERN_ASSIGN_OR_RETURN(std::string pattern, json_pattern(json, "pattern", &is_regex));
  TERN_ASSIGN_OR_RETURN(std::string content, json_string(json, "content"));
  std::optional<Regex> regex;
  if (is_regex) {
    TERN_ASSIGN_OR_RETURN(regex, Regex::compile(pattern));
  }
  return std::make_unique<ReplaceNormalizer>(std::move(regex), is_regex ? "" : pattern, std::move(content));
}

Expected<std::unique_ptr<Normalizer>> sequence_from_json(const nlohmann::json& json) {
  TERN_ASSIGN_OR_RETURN(auto steps, json_component_list<Normalizer>(json, "normalizers", "normalizer", normalizer_from_json));
  return std::make_unique<SequenceNormalizer>(std::move(steps));
}

}  // namespace

Expected<std::unique_ptr<Normalizer>> normalizer_from_json(const nlohmann::json& json) {
  if (json.is_null()) return std::unique_ptr<Normalizer>();
  TERN_ASSIGN_OR_RETURN(std::string type, json_type(json));
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfc);
  if (type == "NFD") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfd);
  if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfkc);
  if (type == "NFKD") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfkd);
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "Prepend") {
    TERN_ASSIGN_OR_RETURN(std::string prefix, json_string(json, "prepend"));
    return std::make_unique<PrependNormalizer>(std::move(prefix));
  }
  if (type == "Strip") {
    TERN_ASSIGN_OR_RETURN(bool left, json_bool(json, "strip_left", true));
    TERN_ASSIGN_OR_RETURN(bool right, json_bool(json, "strip_right", true));
    return std::make_unique<StripNormalizer>(left, right);
  }
  if (type == "Replace") return replace_from_json(json);
  if (type == "Sequence") return sequence_from_json(json);
  return make_error("unsupported normalizer type '{}' (supported: NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Strip, "
                    "Replace, Sequence)",
                    type);
}

}  // namespace tern
