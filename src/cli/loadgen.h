// The measuring parts of `tern loadgen`, kept apart from the HTTP client so that they can be tested alone: prompts,
// arrival schedules, Server-Sent Events parsing, per-request timing, percentiles and the report.
//
// Timing definitions (the report and docs/perf/serving.md use the same words):
//   TTFT  request sent -> first chunk that carries output (text, reasoning, tool calls or logprobs).
//   E2E   request sent -> end of the stream.
//   TPOT  per request, (E2E - TTFT) / (output tokens - 1); output tokens from the server's `usage`.
//   ITL   gaps between consecutive output-carrying chunks, each divided by the request's mean tokens per later
//         chunk, (output tokens - 1) / (chunks - 1), the first chunk standing for the first token as in TTFT and
//         TPOT: a server that packs several tokens into one chunk is not credited with a shorter ITL, and the
//         request's mean ITL is about its TPOT. With one token per chunk (tern, vLLM and SGLang by default) it is the
//         raw gap.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tern {

// --- Workload ---

// `count` lengths drawn uniformly from the integers in [len * (1 - range), len * (1 + range)], at least 1.
std::vector<int64_t> loadgen_draw_lengths(int64_t len, double range, int64_t count, std::mt19937_64& rng);

// Open-loop arrival times in seconds from the start: gamma-distributed gaps with shape `burstiness` and mean
// 1 / `rate` (burstiness 1: a Poisson process; below 1 burstier, above 1 more regular). A rate that is not finite
// and positive sends every request at time 0.
std::vector<double> loadgen_arrival_times(int64_t count, double rate, double burstiness, uint64_t seed);

// About `num_tokens` tokens of text: random words from a fixed list of common English words, each one token with
// its leading space in the usual BPE vocabularies, so that a server tokenizes it to about that length.
std::string loadgen_text_prompt(int64_t num_tokens, std::mt19937_64& rng);
// `num_tokens` random token ids below `vocab_size`, for servers without a tokenizer (dummy weights).
std::vector<int32_t> loadgen_id_prompt(int64_t num_tokens, int32_t vocab_size, std::mt19937_64& rng);

struct LoadgenBodyOptions {
  bool chat = false;
  std::string model;
  int64_t max_tokens = 1;
  double temperature = 0.0;
  bool ignore_eos = false;
  // Ask for per-token logprobs: a server without a tokenizer streams empty text, but still one chunk per token.
  bool logprobs = false;
};

// The JSON body of a streaming /v1/completions or /v1/chat/completions request; `prompt` is a string or an array
// of token ids (completions only).
std::string loadgen_request_body(const LoadgenBodyOptions& options, const nlohmann::json& prompt);

// --- Server-Sent Events ---

// Splits a byte stream into the data payloads of its events, however the bytes are cut into reads. Lines
// "data: x" of one event are joined with '\n'; comments, other fields and CR LF line ends are handled.
class SseParser {
 public:
  std::vector<std::string> feed(std::string_view bytes);
  // At the end of the stream: the last event, when the server did not end it with a blank line.
  std::vector<std::string> finish();

 private:
  std::string line_;
  std::string data_;
  bool has_data_ = false;
};

// What one data payload of an OpenAI stream says.
struct LoadgenChunk {
  bool done = false;        // "[DONE]"
  bool has_output = false;  // carries output text, reasoning, tool calls or logprobs
  std::string finish_reason;
  std::optional<int64_t> prompt_tokens, completion_tokens;  // from `usage`
  std::string error;                                        // an error event or payload that is not an OpenAI chunk
};

LoadgenChunk loadgen_parse_chunk(std::string_view data);

// --- One request ---

struct LoadgenResult {
  bool ok = false;
  std::string error;
  int http_status = 0;
  double start_s = 0;  // when it was sent, seconds from the start of the run
  double ttft_s = 0, e2e_s = 0;
  int64_t prompt_tokens = 0;
  bool prompt_tokens_from_server = false;
  int64_t output_tokens = 0;
  int64_t num_chunks = 0;  // output-carrying chunks
  std::vector<double> itl_s;
};

// Follows one streamed response: bytes in, with their arrival time in seconds from when the request was sent;
// a LoadgenResult out. The caller sets the HTTP status first; a status other than 200 makes the body an error.
class LoadgenStreamTracker {
 public:
  explicit LoadgenStreamTracker(int64_t estimated_prompt_tokens) : estimated_prompt_tokens_(estimated_prompt_tokens) {}
  void on_status(int status) { status_ = status; }
  void on_bytes(std::string_view bytes, double t);
  // `transport_error`: why the connection failed or was cut (empty: it ended normally).
  LoadgenResult finish(double t, const std::string& transport_error);

 private:
  void on_chunk(const LoadgenChunk& chunk, double t);

  int64_t estimated_prompt_tokens_;
  int status_ = 0;
  SseParser parser_;
  std::string error_body_;
  std::vector<double> chunk_times_;
  std::optional<int64_t> prompt_tokens_, completion_tokens_;
  std::string finish_reason_, error_;
  bool done_ = false;
};

// --- The report ---

// numpy.percentile's default ("linear") definition, p in [0, 100]: the sorted values interpolated at rank
// p / 100 * (n - 1). NaN for no values.
double loadgen_percentile(std::vector<double> values, double p);

struct LoadgenStats {
  int64_t count = 0;
  double mean = 0, median = 0, p90 = 0, p99 = 0, max = 0;  // NaN when count is 0
};
LoadgenStats loadgen_stats(const std::vector<double>& values);

struct LoadgenSummary {
  double duration_s = 0;
  int64_t completed = 0, failed = 0;
  int64_t input_tokens = 0, output_tokens = 0;  // completed requests only
  int64_t prompt_tokens_estimated = 0;          // completed requests whose server sent no usage
  double request_throughput = 0, input_throughput = 0, output_throughput = 0, total_throughput = 0;
  LoadgenStats ttft_ms, tpot_ms, itl_ms, e2e_ms;
  std::map<std::string, int64_t> errors;  // message -> count
};

LoadgenSummary loadgen_summarize(const std::vector<LoadgenResult>& results, double duration_s);

// `header`: lines that head the table (the URL, the model, the traffic shape).
std::string loadgen_format_table(const LoadgenSummary& summary, const std::vector<std::string>& header);
nlohmann::ordered_json loadgen_summary_json(const LoadgenSummary& summary);
nlohmann::ordered_json loadgen_result_json(const LoadgenResult& result);

// --- The server's address ---

struct LoadgenUrl {
  std::string scheme_host_port;  // "http://127.0.0.1:30000", what the HTTP client connects to
  std::string base_path;         // prefix of the /v1/... routes, "" or "/proxy"; a trailing "/v1" is dropped
};

Expected<LoadgenUrl> loadgen_parse_url(std::string_view url);

}  // namespace tern
