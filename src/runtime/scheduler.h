// Continuous batching: which tokens of which sequences go into the next forward step.
//
// Every step spends at most `token_budget` tokens. Running sequences come first, in admission order: a decode
// costs one token, an unfinished prefill takes the next chunk that fits the budget. Then waiting sequences are
// admitted in arrival order while there is budget, a free running slot and KV blocks for their first chunk.
// When a running sequence needs a block and none is free, the most recently admitted sequence is preempted: its
// blocks are freed, its cache must be dropped, and it goes back to the front of the queue to be recomputed
// (prompt and output so far) later.
//
// The scheduler owns the cache ids the model runs on: the KV blocks of each sequence (kv_blocks_of, in token order)
// and, for models with recurrent state, its state slot (state_slot_of: one per running sequence, taken at
// admission, given back on preemption or removal). The model runner reads them from each step's inputs.
//
//   Scheduler s(config);
//   s.add(id, prompt_len);                  // false: the queue is full
//   StepPlan plan = s.schedule();           // run plan.items; drop the caches of plan.preempted
//   s.append_token(id);                     // after sampling a token for an item with `samples`
//   s.append_token(id, /*computed=*/true);  // a speculative draft the step verified and accepted
//   s.remove(id);                           // finished or cancelled
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <span>
#include <vector>

#include "runtime/kv_block_allocator.h"

namespace tern {

struct SchedulerConfig {
  int32_t max_running = 64;
  int32_t max_waiting = 256;
  int64_t token_budget = 2048;  // tokens per step (the chunked-prefill size)
  int32_t block_size = 16;
  int32_t num_blocks = 4096;
  int32_t num_state_slots = 0;  // recurrent-state slots; 0: one per running sequence (max_running)
  // Positions past its last token that a sampling step of a sequence may write (speculative decoding's drafts and
  // its draft module's chain): reserved in KV blocks and charged to the token budget.
  int32_t num_lookahead = 0;
};

struct StepItem {
  uint64_t id = 0;
  int64_t begin = 0;  // first token (index into prompt + output) to run
  int64_t count = 0;
  bool samples = false;  // the chunk reaches the last known token, so its logits give the next token
};

struct StepPlan {
  std::vector<StepItem> items;
  std::vector<uint64_t> preempted;  // their caches must be reset before running `items`
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config);

  // `max_chunk` > 0: the most tokens a step runs of this sequence (a prompt whose logits the caller reads whole).
  bool add(uint64_t id, int64_t num_tokens, int64_t max_chunk = 0);
  void remove(uint64_t id);
  // A token the sequence gained; `computed`: one the step already ran into the cache (an accepted draft).
  void append_token(uint64_t id, bool computed = false);
  StepPlan schedule();

  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  const KvBlockAllocator& blocks() const { return blocks_; }
  // The physical KV blocks holding `id`'s cached and planned tokens, in order; valid until the next schedule().
  std::span<const int32_t> kv_blocks_of(uint64_t id) const { return seqs_.at(id).blocks; }
  // `id`'s recurrent-state slot while it runs, -1 while it waits.
  int32_t state_slot_of(uint64_t id) const { return seqs_.at(id).state_slot; }
  bool contains(uint64_t id) const { return seqs_.contains(id); }

 private:
  struct Seq {
    int64_t num_tokens = 0;    // prompt + output tokens known so far
    int64_t num_computed = 0;  // tokens in the cache (or planned into it)
    int64_t max_chunk = 0;     // > 0: the most tokens of one step
    std::vector<int32_t> blocks;
    int32_t state_slot = -1;
  };
  bool reserve(Seq& seq, int64_t num_cached);
  void preempt(uint64_t id, StepPlan& plan);
  void release_slot(Seq& seq);
  bool schedule_running(uint64_t id, int64_t& budget, StepPlan& plan);
  // The tokens of `seq` the next step may run within `budget`.
  static int64_t chunk_of(const Seq& seq, int64_t budget);

  SchedulerConfig config_;
  KvBlockAllocator blocks_;
  KvBlockAllocator slots_;  // state slots, as blocks of one
  std::map<uint64_t, Seq> seqs_;
  std::vector<uint64_t> running_;  // admission order
  std::deque<uint64_t> waiting_;
};

}  // namespace tern
