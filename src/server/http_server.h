// The HTTP front end (cpp-httplib, thread per connection): OpenAI routes, auth, metrics, graceful stop. Handler
// threads turn requests into GenerationRequests, submit them to the Engine and relay its events; they never run
// the model.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "core/error.h"
#include "runtime/engine.h"
#include "server/openai_request.h"
#include "server/tool_parser.h"
#include "template/model_template.h"
#include "tokenizer/tokenizer.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace tern {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 30000;
  std::string served_model_name;
  std::string api_key;  // empty: no auth
  size_t max_body_bytes = 4 << 20;
  int request_read_timeout_s = 30;  // first byte of a request to the last of its body (then 408)
  int64_t context_length = 4096;
  bool reasoning = true;  // split <think> blocks
  ToolFormat tool_format = ToolFormat::kNone;
  int num_threads = 64;
};

class HttpServer {
 public:
  HttpServer(ServerConfig config, Engine& engine, EngineMetrics& metrics, std::optional<Tokenizer> tokenizer,
             std::optional<ChatTemplateSet> templates);
  ~HttpServer();

  // Binds, logs the address, and serves until stop(). `on_listening` runs once the socket accepts connections.
  Expected<void> run();
  // Refuses new requests, ends the engine's requests (streams get their final chunk), then closes the server.
  void stop();

 private:
  void install_routes();
  void handle_generate(const httplib::Request& req, httplib::Response& res, bool chat);
  // POST /tokenize and /detokenize (vLLM's and SGLang's routes).
  void handle_tokenize(const httplib::Request& req, httplib::Response& res);
  void handle_detokenize(const httplib::Request& req, httplib::Response& res);
  // The error for a request naming another model than the one served; nullopt when it names this one or none.
  std::optional<ApiError> check_model(const std::string& model) const;
  void send_error(httplib::Response& res, const ApiError& error);
  // Refuses what the body's framing headers announce before a byte of the body is read (docs/server.md).
  std::optional<ApiError> check_framing(const httplib::Request& req) const;
  void describe_library_error(const httplib::Request& req, httplib::Response& res);
  std::string render_metrics() const;
  void count_outcome(const std::string& outcome);
  // Refuses, before encoding, a text longer than the context can hold whatever it encodes to.
  std::optional<ApiError> check_prompt_bytes(size_t bytes, const char* param) const;
  // The tokens of a chat request's prompt, or of a completions request's prompt number `prompt`.
  tl::expected<std::vector<int32_t>, ApiError> prompt_tokens(const ApiRequest& r, size_t prompt,
                                                             bool& starts_in_reasoning) const;

  ServerConfig config_;
  Engine& engine_;
  EngineMetrics& metrics_;
  std::optional<Tokenizer> tokenizer_;
  std::optional<ChatTemplateSet> templates_;
  std::unique_ptr<httplib::Server> server_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> active_streams_{0};
  std::atomic<uint64_t> next_request_{1};
  mutable std::mutex outcomes_mutex_;
  std::map<std::string, uint64_t> outcomes_;
};

}  // namespace tern
