// safetensors reader and writer.
//
// Validation follows the Rust `safetensors` crate (huggingface/safetensors, safetensors/src/tensor.rs,
// `SafeTensors::read_metadata` and `Metadata::validate`):
//   - the header length must be at most 100,000,000 bytes and lie inside the file;
//   - the header must be valid UTF-8 and valid JSON (a leading '{' is not required: the crate has that check
//     commented out);
//   - entries are sorted by data_offsets (begin, end); the first must begin at 0 and each next one must begin
//     exactly where the previous ended, so the tensors tile the data section with no hole and no overlap;
//   - each tensor's byte length must equal shape product x dtype size, computed without overflow;
//   - the last end must be the end of the file: trailing bytes are rejected (MetadataIncompleteBuffer);
//   - unknown fields inside a tensor entry are ignored, as serde does by default; `__metadata__` may be null.
// We are stricter in two places: a duplicate JSON key anywhere in the header is an error (serde keeps the last one
// silently, which would let two headers name different data for one tensor), and shape dims must fit in int64.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fmt/ranges.h>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <system_error>
#include <tuple>

namespace tern {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderLen = 100'000'000;  // the reference's MAX_HEADER_SIZE
constexpr size_t kLenPrefix = 8;
constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kIndexFileName = "model.safetensors.index.json";
constexpr std::string_view kSingleFileName = "model.safetensors";

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DTypeInfo, 12> kDTypes = {{
    {DType::kBF16, "BF16", 2},
    {DType::kF16, "F16", 2},
    {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},
    {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E5M2, "F8_E5M2", 1},
    {DType::kU8, "U8", 1},
    {DType::kI8, "I8", 1},
    {DType::kI16, "I16", 2},
    {DType::kI32, "I32", 4},
    {DType::kI64, "I64", 8},
    {DType::kBool, "BOOL", 1},
}};

const DTypeInfo& dtype_info(DType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  TERN_CHECK(false, "unknown DType value {}", static_cast<int>(dtype));
  __builtin_unreachable();
}

// Offset of the first byte that breaks UTF-8 (RFC 3629: no overlongs, no surrogates, nothing past U+10FFFF),
// or nullopt when the text is valid. Same acceptance as Rust's core::str::from_utf8.
std::optional<size_t> utf8_find_invalid(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c < 0x80) len = 1;
    else if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) len = 3, lo = 0xA0;
    else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) len = 3;
    else if (c == 0xED) len = 3, hi = 0x9F;
    else if (c == 0xF0) len = 4, lo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    else if (c == 0xF4) len = 4, hi = 0x8F;
    else return i;
    if (len > 1) {
      if (i + len > n || s[i + 1] < lo || s[i + 1] > hi) return i;
      for (size_t k = 2; k < len; ++k) {
        if (s[i + k] < 0x80 || s[i + k] > 0xBF) return i;
      }
    }
    i += len;
  }
  return std::nullopt;
}

// Remembers the keys of every open JSON object while nlohmann parses, to catch the first duplicate key
// (nlohmann, like serde, would keep only the last value).
class DuplicateKeyFinder {
 public:
  bool on_event(nlohmann::json::parse_event_t event, const json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    switch (event) {
      case Event::object_start:
      case Event::array_start: {
        std::string owner = open_.empty() ? std::string() : open_.back().is_object ? last_key_ : open_.back().owner;
        open_.push_back({event == Event::object_start, {}, std::move(owner)});
        break;
      }
      case Event::object_end:
      case Event::array_end:
        if (!open_.empty()) open_.pop_back();
        break;
      case Event::key:
        last_key_ = parsed.get<std::string>();
        if (!open_.empty() && !open_.back().keys.insert(last_key_).second && !duplicate_) {
          duplicate_ = Duplicate{open_.back().owner, last_key_, open_.size() == 1};
        }
        break;
      case Event::value:
        break;
    }
    return true;
  }

  struct Duplicate {
    std::string owner;  // key of the object holding the duplicate ("" at the root)
    std::string key;
    bool at_root;
  };
  const std::optional<Duplicate>& duplicate() const { return duplicate_; }

 private:
  struct Open {
    bool is_object;
    std::set<std::string> keys;
    std::string owner;
  };
  std::vector<Open> open_;
  std::string last_key_;
  std::optional<Duplicate> duplicate_;
};

// Parses JSON text, rejecting invalid UTF-8 and duplicate keys. `what` names the text in errors ("x: header").
Expected<json> json_parse_strict(std::string_view text, std::string_view what, std::string_view root_key_noun) {
  if (std::optional<size_t> bad = utf8_find_invalid(text)) {
    return make_error("{} is not valid UTF-8 (bad byte 0x{:02x} at offset {})", what,
                      static_cast<unsigned char>(text[*bad]), *bad);
  }
  DuplicateKeyFinder finder;
  json root;
  try {
    root = json::parse(text.begin(), text.end(),
                       [&finder](int, json::parse_event_t event, json& parsed) {
                         return finder.on_event(event, parsed);
                       });
  } catch (const json::exception& e) {
    return make_error("{} is not valid JSON: {}", what, e.what());
  }
  if (const auto& dup = finder.duplicate()) {
    if (dup->at_root) return make_error("{}: {} '{}' appears twice", what, root_key_noun, dup->key);
    return make_error("{}: key '{}' appears twice inside '{}'", what, dup->key, dup->owner);
  }
  return root;
}

// A JSON non-negative integer as u64; `field` names it in errors (already prefixed with file and tensor).
Expected<uint64_t> json_to_u64(const json& value, std::string_view field) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer()) {
    const int64_t v = value.get<int64_t>();
    if (v < 0) return make_error("{} is negative ({})", field, v);
    return static_cast<uint64_t>(v);
  }
  if (value.is_number_float()) return make_error("{} is not an integer ({})", field, value.dump());
  return make_error("{} is not a number (got {})", field, value.type_name());
}

Expected<std::vector<int64_t>> parse_shape(const json& entry, std::string_view where) {
  const auto it = entry.find("shape");
  if (it == entry.end()) return make_error("{}: missing 'shape'", where);
  if (!it->is_array()) return make_error("{}: 'shape' is not an array (got {})", where, it->type_name());
  std::vector<int64_t> shape;
  shape.reserve(it->size());
  for (size_t i = 0; i < it->size(); ++i) {
    TERN_ASSIGN_OR_RETURN(uint64_t dim, json_to_u64((*it)[i], fmt::format("{}: shape[{}]", where, i)));
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return make_error("{}: shape[{}] = {} does not fit in int64", where, i, dim);
    }
    shape.push_back(static_cast<int64_t>(dim));
  }
  return shape;
}

Expected<DType> parse_dtype(const json& entry, std::string_view where) {
  const auto it = entry.find("dtype");
  if (it == entry.end()) return make_error("{}: missing 'dtype'", where);
  if (!it->is_string()) return make_error("{}: 'dtype' is not a string (got {})", where, it->type_name());
  const std::string& name = it->get_ref<const std::string&>();
  std::optional<DType> dtype = dtype_from_name(name);
  if (!dtype) return make_error("{}: unknown or unsupported dtype '{}'", where, name);
  return *dtype;
}

Expected<std::pair<uint64_t, uint64_t>> parse_offsets(const json& entry, std::string_view where) {
  const auto it = entry.find("data_offsets");
  if (it == entry.end()) return make_error("{}: missing 'data_offsets'", where);
  if (!it->is_array() || it->size() != 2) {
    return make_error("{}: 'data_offsets' is not an array of two integers (got {})", where,
                      it->is_array() ? fmt::format("{} elements", it->size()) : std::string(it->type_name()));
  }
  TERN_ASSIGN_OR_RETURN(uint64_t begin, json_to_u64((*it)[0], fmt::format("{}: data_offsets[0]", where)));
  TERN_ASSIGN_OR_RETURN(uint64_t end, json_to_u64((*it)[1], fmt::format("{}: data_offsets[1]", where)));
  if (begin > end) return make_error("{}: data_offsets begin {} is after end {}", where, begin, end);
  return std::pair{begin, end};
}

// Element count and byte size of a shape; an error if either overflows.
Expected<uint64_t> shape_byte_size(const std::vector<int64_t>& shape, DType dtype, std::string_view where) {
  int64_t numel = 1;
  for (int64_t dim : shape) {
    if (__builtin_mul_overflow(numel, dim, &numel)) {
      return make_error("{}: shape {} has more elements than int64 can count", where, fmt::join(shape, "x"));
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), static_cast<uint64_t>(dtype_size(dtype)), &bytes)) {
    return make_error("{}: shape {} of {} overflows the byte count", where, fmt::join(shape, "x"), dtype_name(dtype));
  }
  return bytes;
}

Expected<SafetensorsHeaderEntry> parse_entry(const std::string& name, const json& entry, std::string_view label,
                                             uint64_t data_size) {
  const std::string where = fmt::format("{}: tensor '{}'", label, name);
  if (!entry.is_object()) return make_error("{}: entry is not an object (got {})", where, entry.type_name());
  TERN_ASSIGN_OR_RETURN(DType dtype, parse_dtype(entry, where));
  TERN_ASSIGN_OR_RETURN(std::vector<int64_t> shape, parse_shape(entry, where));
  TERN_ASSIGN_OR_RETURN(auto offsets, parse_offsets(entry, where));
  const auto [begin, end] = offsets;
  if (end > data_size) {
    return make_error("{}: data_offsets [{}, {}] run past the end of the {}-byte data section", where, begin, end,
                      data_size);
  }
  TERN_ASSIGN_OR_RETURN(uint64_t bytes, shape_byte_size(shape, dtype, where));
  if (bytes != end - begin) {
    return make_error("{}: shape [{}] of {} needs {} bytes but data_offsets [{}, {}] hold {}", where,
                      fmt::join(shape, ", "), dtype_name(dtype), bytes, begin, end, end - begin);
  }
  return SafetensorsHeaderEntry{name, dtype, std::move(shape), begin, end};
}

Expected<std::map<std::string, std::string>> parse_metadata(const json& value, std::string_view label) {
  std::map<std::string, std::string> metadata;
  if (value.is_null()) return metadata;  // serde reads `null` as an absent Option
  if (!value.is_object()) {
    return make_error("{}: '__metadata__' is not an object of strings (got {})", label, value.type_name());
  }
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return make_error("{}: '__metadata__' value for key '{}' is not a string (got {})", label, key,
                        item.type_name());
    }
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

// The reference's rule: sorted by offsets, the tensors cover [0, data_size) exactly, each starting where the
// previous one ended.
Expected<void> check_tiling(const std::vector<SafetensorsHeaderEntry>& entries, std::string_view label,
                            uint64_t data_size) {
  uint64_t covered = 0;
  const SafetensorsHeaderEntry* prev = nullptr;
  for (const SafetensorsHeaderEntry& e : entries) {
    if (e.begin < covered) {
      return make_error("{}: tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (bytes [{}, {}))", label, e.name,
                        e.begin, e.end, prev->name, prev->begin, prev->end);
    }
    if (e.begin > covered) {
      return make_error("{}: tensor '{}' starts at byte {} but {} ends at byte {}: the data section has a hole "
                        "(tensors must tile it contiguously)",
                        label, e.name, e.begin, prev ? fmt::format("tensor '{}'", prev->name) : "nothing before it",
                        covered);
    }
    covered = e.end;
    prev = &e;
  }
  if (covered != data_size) {
    return make_error("{}: tensors cover {} bytes but the data section has {}: {} trailing bytes belong to no tensor",
                      label, covered, data_size, data_size - covered);
  }
  return {};
}

}  // namespace

std::string_view dtype_name(DType dtype) { return dtype_info(dtype).name; }

size_t dtype_size(DType dtype) { return dtype_info(dtype).size; }

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;  // cannot overflow: the parser rejected such shapes
  return n;
}

Expected<SafetensorsHeader> safetensors_parse_header(std::span<const std::byte> file_bytes, std::string_view label) {
  const uint64_t file_size = file_bytes.size();
  if (file_size < kLenPrefix) {
    return make_error("{}: file is {} bytes, shorter than the 8-byte header length", label, file_size);
  }
  uint64_t header_len = 0;
  for (size_t i = 0; i < kLenPrefix; ++i) header_len |= static_cast<uint64_t>(file_bytes[i]) << (8 * i);
  if (header_len > kMaxHeaderLen) {
    return make_error("{}: header length {} is over the {}-byte limit", label, header_len, kMaxHeaderLen);
  }
  if (header_len > file_size - kLenPrefix) {
    return make_error("{}: header length {} runs past the end of the file ({} bytes)", label, header_len, file_size);
  }
  const std::string_view text(reinterpret_cast<const char*>(file_bytes.data()) + kLenPrefix, header_len);
  TERN_ASSIGN_OR_RETURN(json root, json_parse_strict(text, fmt::format("{}: header", label), "tensor name"));
  if (!root.is_object()) return make_error("{}: header is not a JSON object (got {})", label, root.type_name());

  const uint64_t data_size = file_size - kLenPrefix - header_len;
  SafetensorsHeader header{header_len, {}, {}};
  header.entries.reserve(root.size());
  for (const auto& [name, value] : root.items()) {
    if (name == kMetadataKey) {
      TERN_ASSIGN_OR_RETURN(header.metadata, parse_metadata(value, label));
      continue;
    }
    TERN_ASSIGN_OR_RETURN(SafetensorsHeaderEntry entry, parse_entry(name, value, label, data_size));
    header.entries.push_back(std::move(entry));
  }
  std::sort(header.entries.begin(), header.entries.end(), [](const auto& a, const auto& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  TERN_TRY(check_tiling(header.entries, label, data_size));
  return header;
}

// ---------------------------------------------------------------------------------------------------------------
// SafetensorsFile

struct SafetensorsFile::Impl {
  std::filesystem::path path;
  void* map = nullptr;
  size_t map_size = 0;
  std::vector<TensorView> tensors;
  std::map<std::string, size_t, std::less<>> index;  // name -> position in tensors
  std::map<std::string, std::string> metadata;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (map != nullptr) ::munmap(map, map_size);
  }
};

namespace {

// Maps the whole file read-only. An empty file maps nothing (mmap rejects length 0); the parser reports it.
Expected<void> map_whole_file(const std::filesystem::path& path, void** map, size_t* map_size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return make_error("{}: cannot open: {}", path.string(), std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return make_error("{}: cannot stat: {}", path.string(), std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return make_error("{}: not a regular file", path.string());
  }
  *map_size = static_cast<size_t>(st.st_size);
  if (*map_size > 0) {
    void* p = ::mmap(nullptr, *map_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return make_error("{}: cannot mmap {} bytes: {}", path.string(), *map_size, std::strerror(err));
    }
    *map = p;
  }
  ::close(fd);  // the mapping stays valid without the descriptor
  return {};
}

}  // namespace

SafetensorsFile::SafetensorsFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

Expected<SafetensorsFile> SafetensorsFile::open(const std::filesystem::path& path) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  TERN_TRY(map_whole_file(path, &impl->map, &impl->map_size));
  const std::span<const std::byte> bytes(static_cast<const std::byte*>(impl->map), impl->map_size);
  TERN_ASSIGN_OR_RETURN(SafetensorsHeader header, safetensors_parse_header(bytes, path.string()));

  const std::byte* data = bytes.data() + kLenPrefix + header.header_len;
  impl->tensors.reserve(header.entries.size());
  for (SafetensorsHeaderEntry& e : header.entries) {
    impl->index.emplace(e.name, impl->tensors.size());
    impl->tensors.push_back(TensorView{std::move(e.name), e.dtype, std::move(e.shape),
                                       std::span(data + e.begin, e.end - e.begin), &impl->path});
  }
  impl->metadata = std::move(header.metadata);
  return SafetensorsFile(std::move(impl));
}

const std::vector<TensorView>& SafetensorsFile::tensors() const { return impl_->tensors; }

const TensorView* SafetensorsFile::find(std::string_view name) const {
  const auto it = impl_->index.find(name);
  return it == impl_->index.end() ? nullptr : &impl_->tensors[it->second];
}

const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return impl_->metadata; }

const std::filesystem::path& SafetensorsFile::path() const { return impl_->path; }

// ---------------------------------------------------------------------------------------------------------------
// SafetensorsSet

namespace {

Expected<std::string> read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error("{}: cannot open: {}", path.string(), std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return make_error("{}: read error", path.string());
  return std::move(text).str();
}

// The shard file of each tensor, from model.safetensors.index.json.
using WeightMap = std::vector<std::pair<std::string, std::string>>;

Expected<WeightMap> read_index(const std::filesystem::path& index_path) {
  const std::string label = index_path.string();
  TERN_ASSIGN_OR_RETURN(std::string text, read_text_file(index_path));
  TERN_ASSIGN_OR_RETURN(json root, json_parse_strict(text, label, "key"));
  if (!root.is_object()) return make_error("{}: index is not a JSON object (got {})", label, root.type_name());
  if (const auto meta = root.find("metadata"); meta != root.end() && !meta->is_object() && !meta->is_null()) {
    return make_error("{}: 'metadata' is not an object (got {})", label, meta->type_name());
  }
  const auto map = root.find("weight_map");
  if (map == root.end()) return make_error("{}: missing 'weight_map'", label);
  if (!map->is_object()) return make_error("{}: 'weight_map' is not an object (got {})", label, map->type_name());
  if (map->empty()) return make_error("{}: 'weight_map' lists no tensors", label);
  WeightMap weights;
  for (const auto& [tensor, shard] : map->items()) {
    if (!shard.is_string()) {
      return make_error("{}: weight_map entry for tensor '{}' is not a file name (got {})", label, tensor,
                        shard.type_name());
    }
    const std::filesystem::path shard_path(shard.get<std::string>());
    const bool escapes = std::find(shard_path.begin(), shard_path.end(), "..") != shard_path.end();
    if (shard_path.empty() || shard_path.is_absolute() || escapes) {
      return make_error("{}: weight_map entry for tensor '{}' names '{}', which is not a file inside the model "
                        "directory", label, tensor, shard.get<std::string>());
    }
    weights.emplace_back(tensor, shard.get<std::string>());
  }
  return weights;
}

Expected<std::vector<SafetensorsFile>> open_shards(const std::filesystem::path& dir,
                                                   const std::filesystem::path& index_path,
                                                   const WeightMap& weights) {
  std::map<std::string, std::string> first_tensor_of_shard;  // sorted, so shards open in name order
  for (const auto& [tensor, shard] : weights) first_tensor_of_shard.emplace(shard, tensor);
  std::vector<SafetensorsFile> files;
  for (const auto& [shard, tensor] : first_tensor_of_shard) {
    const std::filesystem::path path = dir / shard;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) {
      return make_error("{}: shard '{}' (holding tensor '{}') does not exist in {}", index_path.string(), shard,
                        tensor, dir.string());
    }
    TERN_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(path));
    files.push_back(std::move(file));
  }
  return files;
}

Expected<std::vector<std::filesystem::path>> list_safetensors(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() == ".safetensors" && it->is_regular_file(ec)) files.push_back(it->path());
  }
  if (ec) return make_error("{}: cannot list directory: {}", dir.string(), ec.message());
  if (files.empty()) return make_error("{}: no .safetensors files in the directory", dir.string());
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

Expected<SafetensorsSet> SafetensorsSet::from_open_files(std::vector<SafetensorsFile> files) {
  SafetensorsSet set;
  set.files_ = std::move(files);
  for (const SafetensorsFile& file : set.files_) {
    for (const TensorView& t : file.tensors()) set.by_name_.push_back(&t);
  }
  std::sort(set.by_name_.begin(), set.by_name_.end(),
            [](const TensorView* a, const TensorView* b) { return a->name < b->name; });
  const auto dup = std::adjacent_find(set.by_name_.begin(), set.by_name_.end(),
                                      [](const TensorView* a, const TensorView* b) { return a->name == b->name; });
  if (dup != set.by_name_.end()) {
    return make_error("tensor '{}' appears in both {} and {}", (*dup)->name, (*dup)->file->string(),
                      (*(dup + 1))->file->string());
  }
  return set;
}

Expected<SafetensorsSet> SafetensorsSet::open_files(std::vector<std::filesystem::path> files) {
  if (files.empty()) return make_error("no safetensors files given");
  std::vector<SafetensorsFile> opened;
  opened.reserve(files.size());
  for (const std::filesystem::path& path : files) {
    TERN_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(path));
    opened.push_back(std::move(file));
  }
  return from_open_files(std::move(opened));
}

Expected<SafetensorsSet> SafetensorsSet::open_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return make_error("{}: not a directory", dir.string());
  const std::filesystem::path index_path = dir / kIndexFileName;
  if (std::filesystem::exists(index_path, ec)) {
    TERN_ASSIGN_OR_RETURN(WeightMap weights, read_index(index_path));
    TERN_ASSIGN_OR_RETURN(std::vector<SafetensorsFile> shards, open_shards(dir, index_path, weights));
    TERN_ASSIGN_OR_RETURN(SafetensorsSet set, from_open_files(std::move(shards)));
    for (const auto& [tensor, shard] : weights) {
      const TensorView* view = set.find(tensor);
      if (view == nullptr || *view->file != dir / shard) {
        return make_error("{}: tensor '{}' is mapped to shard '{}', which does not contain it",
                          index_path.string(), tensor, shard);
      }
    }
    return set;
  }
  // A single model.safetensors wins over other files (e.g. Mistral's consolidated.safetensors holds the same
  // weights under other names and must not be loaded beside it).
  if (std::filesystem::is_regular_file(dir / kSingleFileName, ec)) return open_files({dir / kSingleFileName});
  TERN_ASSIGN_OR_RETURN(std::vector<std::filesystem::path> files, list_safetensors(dir));
  return open_files(std::move(files));
}

const TensorView* SafetensorsSet::find(std::string_view name) const {
  const auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                                   [](const TensorView* t, std::string_view n) { return t->name < n; });
  return it != by_name_.end() && (*it)->name == name ? *it : nullptr;
}

std::vector<const TensorView*> SafetensorsSet::tensors() const { return by_name_; }

size_t SafetensorsSet::num_files() const { return files_.size(); }

// ---------------------------------------------------------------------------------------------------------------
// Writer

namespace {

// The header JSON, compact and padded with spaces to a multiple of 8 bytes. Built piece by piece: an ordered_json
// object would look keys up linearly, quadratic in the tensor count.
Expected<std::string> build_header(const std::vector<TensorToWrite>& tensors,
                                   const std::map<std::string, std::string>& metadata, std::string_view label) {
  std::string header = "{";
  std::set<std::string_view> names;
  uint64_t offset = 0;
  try {
    if (!metadata.empty()) header += fmt::format("\"{}\":{}", kMetadataKey, json(metadata).dump());
    for (const TensorToWrite& t : tensors) {
      const std::string where = fmt::format("{}: tensor '{}'", label, t.name);
      if (t.name == kMetadataKey) return make_error("{}: the name is reserved for metadata", where);
      if (!names.insert(t.name).second) return make_error("{}: name given twice", where);
      for (int64_t dim : t.shape) {
        if (dim < 0) return make_error("{}: negative dim in shape [{}]", where, fmt::join(t.shape, ", "));
      }
      TERN_ASSIGN_OR_RETURN(uint64_t bytes, shape_byte_size(t.shape, t.dtype, where));
      if (bytes != t.data.size()) {
        return make_error("{}: shape [{}] of {} needs {} bytes but {} were given", where, fmt::join(t.shape, ", "),
                          dtype_name(t.dtype), bytes, t.data.size());
      }
      nlohmann::ordered_json entry = {{"dtype", dtype_name(t.dtype)},
                                      {"shape", t.shape},
                                      {"data_offsets", {offset, offset + bytes}}};
      if (header.size() > 1) header += ',';
      header += json(t.name).dump() + ":" + entry.dump();
      offset += bytes;
    }
  } catch (const json::exception& e) {  // dump() throws on names or metadata that are not valid UTF-8
    return make_error("{}: cannot encode the header: {}", label, e.what());
  }
  header += '}';
  header.resize((header.size() + kLenPrefix - 1) / kLenPrefix * kLenPrefix, ' ');
  if (header.size() > kMaxHeaderLen) {
    return make_error("{}: header of {} bytes is over the {}-byte limit", label, header.size(), kMaxHeaderLen);
  }
  return header;
}

Expected<void> write_all(std::FILE* f, const void* data, size_t size, const std::filesystem::path& path) {
  if (size > 0 && std::fwrite(data, 1, size, f) != size) {
    return make_error("{}: write failed: {}", path.string(), std::strerror(errno));
  }
  return {};
}

Expected<void> write_file(const std::filesystem::path& path, const std::string& header,
                          const std::vector<TensorToWrite>& tensors) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return make_error("{}: cannot create: {}", path.string(), std::strerror(errno));
  std::array<unsigned char, kLenPrefix> len{};
  for (size_t i = 0; i < kLenPrefix; ++i) len[i] = static_cast<unsigned char>(header.size() >> (8 * i));
  Expected<void> result = write_all(f, len.data(), len.size(), path);
  if (result) result = write_all(f, header.data(), header.size(), path);
  for (size_t i = 0; result && i < tensors.size(); ++i) {
    result = write_all(f, tensors[i].data.data(), tensors[i].data.size(), path);
  }
  if (std::fclose(f) != 0 && result) result = make_error("{}: close failed: {}", path.string(), std::strerror(errno));
  return result;
}

}  // namespace

Expected<void> safetensors_write(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                                 const std::map<std::string, std::string>& metadata) {
  TERN_ASSIGN_OR_RETURN(std::string header, build_header(tensors, metadata, path.string()));
  // Write beside the target and rename, so a reader never sees a half-written file under the final name.
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  Expected<void> written = write_file(tmp, header, tensors);
  std::error_code ec;
  if (!written) {
    std::filesystem::remove(tmp, ec);
    return written;
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string reason = ec.message();
    std::filesystem::remove(tmp, ec);
    return make_error("{}: cannot rename the written file into place: {}", path.string(), reason);
  }
  return {};
}

}  // namespace tern
