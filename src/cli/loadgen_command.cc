#include "cli/loadgen_command.h"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "cli/loadgen.h"

namespace tern {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

struct LoadgenOptions {
  std::string url, model, api_key, endpoint = "completions";
  int64_t num_requests = 0, concurrency = 0, input_len = 0, output_len = 0, warmup = 0;
  double request_rate = 0;  // 0: not given (closed loop)
  double burstiness = 1.0, input_range = 0, output_range = 0, temperature = 0, timeout_s = 600;
  uint64_t seed = 0;
  int32_t prompt_vocab = 0;  // > 0: prompts are random token ids below this
  bool ignore_eos = false, json = false;
};

struct PlannedRequest {
  std::string body;
  int64_t estimated_prompt_tokens = 0;
};

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

std::vector<PlannedRequest> plan_requests(const LoadgenOptions& o, const std::string& model, int64_t count,
                                          uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<int64_t> in = loadgen_draw_lengths(o.input_len, o.input_range, count, rng);
  const std::vector<int64_t> out = loadgen_draw_lengths(o.output_len, o.output_range, count, rng);
  std::vector<PlannedRequest> plan;
  for (size_t i = 0; i < in.size(); ++i) {
    const LoadgenBodyOptions body{.chat = o.endpoint == "chat",
                                  .model = model,
                                  .max_tokens = out[i],
                                  .temperature = o.temperature,
                                  .ignore_eos = o.ignore_eos,
                                  .logprobs = o.prompt_vocab > 0};
    const Json prompt = o.prompt_vocab > 0 ? Json(loadgen_id_prompt(in[i], o.prompt_vocab, rng))
                                           : Json(loadgen_text_prompt(in[i], rng));
    plan.push_back({loadgen_request_body(body, prompt), in[i]});
  }
  return plan;
}

httplib::Headers auth_headers(const LoadgenOptions& o) {
  httplib::Headers h;
  if (!o.api_key.empty()) h.emplace("Authorization", "Bearer " + o.api_key);
  return h;
}

// One HTTP client, used by one thread at a time; its connection is kept alive across that thread's requests.
class Sender {
 public:
  Sender(const LoadgenUrl& url, const LoadgenOptions& o) : o_(o), client_(url.scheme_host_port) {
    path_ = url.base_path + (o.endpoint == "chat" ? "/v1/chat/completions" : "/v1/completions");
    const auto timeout = std::chrono::duration<double>(o.timeout_s);
    client_.set_connection_timeout(
        std::chrono::duration_cast<std::chrono::microseconds>(std::min(timeout, std::chrono::duration<double>(30.0))));
    // The default of 5 s would cut a long prefill before its first token.
    client_.set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
    client_.set_keep_alive(true);
  }

  LoadgenResult send(const PlannedRequest& p, Clock::time_point run_start) {
    LoadgenStreamTracker tracker(p.estimated_prompt_tokens);
    httplib::Request req;
    req.method = "POST";
    req.path = path_;
    req.headers = auth_headers(o_);
    req.headers.emplace("Content-Type", "application/json");
    req.headers.emplace("Accept", "text/event-stream");
    req.body = p.body;
    const Clock::time_point sent = Clock::now();
    bool timed_out = false;
    req.response_handler = [&](const httplib::Response& res) {
      tracker.on_status(res.status);
      return true;
    };
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      const double t = seconds_between(sent, Clock::now());
      tracker.on_bytes(std::string_view(data, n), t);
      timed_out = t > o_.timeout_s;
      return !timed_out;
    };
    const httplib::Result result = client_.send(req);
    // A server that sends nothing at all ends at the read timeout, which is --timeout too.
    timed_out = timed_out || (!result && seconds_between(sent, Clock::now()) >= o_.timeout_s);
    std::string transport;
    if (timed_out) {
      transport = fmt::format("no end of the stream within --timeout {} s", o_.timeout_s);
    } else if (!result) {
      transport = fmt::format("request failed: {}", httplib::to_string(result.error()));
    }
    LoadgenResult r = tracker.finish(seconds_between(sent, Clock::now()), transport);
    r.start_s = seconds_between(run_start, sent);
    return r;
  }

 private:
  const LoadgenOptions& o_;
  httplib::Client client_;
  std::string path_;
};

// Sends each planned request at its arrival time on a worker thread. A request that arrives while every worker
// is busy gets a new worker, up to `max_in_flight` (0: no limit); past that it waits for a free one, so the number
// of requests in flight never exceeds the cap.
class Dispatcher {
 public:
  Dispatcher(const LoadgenUrl& url, const LoadgenOptions& o, const std::vector<PlannedRequest>& plan,
             int64_t max_in_flight)
      : url_(url), o_(o), plan_(plan), max_in_flight_(max_in_flight), results_(plan.size()) {}

  // Returns the results in plan order, and the time from the start to the end of the last request.
  std::vector<LoadgenResult> run(const std::vector<double>& arrivals, double& duration_s) {
    const Clock::time_point start = Clock::now();
    start_ = start;
    for (size_t i = 0; i < plan_.size(); ++i) {
      std::this_thread::sleep_until(
          start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrivals[i])));
      submit(i);
    }
    {
      std::lock_guard lock(mutex_);
      closed_ = true;
    }
    ready_.notify_all();
    for (std::thread& w : workers_) w.join();
    duration_s = seconds_between(start, Clock::now());
    return std::move(results_);
  }

 private:
  void submit(size_t i) {
    std::lock_guard lock(mutex_);
    queue_.push_back(i);
    // Every queued request needs an idle worker of its own to be sent now.
    const bool room = max_in_flight_ <= 0 || static_cast<int64_t>(workers_.size()) < max_in_flight_;
    if (static_cast<int64_t>(queue_.size()) > idle_ && room) workers_.emplace_back([this] { work(); });
    ready_.notify_one();
  }

  void work() {
    Sender sender(url_, o_);
    std::unique_lock lock(mutex_);
    for (;;) {
      ++idle_;
      ready_.wait(lock, [this] { return !queue_.empty() || closed_; });
      --idle_;
      if (queue_.empty()) return;
      const size_t i = queue_.front();
      queue_.pop_front();
      lock.unlock();
      LoadgenResult r = sender.send(plan_[i], start_);
      lock.lock();
      results_[i] = std::move(r);
    }
  }

  const LoadgenUrl& url_;
  const LoadgenOptions& o_;
  const std::vector<PlannedRequest>& plan_;
  const int64_t max_in_flight_;
  Clock::time_point start_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<size_t> queue_;
  int64_t idle_ = 0;
  bool closed_ = false;
  std::vector<std::thread> workers_;
  std::vector<LoadgenResult> results_;
};

// Checks that the server answers (GET /v1/models) and returns the model to ask for: --model, else the first the
// server lists.
Expected<std::string> resolve_model(const LoadgenUrl& url, const LoadgenOptions& o) {
  httplib::Client client(url.scheme_host_port);
  client.set_connection_timeout(10);
  client.set_read_timeout(30);
  const std::string path = url.base_path + "/v1/models";
  httplib::Result res = client.Get(path, auth_headers(o));
  if (!res) return make_error("cannot reach the server at {} ({})", o.url, httplib::to_string(res.error()));
  if (!o.model.empty()) return o.model;
  const Json body = Json::parse(res->body, nullptr, false);
  if (res->status != 200 || body.is_discarded() || !body.contains("data") || !body["data"].is_array() ||
      body["data"].empty() || !body["data"][0].contains("id") || !body["data"][0]["id"].is_string()) {
    return make_error("{}{} answered HTTP {} without a model list; give --model", url.scheme_host_port, path,
                      res->status);
  }
  return body["data"][0]["id"].get<std::string>();
}

Expected<void> validate(const LoadgenOptions& o) {
  if (o.num_requests < 1) return make_error("--num-requests must be at least 1, got {}", o.num_requests);
  if (o.concurrency < 0) return make_error("--concurrency must be at least 1, got {}", o.concurrency);
  if (o.concurrency == 0 && o.request_rate == 0) return make_error("give --concurrency, --request-rate, or both");
  if (std::isnan(o.request_rate) || o.request_rate < 0) {
    return make_error("--request-rate must be positive (or inf), got {}", o.request_rate);
  }
  if (!(o.burstiness > 0) || !std::isfinite(o.burstiness)) {
    return make_error("--burstiness must be positive and finite, got {}", o.burstiness);
  }
  if (o.input_len < 1 || o.output_len < 1) {
    return make_error("--input-len and --output-len must be at least 1, got {} and {}", o.input_len, o.output_len);
  }
  for (auto [name, v] :
       {std::pair{"--input-len-range", o.input_range}, std::pair{"--output-len-range", o.output_range}}) {
    if (!(v >= 0 && v < 1)) return make_error("{} must be in [0, 1), got {}", name, v);
  }
  if (!(o.timeout_s > 0)) return make_error("--timeout must be positive, got {}", o.timeout_s);
  if (o.warmup < 0) return make_error("--warmup must be at least 0, got {}", o.warmup);
  if (o.prompt_vocab < 0)
    return make_error("--prompt-token-ids must be a vocabulary size >= 1, got {}", o.prompt_vocab);
  if (o.prompt_vocab > 0 && o.endpoint == "chat") {
    return make_error("--prompt-token-ids needs --endpoint completions (chat messages are text)");
  }
  return {};
}

std::vector<std::string> report_header(const LoadgenOptions& o, const std::string& model) {
  std::string traffic;
  if (o.request_rate == 0) {
    traffic = fmt::format("closed loop, {} concurrent", o.concurrency);
  } else {
    traffic = std::isinf(o.request_rate)
                  ? "every request at once"
                  : fmt::format("{:g} req/s, gamma arrivals (burstiness {:g})", o.request_rate, o.burstiness);
    if (o.concurrency > 0) traffic += fmt::format(", at most {} concurrent", o.concurrency);
  }
  return {fmt::format("tern loadgen: {} model '{}' /v1/{}", o.url, model,
                      o.endpoint == "chat" ? "chat/completions" : "completions"),
          fmt::format("traffic: {} requests, {}", o.num_requests, traffic),
          fmt::format("lengths: input ~{} (+-{:g}) {}, output {} (+-{:g}), temperature {:g}{}", o.input_len,
                      o.input_range, o.prompt_vocab > 0 ? "random token ids" : "words", o.output_len, o.output_range,
                      o.temperature, o.ignore_eos ? ", ignore_eos" : "")};
}

nlohmann::ordered_json options_json(const LoadgenOptions& o, const std::string& model) {
  using Ordered = nlohmann::ordered_json;
  return Ordered{{"url", o.url},
                 {"model", model},
                 {"endpoint", o.endpoint},
                 {"num_requests", o.num_requests},
                 {"concurrency", o.concurrency},
                 {"request_rate", std::isinf(o.request_rate) ? Ordered("inf") : Ordered(o.request_rate)},
                 {"burstiness", o.burstiness},
                 {"input_len", o.input_len},
                 {"input_len_range", o.input_range},
                 {"output_len", o.output_len},
                 {"output_len_range", o.output_range},
                 {"seed", o.seed},
                 {"temperature", o.temperature},
                 {"ignore_eos", o.ignore_eos},
                 {"prompt_token_ids", o.prompt_vocab},
                 {"warmup", o.warmup}};
}

int fail(const std::string& message, int code) {
  fmt::print(stderr, "tern loadgen: {}\n", message);
  return code;
}

void run_warmup(const LoadgenUrl& url, const LoadgenOptions& o, const std::string& model) {
  if (o.warmup == 0) return;
  // Other prompts than the measured ones, so that a prefix cache does not favour the measurement.
  const std::vector<PlannedRequest> plan = plan_requests(o, model, o.warmup, o.seed ^ 0x9e3779b97f4a7c15ull);
  double duration_s = 0;
  Dispatcher warm(url, o, plan, std::max<int64_t>(o.concurrency, 1));
  const std::vector<LoadgenResult> results = warm.run(std::vector<double>(plan.size(), 0.0), duration_s);
  const auto ok = std::count_if(results.begin(), results.end(), [](const LoadgenResult& r) { return r.ok; });
  fmt::print(stderr, "tern loadgen: warm-up {}/{} requests completed in {:.2f} s\n", ok, results.size(), duration_s);
}

int run_loadgen(const LoadgenOptions& o) {
  if (auto valid = validate(o); !valid) return fail(valid.error().message, 2);
  auto url = loadgen_parse_url(o.url);
  if (!url) return fail(url.error().message, 2);
  auto model = resolve_model(*url, o);
  if (!model) return fail(model.error().message, 1);
  run_warmup(*url, o, *model);
  const std::vector<PlannedRequest> plan = plan_requests(o, *model, o.num_requests, o.seed);
  const std::vector<double> arrivals = loadgen_arrival_times(o.num_requests, o.request_rate, o.burstiness, o.seed);
  double duration_s = 0;
  Dispatcher dispatcher(*url, o, plan, o.concurrency);
  const std::vector<LoadgenResult> results = dispatcher.run(arrivals, duration_s);
  const LoadgenSummary summary = loadgen_summarize(results, duration_s);
  if (o.json) {
    nlohmann::ordered_json out{{"config", options_json(o, *model)}};
    out.update(loadgen_summary_json(summary));
    out["requests"] = nlohmann::ordered_json::array();
    for (const LoadgenResult& r : results) out["requests"].push_back(loadgen_result_json(r));
    fmt::print("{}\n", out.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
  } else {
    fmt::print("{}", loadgen_format_table(summary, report_header(o, *model)));
  }
  if (summary.completed == 0) return fail(fmt::format("every request to {} failed", o.url), 1);
  return 0;
}

}  // namespace

void register_loadgen_command(CLI::App& app) {
  auto o = std::make_shared<LoadgenOptions>();
  CLI::App* cmd = app.add_subcommand("loadgen", "Benchmark a running OpenAI-compatible server with streamed requests");
  cmd->add_option("--url", o->url, "The server, http://HOST:PORT")->required();
  cmd->add_option("--model", o->model, "Model name to ask for (default: the first of GET /v1/models)");
  cmd->add_option("--api-key", o->api_key, "Send 'Authorization: Bearer KEY'");
  cmd->add_option("--num-requests", o->num_requests, "Requests to measure")->required();
  cmd->add_option("--concurrency", o->concurrency, "Requests in flight: closed loop alone, a cap with --request-rate");
  cmd->add_option("--request-rate", o->request_rate, "Open loop: mean arrivals per second (inf: all at once)");
  cmd->add_option("--burstiness", o->burstiness, "Gamma shape of the gaps between arrivals (1: Poisson)");
  cmd->add_option("--input-len", o->input_len, "Prompt length in tokens (approximate for text prompts)")->required();
  cmd->add_option("--input-len-range", o->input_range, "Prompt lengths uniform in input-len * [1 - F, 1 + F]");
  cmd->add_option("--output-len", o->output_len, "max_tokens of each request")->required();
  cmd->add_option("--output-len-range", o->output_range, "max_tokens uniform in output-len * [1 - F, 1 + F]");
  cmd->add_option("--seed", o->seed, "Seed of prompts, lengths and arrivals");
  cmd->add_option("--endpoint", o->endpoint, "completions or chat")->check(CLI::IsMember({"completions", "chat"}));
  cmd->add_option("--temperature", o->temperature, "Sampling temperature");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "Ask the server to generate max_tokens, past end-of-sequence");
  cmd->add_option("--prompt-token-ids", o->prompt_vocab,
                  "Send prompts as random token ids below this vocabulary "
                  "size, with logprobs so that a server without a tokenizer still streams one chunk per token");
  cmd->add_option("--timeout", o->timeout_s, "Seconds a request may take");
  cmd->add_option("--warmup", o->warmup, "Requests sent first and not measured");
  cmd->add_flag("--json", o->json, "Print the report, with each request, as JSON");
  cmd->callback([o] { throw CLI::RuntimeError(run_loadgen(*o)); });
}

}  // namespace tern
