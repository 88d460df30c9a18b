#include "server/http_server.h"

#include <httplib.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <thread>
#include <tuple>

#include "server/http_connection.h"
#include "server/openai_response.h"

namespace tern {
namespace {

using Json = nlohmann::ordered_json;
using namespace std::chrono_literals;

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

const char* error_type(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 405: return "method_not_allowed";
    case 408: return "request_timeout";
    case 413: return "request_too_large";
    case 503: return "service_unavailable";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

}  // namespace

// A request's choices: one engine request (its stream) and one response builder each, in index order.
struct Choices {
  std::vector<std::shared_ptr<RequestStream>> streams;
  std::vector<ResponseBuilder> builders;

  bool finished() const {
    return std::ranges::all_of(builders, [](const ResponseBuilder& b) { return b.finished(); });
  }
  // The events every stream has queued, each through its choice's builder (the chunks they make appended to
  // `chunks` when given), waiting up to `timeout` for the first. Several choices wait on the first unfinished one
  // at most 10 ms at a time, so that another's tokens are not held back long.
  void poll(std::chrono::milliseconds timeout, std::vector<Json>* chunks) {
    auto take = [&](size_t i, std::chrono::milliseconds wait) {
      bool any = false;
      for (const TokenEvent& e : streams[i]->wait(wait)) {
        any = true;
        std::vector<Json> made = builders[i].on_event(e);
        if (chunks) chunks->insert(chunks->end(), made.begin(), made.end());
      }
      return any;
    };
    if (streams.size() == 1) {
      take(0, timeout);
      return;
    }
    bool any = false;
    for (size_t i = 0; i < streams.size(); ++i) {
      if (!builders[i].finished()) any = take(i, 0ms) || any;
    }
    if (any) return;
    for (size_t i = 0; i < streams.size(); ++i) {
      if (builders[i].finished()) continue;
      take(i, std::min<std::chrono::milliseconds>(timeout, 10ms));
      return;
    }
  }
  // Ends the unfinished choices' requests; how many there were.
  int cancel_unfinished() {
    int n = 0;
    for (size_t i = 0; i < streams.size(); ++i) {
      if (builders[i].finished()) continue;
      streams[i]->cancel();
      ++n;
    }
    return n;
  }
};

// What a streaming response needs after the handler returned; the count of open streams follows its lifetime.
struct StreamState {
  StreamState(Choices c, bool usage, std::atomic<int64_t>& active, std::function<void()> on_abandoned)
      : choices(std::move(c)), include_usage(usage), active_streams(active), on_abandoned(std::move(on_abandoned)) {
    ++active_streams;
  }
  ~StreamState() {
    // The client went away before the end: each unfinished choice's request ends as an abort.
    for (int i = choices.cancel_unfinished(); i > 0; --i) on_abandoned();
    --active_streams;
  }
  Choices choices;
  bool include_usage;
  std::atomic<int64_t>& active_streams;
  std::function<void()> on_abandoned;
};

HttpServer::HttpServer(ServerConfig config, Engine& engine, EngineMetrics& metrics, std::optional<Tokenizer> tokenizer,
                       std::optional<ChatTemplateSet> templates)
    : config_(std::move(config)), engine_(engine), metrics_(metrics), tokenizer_(std::move(tokenizer)),
      templates_(std::move(templates)),
      server_(std::make_unique<ConnectionServer>(
          ConnectionLimits{.request_read_timeout = std::chrono::seconds(config_.request_read_timeout_s)},
          api_error_body({408, fmt::format("the request did not arrive within {} s", config_.request_read_timeout_s),
                          "request_timeout"}))) {
  install_routes();
}

HttpServer::~HttpServer() = default;

void HttpServer::send_error(httplib::Response& res, const ApiError& error) {
  ApiError e = error;
  if (e.type == "invalid_request_error" && e.status != 400) e.type = error_type(e.status);
  res.status = e.status;
  res.set_content(api_error_body(e), "application/json");
}

void HttpServer::count_outcome(const std::string& outcome) {
  std::lock_guard lock(outcomes_mutex_);
  ++outcomes_[outcome];
}

std::optional<ApiError> HttpServer::check_framing(const httplib::Request& req) const {
  auto lower = [](std::string v) {
    for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return v;
  };
  const size_t lengths = req.headers.count("Content-Length"), encodings = req.headers.count("Transfer-Encoding");
  if (const std::string coding = lower(req.get_header_value("Content-Encoding")); !coding.empty() &&
                                                                                 coding != "identity") {
    // The library would inflate it before any limit applies (a 65 KB gzip body inflates to 64 MiB).
    return ApiError{415, fmt::format("Content-Encoding '{}' is not accepted on requests; send the body "
                                     "uncompressed", coding)};
  }
  if (lengths > 1) return ApiError{400, "the request has more than one Content-Length header"};
  if (encodings > 1) return ApiError{400, "the request has more than one Transfer-Encoding header"};
  if (lengths && encodings) return ApiError{400, "the request has both Content-Length and Transfer-Encoding"};
  if (encodings) {
    if (const std::string te = lower(req.get_header_value("Transfer-Encoding")); te != "chunked") {
      return ApiError{501, fmt::format("Transfer-Encoding '{}' is not supported (only chunked)", te)};
    }
    return std::nullopt;
  }
  if (!lengths) {
    if (req.method != "POST") return std::nullopt;
    return ApiError{411, "a POST needs a Content-Length (or Transfer-Encoding: chunked)"};
  }
  const std::string text = req.get_header_value("Content-Length");
  if (text.empty() || text.size() > 18 || text.find_first_not_of("0123456789") != std::string::npos) {
    return ApiError{400, fmt::format("Content-Length '{}' is not a byte count", text.substr(0, 40))};
  }
  if (const uint64_t length = std::stoull(text); length > config_.max_body_bytes) {
    return ApiError{413, fmt::format("the request body ({} bytes by its Content-Length) exceeds the limit of {} bytes",
                                     length, config_.max_body_bytes)};
  }
  return std::nullopt;
}

void HttpServer::describe_library_error(const httplib::Request& req, httplib::Response& res) {
  // A read our connection stopped (deadline, head or body budget): the library only knows it failed (400).
  Connection* conn = Connection::current();
  if (conn && conn->failure() != Connection::Failure::kNone) {
    conn->close_after_response();
    switch (conn->failure()) {
      case Connection::Failure::kTimeout:
        return send_error(res, {408, fmt::format("the request did not arrive within {} s",
                                                 config_.request_read_timeout_s)});
      case Connection::Failure::kHeadTooLarge:
        return send_error(res, {431, "the request line and headers exceed 64 KiB"});
      default:
        return send_error(res, {413, fmt::format("the request body exceeds the limit of {} bytes (chunked framing "
                                                 "included)", config_.max_body_bytes)});
    }
  }
  // A route that exists under another method: 405 with Allow (RFC 9110 §15.5.6), not 404.
  static const std::map<std::string, std::string, std::less<>> kRoutes{
      {"/health", "GET"}, {"/v1/models", "GET"}, {"/metrics", "GET"},
      {"/v1/chat/completions", "POST"}, {"/v1/completions", "POST"}};
  if (const auto route = kRoutes.find(req.path); res.status == 404 && route != kRoutes.end()) {
    res.status = 405;
    res.set_header("Allow", route->second);
    return send_error(res, {405, fmt::format("{} is not allowed on {}; use {}", req.method, req.path, route->second),
                            error_type(405)});
  }
  // What the HTTP library refused before any handler ran, said in words (it sets only the status).
  std::string message;
  switch (res.status) {
    case 400: message = "the request is not valid HTTP (request line, headers or body framing)"; break;
    case 404: message = fmt::format("no route for {} {}", req.method, req.path); break;
    case 413: message = fmt::format("the request body exceeds {} bytes", config_.max_body_bytes); break;
    case 414: message = "the request URI is too long"; break;
    case 431: message = "the request headers are too large"; break;
    default: message = fmt::format("HTTP {}", res.status);
  }
  if (res.status == 400 && conn) conn->close_after_response();  // the framing is unknown: nothing after it is safe
  send_error(res, {res.status, message, error_type(res.status)});
}

void HttpServer::install_routes() {
  httplib::Server& s = *server_;
  const int threads = config_.num_threads;
  s.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  s.set_tcp_nodelay(true);
  // Deadlines and the keep-alive loop are the connection's (http_connection.h); these only keep the library's
  // Keep-Alive header true.
  s.set_keep_alive_timeout(ConnectionLimits{}.keep_alive_timeout.count() / 1000);
  s.set_keep_alive_max_count(ConnectionLimits{}.keep_alive_max_count);
  s.set_write_timeout(ConnectionLimits{}.write_timeout.count() / 1000);
  s.set_payload_max_length(config_.max_body_bytes);
  // Framing first (before a byte of the body is read), then the API key. A refused body is never read: the
  // connection closes after the answer.
  auto refuse = [this](const httplib::Request& req, httplib::Response& res) {
    auto error = check_framing(req);
    if (!error) return false;
    if (Connection* conn = Connection::current()) conn->close_after_response();
    send_error(res, *error);
    return true;
  };
  s.set_expect_100_continue_handler([refuse](const httplib::Request& req, httplib::Response& res) {
    return refuse(req, res) ? res.status : 100;
  });
  s.set_pre_routing_handler([this, refuse](const httplib::Request& req, httplib::Response& res) {
    if (refuse(req, res)) return httplib::Server::HandlerResponse::Handled;
    if (Connection* conn = Connection::current()) {
      const bool chunked = req.has_header("Transfer-Encoding");
      const uint64_t length = chunked ? config_.max_body_bytes : req.get_header_value<uint64_t>("Content-Length");
      conn->begin_body(length, !chunked);
    }
    if (config_.api_key.empty() || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
    if (req.get_header_value("Authorization") == "Bearer " + config_.api_key) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    send_error(res, {401, "a valid API key is required (Authorization: Bearer ...)", "invalid_request_error", "",
                     "invalid_api_key"});
    return httplib::Server::HandlerResponse::Handled;
  });
  s.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (res.body.empty()) describe_library_error(req, res);
  });
  // Last before the head is written: say "close" exactly when the connection will close.
  s.set_post_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    Connection* conn = Connection::current();
    if (!conn) return;
    std::string asked = req.get_header_value("Connection");
    for (char& c : asked) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (asked == "close" || (req.version == "HTTP/1.0" && asked != "keep-alive") ||
        res.get_header_value("Connection") == "close" || conn->body_unread()) {
      conn->close_after_response();
    }
    if (conn->closing()) {
      res.headers.erase("Keep-Alive");
      res.headers.erase("Connection");
      res.set_header("Connection", "close");
    }
  });
  s.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (stopping_) return send_error(res, {503, "the server is shutting down", "service_unavailable"});
    if (auto why = engine_.failure()) {
      return send_error(res, {503, "unhealthy: the model can run no more steps: " + *why, "service_unavailable"});
    }
    res.set_content("{\"status\":\"ok\"}", "application/json");
  });
  s.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    Json model{{"id", config_.served_model_name}, {"object", "model"}, {"created", 0}, {"owned_by", "tern"},
               {"max_model_len", config_.context_length}};
    res.set_content(dump(Json{{"object", "list"}, {"data", Json::array({model})}}), "application/json");
  });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(render_metrics(), "text/plain; version=0.0.4");
  });
  s.Post("/v1/chat/completions",
         [this](const httplib::Request& req, httplib::Response& res) { handle_generate(req, res, true); });
  s.Post("/v1/completions",
         [this](const httplib::Request& req, httplib::Response& res) { handle_generate(req, res, false); });
  s.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) { handle_tokenize(req, res); });
  s.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) { handle_detokenize(req, res); });
}

std::optional<ApiError> HttpServer::check_model(const std::string& model) const {
  if (model.empty() || model == config_.served_model_name) return std::nullopt;
  return ApiError{404, fmt::format("the model '{}' does not exist; this server serves '{}'", model,
                                   config_.served_model_name),
                  "invalid_request_error", "model", "model_not_found"};
}

void HttpServer::handle_tokenize(const httplib::Request& req, httplib::Response& res) {
  auto parsed = api_tokenize_parse(req.body);
  if (!parsed) return send_error(res, parsed.error());
  if (auto e = check_model(parsed->model)) return send_error(res, *e);
  std::vector<int32_t> ids;
  if (parsed->chat) {
    bool starts_in_reasoning = false;
    auto chat = prompt_tokens(*parsed->chat, 0, starts_in_reasoning);
    if (!chat) return send_error(res, chat.error());
    ids = std::move(*chat);
  } else {
    if (!tokenizer_) return send_error(res, {400, "this model has no tokenizer", "invalid_request_error", "prompt"});
    if (auto e = check_prompt_bytes(parsed->prompt->size(), "prompt")) return send_error(res, *e);
    ids = tokenizer_->encode(*parsed->prompt, parsed->add_special_tokens);
  }
  res.set_content(dump(Json{{"count", ids.size()}, {"max_model_len", config_.context_length}, {"tokens", ids}}),
                  "application/json");
}

void HttpServer::handle_detokenize(const httplib::Request& req, httplib::Response& res) {
  auto parsed = api_detokenize_parse(req.body);
  if (!parsed) return send_error(res, parsed.error());
  if (auto e = check_model(parsed->model)) return send_error(res, *e);
  if (!tokenizer_) return send_error(res, {400, "this model has no tokenizer", "invalid_request_error", "tokens"});
  const int64_t vocab = engine_.model_config().vocab_size;
  for (int32_t id : parsed->tokens) {
    if (id >= vocab) {
      return send_error(res, {400, fmt::format("token id {} is outside the vocabulary (size {})", id, vocab),
                              "invalid_request_error", "tokens"});
    }
  }
  res.set_content(dump(Json{{"prompt", tokenizer_->decode(parsed->tokens)}}), "application/json");
}

std::optional<ApiError> HttpServer::check_prompt_bytes(size_t bytes, const char* param) const {
  const std::optional<size_t> per_token = tokenizer_->max_bytes_per_token();
  uint64_t limit = 0;
  if (!per_token || __builtin_mul_overflow(static_cast<uint64_t>(config_.context_length), *per_token, &limit) ||
      bytes <= limit) {
    return std::nullopt;
  }
  return ApiError{400, fmt::format("the prompt is {} bytes: a context of {} tokens holds at most {} bytes of text "
                                   "with this tokenizer (one token covers at most {} bytes)",
                                   bytes, config_.context_length, limit, *per_token),
                  "invalid_request_error", param, "context_length_exceeded"};
}

tl::expected<std::vector<int32_t>, ApiError> HttpServer::prompt_tokens(const ApiRequest& r, size_t prompt,
                                                                      bool& starts_in_reasoning) const {
  std::vector<int32_t> ids;
  if (r.chat) {
    if (!tokenizer_ || !templates_) {
      return tl::unexpected(ApiError{400, "this model has no tokenizer or chat template: use /v1/completions with "
                                          "token ids"});
    }
    auto text = templates_->render_request(r.template_request);
    if (!text) return tl::unexpected(ApiError{400, "the chat template failed: " + text.error().message});
    std::string_view t = *text;
    while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.remove_suffix(1);
    starts_in_reasoning = t.ends_with("<think>");
    if (auto e = check_prompt_bytes(text->size(), "messages")) return tl::unexpected(*e);
    ids = tokenizer_->encode(*text, false);
  } else if (const ApiPrompt& p = r.prompts.at(prompt); p.text) {
    if (!tokenizer_) {
      return tl::unexpected(ApiError{400, "this model has no tokenizer: give the prompt as token ids", "", "prompt"});
    }
    if (auto e = check_prompt_bytes(p.text->size(), "prompt")) return tl::unexpected(*e);
    ids = tokenizer_->encode(*p.text, true);
  } else {
    ids = *p.ids;
  }
  const int64_t vocab = engine_.model_config().vocab_size;
  for (int32_t id : ids) {
    if (id >= vocab) {
      return tl::unexpected(ApiError{400, fmt::format("token id {} is outside the vocabulary (size {})", id, vocab),
                                     "invalid_request_error", "prompt"});
    }
  }
  if (ids.empty()) return tl::unexpected(ApiError{400, "the prompt is empty", "invalid_request_error", "prompt"});
  return ids;
}

void HttpServer::handle_generate(const httplib::Request& req, httplib::Response& res, bool chat) {
  auto fail = [&](const ApiError& e) {
    count_outcome(e.status == 503 ? "unavailable" : "rejected");
    send_error(res, e);
  };
  if (stopping_) return fail({503, "the server is shutting down", "service_unavailable"});
  auto parsed = api_request_parse(req.body, chat);
  if (!parsed) return fail(parsed.error());
  const ApiRequest& r = *parsed;
  if (auto e = check_model(r.model)) return fail(*e);
  // Every prompt (a chat request's one, or each of a completions batch) checked before anything is submitted.
  struct Prompt {
    std::vector<int32_t> ids;
    int32_t max_tokens = 0;
  };
  std::vector<Prompt> prompts;
  bool starts_in_reasoning = false;
  for (size_t p = 0; p < (chat ? 1 : r.prompts.size()); ++p) {
    auto ids = prompt_tokens(r, p, starts_in_reasoning);
    if (!ids) return fail(ids.error());
    auto max_tokens = api_request_max_tokens(r, static_cast<int64_t>(ids->size()), config_.context_length);
    if (!max_tokens) return fail(max_tokens.error());
    if (r.min_tokens > *max_tokens) {
      return fail({400,
                   fmt::format("min_tokens is {}, but the prompt has {} tokens and the context length is {} (at most "
                               "{} more)", r.min_tokens, ids->size(), config_.context_length, *max_tokens),
                   "invalid_request_error", "min_tokens"});
    }
    prompts.push_back({std::move(*ids), *max_tokens});
  }
  const StopCriteria stop{.stop_token_ids = r.stop_token_ids, .stop_strings = r.stop_strings,
                          .include_stop_string = r.include_stop_string};
  if (r.prompt_logprobs >= 0 && engine_.speculative()) {
    return fail({400, "'logprobs' with 'echo' (the prompt's logprobs) is not available with speculative decoding",
                 "invalid_request_error", "echo"});
  }
  if (auto v = stop_criteria_validate(stop); !v) return fail({400, v.error().message, "invalid_request_error", "stop"});

  ResponseContext ctx{.chat = chat, .id = fmt::format("{}-{:x}{:04x}", chat ? "chatcmpl" : "cmpl", unix_now(),
                                                      next_request_++),
                      .model = config_.served_model_name, .created = unix_now(), .logprobs = r.logprobs,
                      .tokenizer = tokenizer_ ? &*tokenizer_ : nullptr};
  if (chat && config_.reasoning && r.separate_reasoning) ctx.reasoning.emplace(starts_in_reasoning);
  if (chat && r.tools_enabled && config_.tool_format != ToolFormat::kNone) ctx.tools.emplace(config_.tool_format, r.tools);

  // One engine request per choice, prompt by prompt; choice i of a prompt of a seeded request samples with seed + i
  // (vLLM's rule). A choice the engine cannot take ends the ones taken before it.
  Choices choices;
  for (size_t p = 0; p < prompts.size(); ++p) {
    for (int32_t i = 0; i < r.n; ++i) {
      GenerationRequest g{.prompt = prompts[p].ids, .sampling = r.sampling, .stop = stop,
                          .skip_special_tokens = r.skip_special_tokens, .ignore_eos = r.ignore_eos,
                          .prompt_logprobs = r.prompt_logprobs};
      g.stop.max_tokens = prompts[p].max_tokens;
      g.stop.min_tokens = r.min_tokens;
      if (r.sampling.seed) g.sampling.seed = *r.sampling.seed + static_cast<uint64_t>(i);
      auto stream = engine_.submit(std::move(g));
      if (!stream) {
        choices.cancel_unfinished();
        return fail({503, stream.error().message, "service_unavailable"});
      }
      choices.streams.push_back(*stream);
      ResponseContext c = ctx;
      c.index = static_cast<int64_t>(p) * r.n + i;
      c.num_prompt_tokens = static_cast<int64_t>(prompts[p].ids.size());
      c.counts_prompt = i == 0;
      if (!chat && r.echo) {
        const ApiPrompt& given = r.prompts[p];
        c.echo_text = given.text ? *given.text : (tokenizer_ ? tokenizer_->decode(prompts[p].ids) : "");
        if (r.prompt_logprobs >= 0) c.echo_ids = prompts[p].ids;
      }
      choices.builders.emplace_back(std::move(c));
    }
  }

  Connection* conn = Connection::current();
  if (!r.stream) {
    while (!choices.finished()) {
      choices.poll(100ms, nullptr);
      // Nobody waits for the answer any more: end the requests, as an abandoned stream does.
      if (!choices.finished() && conn && conn->peer_closed()) {
        for (int i = choices.cancel_unfinished(); i > 0; --i) count_outcome("abort");
        conn->close_after_response();
        return;
      }
    }
    for (const ResponseBuilder& b : choices.builders) count_outcome(b.finish_reason());
    res.set_content(dump(final_response(choices.builders)), "application/json");
    return;
  }
  auto state = std::make_shared<StreamState>(std::move(choices), r.include_usage, active_streams_,
                                             [this] { count_outcome("abort"); });
  // HTTP/1.0 has no chunked encoding: its stream is delimited by closing the connection.
  const bool http10 = req.version == "HTTP/1.0";
  if (http10 && conn) conn->close_after_response();
  auto provide = [this, state](size_t, httplib::DataSink& sink) {
    auto write = [&](const std::string& data) { return sink.write(data.data(), data.size()); };
    for (;;) {
      std::vector<Json> chunks;
      state->choices.poll(100ms, &chunks);
      if (!sink.is_writable()) return false;
      for (const Json& c : chunks) {
        if (!write("data: " + dump(c) + "\n\n")) return false;
      }
      if (state->choices.finished()) {
        const std::vector<ResponseBuilder>& builders = state->choices.builders;
        for (const ResponseBuilder& b : builders) count_outcome(b.finish_reason());
        if (state->include_usage) write("data: " + dump(usage_chunk(builders)) + "\n\n");
        // A failed choice's final chunk only says "error"; the reason follows as an OpenAI error event (clients
        // raise it): the first failed choice's.
        auto failed = std::ranges::find_if(builders, [](const ResponseBuilder& b) { return !b.error().empty(); });
        if (failed != builders.end()) write("data: " + api_error_body({500, failed->error(), "server_error"}) + "\n\n");
        write("data: [DONE]\n\n");
        sink.done();
        return true;
      }
    }
  };
  if (http10) res.set_content_provider("text/event-stream", std::move(provide));
  else res.set_chunked_content_provider("text/event-stream", std::move(provide));
}

std::string HttpServer::render_metrics() const {
  std::string out;
  auto metric = [&](const char* name, const char* type, const char* help, auto value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, value);
  };
  out += "# HELP tern_requests_total Generation requests (each choice of one with n > 1) by outcome (finish reason, "
         "rejected, unavailable).\n"
         "# TYPE tern_requests_total counter\n";
  {
    std::lock_guard lock(outcomes_mutex_);
    for (const char* o : {"stop", "length", "tool_calls", "error", "abort", "rejected", "unavailable"}) {
      auto it = outcomes_.find(o);
      out += fmt::format("tern_requests_total{{outcome=\"{}\"}} {}\n", o, it == outcomes_.end() ? 0 : it->second);
    }
  }
  metric("tern_prompt_tokens_total", "counter", "Prompt tokens admitted.", metrics_.prompt_tokens.load());
  metric("tern_generation_tokens_total", "counter", "Tokens generated.", metrics_.generation_tokens.load());
  metric("tern_nan_aborts_total", "counter", "Requests ended by non-finite logits.", metrics_.nan_aborts.load());
  metric("tern_preemptions_total", "counter", "Sequences preempted for KV capacity.", metrics_.preemptions.load());
  metric("tern_spec_verify_steps_total", "counter", "Speculative verifications (one sequence, one step).",
         metrics_.spec_verify_steps.load());
  metric("tern_spec_draft_tokens_total", "counter", "Draft tokens verified.", metrics_.spec_draft_tokens.load());
  metric("tern_spec_accepted_tokens_total", "counter", "Draft tokens accepted.", metrics_.spec_accepted_tokens.load());
  for (const auto& [name, help, counts] :
       {std::tuple{"tern_spec_draft_tokens_at_position_total", "Draft tokens verified, by draft position.",
                   &metrics_.spec_draft_tokens_at},
        std::tuple{"tern_spec_accepted_tokens_at_position_total", "Draft tokens accepted, by draft position.",
                   &metrics_.spec_accepted_tokens_at}}) {
    out += fmt::format("# HELP {} {}\n# TYPE {} counter\n", name, help, name);
    for (size_t k = 0; k < counts->size(); ++k) {
      out += fmt::format("{}{{position=\"{}\"}} {}\n", name, k, (*counts)[k].load());
    }
  }
  metric("tern_num_requests_running", "gauge", "Requests in the running batch.", metrics_.num_running.load());
  metric("tern_num_requests_waiting", "gauge", "Requests waiting to run.", metrics_.num_waiting.load());
  metric("tern_kv_blocks_used", "gauge", "KV-cache blocks in use.", metrics_.kv_blocks_used.load());
  metric("tern_kv_blocks_total", "gauge", "KV-cache blocks in all.", metrics_.kv_blocks_total.load());
  const double total = static_cast<double>(std::max<int64_t>(1, metrics_.kv_blocks_total.load()));
  metric("tern_kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use.",
         static_cast<double>(metrics_.kv_blocks_used.load()) / total);
  metric("tern_http_streams_active", "gauge", "Streaming responses open.", active_streams_.load());
  metrics_.ttft.render(out, "tern_time_to_first_token_seconds", "Time from arrival to the first token.");
  metrics_.inter_token.render(out, "tern_inter_token_latency_seconds", "Time between consecutive tokens.");
  return out;
}

Expected<void> HttpServer::run() {
  int listen_fd = -1;
  // Only SO_REUSEADDR: the default SO_REUSEPORT would let a second server bind the same port silently.
  server_->set_socket_options([&listen_fd](socket_t fd) {
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (listen_fd < 0) listen_fd = fd;
  });
  int port = config_.port;
  if (port == 0) {
    port = server_->bind_to_any_port(config_.host);
    if (port < 0) return make_error("cannot bind {} to a free port", config_.host);
  } else if (!server_->bind_to_port(config_.host, port)) {
    return make_error("cannot listen on {}:{} (in use, or not an address of this host?)", config_.host, port);
  }
  // The library listens with a backlog of 5, which drops bursts of connections; listen again with a deep one.
  if (listen_fd >= 0) ::listen(listen_fd, 4096);
  spdlog::info("listening on http://{}:{} (model '{}')", config_.host, port, config_.served_model_name);
  if (!server_->listen_after_bind() && !stopping_) return make_error("the HTTP server stopped unexpectedly");
  return {};
}

void HttpServer::stop() {
  if (stopping_.exchange(true)) return;
  spdlog::info("shutting down: refusing new requests, ending {} open streams", active_streams_.load());
  engine_.shutdown();
  for (int i = 0; i < 100 && active_streams_ > 0; ++i) std::this_thread::sleep_for(50ms);
  server_->stop();
}

}  // namespace tern
