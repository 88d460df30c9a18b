// FNV-1a, 64 bits: a fast, stable hash of bytes (dummy weights' per-tensor streams, the nodes' config.json check).
#pragma once

#include <cstdint>
#include <string_view>

namespace tern {

// `seed` is xored into the offset basis, so distinct seeds give distinct streams of the same bytes.
inline uint64_t fnv1a64(std::string_view bytes, uint64_t seed = 0) {
  uint64_t h = seed ^ 0xCBF29CE484222325ull;
  for (char c : bytes) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001B3ull;
  return h;
}

}  // namespace tern
