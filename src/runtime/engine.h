// The engine thread: owns the model's runner (ModelRunner is not thread-safe), runs continuous batching through the
// Scheduler, samples, detokenizes and stop-checks, and hands each request's tokens to its RequestStream. Other
// threads (HTTP handlers) only submit requests and wait on their streams; they never run the model.
//
//   Engine engine(std::move(model), tokenizer, config, metrics);
//   TERN_ASSIGN_OR_RETURN(auto stream, engine.submit(std::move(request)));   // error: queue full / shutting down
//   while (!done) for (TokenEvent& e : stream->wait(100ms)) { ...; done = e.finished; }
//   stream->cancel();                                                         // the client went away
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "runtime/engine_metrics.h"
#include "runtime/model_runner.h"
#include "runtime/speculative.h"
#include "kernels/cpu/sampler.h"
#include "runtime/scheduler.h"
#include "runtime/stop.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"

namespace tern {

// A step of a sequence whose prompt logprobs were asked for runs at most this many of its tokens (and at most the
// scheduler's max_running), so that the logits the step returns for them stay small (rows x vocab floats).
inline constexpr int64_t kPromptLogprobsChunk = 256;

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  StopCriteria stop;  // the engine adds the model's EOS ids; with min_tokens it bans the stop ids until then
  bool skip_special_tokens = true;
  bool ignore_eos = false;  // keep generating past the model's EOS (benchmarks, tests)
  // >= 0: the raw logprob of every prompt token after the first and the top `prompt_logprobs` at each position
  // (vLLM's prompt_logprobs; OpenAI's echo with logprobs), sent before the first token. Not with speculative decoding.
  int32_t prompt_logprobs = -1;
};

struct TokenEvent {
  int32_t token_id = -1;  // -1: no token (a final event alone, or prompt logprobs)
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top_logprobs;
  // Prompt tokens' logprobs (GenerationRequest::prompt_logprobs), in order from the second prompt token on; each
  // event carries the next ones.
  std::vector<SampledToken> prompt_logprobs;
  std::string text;  // text the client may see now (after stop-string hold-back)
  bool finished = false;
  std::string finish_reason;  // "stop", "length", "error" (with `error`) or "abort"
  std::string error;
};

class RequestStream {
 public:
  explicit RequestStream(int64_t num_prompt_tokens) : num_prompt_tokens_(num_prompt_tokens) {}
  // Events queued so far, waiting up to `timeout` for the first one.
  std::vector<TokenEvent> wait(std::chrono::milliseconds timeout);
  void cancel();
  bool cancelled() const;
  int64_t num_prompt_tokens() const { return num_prompt_tokens_; }
  void push(TokenEvent event);

 private:
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<TokenEvent> events_;
  bool cancelled_ = false;
  int64_t num_prompt_tokens_;
};

struct EngineConfig {
  SchedulerConfig scheduler;  // its num_lookahead is set from speculative_steps
  int64_t context_length = 4096;
  // Speculative decoding with the model's draft module (runtime/speculative.h): draft tokens verified per step of a
  // sequence (0: off), and the number of sampling sequences in a step from which on it verifies none (0: never off).
  int speculative_steps = 0;
  int speculative_disable_batch_size = 0;
  // Verify drafts only in the steps where the measured speculative steps give more tokens per second than plain ones
  // at that batch size (runtime/speculative.h SpeculationGovernor); within speculative_disable_batch_size.
  bool speculative_adaptive = false;
};

class Engine {
 public:
  Engine(std::unique_ptr<ModelRunner> model, std::optional<Tokenizer> tokenizer, const EngineConfig& config,
         EngineMetrics& metrics);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Expected<std::shared_ptr<RequestStream>> submit(GenerationRequest request);
  // Ends every request with finish_reason "abort" and stops the thread; later submits fail.
  void shutdown();

  const ModelConfig& model_config() const { return model_->config(); }
  bool speculative() const { return config_.speculative_steps > 0; }
  // Why the engine can serve nothing more (its model failed for good, e.g. a tensor-parallel rank); nullopt while it
  // is healthy. /health answers 503 with it, and submit refuses new requests.
  std::optional<std::string> failure() const;

 private:
  struct Active;
  void run();
  void admit_new();
  void sweep_cancelled();
  void step();
  // The step's items of requests with prompt logprobs still to send: each run apart with every row's logits, its
  // prompt tokens' logprobs sent and its sample drawn on the host.
  void step_prompt_logprobs(const StepPlan& plan);
  // A step's failure: every request of the plan ends with it, and every other one too if the model failed for good.
  void fail_step(const StepPlan& plan, const Error& error);
  // The step with speculation (runtime/speculative.h): up to speculative_steps + 1 tokens per sampling sequence.
  void step_speculative(const StepPlan& plan);
  SpeculationGovernor governor_;
  bool last_verified_ = false;  // the previous speculative step's mode (a step is steady when it repeats it)
  // Hands a sampled token (or the row's failure) to its request: stream, stop check, metrics. `computed`: the token
  // is already in the cache (an accepted draft). False when the request finished.
  bool take_token(Active& a, Expected<SampledToken> token, bool computed = false);
  void finish(uint64_t id, std::string_view reason, std::string error = {});
  void publish_gauges();

  std::unique_ptr<ModelRunner> model_;
  std::optional<Tokenizer> tokenizer_;
  EngineConfig config_;
  EngineMetrics& metrics_;
  Scheduler scheduler_;
  std::map<uint64_t, std::unique_ptr<Active>> active_;

  mutable std::mutex inbox_mutex_;
  std::condition_variable inbox_ready_;
  std::vector<std::unique_ptr<Active>> inbox_;
  int32_t num_waiting_snapshot_ = 0;  // scheduler's queue length after the last step (guarded by inbox_mutex_)
  bool stopping_ = false;
  std::optional<std::string> failure_;  // guarded by inbox_mutex_
  uint64_t next_id_ = 1;
  std::thread thread_;
};

}  // namespace tern
