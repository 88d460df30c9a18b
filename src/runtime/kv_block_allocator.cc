#include "runtime/kv_block_allocator.h"

#include "core/error.h"

namespace tern {

KvBlockAllocator::KvBlockAllocator(int32_t num_blocks, int32_t block_size)
    : block_size_(block_size), in_use_(static_cast<size_t>(num_blocks), false) {
  TERN_CHECK(num_blocks > 0 && block_size > 0);
  free_.reserve(static_cast<size_t>(num_blocks));
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

std::optional<std::vector<int32_t>> KvBlockAllocator::allocate(int64_t n) {
  if (n < 0 || n > static_cast<int64_t>(free_.size())) return std::nullopt;
  std::vector<int32_t> blocks(free_.end() - n, free_.end());
  free_.resize(free_.size() - static_cast<size_t>(n));
  for (int32_t b : blocks) in_use_[static_cast<size_t>(b)] = true;
  return blocks;
}

void KvBlockAllocator::release(std::span<const int32_t> blocks) {
  for (int32_t b : blocks) {
    TERN_CHECK(b >= 0 && b < num_total() && in_use_[static_cast<size_t>(b)]);
    in_use_[static_cast<size_t>(b)] = false;
    free_.push_back(b);
  }
}

}  // namespace tern
