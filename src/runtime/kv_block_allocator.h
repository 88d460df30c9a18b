// KV-cache capacity in fixed-size blocks of tokens. The scheduler charges every sequence the blocks its cached
// tokens need and gives them back when the sequence finishes or is preempted, so the number of tokens held across
// all running sequences never exceeds the configured total (--max-total-tokens).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace tern {

class KvBlockAllocator {
 public:
  KvBlockAllocator(int32_t num_blocks, int32_t block_size);

  static int64_t blocks_for_tokens(int64_t num_tokens, int32_t block_size) {
    return (num_tokens + block_size - 1) / block_size;
  }

  // `n` free block ids, or nothing (and no change) when fewer are free.
  std::optional<std::vector<int32_t>> allocate(int64_t n);
  // Gives blocks back; a block that is not currently allocated is an internal error.
  void release(std::span<const int32_t> blocks);

  int32_t block_size() const { return block_size_; }
  int32_t num_total() const { return static_cast<int32_t>(in_use_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_total() - num_free(); }

 private:
  int32_t block_size_;
  std::vector<int32_t> free_;  // a stack: the most recently freed block is reused first
  std::vector<bool> in_use_;
};

}  // namespace tern
