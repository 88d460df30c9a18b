// The host-side argument checks the checked launchers share (attention.cc, mla.cc, indexer.cc): a null pointer and a
// pointer the kernel reads 16 bytes at a time, each an error naming the kernel and the argument.
#pragma once

#include <cstdint>

#include "core/error.h"

namespace tern {

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

inline Expected<void> check_pointer(const char* kernel, const char* name, const void* ptr) {
  if (ptr == nullptr) return make_error("{}: {} is null", kernel, name);
  return {};
}

inline Expected<void> check_vec_pointer(const char* kernel, const char* name, const void* ptr) {
  TERN_TRY(check_pointer(kernel, name, ptr));
  if (!aligned16(ptr)) return make_error("{}: {} is not 16-byte aligned", kernel, name);
  return {};
}

}  // namespace tern
