// safetensors checkpoints: one memory-mapped file or a directory of shards, read zero-copy, plus a writer.
//
// File layout: an 8-byte little-endian u64 N, then N bytes of UTF-8 JSON header
//   {"__metadata__": {str: str}, "name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...}
// then the data section; offsets are relative to its start. Validation follows the Rust `safetensors` crate
// (see safetensors.cc), so a file we accept is one the reference accepts, and every malformed file gives an Error
// naming the file and, where known, the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tern {

enum class DType { kBF16, kF16, kF32, kF64, kF8E4M3, kF8E5M2, kU8, kI8, kI16, kI32, kI64, kBool };

// "BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "U8", "I8", "I16", "I32", "I64", "BOOL" (the header's names).
std::string_view dtype_name(DType dtype);
std::optional<DType> dtype_from_name(std::string_view name);
size_t dtype_size(DType dtype);

// A zero-copy view into a mapped file; valid while the SafetensorsFile (or Set) that made it is alive.
struct TensorView {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;              // empty for a 0-d tensor (one element)
  std::span<const std::byte> data;         // exactly numel() * dtype_size(dtype) bytes
  const std::filesystem::path* file;       // the file it lives in (for error messages)

  int64_t numel() const;

  // The data as elements of T. Aborts (TERN_CHECK) if sizeof(T) differs from the dtype's size or the data is not
  // aligned for T: files written with tensors in an order that breaks alignment must be copied by the caller.
  template <class T>
  std::span<const T> as() const {
    TERN_CHECK(sizeof(T) == dtype_size(dtype), "tensor '{}' in {}: element size {} != dtype {} size {}", name,
               file ? file->string() : std::string("?"), sizeof(T), dtype_name(dtype), dtype_size(dtype));
    TERN_CHECK(reinterpret_cast<uintptr_t>(data.data()) % alignof(T) == 0,
               "tensor '{}' in {}: data is not aligned to {} bytes", name, file ? file->string() : std::string("?"),
               alignof(T));
    return {reinterpret_cast<const T*>(data.data()), data.size() / sizeof(T)};
  }
};

// One mmapped file (MAP_PRIVATE, PROT_READ); movable, not copyable; unmaps on destruction. The mapping and the
// views live on the heap, so moving the file keeps TensorView addresses and their `file` pointers valid.
class SafetensorsFile {
 public:
  static Expected<SafetensorsFile> open(const std::filesystem::path& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::vector<TensorView>& tensors() const;          // in data-offset order
  const TensorView* find(std::string_view name) const;     // nullptr if absent
  const std::map<std::string, std::string>& metadata() const;
  const std::filesystem::path& path() const;

 private:
  struct Impl;
  explicit SafetensorsFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A model directory: one model.safetensors, or an index + shards.
class SafetensorsSet {
 public:
  // dir holding model.safetensors.index.json (sharded) or exactly model.safetensors; otherwise every
  // *.safetensors file in the directory (error if none). Tensor names must be unique across files.
  // With an index, the shards are the files its weight_map names, and each tensor it lists must be in its shard;
  // a shard's tensors that the index omits are still served, as transformers loads whole shards.
  static Expected<SafetensorsSet> open_dir(const std::filesystem::path& dir);
  static Expected<SafetensorsSet> open_files(std::vector<std::filesystem::path> files);

  const TensorView* find(std::string_view name) const;
  std::vector<const TensorView*> tensors() const;          // all tensors, sorted by name
  size_t num_files() const;

 private:
  static Expected<SafetensorsSet> from_open_files(std::vector<SafetensorsFile> files);

  std::vector<SafetensorsFile> files_;
  std::vector<const TensorView*> by_name_;                 // sorted by name; points into files_
};

// The header parser on its own, over bytes in memory (used by open() and by the fuzzer). `label` is the file name
// used in error messages. On success every tensor's byte range lies inside `file_size - 8 - header_len`, and the
// entries are in data-offset order.
struct SafetensorsHeaderEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;  // relative to the data section
};
struct SafetensorsHeader {
  uint64_t header_len;
  std::vector<SafetensorsHeaderEntry> entries;
  std::map<std::string, std::string> metadata;
};
Expected<SafetensorsHeader> safetensors_parse_header(std::span<const std::byte> file_bytes, std::string_view label);

// Writes tensors in the order given, contiguous, after a header padded with spaces to a multiple of 8 bytes (as the
// reference writer does). Elements stay aligned only if the caller orders tensors by descending dtype size.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;
};
Expected<void> safetensors_write(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                                 const std::map<std::string, std::string>& metadata = {});

}  // namespace tern
