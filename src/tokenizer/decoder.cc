#include "tokenizer/decoder.h"

#include <optional>

#include "tokenizer/json_fields.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace tern {
namespace {

constexpr const char* kReplacementChar = "\xEF\xBF\xBD";

class ByteLevelDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const auto& token : tokens) {
      // A token outside the byte alphabet (an added token such as "<|im_end|>") stands for its own UTF-8 bytes.
      if (auto decoded = byte_level_decode(token)) bytes.append(*decoded);
      else bytes.append(token);
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

std::optional<uint8_t> byte_fallback_value(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return std::nullopt;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(token[3]), lo = hex(token[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<uint8_t>(hi * 16 + lo);
}

class ByteFallbackDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      // A run of byte tokens that is not valid UTF-8 becomes one U+FFFD per byte, as the reference does.
      if (utf8_is_valid(pending)) out.push_back(pending);
      else out.insert(out.end(), pending.size(), kReplacementChar);
      pending.clear();
    };
    for (auto& token : tokens) {
      if (auto byte = byte_fallback_value(token)) {
        pending.push_back(static_cast<char>(*byte));
        continue;
      }
      flush();
      out.push_back(std::move(token));
    }
    flush();
    tokens.swap(out);
  }
};

class FuseDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string joined;
    for (const auto& token : tokens) joined.append(token);
    tokens.assign(1, std::move(joined));
  }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(char32_t content, size_t start, size_t stop) : content_(content), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& token : tokens) {
      std::vector<std::pair<size_t, char32_t>> chars;  // byte offset, character
      for (size_t i = 0, len = 0; i < token.size(); i += len) chars.emplace_back(i, utf8_decode_at(token, i, &len));
      size_t begin = 0, end = chars.size();
      while (begin < start_ && begin < end && chars[begin].second == content_) ++begin;
      size_t stripped = 0;
      while (stripped < stop_ && end > begin && chars[end - 1].second == content_) --end, ++stripped;
      const size_t byte_begin = begin < chars.size() ? chars[begin].first : token.size();
      const size_t byte_end = end < chars.size() ? chars[end].first : token.size();
      token = token.substr(byte_begin, byte_end - byte_begin);
    }
  }

 private:
  char32_t content_;
  size_t start_, stop_;
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(std::optional<Regex> regex, std::string literal, std::string content)
      : regex_(std::move(regex)), literal_(std::move(literal)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& token : tokens) token = replace_matches(token, regex_, literal_, content_);
  }

 private:
  std::optional<Regex> regex_;
  std::string literal_;
  std::string content_;
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, bool strip_first) : replacement_(std::move(replacement)), strip_first_(strip_first) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      // The reference drops every replacement character of the first token, not only a leading one.
      const std::string with = (i == 0 && strip_first_) ? std::string() : std::string(" ");
      std::string out;
      const std::string& token = tokens[i];
      size_t last = 0;
      for (size_t pos = token.find(replacement_); pos != std::string::npos; pos = token.find(replacement_, last)) {
        out.append(token, last, pos - last);
        out.append(with);
        last = pos + replacement_.size();
      }
      out.append(token, last, std::string::npos);
      tokens[i].swap(out);
    }
  }

 private:
  std::string replacement_;
  bool strip_first_;
};

class BpeSuffixDecoder final : public Decoder {
 public:
  explicit BpeSuffixDecoder(std::string suffix) : suffix_(std::move(suffix)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size() && !suffix_.empty(); ++i) {
      const std::string with = i + 1 == tokens.size() ? "" : " ";
      std::string& token = tokens[i];
      for (size_t pos = token.find(suffix_); pos != std::string::npos; pos = token.find(suffix_, pos + with.size())) {
        token.replace(pos, suffix_.size(), with);
      }
    }
  }

 private:
  std::string suffix_;
};

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& step : steps_) step->decode_chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

Expected<std::unique_ptr<Decoder>> strip_from_json(const nlohmann::json& json) {
  TERN_ASSIGN_OR_RETURN(std::string content, json_string(json, "content"));
  TERN_ASSIGN_OR_RETURN(int64_t start, json_int(json, "start", 0));
  TERN_ASSIGN_OR_RETURN(int64_t stop, json_int(json, "stop", 0));
  size_t len = 0;
  if (content.empty() || (utf8_decode_at(content, 0, &len), len != content.size()) || start < 0 || stop < 0) {
    return make_error("Strip decoder needs one 'content' character and non-negative 'start'/'stop'");
  }
  return std::make_unique<StripDecoder>(utf8_decode_at(content, 0, &len), static_cast<size_t>(start),
                                        static_cast<size_t>(stop));
}

Expected<std::unique_ptr<Decoder>> replace_from_json(const nlohmann::json& json) {
  bool is_regex = false;
  TERN_ASSIGN_OR_RETURN(std::string pattern, json_pattern(json, "pattern", &is_regex));
  TERN_ASSIGN_OR_RETURN(std::string content, json_string(json, "content"));
  std::optional<Regex> regex;
  if (is_regex) {
    TERN_ASSIGN_OR_RETURN(regex, Regex::compile(pattern));
  }
  return std::make_unique<ReplaceDecoder>(std::move(regex), is_regex ? "" : pattern, std::move(content));
}

Expected<std::unique_ptr<Decoder>> metaspace_from_json(const nlohmann::json& json) {
  TERN_ASSIGN_OR_RETURN(std::string replacement, json_string(json, "replacement"));
  TERN_ASSIGN_OR_RETURN(bool add_prefix_space, json_bool(json, "add_prefix_space", true));
  bool strip_first = add_prefix_space;
  if (const auto it = json.find("prepend_scheme"); it != json.end() && it->is_string()) {
    strip_first = add_prefix_space && it->get<std::string>() != "never";
  }
  return std::make_unique<MetaspaceDecoder>(std::move(replacement), strip_first);
}

Expected<std::unique_ptr<Decoder>> sequence_from_json(const nlohmann::json& json) {
  TERN_ASSIGN_OR_RETURN(auto steps, json_component_list<Decoder>(json, "decoders", "decoder", decoder_from_json));
  return std::make_unique<SequenceDecoder>(std::move(steps));
}

}  // namespace

Expected<std::unique_ptr<Decoder>> decoder_from_json(const nlohmann::json& json) {
  if (json.is_null()) return std::unique_ptr<Decoder>();
  TERN_ASSIGN_OR_RETURN(std::string type, json_type(json));
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") return strip_from_json(json);
  if (type == "Replace") return replace_from_json(json);
  if (type == "Metaspace") return metaspace_from_json(json);
  if (type == "BPEDecoder") {
    TERN_ASSIGN_OR_RETURN(std::string suffix, json_string(json, "suffix"));
    return std::make_unique<BpeSuffixDecoder>(std::move(suffix));
  }
  if (type == "Sequence") return sequence_from_json(json);
  return make_error("unsupported decoder type '{}' (supported: ByteLevel, ByteFallback, Fuse, Strip, Replace, "
                    "Metaspace, BPEDecoder, Sequence)",
                    type);
}

std::string decoder_run(const Decoder* decoder, std::vector<std::string> tokens) {
  std::string out;
  if (decoder == nullptr) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) out.push_back(' ');
      out.append(tokens[i]);
    }
    return out;
  }
  decoder->decode_chain(tokens);
  for (const auto& token : tokens) out.append(token);
  return out;
}

}  // namespace tern
