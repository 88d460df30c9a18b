#include "cli/loadgen.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <limits>

namespace tern {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr size_t kMaxErrorBody = 4096;
constexpr size_t kMaxErrorMessage = 300;

// Short, frequent English words, each a single token with its leading space in the Qwen3, Llama 3, DeepSeek-V3 and
// gpt-oss vocabularies (checked with `tern tokenize`), so N of them make about N tokens on those servers.
constexpr std::array<std::string_view, 128> kWords = {
    "the",   "of",     "and",   "to",     "in",    "is",    "that",  "for",   "it",    "as",    "was",   "with",
    "be",    "by",     "on",    "not",    "he",    "this",  "are",   "or",    "his",   "from",  "at",    "which",
    "but",   "have",   "an",    "had",    "they",  "you",   "were",  "their", "one",   "all",   "we",    "can",
    "her",   "has",    "there", "been",   "if",    "more",  "when",  "will",  "would", "who",   "so",    "no",
    "time",  "people", "water", "world",  "house", "light", "music", "story", "river", "city",  "paper", "money",
    "night", "table",  "voice", "group",  "place", "field", "power", "heart", "line",  "room",  "book",  "road",
    "small", "large",  "early", "young",  "great", "good",  "long",  "high",  "old",   "new",   "last",  "first",
    "open",  "short",  "free",  "real",   "full",  "clear", "close", "green", "black", "white", "red",   "blue",
    "make",  "take",   "come",  "give",   "find",  "tell",  "work",  "call",  "try",   "ask",   "need",  "feel",
    "leave", "keep",   "begin", "help",   "show",  "hear",  "play",  "run",   "move",  "live",  "hold",  "bring",
    "write", "stand",  "learn", "change", "read",  "build", "grow",  "walk"};

std::string truncate(std::string_view s, size_t n) {
  return s.size() <= n ? std::string(s) : fmt::format("{}...", s.substr(0, n));
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool nonempty_string(const Json& object, const char* key) {
  auto it = object.find(key);
  return it != object.end() && it->is_string() && !it->get_ref<const std::string&>().empty();
}

// The message of an error value: {"message": ...}, a string, or the JSON itself.
std::string error_message(const Json& error) {
  if (error.is_string()) return error.get<std::string>();
  if (error.is_object()) {
    for (const char* key : {"message", "detail", "msg"}) {
      if (nonempty_string(error, key)) return error[key].get<std::string>();
    }
  }
  return truncate(error.dump(), kMaxErrorMessage);
}

// Whether the first choice of a chunk carries output; the chat role chunk ({"role": ..., "content": ""}) does not.
bool choice_has_output(const Json& choice) {
  if (!choice.is_object()) return false;
  if (nonempty_string(choice, "text")) return true;
  if (auto lp = choice.find("logprobs"); lp != choice.end() && !lp->is_null() && !lp->empty()) return true;
  auto delta = choice.find("delta");
  if (delta == choice.end() || !delta->is_object()) return false;
  if (nonempty_string(*delta, "content") || nonempty_string(*delta, "reasoning_content") ||
      nonempty_string(*delta, "reasoning")) {
    return true;
  }
  auto calls = delta->find("tool_calls");
  return calls != delta->end() && calls->is_array() && !calls->empty();
}

std::optional<int64_t> count_field(const Json& usage, const char* key) {
  auto it = usage.find(key);
  if (it == usage.end() || !it->is_number_integer()) return std::nullopt;
  return it->get<int64_t>();
}

// The error of a non-200 response: its OpenAI error message when the body has one, else the body itself.
std::string http_error(int status, const std::string& body) {
  Json j = Json::parse(body, nullptr, false);
  std::string message = truncate(trim(body), kMaxErrorMessage);
  if (!j.is_discarded() && j.is_object()) message = error_message(j.contains("error") ? j["error"] : j);
  return message.empty() ? fmt::format("HTTP {}", status) : fmt::format("HTTP {}: {}", status, message);
}

}  // namespace

std::vector<int64_t> loadgen_draw_lengths(int64_t len, double range, int64_t count, std::mt19937_64& rng) {
  const int64_t lo = std::max<int64_t>(1, std::llround(static_cast<double>(len) * (1.0 - range)));
  const int64_t hi = std::max<int64_t>(lo, std::llround(static_cast<double>(len) * (1.0 + range)));
  std::uniform_int_distribution<int64_t> dist(lo, hi);
  std::vector<int64_t> out(static_cast<size_t>(std::max<int64_t>(count, 0)));
  for (int64_t& v : out) v = dist(rng);
  return out;
}

std::vector<double> loadgen_arrival_times(int64_t count, double rate, double burstiness, uint64_t seed) {
  std::vector<double> out(static_cast<size_t>(std::max<int64_t>(count, 0)), 0.0);
  if (!std::isfinite(rate) || rate <= 0 || out.empty()) return out;
  std::mt19937_64 rng(seed);
  // Mean of gamma(k, theta) is k * theta; theta = 1 / (rate * k) keeps the mean gap at 1 / rate for any k.
  std::gamma_distribution<double> gap(burstiness, 1.0 / (rate * burstiness));
  for (size_t i = 1; i < out.size(); ++i) out[i] = out[i - 1] + gap(rng);
  return out;
}

std::string loadgen_text_prompt(int64_t num_tokens, std::mt19937_64& rng) {
  std::uniform_int_distribution<size_t> pick(0, kWords.size() - 1);
  std::string out;
  for (int64_t i = 0; i < num_tokens; ++i) {
    if (i > 0) out += ' ';
    out += kWords[pick(rng)];
  }
  return out;
}

std::vector<int32_t> loadgen_id_prompt(int64_t num_tokens, int32_t vocab_size, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> pick(0, std::max(vocab_size, 1) - 1);
  std::vector<int32_t> out(static_cast<size_t>(std::max<int64_t>(num_tokens, 0)));
  for (int32_t& id : out) id = pick(rng);
  return out;
}

std::string loadgen_request_body(const LoadgenBodyOptions& o, const Json& prompt) {
  OrderedJson body{{"model", o.model}};
  if (o.chat) {
    body["messages"] = OrderedJson::array({{{"role", "user"}, {"content", prompt}}});
  } else {
    body["prompt"] = prompt;
  }
  body["max_tokens"] = o.max_tokens;
  body["temperature"] = o.temperature;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  // Only when asked: servers that follow OpenAI strictly reject fields they do not know.
  if (o.ignore_eos) body["ignore_eos"] = true;
  if (o.logprobs && o.chat) {
    body["logprobs"] = true;
    body["top_logprobs"] = 0;
  } else if (o.logprobs) {
    body["logprobs"] = 0;
  }
  return body.dump();
}

std::vector<std::string> SseParser::feed(std::string_view bytes) {
  std::vector<std::string> events;
  for (char c : bytes) {
    if (c != '\n') {
      line_ += c;
      continue;
    }
    std::string_view line = line_;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) {  // a blank line ends the event
      if (has_data_) events.push_back(std::move(data_));
      data_.clear();
      has_data_ = false;
    } else if (line.starts_with("data:")) {
      std::string_view value = line.substr(5);
      if (value.starts_with(' ')) value.remove_prefix(1);
      if (has_data_) data_ += '\n';
      data_ += value;
      has_data_ = true;
    }  // else a comment (":...") or a field loadgen does not use (event:, id:, retry:)
    line_.clear();
  }
  return events;
}

std::vector<std::string> SseParser::finish() {
  std::vector<std::string> events = feed("\n\n");
  line_.clear();
  return events;
}

LoadgenChunk loadgen_parse_chunk(std::string_view data) {
  LoadgenChunk c;
  data = trim(data);
  if (data == "[DONE]") {
    c.done = true;
    return c;
  }
  Json j = Json::parse(data, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    c.error = fmt::format("malformed stream chunk: {}", truncate(data, 120));
    return c;
  }
  if (auto e = j.find("error"); e != j.end() && !e->is_null()) {
    c.error = error_message(*e);
    return c;
  }
  if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
    c.prompt_tokens = count_field(*u, "prompt_tokens");
    c.completion_tokens = count_field(*u, "completion_tokens");
  }
  if (auto ch = j.find("choices"); ch != j.end() && ch->is_array() && !ch->empty()) {
    const Json& choice = (*ch)[0];
    c.has_output = choice_has_output(choice);
    if (choice.is_object() && nonempty_string(choice, "finish_reason"))
      c.finish_reason = choice["finish_reason"].get<std::string>();
  }
  return c;
}

void LoadgenStreamTracker::on_bytes(std::string_view bytes, double t) {
  if (status_ != 200) {
    if (error_body_.size() < kMaxErrorBody) error_body_ += bytes.substr(0, kMaxErrorBody - error_body_.size());
    return;
  }
  for (const std::string& data : parser_.feed(bytes)) on_chunk(loadgen_parse_chunk(data), t);
}

void LoadgenStreamTracker::on_chunk(const LoadgenChunk& c, double t) {
  if (done_) return;
  if (c.done) {
    done_ = true;
    return;
  }
  if (!c.error.empty()) {
    if (error_.empty()) error_ = c.error;
    return;
  }
  if (c.prompt_tokens) prompt_tokens_ = c.prompt_tokens;
  if (c.completion_tokens) completion_tokens_ = c.completion_tokens;
  if (c.has_output) chunk_times_.push_back(t);
  if (!c.finish_reason.empty()) finish_reason_ = c.finish_reason;
}

LoadgenResult LoadgenStreamTracker::finish(double t, const std::string& transport_error) {
  if (status_ == 200) {
    for (const std::string& data : parser_.finish()) on_chunk(loadgen_parse_chunk(data), t);
  }
  LoadgenResult r;
  r.http_status = status_;
  r.e2e_s = t;
  if (!transport_error.empty()) {
    r.error = transport_error;
  } else if (status_ != 200) {
    r.error = http_error(status_, error_body_);
  } else if (!error_.empty()) {
    r.error = error_;
  } else if (finish_reason_ == "error") {
    r.error = "finish_reason \"error\" without an error event";
  } else if (!done_ && finish_reason_.empty()) {
    r.error = "the stream ended before a finish_reason or [DONE]";
  }
  r.ok = r.error.empty();
  r.prompt_tokens_from_server = prompt_tokens_.has_value();
  r.prompt_tokens = prompt_tokens_.value_or(estimated_prompt_tokens_);
  r.num_chunks = static_cast<int64_t>(chunk_times_.size());
  r.output_tokens = completion_tokens_.value_or(r.num_chunks);
  // No output-carrying chunk (e.g. zero tokens): the first token, if any, came with the end.
  r.ttft_s = chunk_times_.empty() ? t : chunk_times_.front();
  const int64_t k = r.num_chunks, n = r.output_tokens;
  if (k >= 2) {
    const double tokens_per_chunk = n > k ? static_cast<double>(n - 1) / static_cast<double>(k - 1) : 1.0;
    for (size_t i = 1; i < chunk_times_.size(); ++i) {
      r.itl_s.push_back((chunk_times_[i] - chunk_times_[i - 1]) / tokens_per_chunk);
    }
  }
  return r;
}

double loadgen_percentile(std::vector<double> values, double p) {
  if (values.empty()) return kNaN;
  std::sort(values.begin(), values.end());
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (rank - static_cast<double>(lo)) * (values[hi] - values[lo]);
}

LoadgenStats loadgen_stats(const std::vector<double>& values) {
  LoadgenStats s;
  s.count = static_cast<int64_t>(values.size());
  if (values.empty()) {
    s.mean = s.median = s.p90 = s.p99 = s.max = kNaN;
    return s;
  }
  double sum = 0;
  for (double v : values) sum += v;
  s.mean = sum / static_cast<double>(values.size());
  s.median = loadgen_percentile(values, 50);
  s.p90 = loadgen_percentile(values, 90);
  s.p99 = loadgen_percentile(values, 99);
  s.max = *std::max_element(values.begin(), values.end());
  return s;
}

LoadgenSummary loadgen_summarize(const std::vector<LoadgenResult>& results, double duration_s) {
  LoadgenSummary s;
  s.duration_s = duration_s;
  std::vector<double> ttft, tpot, itl, e2e;
  for (const LoadgenResult& r : results) {
    if (!r.ok) {
      ++s.failed;
      ++s.errors[r.error];
      continue;
    }
    ++s.completed;
    s.input_tokens += r.prompt_tokens;
    s.output_tokens += r.output_tokens;
    if (!r.prompt_tokens_from_server) ++s.prompt_tokens_estimated;
    ttft.push_back(r.ttft_s * 1e3);
    e2e.push_back(r.e2e_s * 1e3);
    if (r.output_tokens > 1) tpot.push_back((r.e2e_s - r.ttft_s) * 1e3 / static_cast<double>(r.output_tokens - 1));
    for (double v : r.itl_s) itl.push_back(v * 1e3);
  }
  if (duration_s > 0) {
    s.request_throughput = static_cast<double>(s.completed) / duration_s;
    s.input_throughput = static_cast<double>(s.input_tokens) / duration_s;
    s.output_throughput = static_cast<double>(s.output_tokens) / duration_s;
    s.total_throughput = s.input_throughput + s.output_throughput;
  }
  s.ttft_ms = loadgen_stats(ttft);
  s.tpot_ms = loadgen_stats(tpot);
  s.itl_ms = loadgen_stats(itl);
  s.e2e_ms = loadgen_stats(e2e);
  return s;
}

std::string loadgen_format_table(const LoadgenSummary& s, const std::vector<std::string>& header) {
  std::string out;
  auto row = [&](std::string_view name, const std::string& value) {
    out += fmt::format("{:<36}{:>14}\n", name, value);
  };
  for (const std::string& line : header) out += line + '\n';
  out += std::string(50, '-') + '\n';
  row("Completed requests:", fmt::format("{}", s.completed));
  row("Failed requests:", fmt::format("{}", s.failed));
  row("Duration (s):", fmt::format("{:.2f}", s.duration_s));
  row("Total input tokens:", fmt::format("{}", s.input_tokens));
  row("Total output tokens:", fmt::format("{}", s.output_tokens));
  row("Request throughput (req/s):", fmt::format("{:.2f}", s.request_throughput));
  row("Input token throughput (tok/s):", fmt::format("{:.2f}", s.input_throughput));
  row("Output token throughput (tok/s):", fmt::format("{:.2f}", s.output_throughput));
  row("Total token throughput (tok/s):", fmt::format("{:.2f}", s.total_throughput));
  if (s.prompt_tokens_estimated > 0) {
    out += fmt::format("({} requests without usage: their input tokens are estimates)\n", s.prompt_tokens_estimated);
  }
  out += fmt::format("{:<12}{:>10}{:>10}{:>10}{:>10}{:>10}\n", "(ms)", "mean", "median", "p90", "p99", "max");
  auto stats = [&](std::string_view name, const LoadgenStats& v) {
    out += fmt::format("{:<12}{:>10.2f}{:>10.2f}{:>10.2f}{:>10.2f}{:>10.2f}\n", name, v.mean, v.median, v.p90, v.p99,
                       v.max);
  };
  stats("TTFT", s.ttft_ms);
  stats("TPOT", s.tpot_ms);
  stats("ITL", s.itl_ms);
  stats("E2E", s.e2e_ms);
  if (!s.errors.empty()) out += "Errors:\n";
  for (const auto& [message, count] : s.errors) out += fmt::format("  {:>6} x {}\n", count, message);
  return out;
}

OrderedJson loadgen_summary_json(const LoadgenSummary& s) {
  auto stats = [](const LoadgenStats& v) {
    return OrderedJson{{"count", v.count}, {"mean", v.mean}, {"median", v.median},
                       {"p90", v.p90},     {"p99", v.p99},   {"max", v.max}};
  };
  OrderedJson errors = OrderedJson::object();
  for (const auto& [message, count] : s.errors) errors[message] = count;
  return OrderedJson{{"duration_s", s.duration_s},
                     {"completed", s.completed},
                     {"failed", s.failed},
                     {"total_input_tokens", s.input_tokens},
                     {"total_output_tokens", s.output_tokens},
                     {"input_tokens_estimated_requests", s.prompt_tokens_estimated},
                     {"request_throughput", s.request_throughput},
                     {"input_throughput", s.input_throughput},
                     {"output_throughput", s.output_throughput},
                     {"total_token_throughput", s.total_throughput},
                     {"ttft_ms", stats(s.ttft_ms)},
                     {"tpot_ms", stats(s.tpot_ms)},
                     {"itl_ms", stats(s.itl_ms)},
                     {"e2e_ms", stats(s.e2e_ms)},
                     {"errors", errors}};
}

OrderedJson loadgen_result_json(const LoadgenResult& r) {
  OrderedJson j{{"ok", r.ok},
                {"http_status", r.http_status},
                {"start_s", r.start_s},
                {"ttft_s", r.ttft_s},
                {"e2e_s", r.e2e_s},
                {"prompt_tokens", r.prompt_tokens},
                {"prompt_tokens_from_server", r.prompt_tokens_from_server},
                {"output_tokens", r.output_tokens},
                {"chunks", r.num_chunks}};
  if (!r.ok) j["error"] = r.error;
  return j;
}

Expected<LoadgenUrl> loadgen_parse_url(std::string_view url) {
  std::string_view rest = trim(url);
  std::string scheme = "http";
  if (auto sep = rest.find("://"); sep != std::string_view::npos) {
    scheme = std::string(rest.substr(0, sep));
    rest.remove_prefix(sep + 3);
  }
  if (scheme != "http" && scheme != "https") return make_error("--url '{}': the scheme must be http or https", url);
  const size_t slash = rest.find('/');
  const std::string_view authority = rest.substr(0, slash);
  std::string_view path = slash == std::string_view::npos ? std::string_view() : rest.substr(slash);
  if (authority.empty()) return make_error("--url '{}' has no host", url);
  const size_t colon = authority.rfind(':');
  if (colon != std::string_view::npos && authority.find(']', colon) == std::string_view::npos) {
    const std::string_view port = authority.substr(colon + 1);
    if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), [](char c) {
          return std::isdigit(static_cast<unsigned char>(c)) != 0;
        })) {
      return make_error("--url '{}': the port '{}' is not a number", url, port);
    }
  }
  while (path.ends_with('/')) path.remove_suffix(1);
  if (path.ends_with("/v1")) path.remove_suffix(3);
  return LoadgenUrl{fmt::format("{}://{}", scheme, authority), std::string(path)};
}

}  // namespace tern
