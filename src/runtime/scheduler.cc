#include "runtime/scheduler.h"

#include <algorithm>

#include "core/error.h"

namespace tern {

Scheduler::Scheduler(const SchedulerConfig& config)
    : config_(config),
      blocks_(config.num_blocks, config.block_size),
      slots_(config.num_state_slots > 0 ? config.num_state_slots : config.max_running, 1) {}

bool Scheduler::add(uint64_t id, int64_t num_tokens, int64_t max_chunk) {
  TERN_CHECK(!seqs_.contains(id) && num_tokens > 0);
  if (num_waiting() >= config_.max_waiting) return false;
  seqs_[id] = Seq{.num_tokens = num_tokens, .max_chunk = max_chunk};
  waiting_.push_back(id);
  return true;
}

void Scheduler::remove(uint64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  blocks_.release(it->second.blocks);
  release_slot(it->second);
  seqs_.erase(it);
  std::erase(running_, id);
  std::erase(waiting_, id);
}

void Scheduler::append_token(uint64_t id, bool computed) {
  auto it = seqs_.find(id);
  TERN_CHECK(it != seqs_.end());
  ++it->second.num_tokens;
  if (computed) {
    TERN_CHECK(it->second.num_computed < it->second.num_tokens);
    ++it->second.num_computed;
  }
}

int64_t Scheduler::chunk_of(const Seq& seq, int64_t budget) {
  const int64_t count = std::min(seq.num_tokens - seq.num_computed, budget);
  return seq.max_chunk > 0 ? std::min(count, seq.max_chunk) : count;
}

bool Scheduler::reserve(Seq& seq, int64_t num_cached) {
  const int64_t need = KvBlockAllocator::blocks_for_tokens(num_cached, config_.block_size) -
                       static_cast<int64_t>(seq.blocks.size());
  if (need <= 0) return true;
  auto got = blocks_.allocate(need);
  if (!got) return false;
  seq.blocks.insert(seq.blocks.end(), got->begin(), got->end());
  return true;
}

void Scheduler::release_slot(Seq& seq) {
  if (seq.state_slot < 0) return;
  const int32_t slot[] = {seq.state_slot};
  slots_.release(slot);
  seq.state_slot = -1;
}

void Scheduler::preempt(uint64_t id, StepPlan& plan) {
  Seq& seq = seqs_.at(id);
  blocks_.release(seq.blocks);
  seq.blocks.clear();
  release_slot(seq);
  seq.num_computed = 0;
  std::erase(running_, id);
  waiting_.push_front(id);
  plan.preempted.push_back(id);
}

// Plans the next chunk of one running sequence, preempting later admissions while blocks are short. False when
// the sequence itself had to be preempted.
bool Scheduler::schedule_running(uint64_t id, int64_t& budget, StepPlan& plan) {
  Seq& seq = seqs_.at(id);
  const int64_t count = chunk_of(seq, budget);
  if (count <= 0) return true;
  const bool samples = seq.num_computed + count == seq.num_tokens;
  const int64_t lookahead = samples ? config_.num_lookahead : 0;
  while (!reserve(seq, seq.num_computed + count + lookahead)) {
    const uint64_t victim = running_.back();
    preempt(victim, plan);
    if (victim == id) return false;
  }
  plan.items.push_back({id, seq.num_computed, count, samples});
  seq.num_computed += count;
  budget -= count + lookahead;
  return true;
}

StepPlan Scheduler::schedule() {
  StepPlan plan;
  int64_t budget = config_.token_budget;
  // A copy: preemption removes entries from running_ while we walk it.
  const std::vector<uint64_t> order = running_;
  for (uint64_t id : order) {
    if (budget <= 0) break;
    if (std::find(running_.begin(), running_.end(), id) == running_.end()) continue;  // preempted this step
    if (!schedule_running(id, budget, plan)) break;
  }
  // After a preemption, blocks are short: admitting now would only preempt again.
  if (!plan.preempted.empty()) return plan;
  while (budget > 0 && !waiting_.empty() && num_running() < config_.max_running && slots_.num_free() > 0) {
    const uint64_t id = waiting_.front();
    Seq& seq = seqs_.at(id);
    const int64_t count = chunk_of(seq, budget);
    const bool samples = seq.num_computed + count == seq.num_tokens;
    const int64_t lookahead = samples ? config_.num_lookahead : 0;
    if (!reserve(seq, seq.num_computed + count + lookahead)) break;
    seq.state_slot = slots_.allocate(1)->front();
    waiting_.pop_front();
    running_.push_back(id);
    plan.items.push_back({id, seq.num_computed, count, samples});
    seq.num_computed += count;
    budget -= count + lookahead;
  }
  return plan;
}

}  // namespace tern
