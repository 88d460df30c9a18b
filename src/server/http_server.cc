#include "server/http_server.h"

#include <httplib.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <chrono>
#include <functional>
#include <map>
#include <thread>

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
    case 413: return "request_too_large";
    case 503: return "service_unavailable";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

}  // namespace

// What a streaming response needs after the handler returned; the count of open streams follows its lifetime.
struct StreamState {
  StreamState(std::shared_ptr<RequestStream> s, ResponseContext ctx, bool usage, std::atomic<int64_t>& active,
              std::function<void()> on_abandoned)
      : stream(std::move(s)), builder(std::move(ctx)), include_usage(usage), active_streams(active),
        on_abandoned(std::move(on_abandoned)) {
    ++active_streams;
  }
  ~StreamState() {
    if (!builder.finished()) {  // the client went away before the end
      stream->cancel();
      on_abandoned();
    }
    --active_streams;
  }
  std::shared_ptr<RequestStream> stream;
  ResponseBuilder builder;
  bool include_usage;
  std::atomic<int64_t>& active_streams;
  std::function<void()> on_abandoned;
};

HttpServer::HttpServer(ServerConfig config, Engine& engine, EngineMetrics& metrics, std::optional<Tokenizer> tokenizer,
                       std::optional<ChatTemplateSet> templates)
    : config_(std::move(config)), engine_(engine), metrics_(metrics), tokenizer_(std::move(tokenizer)),
      templates_(std::move(templates)), server_(std::make_unique<httplib::Server>()) {
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

void HttpServer::install_routes() {
  httplib::Server& s = *server_;
  const int threads = config_.num_threads;
  s.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  s.set_tcp_nodelay(true);
  s.set_keep_alive_timeout(5);
  s.set_read_timeout(30);
  s.set_write_timeout(30);
  s.set_payload_max_length(config_.max_body_bytes);
  s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (config_.api_key.empty() || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
    if (req.get_header_value("Authorization") == "Bearer " + config_.api_key) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    send_error(res, {401, "a valid API key is required (Authorization: Bearer ...)", "invalid_request_error", "",
                     "invalid_api_key"});
    return httplib::Server::HandlerResponse::Handled;
  });
  s.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
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
    send_error(res, {res.status, message, error_type(res.status)});
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
}

tl::expected<std::vector<int32_t>, ApiError> HttpServer::prompt_tokens(const ApiRequest& r,
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
    ids = tokenizer_->encode(*text, false);
  } else if (r.prompt_text) {
    if (!tokenizer_) {
      return tl::unexpected(ApiError{400, "this model has no tokenizer: give the prompt as token ids", "", "prompt"});
    }
    ids = tokenizer_->encode(*r.prompt_text, true);
  } else {
    ids = *r.prompt_ids;
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
  if (r.model != config_.served_model_name) {
    return fail({404, fmt::format("the model '{}' does not exist; this server serves '{}'", r.model,
                                  config_.served_model_name),
                 "invalid_request_error", "model", "model_not_found"});
  }
  bool starts_in_reasoning = false;
  auto ids = prompt_tokens(r, starts_in_reasoning);
  if (!ids) return fail(ids.error());
  auto max_tokens = api_request_max_tokens(r, static_cast<int64_t>(ids->size()), config_.context_length);
  if (!max_tokens) return fail(max_tokens.error());
  GenerationRequest g{.prompt = *ids, .sampling = r.sampling,
                      .stop = {.stop_token_ids = r.stop_token_ids, .stop_strings = r.stop_strings,
                               .max_tokens = *max_tokens},
                      .skip_special_tokens = r.skip_special_tokens, .ignore_eos = r.ignore_eos};
  if (auto v = stop_criteria_validate(g.stop); !v) return fail({400, v.error().message, "invalid_request_error", "stop"});
  auto stream = engine_.submit(std::move(g));
  if (!stream) return fail({503, stream.error().message, "service_unavailable"});

  ResponseContext ctx{.chat = chat, .id = fmt::format("{}-{:x}{:04x}", chat ? "chatcmpl" : "cmpl", unix_now(),
                                                      next_request_++),
                      .model = config_.served_model_name, .created = unix_now(),
                      .num_prompt_tokens = static_cast<int64_t>(ids->size()), .logprobs = r.logprobs,
                      .tokenizer = tokenizer_ ? &*tokenizer_ : nullptr};
  if (chat && config_.reasoning && r.separate_reasoning) ctx.reasoning.emplace(starts_in_reasoning);
  if (chat && r.tools_enabled && config_.tool_format != ToolFormat::kNone) ctx.tools.emplace(config_.tool_format, r.tools);
  if (!chat && r.echo) ctx.echo_text = r.prompt_text ? *r.prompt_text : (tokenizer_ ? tokenizer_->decode(*ids) : "");

  if (!r.stream) {
    ResponseBuilder builder(std::move(ctx));
    while (!builder.finished()) {
      for (const TokenEvent& e : (*stream)->wait(100ms)) builder.on_event(e);
    }
    count_outcome(builder.finish_reason());
    res.set_content(dump(builder.final_response()), "application/json");
    return;
  }
  auto state = std::make_shared<StreamState>(*stream, std::move(ctx), r.include_usage, active_streams_,
                                             [this] { count_outcome("abort"); });
  res.set_chunked_content_provider("text/event-stream", [this, state](size_t, httplib::DataSink& sink) {
    auto write = [&](const std::string& data) { return sink.write(data.data(), data.size()); };
    for (;;) {
      std::vector<TokenEvent> events = state->stream->wait(100ms);
      if (!sink.is_writable()) return false;
      for (const TokenEvent& e : events) {
        for (const Json& c : state->builder.on_event(e)) {
          if (!write("data: " + dump(c) + "\n\n")) return false;
        }
      }
      if (state->builder.finished()) {
        count_outcome(state->builder.finish_reason());
        if (state->include_usage) write("data: " + dump(state->builder.usage_chunk()) + "\n\n");
        // The final chunk only says "error"; the reason follows as an OpenAI error event (clients raise it).
        if (!state->builder.error().empty()) {
          write("data: " + api_error_body({500, state->builder.error(), "server_error"}) + "\n\n");
        }
        write("data: [DONE]\n\n");
        sink.done();
        return true;
      }
    }
  });
}

std::string HttpServer::render_metrics() const {
  std::string out;
  auto metric = [&](const char* name, const char* type, const char* help, auto value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, value);
  };
  out += "# HELP tern_requests_total Generation requests by outcome (finish reason, rejected, unavailable).\n"
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
