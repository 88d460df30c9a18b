#include "runtime/kv_block_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

namespace tern {
namespace {

TEST(KvBlockAllocator, BlocksForTokensRoundsUp) {
  EXPECT_EQ(KvBlockAllocator::blocks_for_tokens(0, 16), 0);
  EXPECT_EQ(KvBlockAllocator::blocks_for_tokens(1, 16), 1);
  EXPECT_EQ(KvBlockAllocator::blocks_for_tokens(16, 16), 1);
  EXPECT_EQ(KvBlockAllocator::blocks_for_tokens(17, 16), 2);
}

TEST(KvBlockAllocator, AllocatesDistinctBlocksUntilExhausted) {
  KvBlockAllocator a(10, 16);
  auto x = a.allocate(4);
  auto y = a.allocate(6);
  ASSERT_TRUE(x && y);
  std::set<int32_t> all(x->begin(), x->end());
  all.insert(y->begin(), y->end());
  EXPECT_EQ(all.size(), 10u);
  EXPECT_EQ(*all.begin(), 0);
  EXPECT_EQ(*all.rbegin(), 9);
  EXPECT_EQ(a.num_free(), 0);
  EXPECT_FALSE(a.allocate(1));
  a.release(*x);
  EXPECT_EQ(a.num_used(), 6);
  EXPECT_FALSE(a.allocate(5));
  EXPECT_EQ(a.num_free(), 4);  // a failed allocation changes nothing
  auto z = a.allocate(4);
  ASSERT_TRUE(z);
  a.release(*y);
  a.release(*z);
  EXPECT_EQ(a.num_used(), 0);
}

TEST(KvBlockAllocatorDeathTest, DoubleReleaseIsAnInternalError) {
  KvBlockAllocator a(2, 16);
  auto x = a.allocate(1);
  a.release(*x);
  EXPECT_DEATH(a.release(*x), "");
}

}  // namespace
}  // namespace tern
