// safetensors tests. Expected bytes come from the format definition and from the Rust `safetensors` crate's own
// tests (safetensors/src/tensor.rs: test_serialization, test_empty, test_serialization_forced_alignement and the
// `deserialize` doc example), written here by hand; bad files are built byte by byte in each test. Which malformed
// headers must be rejected follows the crate's `read_metadata` / `Metadata::validate` (see safetensors.cc).
#include "io/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

namespace tern {
namespace {

namespace fs = std::filesystem;

std::string le_u64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

// Non-zero pseudo-random bytes, so a reader that drops or shifts data cannot match by accident.
std::string random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(1, 255);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(dist(rng));
  return s;
}

// A file: length prefix (the header's own length unless overridden), header text, then `data_bytes` data bytes.
std::string make_file(std::string_view header, size_t data_bytes, std::optional<uint64_t> len = std::nullopt) {
  return le_u64(len.value_or(header.size())) + std::string(header) + random_bytes(data_bytes, 7);
}

std::span<const std::byte> as_bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

std::string bytes_to_string(std::span<const std::byte> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    dir_ = fs::temp_directory_path() / ("tern_safetensors_test_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(counter++));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path write(const std::string& name, const std::string& bytes) {
    const fs::path path = dir_ / name;
    fs::create_directories(path.parent_path());
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }

  std::string read(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  // Opens bytes written as bad.safetensors; the open must fail and the message must name the file.
  std::string open_error(const std::string& bytes) {
    const fs::path path = write("bad.safetensors", bytes);
    Expected<SafetensorsFile> file = SafetensorsFile::open(path);
    if (file) {
      ADD_FAILURE() << "opened a malformed file";
      return "";
    }
    EXPECT_NE(file.error().message.find(path.string()), std::string::npos) << file.error().message;
    return file.error().message;
  }

  std::string open_header_error(std::string_view header, size_t data_bytes) {
    return open_error(make_file(header, data_bytes));
  }

  std::string dir_error() {
    Expected<SafetensorsSet> set = SafetensorsSet::open_dir(dir_);
    if (set) {
      ADD_FAILURE() << "opened a malformed directory";
      return "";
    }
    return set.error().message;
  }

  fs::path dir_;
};

#define EXPECT_HAS(message, part) EXPECT_NE((message).find(part), std::string::npos) << (message)

// --- dtypes -----------------------------------------------------------------------------------------------------

TEST(SafetensorsDType, NamesAndSizesMatchTheFormat) {
  const std::vector<std::tuple<DType, std::string, size_t>> expected = {
      {DType::kBF16, "BF16", 2}, {DType::kF16, "F16", 2},         {DType::kF32, "F32", 4},
      {DType::kF64, "F64", 8},   {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
      {DType::kU8, "U8", 1},     {DType::kI8, "I8", 1},           {DType::kI16, "I16", 2},
      {DType::kI32, "I32", 4},   {DType::kI64, "I64", 8},         {DType::kBool, "BOOL", 1}};
  for (const auto& [dtype, name, size] : expected) {
    EXPECT_EQ(dtype_name(dtype), name);
    EXPECT_EQ(dtype_size(dtype), size) << name;
    EXPECT_EQ(dtype_from_name(name), dtype) << name;
  }
  EXPECT_EQ(dtype_from_name("bf16"), std::nullopt);
  EXPECT_EQ(dtype_from_name("F4"), std::nullopt);
  EXPECT_EQ(dtype_from_name(""), std::nullopt);
}

// --- writer against the reference crate's bytes ----------------------------------------------------------------

TEST_F(SafetensorsTest, WriterMatchesReferenceSerialization) {
  const std::vector<float> values = {0, 1, 2, 3, 4, 5};
  const auto data = std::as_bytes(std::span(values));
  ASSERT_TRUE(safetensors_write(dir_ / "a.safetensors", {{"attn.0", DType::kF32, {1, 2, 3}, data}}));
  // test_serialization: a 64-byte header needs no padding.
  const std::string header = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  ASSERT_EQ(header.size(), 64u);
  EXPECT_EQ(read(dir_ / "a.safetensors"), le_u64(64) + header + bytes_to_string(data));

  // test_serialization_forced_alignement: 65 bytes of JSON padded with 7 spaces to 72.
  ASSERT_TRUE(safetensors_write(dir_ / "b.safetensors", {{"attn0", DType::kF32, {1, 1, 2, 3}, data}}));
  const std::string header_b = R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})";
  EXPECT_EQ(read(dir_ / "b.safetensors"), le_u64(72) + header_b + std::string(7, ' ') + bytes_to_string(data));
}

TEST_F(SafetensorsTest, WriterMatchesReferenceEmptyFiles) {
  ASSERT_TRUE(safetensors_write(dir_ / "e.safetensors", {}));
  EXPECT_EQ(read(dir_ / "e.safetensors"), le_u64(8) + "{}" + std::string(6, ' '));
  ASSERT_TRUE(safetensors_write(dir_ / "m.safetensors", {}, {{"framework", "pt"}}));
  EXPECT_EQ(read(dir_ / "m.safetensors"), le_u64(40) + R"({"__metadata__":{"framework":"pt"}})" + std::string(5, ' '));

  Expected<SafetensorsFile> file = SafetensorsFile::open(dir_ / "m.safetensors");
  ASSERT_TRUE(file) << file.error().message;
  EXPECT_TRUE(file->tensors().empty());
  EXPECT_EQ(file->metadata(), (std::map<std::string, std::string>{{"framework", "pt"}}));
}

TEST_F(SafetensorsTest, ReadsReferenceDocExampleWithUnpaddedHeader) {
  // The crate's deserialize example: a 60-byte header (not a multiple of 8) and 16 zero bytes of I32 [2, 2].
  const std::string header = R"({"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}})";
  ASSERT_EQ(header.size(), 60u);
  const fs::path path = write("doc.safetensors", le_u64(60) + header + std::string(16, '\0'));
  Expected<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_TRUE(file) << file.error().message;
  const TensorView* t = file->find("test");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::kI32);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(t->numel(), 4);
  EXPECT_EQ(bytes_to_string(t->data), std::string(16, '\0'));
  EXPECT_EQ(t->file, &file->path());
  EXPECT_EQ(file->find("missing"), nullptr);
}

// --- happy paths --------------------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, RoundTripsEveryDTypeByteForByte) {
  const std::vector<DType> dtypes = {DType::kBF16, DType::kF16,  DType::kF32, DType::kF64,
                                     DType::kF8E4M3, DType::kF8E5M2, DType::kU8, DType::kI8,
                                     DType::kI16, DType::kI32, DType::kI64, DType::kBool};
  std::mt19937 rng(42);
  std::vector<std::string> storage;
  std::vector<TensorToWrite> tensors;
  storage.reserve(dtypes.size());
  for (size_t i = 0; i < dtypes.size(); ++i) {
    std::vector<int64_t> shape = {static_cast<int64_t>(rng() % 5 + 1), static_cast<int64_t>(rng() % 7 + 1)};
    const size_t bytes = static_cast<size_t>(shape[0] * shape[1]) * dtype_size(dtypes[i]);
    storage.push_back(random_bytes(bytes, static_cast<uint32_t>(100 + i)));
    tensors.push_back({"layer." + std::to_string(i) + "." + std::string(dtype_name(dtypes[i])), dtypes[i], shape,
                       as_bytes(storage.back())});
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "ünïcode ✓"}};
  ASSERT_TRUE(safetensors_write(dir_ / "all.safetensors", tensors, metadata));

  Expected<SafetensorsFile> file = SafetensorsFile::open(dir_ / "all.safetensors");
  ASSERT_TRUE(file) << file.error().message;
  EXPECT_EQ(file->metadata(), metadata);
  ASSERT_EQ(file->tensors().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& got = file->tensors()[i];  // offset order = write order
    EXPECT_EQ(got.name, tensors[i].name);
    EXPECT_EQ(got.dtype, tensors[i].dtype);
    EXPECT_EQ(got.shape, tensors[i].shape);
    EXPECT_EQ(bytes_to_string(got.data), storage[i]) << got.name;
    EXPECT_EQ(file->find(got.name), &got);
  }
  // The file is exactly prefix + header + contiguous data.
  const std::string raw = read(dir_ / "all.safetensors");
  size_t total = 0;
  for (const std::string& s : storage) total += s.size();
  uint64_t header_len = 0;
  std::memcpy(&header_len, raw.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + header_len + total);
}

TEST_F(SafetensorsTest, ZeroDimAndZeroSizeTensorsAndTypedAccess) {
  const float scalar = -3.25f;
  const std::vector<float> vec = {1.5f, -2.0f, 1e-3f, 7.0f};
  ASSERT_TRUE(safetensors_write(dir_ / "s.safetensors",
                                {{"vec", DType::kF32, {2, 2}, std::as_bytes(std::span(vec))},
                                 {"scalar", DType::kF32, {}, std::as_bytes(std::span(&scalar, 1))},
                                 {"empty", DType::kF32, {0, 3}, {}}}));
  Expected<SafetensorsFile> file = SafetensorsFile::open(dir_ / "s.safetensors");
  ASSERT_TRUE(file) << file.error().message;
  const TensorView* s = file->find("scalar");
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(s->numel(), 1);
  ASSERT_EQ(s->as<float>().size(), 1u);
  EXPECT_EQ(s->as<float>()[0], -3.25f);
  const TensorView* e = file->find("empty");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->numel(), 0);
  EXPECT_TRUE(e->data.empty());
  const TensorView* v = file->find("vec");
  ASSERT_NE(v, nullptr);
  const std::span<const float> got = v->as<float>();
  EXPECT_EQ(std::vector<float>(got.begin(), got.end()), vec);
}

TEST_F(SafetensorsTest, OnlyZeroSizeTensorsGiveAnEmptyDataSection) {
  const std::string header = R"({"a":{"dtype":"BF16","shape":[0],"data_offsets":[0,0]},)"
                             R"("b":{"dtype":"I64","shape":[4,0,2],"data_offsets":[0,0]}})";
  const fs::path path = write("z.safetensors", make_file(header, 0));
  Expected<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_TRUE(file) << file.error().message;
  ASSERT_EQ(file->tensors().size(), 2u);
  EXPECT_EQ(file->find("b")->shape, (std::vector<int64_t>{4, 0, 2}));
  EXPECT_TRUE(file->find("b")->data.empty());
}

TEST_F(SafetensorsTest, HeaderKeyOrderNeedNotFollowOffsets) {
  // The reference sorts entries by offsets before checking them; JSON key order is free.
  const std::string header = R"({"second":{"dtype":"U8","shape":[3],"data_offsets":[2,5]},)"
                             R"("__metadata__":{"k":"v"},"first":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}})";
  const std::string bytes = make_file(header, 5);
  const fs::path path = write("o.safetensors", bytes);
  Expected<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_TRUE(file) << file.error().message;
  ASSERT_EQ(file->tensors().size(), 2u);
  EXPECT_EQ(file->tensors()[0].name, "first");
  EXPECT_EQ(file->tensors()[1].name, "second");
  const size_t data_start = 8 + header.size();
  EXPECT_EQ(bytes_to_string(file->find("second")->data), bytes.substr(data_start + 2, 3));
}

TEST_F(SafetensorsTest, AcceptsWhatTheReferenceAccepts) {
  // serde reads a null `__metadata__` as absent and ignores unknown fields in a tensor entry.
  const std::string header = R"({"__metadata__":null,"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":[1]}})";
  Expected<SafetensorsFile> file = SafetensorsFile::open(write("r.safetensors", make_file(header, 2)));
  ASSERT_TRUE(file) << file.error().message;
  EXPECT_TRUE(file->metadata().empty());
  ASSERT_NE(file->find("w"), nullptr);
  EXPECT_EQ(file->find("w")->data.size(), 2u);
}

TEST_F(SafetensorsTest, MovingAFileKeepsViewsValid) {
  const std::vector<int32_t> values = {11, -22, 33};
  ASSERT_TRUE(safetensors_write(dir_ / "mv.safetensors", {{"w", DType::kI32, {3}, std::as_bytes(std::span(values))}}));
  Expected<SafetensorsFile> opened = SafetensorsFile::open(dir_ / "mv.safetensors");
  ASSERT_TRUE(opened) << opened.error().message;
  const TensorView* before = opened->find("w");
  SafetensorsFile moved = std::move(*opened);
  EXPECT_EQ(moved.find("w"), before);
  EXPECT_EQ(before->file, &moved.path());
  EXPECT_EQ(moved.path(), dir_ / "mv.safetensors");
  EXPECT_EQ(before->as<int32_t>()[1], -22);
}

TEST_F(SafetensorsTest, TypedAccessWithTheWrongSizeAborts) {
  const std::vector<uint16_t> values = {1, 2};
  ASSERT_TRUE(safetensors_write(dir_ / "t.safetensors", {{"w", DType::kBF16, {2}, std::as_bytes(std::span(values))}}));
  Expected<SafetensorsFile> file = SafetensorsFile::open(dir_ / "t.safetensors");
  ASSERT_TRUE(file) << file.error().message;
  EXPECT_DEATH(file->find("w")->as<float>(), "element size");
}

// A sharded checkpoint as transformers writes it: two shards and an index.
class ShardedTest : public SafetensorsTest {
 protected:
  void write_shards() {
    a_ = random_bytes(2 * 3 * 2, 1);
    b_ = random_bytes(4 * 4, 2);
    c_ = random_bytes(5, 3);
    ASSERT_TRUE(safetensors_write(dir_ / "model-00001-of-00002.safetensors",
                                  {{"model.embed.weight", DType::kBF16, {2, 3}, as_bytes(a_)},
                                   {"model.norm.weight", DType::kF32, {4}, as_bytes(b_)}}));
    ASSERT_TRUE(safetensors_write(dir_ / "model-00002-of-00002.safetensors",
                                  {{"lm_head.weight", DType::kU8, {5}, as_bytes(c_)}}));
  }
  void write_index(const nlohmann::json& weight_map) {
    nlohmann::json index = {{"metadata", {{"total_size", 33}}}, {"weight_map", weight_map}};
    write("model.safetensors.index.json", index.dump(2));
  }
  nlohmann::json good_weight_map() const {
    return {{"model.embed.weight", "model-00001-of-00002.safetensors"},
            {"model.norm.weight", "model-00001-of-00002.safetensors"},
            {"lm_head.weight", "model-00002-of-00002.safetensors"}};
  }
  std::string a_, b_, c_;
};

TEST_F(ShardedTest, OpensIndexedShards) {
  write_shards();
  write_index(good_weight_map());
  Expected<SafetensorsSet> set = SafetensorsSet::open_dir(dir_);
  ASSERT_TRUE(set) << set.error().message;
  EXPECT_EQ(set->num_files(), 2u);
  const std::vector<const TensorView*> all = set->tensors();
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0]->name, "lm_head.weight");
  EXPECT_EQ(all[1]->name, "model.embed.weight");
  EXPECT_EQ(all[2]->name, "model.norm.weight");
  EXPECT_EQ(bytes_to_string(set->find("model.embed.weight")->data), a_);
  EXPECT_EQ(bytes_to_string(set->find("model.norm.weight")->data), b_);
  EXPECT_EQ(bytes_to_string(set->find("lm_head.weight")->data), c_);
  EXPECT_EQ(*set->find("lm_head.weight")->file, dir_ / "model-00002-of-00002.safetensors");
  EXPECT_EQ(set->find("model.missing"), nullptr);
}

TEST_F(ShardedTest, OpensEveryFileWithoutAnIndex) {
  write_shards();
  Expected<SafetensorsSet> set = SafetensorsSet::open_dir(dir_);
  ASSERT_TRUE(set) << set.error().message;
  EXPECT_EQ(set->num_files(), 2u);
  EXPECT_EQ(set->tensors().size(), 3u);
}

TEST_F(SafetensorsTest, SingleModelFileWinsOverOtherFiles) {
  const std::string w = random_bytes(4, 9);
  ASSERT_TRUE(safetensors_write(dir_ / "model.safetensors", {{"w", DType::kF32, {1}, as_bytes(w)}}));
  ASSERT_TRUE(safetensors_write(dir_ / "consolidated.safetensors", {{"w", DType::kF32, {1}, as_bytes(w)}}));
  Expected<SafetensorsSet> set = SafetensorsSet::open_dir(dir_);
  ASSERT_TRUE(set) << set.error().message;
  EXPECT_EQ(set->num_files(), 1u);
  EXPECT_EQ(*set->find("w")->file, dir_ / "model.safetensors");
}

TEST_F(SafetensorsTest, OpenFilesTakesAnExplicitList) {
  const std::string w = random_bytes(2, 9);
  ASSERT_TRUE(safetensors_write(dir_ / "x.safetensors", {{"x", DType::kI8, {2}, as_bytes(w)}}));
  ASSERT_TRUE(safetensors_write(dir_ / "y.safetensors", {{"y", DType::kI8, {2}, as_bytes(w)}}));
  Expected<SafetensorsSet> set = SafetensorsSet::open_files({dir_ / "y.safetensors", dir_ / "x.safetensors"});
  ASSERT_TRUE(set) << set.error().message;
  EXPECT_EQ(set->num_files(), 2u);
  EXPECT_EQ(set->tensors()[0]->name, "x");
  Expected<SafetensorsSet> none = SafetensorsSet::open_files({});
  EXPECT_FALSE(none);
}

// --- malformed files: one test per case ---------------------------------------------------------------------------

TEST_F(SafetensorsTest, RejectsEmptyFile) { EXPECT_HAS(open_error(""), "shorter than the 8-byte"); }

TEST_F(SafetensorsTest, RejectsFileShorterThan8Bytes) { EXPECT_HAS(open_error(std::string("\x02\0\0\0\0", 5)), "is 5 bytes"); }

TEST_F(SafetensorsTest, RejectsHeaderLengthPastEndOfFile) {
  EXPECT_HAS(open_error(make_file("{}", 0, 100)), "header length 100 runs past the end of the file (10 bytes)");
}

TEST_F(SafetensorsTest, RejectsAbsurdHeaderLength) {
  EXPECT_HAS(open_error(make_file("{}", 0, uint64_t{1} << 63)), "header length 9223372036854775808 is over");
  EXPECT_HAS(open_error(make_file("{}", 0, ~uint64_t{0})), "is over");
  EXPECT_HAS(open_error(make_file("{}", 0, 100'000'001)), "is over the 100000000-byte limit");
}

TEST_F(SafetensorsTest, RejectsHeaderThatIsNotJson) {
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", )", 0), "header is not valid JSON");
  EXPECT_HAS(open_header_error("", 0), "header is not valid JSON");
  EXPECT_HAS(open_header_error("{} {}", 0), "header is not valid JSON");
}

TEST_F(SafetensorsTest, RejectsHeaderThatIsNotUtf8) {
  EXPECT_HAS(open_header_error("{\"w\xff\": 1}", 0), "not valid UTF-8 (bad byte 0xff at offset 3)");
  EXPECT_HAS(open_header_error("{\"\xc0\xaf\": 1}", 0), "not valid UTF-8");       // overlong '/'
  EXPECT_HAS(open_header_error("{\"\xed\xa0\x80\": 1}", 0), "not valid UTF-8");   // surrogate U+D800
  EXPECT_HAS(open_header_error("{\"\xf4\x90\x80\x80\": 1}", 0), "not valid UTF-8");  // past U+10FFFF
  EXPECT_HAS(open_header_error("{\"\xe2\x82\": 1}", 0), "not valid UTF-8");       // truncated sequence
}

TEST_F(SafetensorsTest, RejectsDeeplyNestedHeaderWithoutOverflowingTheStack) {
  const size_t depth = 200'000;
  EXPECT_HAS(open_header_error("{\"w\":" + std::string(depth, '[') + std::string(depth, ']') + "}", 0),
             "tensor 'w': entry is not an object (got array)");
  EXPECT_HAS(open_header_error(std::string(depth, '{'), 0), "header is not valid JSON");
}

TEST_F(SafetensorsTest, RejectsHeaderThatIsNotAnObject) {
  EXPECT_HAS(open_header_error("[1, 2]", 0), "header is not a JSON object (got array)");
  EXPECT_HAS(open_header_error("\"x\"", 0), "header is not a JSON object (got string)");
}

TEST_F(SafetensorsTest, RejectsEntryThatIsNotAnObject) {
  EXPECT_HAS(open_header_error(R"({"w": [1, 2]})", 0), "tensor 'w': entry is not an object (got array)");
}

TEST_F(SafetensorsTest, RejectsMissingOrWrongTypedDtype) {
  EXPECT_HAS(open_header_error(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", 4), "tensor 'w': missing 'dtype'");
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}})", 4),
             "tensor 'w': 'dtype' is not a string (got number)");
}

TEST_F(SafetensorsTest, RejectsMissingOrWrongTypedShape) {
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", 4), "tensor 'w': missing 'shape'");
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}})", 4),
             "tensor 'w': 'shape' is not an array (got string)");
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]}})", 4),
             "tensor 'w': shape[0] is not a number (got string)");
}

TEST_F(SafetensorsTest, RejectsMissingOrWrongTypedDataOffsets) {
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [1]}})", 4), "tensor 'w': missing 'data_offsets'");
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4]}})", 4),
             "tensor 'w': 'data_offsets' is not an array of two integers (got 1 elements)");
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}})", 4),
             "(got 3 elements)");
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": {"a": 0}}})", 4),
             "(got object)");
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]}})", 4),
             "tensor 'w': data_offsets[1] is not a number");
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 4),
             "tensor 'w': data_offsets[0] is negative (-4)");
}

TEST_F(SafetensorsTest, RejectsNegativeShapeDim) {
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}})", 8),
             "tensor 'w': shape[1] is negative (-1)");
}

TEST_F(SafetensorsTest, RejectsNonIntegerShapeDim) {
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4),
             "tensor 'w': shape[0] is not an integer (1.5)");
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}})", 4),
             "shape[0] is not an integer");
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [null], "data_offsets": [0, 4]}})", 4),
             "shape[0] is not a number (got null)");
}

TEST_F(SafetensorsTest, RejectsDataOffsetsPastTheDataSection) {
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 12),
             "tensor 'w': data_offsets [0, 16] run past the end of the 12-byte data section");
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [99, 99]}})", 0),
             "tensor 'w': data_offsets [99, 99] run past");
}

TEST_F(SafetensorsTest, RejectsBeginAfterEnd) {
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8),
             "tensor 'w': data_offsets begin 8 is after end 4");
}

TEST_F(SafetensorsTest, RejectsOverlappingTensors) {
  const std::string header = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                             R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})";
  EXPECT_HAS(open_header_error(header, 12), "tensor 'b' (bytes [4, 12)) overlaps tensor 'a' (bytes [0, 8))");
}

TEST_F(SafetensorsTest, RejectsHoleBetweenTensors) {
  const std::string header = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                             R"( "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})";
  EXPECT_HAS(open_header_error(header, 12), "tensor 'b' starts at byte 8 but tensor 'a' ends at byte 4");
}

TEST_F(SafetensorsTest, RejectsHoleAtStartOfDataSection) {
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8),
             "tensor 'w' starts at byte 4 but nothing before it ends at byte 0");
}

TEST_F(SafetensorsTest, RejectsTrailingBytesAfterTheLastTensor) {
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 6),
             "tensors cover 4 bytes but the data section has 6: 2 trailing bytes");
  EXPECT_HAS(open_header_error("{}", 3), "tensors cover 0 bytes but the data section has 3");
}

TEST_F(SafetensorsTest, RejectsShapeThatDisagreesWithByteLength) {
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}})", 10),
             "tensor 'w': shape [2, 3] of BF16 needs 12 bytes but data_offsets [0, 10] hold 10");
}

TEST_F(SafetensorsTest, RejectsShapeProductOverflow) {
  // 2^62 * 4 overflows int64 elements.
  EXPECT_HAS(open_header_error(
                 R"({"w": {"dtype": "U8", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}})", 0),
             "tensor 'w': shape 4611686018427387904x4 has more elements than int64 can count");
  // 2^61 elements fit in int64, but 2^61 * 8 bytes do not fit in u64.
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "F64", "shape": [2305843009213693952], "data_offsets": [0, 0]}})",
                               0),
             "tensor 'w': shape 2305843009213693952 of F64 overflows the byte count");
  // A single dim above INT64_MAX.
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "U8", "shape": [9223372036854775808], "data_offsets": [0, 0]}})",
                               0),
             "tensor 'w': shape[0] = 9223372036854775808 does not fit in int64");
}

TEST_F(SafetensorsTest, RejectsUnknownDtype) {
  EXPECT_HAS(open_header_error(R"({"w": {"dtype": "Q4_K", "shape": [1], "data_offsets": [0, 1]}})", 1),
             "tensor 'w': unknown or unsupported dtype 'Q4_K'");
}

TEST_F(SafetensorsTest, RejectsDuplicateTensorName) {
  const std::string header = R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},)"
                             R"( "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})";
  EXPECT_HAS(open_header_error(header, 2), "tensor name 'w' appears twice");
  const std::string field = R"({"w": {"dtype": "U8", "dtype": "I8", "shape": [1], "data_offsets": [0, 1]}})";
  EXPECT_HAS(open_header_error(field, 1), "key 'dtype' appears twice inside 'w'");
}

TEST_F(SafetensorsTest, RejectsMetadataThatIsNotAStringMap) {
  EXPECT_HAS(open_header_error(R"({"__metadata__": ["a"]})", 0), "'__metadata__' is not an object of strings");
  EXPECT_HAS(open_header_error(R"({"__metadata__": {"epoch": 3}})", 0),
             "'__metadata__' value for key 'epoch' is not a string (got number)");
}

TEST_F(SafetensorsTest, RejectsADirectoryWithNoSafetensors) {
  write("config.json", "{}");
  EXPECT_HAS(dir_error(), "no .safetensors files");
  EXPECT_FALSE(SafetensorsSet::open_dir(dir_ / "does-not-exist"));
}

TEST_F(SafetensorsTest, RejectsTheSameTensorInTwoFiles) {
  const std::string w = random_bytes(4, 9);
  ASSERT_TRUE(safetensors_write(dir_ / "a.safetensors", {{"shared", DType::kF32, {1}, as_bytes(w)}}));
  ASSERT_TRUE(safetensors_write(dir_ / "b.safetensors", {{"shared", DType::kF32, {1}, as_bytes(w)}}));
  const std::string message = dir_error();
  EXPECT_HAS(message, "tensor 'shared' appears in both");
  EXPECT_HAS(message, "a.safetensors");
  EXPECT_HAS(message, "b.safetensors");
}

TEST_F(SafetensorsTest, ReportsTheBadShardInADirectory) {
  write("model.safetensors", make_file(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", 4));
  const std::string message = dir_error();
  EXPECT_HAS(message, "model.safetensors");
  EXPECT_HAS(message, "tensor 'w': shape [2] of F32 needs 8 bytes");
}

TEST_F(ShardedTest, RejectsMalformedIndexJson) {
  write_shards();
  write("model.safetensors.index.json", R"({"weight_map": {"a": )");
  std::string message = dir_error();
  EXPECT_HAS(message, "model.safetensors.index.json is not valid JSON");
  write("model.safetensors.index.json", R"({"metadata": {}})");
  EXPECT_HAS(dir_error(), "model.safetensors.index.json: missing 'weight_map'");
  write("model.safetensors.index.json", R"({"weight_map": ["a"]})");
  EXPECT_HAS(dir_error(), "'weight_map' is not an object (got array)");
  write("model.safetensors.index.json", R"({"weight_map": {"lm_head.weight": 2}})");
  EXPECT_HAS(dir_error(), "weight_map entry for tensor 'lm_head.weight' is not a file name (got number)");
  write("model.safetensors.index.json",
        R"({"weight_map": {"x": "model-00002-of-00002.safetensors", "x": "model-00001-of-00002.safetensors"}})");
  EXPECT_HAS(dir_error(), "key 'x' appears twice inside 'weight_map'");
  write("model.safetensors.index.json", R"({"weight_map": {"x": "../model-00001-of-00002.safetensors"}})");
  EXPECT_HAS(dir_error(), "which is not a file inside the model directory");
}

TEST_F(ShardedTest, RejectsIndexNamingAMissingShard) {
  write_shards();
  nlohmann::json map = good_weight_map();
  map["lm_head.weight"] = "model-00003-of-00003.safetensors";
  write_index(map);
  EXPECT_HAS(dir_error(), "shard 'model-00003-of-00003.safetensors' (holding tensor 'lm_head.weight') does not exist");
}

TEST_F(ShardedTest, RejectsIndexNamingATensorAbsentFromItsShard) {
  write_shards();
  nlohmann::json map = good_weight_map();
  map["model.layers.0.mlp.weight"] = "model-00002-of-00002.safetensors";
  write_index(map);
  EXPECT_HAS(dir_error(), "tensor 'model.layers.0.mlp.weight' is mapped to shard 'model-00002-of-00002.safetensors', "
                          "which does not contain it");
  map = good_weight_map();
  map["lm_head.weight"] = "model-00001-of-00002.safetensors";  // present, but in the other shard
  write_index(map);
  EXPECT_HAS(dir_error(), "tensor 'lm_head.weight' is mapped to shard 'model-00001-of-00002.safetensors'");
}

// --- writer errors ----------------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, WriterRejectsInconsistentTensors) {
  const std::string four = random_bytes(4, 5);
  auto error_of = [&](const std::vector<TensorToWrite>& tensors) {
    Expected<void> result = safetensors_write(dir_ / "w.safetensors", tensors);
    return result ? std::string("(no error)") : result.error().message;
  };
  EXPECT_HAS(error_of({{"w", DType::kF32, {2}, as_bytes(four)}}), "tensor 'w': shape [2] of F32 needs 8 bytes but 4");
  EXPECT_HAS(error_of({{"w", DType::kU8, {4}, as_bytes(four)}, {"w", DType::kU8, {4}, as_bytes(four)}}),
             "tensor 'w': name given twice");
  EXPECT_HAS(error_of({{"__metadata__", DType::kU8, {4}, as_bytes(four)}}), "reserved");
  EXPECT_HAS(error_of({{"w", DType::kU8, {-4}, as_bytes(four)}}), "negative dim");
  EXPECT_HAS(error_of({{"bad\xff", DType::kU8, {4}, as_bytes(four)}}), "cannot encode the header");
  EXPECT_FALSE(fs::exists(dir_ / "w.safetensors"));
  EXPECT_FALSE(fs::exists(dir_ / "w.safetensors.tmp"));
}

// --- the parser on bytes in memory ----------------------------------------------------------------------------

TEST(SafetensorsParseHeader, NamesTheLabelAndReturnsRangesInsideTheFile) {
  const std::string header = R"({"b":{"dtype":"F16","shape":[3],"data_offsets":[2,8]},)"
                             R"("a":{"dtype":"I16","shape":[],"data_offsets":[0,2]}})";
  const std::string bytes = make_file(header, 8);
  Expected<SafetensorsHeader> parsed = safetensors_parse_header(as_bytes(bytes), "mem");
  ASSERT_TRUE(parsed) << parsed.error().message;
  EXPECT_EQ(parsed->header_len, header.size());
  ASSERT_EQ(parsed->entries.size(), 2u);
  EXPECT_EQ(parsed->entries[0].name, "a");
  EXPECT_TRUE(parsed->entries[0].shape.empty());
  EXPECT_EQ(parsed->entries[1].begin, 2u);
  EXPECT_EQ(parsed->entries[1].end, 8u);

  Expected<SafetensorsHeader> bad = safetensors_parse_header(as_bytes(bytes.substr(0, bytes.size() - 1)), "mem");
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().message.rfind("mem: ", 0), 0u) << bad.error().message;
}

}  // namespace
}  // namespace tern
