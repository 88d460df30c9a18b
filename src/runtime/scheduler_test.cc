#include "runtime/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace tern {
namespace {

SchedulerConfig small_config() {
  return {.max_running = 2, .max_waiting = 3, .token_budget = 8, .block_size = 4, .num_blocks = 6};
}

TEST(Scheduler, ChunksPrefillUnderTheTokenBudget) {
  Scheduler s(small_config());
  ASSERT_TRUE(s.add(1, 13));
  StepPlan p = s.schedule();
  ASSERT_EQ(p.items.size(), 1u);
  EXPECT_EQ(p.items[0].begin, 0);
  EXPECT_EQ(p.items[0].count, 8);
  EXPECT_FALSE(p.items[0].samples);
  p = s.schedule();
  ASSERT_EQ(p.items.size(), 1u);
  EXPECT_EQ(p.items[0].begin, 8);
  EXPECT_EQ(p.items[0].count, 5);
  EXPECT_TRUE(p.items[0].samples);
  EXPECT_EQ(s.blocks().num_used(), 4);  // ceil(13 / 4)
  s.append_token(1);
  p = s.schedule();
  ASSERT_EQ(p.items.size(), 1u);
  EXPECT_EQ(p.items[0].begin, 13);
  EXPECT_EQ(p.items[0].count, 1);
  EXPECT_TRUE(p.items[0].samples);
  s.remove(1);
  EXPECT_EQ(s.blocks().num_used(), 0);
  EXPECT_EQ(s.num_running(), 0);
}

// A sequence's max_chunk caps its steps below the budget; the budget left goes to the next sequence.
TEST(Scheduler, MaxChunkCapsOneSequencesSteps) {
  Scheduler s(small_config());
  ASSERT_TRUE(s.add(1, 7, 3));
  ASSERT_TRUE(s.add(2, 4));
  StepPlan p = s.schedule();
  ASSERT_EQ(p.items.size(), 2u);
  EXPECT_EQ(p.items[0].id, 1u);
  EXPECT_EQ(p.items[0].count, 3);
  EXPECT_FALSE(p.items[0].samples);
  EXPECT_EQ(p.items[1].id, 2u);
  EXPECT_EQ(p.items[1].count, 4);
  p = s.schedule();
  ASSERT_GE(p.items.size(), 1u);
  EXPECT_EQ(p.items[0].begin, 3);
  EXPECT_EQ(p.items[0].count, 3);
  p = s.schedule();
  ASSERT_GE(p.items.size(), 1u);
  EXPECT_EQ(p.items[0].begin, 6);
  EXPECT_EQ(p.items[0].count, 1);
  EXPECT_TRUE(p.items[0].samples);
}

TEST(Scheduler, MixesDecodesWithAPrefillChunkAndCapsRunning) {
  Scheduler s(small_config());
  ASSERT_TRUE(s.add(1, 3));
  ASSERT_TRUE(s.add(2, 10));
  ASSERT_TRUE(s.add(3, 2));
  StepPlan p = s.schedule();
  ASSERT_EQ(p.items.size(), 2u);  // seq 1 whole (3), seq 2 the rest of the budget (5); seq 3 over max_running
  EXPECT_EQ(p.items[0].count, 3);
  EXPECT_EQ(p.items[1].id, 2u);
  EXPECT_EQ(p.items[1].count, 5);
  EXPECT_EQ(s.num_waiting(), 1);
  s.append_token(1);
  p = s.schedule();
  ASSERT_EQ(p.items.size(), 2u);
  EXPECT_EQ(p.items[0].count, 1);  // decode
  EXPECT_EQ(p.items[1].begin, 5);
  EXPECT_EQ(p.items[1].count, 5);
  EXPECT_TRUE(p.items[1].samples);
}

TEST(Scheduler, LookaheadReservesDraftPositionsAndAcceptedDraftsCountAsComputed) {
  SchedulerConfig c = small_config();
  c.num_lookahead = 4;
  c.token_budget = 32;
  c.num_blocks = 32;
  Scheduler s(c);
  ASSERT_TRUE(s.add(1, 5));
  StepPlan p = s.schedule();
  ASSERT_EQ(p.items.size(), 1u);
  EXPECT_TRUE(p.items[0].samples);
  EXPECT_EQ(s.blocks().num_used(), 3);  // ceil((5 + 4) / 4): the prompt and 4 positions after it
  // The step sampled 3 tokens: 2 accepted drafts (in the cache) and one more (not).
  s.append_token(1, true);
  s.append_token(1, true);
  s.append_token(1);
  p = s.schedule();
  ASSERT_EQ(p.items.size(), 1u);
  EXPECT_EQ(p.items[0].begin, 7);  // 5 + 2 accepted drafts already computed
  EXPECT_EQ(p.items[0].count, 1);
  EXPECT_TRUE(p.items[0].samples);
  EXPECT_EQ(s.blocks().num_used(), 3);  // ceil((7 + 1 + 4) / 4)
  // A prompt chunk that samples nothing reserves no lookahead.
  s.append_token(1);
  ASSERT_TRUE(s.add(2, 40));
  p = s.schedule();
  ASSERT_EQ(p.items.size(), 2u);
  EXPECT_FALSE(p.items[1].samples);
  EXPECT_EQ(p.items[1].count, 32 - 1 - 4);  // the budget less the decode and its lookahead
  EXPECT_EQ(s.blocks().num_used(), 4 + 7);  // seq 1: ceil((8 + 1 + 4) / 4) = 4 blocks; seq 2: ceil(27 / 4) = 7
}

TEST(Scheduler, BoundedQueueRefusesExtraRequests) {
  Scheduler s(small_config());
  EXPECT_TRUE(s.add(1, 1));
  EXPECT_TRUE(s.add(2, 1));
  EXPECT_TRUE(s.add(3, 1));
  EXPECT_FALSE(s.add(4, 1));
  s.remove(2);
  EXPECT_TRUE(s.add(4, 1));
}

TEST(Scheduler, PreemptsTheLatestAdmissionWhenBlocksRunOut) {
  Scheduler s(small_config());  // 6 blocks of 4 tokens
  ASSERT_TRUE(s.add(1, 8));       // 2 blocks
  ASSERT_TRUE(s.add(2, 16));      // 4 blocks, over two steps
  s.schedule();                  // 1: 8 tokens
  s.append_token(1);             // 9 tokens: needs a third block on its next step
  StepPlan p = s.schedule();     // 1 decode (3 blocks), 2 gets 7 tokens (2 blocks)
  ASSERT_EQ(p.items.size(), 2u);
  EXPECT_EQ(s.blocks().num_used(), 5);
  p = s.schedule();  // 2 wants 9 more tokens (16 total, 4 blocks): only 1 free -> 2 itself is preempted
  EXPECT_EQ(p.preempted, std::vector<uint64_t>{2});
  EXPECT_EQ(s.num_waiting(), 1);
  EXPECT_EQ(s.blocks().num_used(), 3);
  s.remove(1);
  p = s.schedule();  // recomputed from the start
  ASSERT_EQ(p.items.size(), 1u);
  EXPECT_EQ(p.items[0].id, 2u);
  EXPECT_EQ(p.items[0].begin, 0);
  EXPECT_EQ(p.items[0].count, 8);
  s.remove(2);
  EXPECT_EQ(s.blocks().num_used(), 0);
}

TEST(Scheduler, AdmissionWaitsForFreeBlocks) {
  SchedulerConfig c = small_config();
  c.num_blocks = 4;
  Scheduler s(c);
  ASSERT_TRUE(s.add(1, 8));  // 2 blocks
  ASSERT_TRUE(s.add(2, 8));
  s.schedule();  // 1: 8 tokens, 2 blocks; the budget is spent
  s.append_token(1);
  StepPlan p = s.schedule();  // 1 decodes into a third block; 2's first 7 tokens need 2 blocks, 1 is free
  ASSERT_EQ(p.items.size(), 1u);
  EXPECT_EQ(p.items[0].id, 1u);
  EXPECT_EQ(s.num_waiting(), 1);
  EXPECT_EQ(s.blocks().num_used(), 3);
  s.remove(1);
  p = s.schedule();
  ASSERT_EQ(p.items.size(), 1u);
  EXPECT_EQ(p.items[0].id, 2u);
  s.remove(2);
  EXPECT_EQ(s.blocks().num_used(), 0);
}

// The ids the model runs on come from the scheduler: each running sequence's blocks cover its planned tokens and
// are its own, its state slot is unique among the running, and both go back on preemption and removal.
TEST(Scheduler, OwnsTheBlockIdsAndStateSlotsOfRunningSequences) {
  SchedulerConfig c = small_config();
  c.max_running = 3;
  c.num_state_slots = 2;  // fewer slots than running places: the slots bound admission
  Scheduler s(c);
  ASSERT_TRUE(s.add(1, 5));
  ASSERT_TRUE(s.add(2, 3));
  ASSERT_TRUE(s.add(3, 1));
  StepPlan p = s.schedule();
  ASSERT_EQ(p.items.size(), 2u);  // seq 3 waits for a slot although a running place and budget are left
  EXPECT_EQ(s.state_slot_of(3), -1);
  const int32_t slot1 = s.state_slot_of(1), slot2 = s.state_slot_of(2);
  EXPECT_GE(slot1, 0);
  EXPECT_GE(slot2, 0);
  EXPECT_LT(slot1, 2);
  EXPECT_LT(slot2, 2);
  EXPECT_NE(slot1, slot2);
  ASSERT_EQ(s.kv_blocks_of(1).size(), 2u);  // 5 tokens in blocks of 4
  ASSERT_EQ(s.kv_blocks_of(2).size(), 1u);
  std::vector<int32_t> all(s.kv_blocks_of(1).begin(), s.kv_blocks_of(1).end());
  all.push_back(s.kv_blocks_of(2)[0]);
  for (int32_t b : all) {
    EXPECT_GE(b, 0);
    EXPECT_LT(b, c.num_blocks);
  }
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end()) << "a block given to two sequences";
  s.remove(1);
  p = s.schedule();  // seq 2 waits for a token (not appended); seq 3 takes the freed slot
  ASSERT_EQ(p.items.size(), 1u);
  EXPECT_EQ(p.items[0].id, 3u);
  EXPECT_EQ(s.state_slot_of(3), slot1);
  EXPECT_EQ(s.blocks().num_used(), 2);
}

TEST(Scheduler, PreemptionGivesBackTheStateSlot) {
  SchedulerConfig c{.max_running = 2, .max_waiting = 3, .token_budget = 8, .block_size = 4, .num_blocks = 2};
  Scheduler s(c);
  ASSERT_TRUE(s.add(1, 4));
  ASSERT_TRUE(s.add(2, 4));
  StepPlan p = s.schedule();
  ASSERT_EQ(p.items.size(), 2u);
  s.append_token(1);
  s.append_token(2);
  p = s.schedule();  // seq 1 needs a second block, none is free: seq 2, admitted last, is preempted
  ASSERT_EQ(p.preempted.size(), 1u);
  EXPECT_EQ(p.preempted[0], 2u);
  EXPECT_EQ(s.state_slot_of(2), -1);
  EXPECT_TRUE(s.kv_blocks_of(2).empty());
  EXPECT_GE(s.state_slot_of(1), 0);
  EXPECT_EQ(s.kv_blocks_of(1).size(), 2u);
}

}  // namespace
}  // namespace tern
