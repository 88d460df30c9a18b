// libFuzzer target for safetensors_parse_header: any input must give a value or an Error, never a crash or an
// out-of-bounds read (ASan/UBSan watch the parser), and every accepted header must describe ranges that tile the
// data section of the input exactly. A violated invariant aborts, which libFuzzer reports as a crash.
#include <cstdio>
#include <cstdlib>
#include <span>

#include "io/safetensors.h"

namespace {

[[noreturn]] void invariant_failed(const char* what, const tern::SafetensorsHeaderEntry* e) {
  std::fprintf(stderr, "safetensors_header_fuzz: accepted header breaks an invariant: %s (tensor '%s')\n", what,
               e ? e->name.c_str() : "");
  std::abort();
}

void check_accepted(const tern::SafetensorsHeader& header, uint64_t file_size) {
  if (file_size < 8 || header.header_len > file_size - 8) invariant_failed("header runs past the file", nullptr);
  const uint64_t data_size = file_size - 8 - header.header_len;
  uint64_t covered = 0;
  for (const tern::SafetensorsHeaderEntry& e : header.entries) {
    if (e.begin > e.end) invariant_failed("begin > end", &e);
    if (e.end > data_size) invariant_failed("range past the data section", &e);
    if (e.begin != covered) invariant_failed("entries do not tile the data section in order", &e);
    covered = e.end;
    uint64_t numel = 1;
    for (int64_t dim : e.shape) {
      if (dim < 0) invariant_failed("negative dim", &e);
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel)) invariant_failed("numel overflow", &e);
    }
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(numel, tern::dtype_size(e.dtype), &bytes) || bytes != e.end - e.begin) {
      invariant_failed("byte length differs from shape x dtype size", &e);
    }
  }
  if (covered != data_size) invariant_failed("data section not fully covered", nullptr);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  tern::Expected<tern::SafetensorsHeader> header = tern::safetensors_parse_header(bytes, "fuzz-input");
  if (header) {
    check_accepted(*header, size);
  } else if (header.error().message.rfind("fuzz-input: ", 0) != 0) {
    std::fprintf(stderr, "error does not name the file: %s\n", header.error().message.c_str());
    std::abort();
  }
  return 0;
}
