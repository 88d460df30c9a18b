#include "runtime/engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "runtime/speculative.h"

namespace tern {

using Clock = std::chrono::steady_clock;

std::vector<TokenEvent> RequestStream::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  ready_.wait_for(lock, timeout, [&] { return !events_.empty(); });
  std::vector<TokenEvent> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  return out;
}

void RequestStream::cancel() {
  std::lock_guard lock(mutex_);
  cancelled_ = true;
}

bool RequestStream::cancelled() const {
  std::lock_guard lock(mutex_);
  return cancelled_;
}

void RequestStream::push(TokenEvent event) {
  {
    std::lock_guard lock(mutex_);
    events_.push_back(std::move(event));
  }
  ready_.notify_all();
}

struct Engine::Active {
  uint64_t id = 0;
  std::shared_ptr<RequestStream> stream;
  GenerationRequest request;
  std::vector<int32_t> tokens;  // prompt + output
  Sampler sampler;
  StopChecker stop;
  std::optional<IncrementalDetokenizer> detokenizer;
  SequenceCache cache;
  Clock::time_point arrival, last_token;
  bool has_token = false;
  std::vector<int32_t> drafts;  // speculative decoding: the draft tokens the next step verifies
  int64_t prompt_logprobs_next = 1;  // the next prompt position whose logprob is to be sent

  bool wants_prompt_logprobs() const {
    return request.prompt_logprobs >= 0 && prompt_logprobs_next < static_cast<int64_t>(request.prompt.size());
  }
  Active(GenerationRequest r, const StopCriteria& criteria)
      : request(std::move(r)), tokens(request.prompt), sampler(request.sampling), stop(criteria) {}
  std::span<const int32_t> output() const {
    return std::span(tokens).subspan(request.prompt.size());
  }
};

Engine::Engine(std::unique_ptr<ModelRunner> model, std::optional<Tokenizer> tokenizer, const EngineConfig& config,
               EngineMetrics& metrics)
    : model_(std::move(model)), tokenizer_(std::move(tokenizer)), config_(config), metrics_(metrics),
      scheduler_([&] {
        // A sampling step writes the drafts after its last token and the draft module's chain after the kept
        // tokens: at most 2 * steps positions past the last token.
        SchedulerConfig c = config.scheduler;
        c.num_lookahead = 2 * config.speculative_steps;
        return c;
      }()) {
  metrics_.kv_blocks_total = scheduler_.blocks().num_total();
  thread_ = std::thread([this] { run(); });
}

Engine::~Engine() { shutdown(); }

Expected<std::shared_ptr<RequestStream>> Engine::submit(GenerationRequest request) {
  if (request.prompt_logprobs >= 0 && config_.speculative_steps > 0) {
    return make_error("prompt logprobs are not available with speculative decoding");
  }
  StopCriteria criteria = request.stop;
  if (!request.ignore_eos) {
    for (int64_t id : model_->config().eos_token_ids) criteria.stop_token_ids.push_back(static_cast<int32_t>(id));
  }
  auto active = std::make_unique<Active>(std::move(request), criteria);
  if (criteria.min_tokens > 0 && !criteria.stop_token_ids.empty()) {
    // min_tokens keeps the stop ids (the model's EOS among them unless ignore_eos) from being sampled by every row
    // whose output is shorter: the sampler decides per row, so a speculative verification's rows each by the drafts
    // before them (SamplingParams::banned_until).
    std::vector<int32_t> ban = criteria.stop_token_ids;
    std::ranges::sort(ban);
    const auto [first, last] = std::ranges::unique(ban);
    ban.erase(first, last);
    active->sampler.set_banned_ids(std::move(ban), criteria.min_tokens);
  }
  active->stream = std::make_shared<RequestStream>(static_cast<int64_t>(active->tokens.size()));
  active->arrival = Clock::now();
  if (tokenizer_) active->detokenizer.emplace(*tokenizer_, active->request.skip_special_tokens);
  std::shared_ptr<RequestStream> stream = active->stream;
  {
    std::lock_guard lock(inbox_mutex_);
    if (stopping_) return make_error("the server is shutting down");
    if (failure_) return make_error("the model can run no more steps: {}", *failure_);
    if (static_cast<int64_t>(inbox_.size()) + num_waiting_snapshot_ >= config_.scheduler.max_waiting) {
      return make_error("the request queue is full ({} waiting)", config_.scheduler.max_waiting);
    }
    active->id = next_id_++;
    inbox_.push_back(std::move(active));
    metrics_.num_waiting = static_cast<int64_t>(inbox_.size()) + num_waiting_snapshot_;
  }
  inbox_ready_.notify_one();
  return stream;
}

void Engine::shutdown() {
  {
    std::lock_guard lock(inbox_mutex_);
    stopping_ = true;
  }
  inbox_ready_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Engine::run() {
  for (;;) {
    {
      std::unique_lock lock(inbox_mutex_);
      if (active_.empty() && !stopping_) {
        inbox_ready_.wait_for(lock, std::chrono::milliseconds(50), [&] { return stopping_ || !inbox_.empty(); });
      }
      if (stopping_) break;
    }
    admit_new();
    sweep_cancelled();
    if (!active_.empty()) step();
    publish_gauges();
  }
  admit_new();
  std::vector<uint64_t> ids;
  for (const auto& [id, a] : active_) ids.push_back(id);
  for (uint64_t id : ids) finish(id, "abort");
  publish_gauges();
}

void Engine::admit_new() {
  std::vector<std::unique_ptr<Active>> fresh;
  {
    std::lock_guard lock(inbox_mutex_);
    fresh.swap(inbox_);
  }
  for (auto& a : fresh) {
    a->cache = model_->new_sequence();
    const uint64_t id = a->id;
    // A prompt whose logprobs are asked for runs at most max_running tokens a step: the rows of logits a GPU runner
    // holds without growing the buffer its CUDA graphs read (which would drop them).
    const int64_t max_chunk =
        a->request.prompt_logprobs >= 0 ? std::min<int64_t>(kPromptLogprobsChunk, config_.scheduler.max_running) : 0;
    if (!scheduler_.add(id, static_cast<int64_t>(a->tokens.size()), max_chunk)) {
      a->stream->push({.finished = true, .finish_reason = "error", .error = "the request queue is full"});
      continue;
    }
    metrics_.prompt_tokens += a->request.prompt.size();
    active_[id] = std::move(a);
  }
}

void Engine::sweep_cancelled() {
  std::vector<uint64_t> gone;
  for (const auto& [id, a] : active_) {
    if (a->stream->cancelled()) gone.push_back(id);
  }
  for (uint64_t id : gone) finish(id, "abort");
}

namespace {

SequenceInput input_of(std::span<const int32_t> tokens, const StepItem& item, SequenceCache& cache,
                       const Scheduler& scheduler) {
  return {.cache = &cache,
          .tokens = tokens.subspan(static_cast<size_t>(item.begin), static_cast<size_t>(item.count)),
          .kv_blocks = scheduler.kv_blocks_of(item.id),
          .state_slot = scheduler.state_slot_of(item.id)};
}

}  // namespace

void Engine::step() {
  const StepPlan plan = scheduler_.schedule();
  for (uint64_t id : plan.preempted) {
    active_.at(id)->cache = model_->new_sequence();
    active_.at(id)->drafts.clear();
    ++metrics_.preemptions;
  }
  if (plan.items.empty()) return;
  if (config_.speculative_steps > 0) {
    step_speculative(plan);
    return;
  }
  // Items of requests with prompt logprobs still to send run apart; the rest as one batch (those still active after
  // the first part: a failure of the model for good ends them all).
  StepPlan scored, rest;
  for (const StepItem& item : plan.items) {
    (active_.at(item.id)->wants_prompt_logprobs() ? scored : rest).items.push_back(item);
  }
  if (!scored.items.empty()) {
    step_prompt_logprobs(scored);
    std::erase_if(rest.items, [&](const StepItem& item) { return !active_.contains(item.id); });
    if (rest.items.empty()) return;
  }
  std::vector<SequenceInput> batch;
  std::vector<SampleRow> rows;
  batch.reserve(rest.items.size());
  rows.reserve(rest.items.size());
  for (const StepItem& item : rest.items) {
    Active& a = *active_.at(item.id);
    batch.push_back(input_of(a.tokens, item, a.cache, scheduler_));
    rows.push_back(item.samples ? SampleRow{&a.sampler, a.request.prompt, a.output()} : SampleRow{});
  }
  auto sampled = model_->forward_sample(batch, rows);
  if (!sampled) {
    fail_step(rest, sampled.error());
    return;
  }
  for (size_t i = 0; i < rest.items.size(); ++i) {
    if (!rest.items[i].samples) continue;
    take_token(*active_.at(rest.items[i].id), std::move((*sampled)[i]));
  }
}

void Engine::step_prompt_logprobs(const StepPlan& plan) {
  // One forward per sequence, so that no step returns more rows of logits than one sequence's chunk.
  const auto vocab = static_cast<size_t>(model_->config().vocab_size);
  for (const StepItem& item : plan.items) {
    if (!active_.contains(item.id)) continue;  // ended by a failure of the model for good
    Active& a = *active_.at(item.id);
    const std::vector<SequenceInput> batch{input_of(a.tokens, item, a.cache, scheduler_)};
    auto logits = model_->forward(batch, LogitsFor::kAllTokens);
    if (!logits) {
      fail_step(StepPlan{.items = {item}}, logits.error());
      continue;
    }
    auto row = [&](int64_t r) {
      return std::span<const float>(*logits).subspan(static_cast<size_t>(r) * vocab, vocab);
    };
    // Row r's logits give the token at position begin + r + 1; a recomputed prompt (after a preemption) sends
    // nothing twice.
    TokenEvent event;
    std::optional<Error> failed;
    const auto prompt_len = static_cast<int64_t>(a.request.prompt.size());
    for (int64_t r = 0; r < item.count; ++r) {
      const int64_t next = item.begin + r + 1;
      if (next != a.prompt_logprobs_next || next >= prompt_len) continue;
      auto lp = logits_token_logprob(row(r), a.request.prompt[static_cast<size_t>(next)], a.request.prompt_logprobs);
      if (!lp) {
        failed = lp.error();
        break;
      }
      event.prompt_logprobs.push_back(std::move(*lp));
      ++a.prompt_logprobs_next;
    }
    if (!event.prompt_logprobs.empty()) a.stream->push(std::move(event));
    if (failed) {
      take_token(a, tl::unexpected<Error>(*failed));
      continue;
    }
    if (item.samples) take_token(a, a.sampler.sample(row(item.count - 1), a.request.prompt, a.output()));
  }
}

void Engine::fail_step(const StepPlan& plan, const Error& error) {
  spdlog::error("forward step failed: {}", error.message);
  // A broken model is recorded before any request hears of the failure: a client that sees its stream fail and then
  // asks /health must find it unhealthy.
  const std::optional<std::string> why = model_->failure();
  if (why) {
    spdlog::error("the model can run no more steps: {}", *why);
    std::lock_guard lock(inbox_mutex_);
    failure_ = why;
  }
  for (const StepItem& item : plan.items) finish(item.id, "error", error.message);
  if (!why) return;
  // Nothing queued can run either.
  std::vector<uint64_t> rest;
  for (const auto& [id, a] : active_) rest.push_back(id);
  for (const uint64_t id : rest) finish(id, "error", "the model can run no more steps: " + *why);
}

void Engine::step_speculative(const StepPlan& plan) {
  int sampling = 0;
  for (const StepItem& item : plan.items) sampling += item.samples ? 1 : 0;
  // Past the batch size where verifying stops paying, or where the governor measured that it does not, this step
  // verifies nothing; the draft module still follows.
  const int limit = config_.speculative_disable_batch_size;
  const bool verify = (limit <= 0 || sampling < limit) &&
                      (!config_.speculative_adaptive || sampling == 0 || governor_.verify(sampling));
  // A steady step (the previous step's mode, no prompt chunk) is what the governor learns from.
  bool steady = verify == last_verified_ && sampling > 0;
  for (const StepItem& item : plan.items) steady = steady && item.samples && item.count == 1;
  last_verified_ = verify;
  const auto start = std::chrono::steady_clock::now();
  std::vector<SpecSequence> seqs;
  seqs.reserve(plan.items.size());
  for (const StepItem& item : plan.items) {
    Active& a = *active_.at(item.id);
    if (!verify) a.drafts.clear();
    const std::span<const int32_t> known(a.tokens);
    SpecSequence s;
    s.input = {.cache = &a.cache,
               .tokens = known.subspan(static_cast<size_t>(item.begin), static_cast<size_t>(item.count)),
               .kv_blocks = scheduler_.kv_blocks_of(item.id),
               .state_slot = scheduler_.state_slot_of(item.id)};
    s.following = known.subspan(static_cast<size_t>(item.begin) + 1);
    if (item.samples) s.sample = {&a.sampler, a.request.prompt, a.output()};
    s.drafts = &a.drafts;
    seqs.push_back(s);
  }
  auto outcomes = speculative_step(*model_, seqs, verify ? config_.speculative_steps : 0);
  if (!outcomes) {
    fail_step(plan, outcomes.error());
    return;
  }
  if (config_.speculative_adaptive && steady) {
    int64_t tokens = 0;
    for (const SpecOutcome& o : *outcomes) tokens += static_cast<int64_t>(o.tokens.size());
    governor_.record(sampling, verify, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                     static_cast<double>(tokens) / sampling);
  }
  for (size_t i = 0; i < plan.items.size(); ++i) {
    if (!plan.items[i].samples) continue;
    Active& a = *active_.at(plan.items[i].id);
    SpecOutcome& o = (*outcomes)[i];
    if (o.error) {
      take_token(a, tl::unexpected<Error>(*o.error));
      continue;
    }
    if (o.drafted > 0) {
      ++metrics_.spec_verify_steps;
      metrics_.spec_draft_tokens += static_cast<uint64_t>(o.drafted);
      metrics_.spec_accepted_tokens += static_cast<uint64_t>(o.accepted);
      static_assert(EngineMetrics::kSpecPositions == kMaxSpeculativeSteps);
      for (int64_t k = 0; k < std::min<int64_t>(o.drafted, EngineMetrics::kSpecPositions); ++k) {
        ++metrics_.spec_draft_tokens_at[static_cast<size_t>(k)];
        if (k < o.accepted) ++metrics_.spec_accepted_tokens_at[static_cast<size_t>(k)];
      }
    }
    // The accepted drafts are in the cache already; the last token is not. A stop ends the rest.
    for (size_t t = 0; t < o.tokens.size(); ++t) {
      const bool computed = static_cast<int64_t>(t) < o.accepted;
      if (!take_token(a, std::move(o.tokens[t]), computed)) break;
    }
  }
}

bool Engine::take_token(Active& a, Expected<SampledToken> token, bool computed) {
  if (!token) {
    ++metrics_.nan_aborts;
    spdlog::warn("request {} ended: {}", a.id, token.error().message);
    finish(a.id, "error", token.error().message);
    return false;
  }
  const auto now = Clock::now();
  if (a.has_token) {
    metrics_.inter_token.observe(std::chrono::duration<double>(now - a.last_token).count());
  } else {
    metrics_.ttft.observe(std::chrono::duration<double>(now - a.arrival).count());
  }
  a.has_token = true;
  a.last_token = now;
  ++metrics_.generation_tokens;
  a.tokens.push_back(token->id);
  scheduler_.append_token(a.id, computed);
  StopUpdate update = a.stop.feed(token->id, a.detokenizer ? a.detokenizer->push(token->id) : std::string());
  // Ended by a stop id or max_tokens: the detokenizer's held-back tail (a trailing incomplete UTF-8 sequence, as
  // U+FFFD) belongs to the text, which then equals the decode of every generated id. After a stop string it does not.
  if (update.finished && !update.stop_string && a.detokenizer) update.text += a.detokenizer->finish();
  TokenEvent event{.token_id = token->id, .logprob = token->logprob, .top_logprobs = std::move(token->top_logprobs),
                   .text = std::move(update.text)};
  const bool at_context_end = static_cast<int64_t>(a.tokens.size()) >= config_.context_length;
  a.stream->push(std::move(event));
  if (update.finished) {
    finish(a.id, update.finish_reason);
    return false;
  }
  if (at_context_end) {
    finish(a.id, "length");
    return false;
  }
  return true;
}

std::optional<std::string> Engine::failure() const {
  std::lock_guard lock(inbox_mutex_);
  return failure_;
}

void Engine::finish(uint64_t id, std::string_view reason, std::string error) {
  auto it = active_.find(id);
  if (it == active_.end()) return;
  Active& a = *it->second;
  std::string tail;
  if (!a.stop.finished()) {
    // The detokenizer's own tail is at most a replacement character for an incomplete UTF-8 sequence.
    tail = a.stop.flush() + (a.detokenizer ? a.detokenizer->finish() : std::string());
  }
  a.stream->push({.text = std::move(tail), .finished = true, .finish_reason = std::string(reason),
                  .error = std::move(error)});
  scheduler_.remove(id);
  active_.erase(it);
}

void Engine::publish_gauges() {
  metrics_.num_running = scheduler_.num_running();
  metrics_.kv_blocks_used = scheduler_.blocks().num_used();
  std::lock_guard lock(inbox_mutex_);
  num_waiting_snapshot_ = scheduler_.num_waiting();
  metrics_.num_waiting = static_cast<int64_t>(inbox_.size()) + num_waiting_snapshot_;
}

}  // namespace tern
