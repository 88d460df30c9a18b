#include "cli/loadgen.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

namespace tern {
namespace {

using Json = nlohmann::json;

// Expected values worked by hand from numpy.percentile's default definition: rank = p / 100 * (n - 1) in the
// sorted values, linear between its neighbours.
TEST(LoadgenPercentile, MatchesNumpyLinear) {
  EXPECT_DOUBLE_EQ(loadgen_percentile({1, 2, 3, 4}, 50), 2.5);                      // rank 1.5
  EXPECT_DOUBLE_EQ(loadgen_percentile({1, 2, 3, 4}, 90), 3.7);                      // rank 2.7
  EXPECT_DOUBLE_EQ(loadgen_percentile({4, 1, 3, 2}, 99), 3.97);                     // rank 2.97, unsorted input
  EXPECT_DOUBLE_EQ(loadgen_percentile({15, 20, 35, 40, 50}, 40), 29.0);             // rank 1.6: 20 + 0.6 * 15
  EXPECT_DOUBLE_EQ(loadgen_percentile({50, 15, 40, 20, 35}, 90), 46.0);             // rank 3.6: 40 + 0.6 * 10
  EXPECT_DOUBLE_EQ(loadgen_percentile({0.5, 2.5, 1.0, 4.0, 8.0, 3.5}, 75), 3.875);  // rank 3.75: 3.5 + 0.75 * 0.5
  EXPECT_DOUBLE_EQ(loadgen_percentile({3, 1, 2}, 0), 1.0);
  EXPECT_DOUBLE_EQ(loadgen_percentile({3, 1, 2}, 100), 3.0);
  EXPECT_DOUBLE_EQ(loadgen_percentile({7}, 99), 7.0);
  EXPECT_TRUE(std::isnan(loadgen_percentile({}, 50)));
}

TEST(LoadgenPercentile, Stats) {
  const LoadgenStats s = loadgen_stats({10, 40, 20, 30});
  EXPECT_EQ(s.count, 4);
  EXPECT_DOUBLE_EQ(s.mean, 25.0);
  EXPECT_DOUBLE_EQ(s.median, 25.0);  // rank 1.5
  EXPECT_DOUBLE_EQ(s.p90, 37.0);     // rank 2.7
  EXPECT_DOUBLE_EQ(s.p99, 39.7);     // rank 2.97
  EXPECT_DOUBLE_EQ(s.max, 40.0);
  const LoadgenStats empty = loadgen_stats({});
  EXPECT_EQ(empty.count, 0);
  EXPECT_TRUE(std::isnan(empty.mean) && std::isnan(empty.max));
}

struct GapMoments {
  double mean = 0, cv = 0;  // coefficient of variation: std / mean
};

GapMoments gap_moments(const std::vector<double>& arrivals) {
  std::vector<double> gaps;
  for (size_t i = 1; i < arrivals.size(); ++i) gaps.push_back(arrivals[i] - arrivals[i - 1]);
  double sum = 0, sq = 0;
  for (double g : gaps) sum += g;
  const double mean = sum / static_cast<double>(gaps.size());
  for (double g : gaps) sq += (g - mean) * (g - mean);
  return {mean, std::sqrt(sq / static_cast<double>(gaps.size())) / mean};
}

// Over 20000 gaps the sample mean of an exponential lies within 0.7% of 1/R per standard error; 2.5% is ~3.5 sigma.
TEST(LoadgenArrivals, PoissonMeanAndSpread) {
  const std::vector<double> t = loadgen_arrival_times(20001, 10.0, 1.0, 7);
  ASSERT_EQ(t.size(), 20001u);
  EXPECT_EQ(t[0], 0.0);
  for (size_t i = 1; i < t.size(); ++i) ASSERT_GE(t[i], t[i - 1]) << i;
  const GapMoments m = gap_moments(t);
  EXPECT_NEAR(m.mean, 0.1, 0.1 * 0.025);
  EXPECT_NEAR(m.cv, 1.0, 0.05);  // exponential gaps: std == mean
}

TEST(LoadgenArrivals, BurstinessKeepsTheRate) {
  // Gamma with shape k: the same mean 1/R, coefficient of variation 1/sqrt(k).
  const GapMoments regular = gap_moments(loadgen_arrival_times(20001, 4.0, 4.0, 11));
  EXPECT_NEAR(regular.mean, 0.25, 0.25 * 0.025);
  EXPECT_NEAR(regular.cv, 0.5, 0.05);
  const GapMoments bursty = gap_moments(loadgen_arrival_times(20001, 4.0, 0.25, 11));
  EXPECT_NEAR(bursty.mean, 0.25, 0.25 * 0.06);  // cv 2: four times the spread of the mean
  EXPECT_NEAR(bursty.cv, 2.0, 0.2);
}

TEST(LoadgenArrivals, SeededAndInfiniteRate) {
  EXPECT_EQ(loadgen_arrival_times(50, 3.0, 1.0, 5), loadgen_arrival_times(50, 3.0, 1.0, 5));
  EXPECT_NE(loadgen_arrival_times(50, 3.0, 1.0, 5), loadgen_arrival_times(50, 3.0, 1.0, 6));
  EXPECT_EQ(loadgen_arrival_times(3, INFINITY, 1.0, 5), (std::vector<double>{0, 0, 0}));
}

TEST(LoadgenPrompts, LengthsStayInRangeAndReachBothEnds) {
  std::mt19937_64 rng(3);
  EXPECT_EQ(loadgen_draw_lengths(32, 0.0, 5, rng), (std::vector<int64_t>(5, 32)));
  const std::vector<int64_t> v = loadgen_draw_lengths(10, 0.5, 2000, rng);
  const std::set<int64_t> seen(v.begin(), v.end());
  EXPECT_EQ(*seen.begin(), 5);
  EXPECT_EQ(*seen.rbegin(), 15);
  EXPECT_EQ(seen.size(), 11u);
  for (int64_t x : loadgen_draw_lengths(1, 0.9, 100, rng)) EXPECT_GE(x, 1);
}

TEST(LoadgenPrompts, TextIsOneWordPerToken) {
  std::mt19937_64 a(9), b(9);
  const std::string text = loadgen_text_prompt(200, a);
  EXPECT_EQ(text, loadgen_text_prompt(200, b));
  EXPECT_EQ(std::count(text.begin(), text.end(), ' '), 199);
  for (char c : text) EXPECT_TRUE(c == ' ' || (c >= 'a' && c <= 'z')) << text;
  std::mt19937_64 c(10);
  EXPECT_NE(text, loadgen_text_prompt(200, c));
}

TEST(LoadgenPrompts, TokenIdsBelowTheVocabulary) {
  std::mt19937_64 rng(4);
  const std::vector<int32_t> ids = loadgen_id_prompt(1000, 37, rng);
  ASSERT_EQ(ids.size(), 1000u);
  const std::set<int32_t> seen(ids.begin(), ids.end());
  EXPECT_EQ(*seen.begin(), 0);
  EXPECT_EQ(*seen.rbegin(), 36);
}

TEST(LoadgenPrompts, RequestBodies) {
  const Json c = Json::parse(loadgen_request_body({.model = "m", .max_tokens = 7, .ignore_eos = true, .logprobs = true},
                                                  Json(std::vector<int32_t>{1, 2})));
  EXPECT_EQ(c["model"], "m");
  EXPECT_EQ(c["prompt"], Json({1, 2}));
  EXPECT_EQ(c["max_tokens"], 7);
  EXPECT_EQ(c["temperature"], 0.0);
  EXPECT_EQ(c["stream"], true);
  EXPECT_EQ(c["stream_options"]["include_usage"], true);
  EXPECT_EQ(c["ignore_eos"], true);
  EXPECT_EQ(c["logprobs"], 0);
  const Json chat = Json::parse(loadgen_request_body({.chat = true, .model = "m", .max_tokens = 3}, Json("hi")));
  EXPECT_EQ(chat["messages"], Json::parse(R"([{"role": "user", "content": "hi"}])"));
  EXPECT_FALSE(chat.contains("ignore_eos") || chat.contains("logprobs") || chat.contains("prompt"));
}

// The stream of a tern /v1/chat/completions request with include_usage, as the server writes it.
const char* const kChatStream =
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":"
    "[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":"
    "[{\"index\":0,\"delta\":{\"content\":\"Hel\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":"
    "[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":"
    "[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"length\"}]}\n\n"
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],"
    "\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":2,\"total_tokens\":14}}\n\n"
    "data: [DONE]\n\n";

TEST(LoadgenSse, EventsWhereverTheBytesAreCut) {
  SseParser whole;
  const std::vector<std::string> expected = whole.feed(kChatStream);
  ASSERT_EQ(expected.size(), 6u);
  EXPECT_EQ(expected.back(), "[DONE]");
  const std::string stream = kChatStream;
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    SseParser p;
    std::vector<std::string> got = p.feed(std::string_view(stream).substr(0, cut));
    for (std::string& e : p.feed(std::string_view(stream).substr(cut))) got.push_back(std::move(e));
    ASSERT_EQ(got, expected) << "cut at " << cut;
  }
}

TEST(LoadgenSse, CrLfCommentsFieldsAndMultiLineData) {
  SseParser p;
  const auto events =
      p.feed(": keep-alive\r\n\r\nevent: message\r\nid: 3\r\ndata: {\"a\":\r\ndata:1}\r\n\r\ndata:x\n\n");
  EXPECT_EQ(events, (std::vector<std::string>{"{\"a\":\n1}", "x"}));
  EXPECT_TRUE(p.feed("data: tail").empty());
  EXPECT_EQ(p.finish(), std::vector<std::string>{"tail"});
}

TEST(LoadgenChunk, RealChunks) {
  SseParser p;
  const std::vector<std::string> e = p.feed(kChatStream);
  const LoadgenChunk role = loadgen_parse_chunk(e[0]);
  EXPECT_FALSE(role.has_output || role.done);
  EXPECT_TRUE(role.error.empty());
  EXPECT_TRUE(loadgen_parse_chunk(e[1]).has_output);
  const LoadgenChunk fin = loadgen_parse_chunk(e[3]);
  EXPECT_FALSE(fin.has_output);
  EXPECT_EQ(fin.finish_reason, "length");
  const LoadgenChunk usage = loadgen_parse_chunk(e[4]);
  EXPECT_EQ(usage.prompt_tokens, 12);
  EXPECT_EQ(usage.completion_tokens, 2);
  EXPECT_FALSE(usage.has_output);
  EXPECT_TRUE(loadgen_parse_chunk(e[5]).done);
  // Completions text, reasoning, tool calls, and logprobs with empty text (a server without a tokenizer).
  EXPECT_TRUE(loadgen_parse_chunk(R"({"object":"text_completion","choices":[{"index":0,"text":" the","logprobs":null,
      "finish_reason":null}]})")
                  .has_output);
  EXPECT_TRUE(
      loadgen_parse_chunk(R"({"choices":[{"delta":{"reasoning_content":"hm"},"finish_reason":null}]})").has_output);
  EXPECT_TRUE(loadgen_parse_chunk(R"({"choices":[{"delta":{"tool_calls":[{"index":0}]}}]})").has_output);
  EXPECT_TRUE(loadgen_parse_chunk(R"({"choices":[{"index":0,"text":"","logprobs":{"tokens":["token_id:5"],
      "token_logprobs":[-1.5],"top_logprobs":[{}],"text_offset":[0]},"finish_reason":null}]})")
                  .has_output);
  EXPECT_FALSE(loadgen_parse_chunk(R"({"choices":[{"index":0,"text":"","logprobs":null}],"usage":null})").has_output);
}

TEST(LoadgenChunk, ErrorsAndMalformed) {
  // tern's error event after a finish_reason "error" chunk (a request whose logits went non-finite).
  const LoadgenChunk e = loadgen_parse_chunk(
      R"({"error":{"message":"non-finite logits at step 3","type":"server_error","param":null,"code":null}})");
  EXPECT_EQ(e.error, "non-finite logits at step 3");
  EXPECT_FALSE(loadgen_parse_chunk("{\"choices\": [").error.empty());
  EXPECT_FALSE(loadgen_parse_chunk("[1, 2]").error.empty());
  EXPECT_TRUE(loadgen_parse_chunk(" [DONE] ").done);
}

TEST(LoadgenTracker, TimesAndCountsOfAStream) {
  LoadgenStreamTracker t(99);
  t.on_status(200);
  SseParser split;
  const std::vector<std::string> events = split.feed(kChatStream);
  const double times[] = {0.05, 0.10, 0.25, 0.26, 0.27, 0.28};
  for (size_t i = 0; i < events.size(); ++i) t.on_bytes("data: " + events[i] + "\n\n", times[i]);
  const LoadgenResult r = t.finish(0.30, "");
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_DOUBLE_EQ(r.ttft_s, 0.10);  // the role chunk carries no output
  EXPECT_DOUBLE_EQ(r.e2e_s, 0.30);
  EXPECT_EQ(r.prompt_tokens, 12);
  EXPECT_TRUE(r.prompt_tokens_from_server);
  EXPECT_EQ(r.output_tokens, 2);
  EXPECT_EQ(r.num_chunks, 2);
  ASSERT_EQ(r.itl_s.size(), 1u);
  EXPECT_NEAR(r.itl_s[0], 0.15, 1e-12);
}

std::string text_chunk(const std::string& text) {
  return "data: {\"choices\":[{\"index\":0,\"text\":\"" + text + "\",\"finish_reason\":null}]}\n\n";
}

TEST(LoadgenTracker, ChunksOfSeveralTokensSpreadTheGap) {
  // Seven tokens in three chunks: the first token, then the six others in two chunks, three tokens per gap.
  LoadgenStreamTracker t(5);
  t.on_status(200);
  t.on_bytes(text_chunk("a"), 1.0);
  t.on_bytes(text_chunk(" b c d"), 1.6);
  t.on_bytes(text_chunk(" e f g"), 2.5);
  t.on_bytes("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7}}\n\ndata: [DONE]\n\n", 2.5);
  const LoadgenResult r = t.finish(2.5, "");
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.output_tokens, 7);
  EXPECT_DOUBLE_EQ(r.ttft_s, 1.0);
  ASSERT_EQ(r.itl_s.size(), 2u);
  EXPECT_NEAR(r.itl_s[0], 0.2, 1e-12);
  EXPECT_NEAR(r.itl_s[1], 0.3, 1e-12);
}

TEST(LoadgenTracker, WithoutUsageTheChunksCountAndThePromptIsEstimated) {
  LoadgenStreamTracker t(40);
  t.on_status(200);
  t.on_bytes(text_chunk("x") + text_chunk("y") + text_chunk("z"), 0.5);
  t.on_bytes("data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"stop\"}]}\n\n", 0.6);
  const LoadgenResult r = t.finish(0.6, "");
  ASSERT_TRUE(r.ok) << r.error;  // a finish_reason without [DONE] is a complete response
  EXPECT_EQ(r.output_tokens, 3);
  EXPECT_EQ(r.prompt_tokens, 40);
  EXPECT_FALSE(r.prompt_tokens_from_server);
  EXPECT_EQ(r.itl_s, (std::vector<double>{0.0, 0.0}));  // one read, one arrival time
}

TEST(LoadgenTracker, Failures) {
  LoadgenStreamTracker rejected(8);
  rejected.on_status(400);
  rejected.on_bytes(R"({"error":{"message":"'max_tokens' must be","type":"invalid_request_error"}})", 0.01);
  const LoadgenResult r400 = rejected.finish(0.01, "");
  EXPECT_FALSE(r400.ok);
  EXPECT_EQ(r400.http_status, 400);
  EXPECT_EQ(r400.error, "HTTP 400: 'max_tokens' must be");

  LoadgenStreamTracker plain(8);
  plain.on_status(502);
  plain.on_bytes("Bad Gateway", 0.01);
  EXPECT_EQ(plain.finish(0.01, "").error, "HTTP 502: Bad Gateway");

  LoadgenStreamTracker nan(8);
  nan.on_status(200);
  nan.on_bytes(text_chunk("a"), 0.1);
  nan.on_bytes(
      "data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"error\"}]}\n\n"
      "data: {\"error\":{\"message\":\"non-finite logits\",\"type\":\"server_error\"}}\n\ndata: [DONE]\n\n",
      0.2);
  EXPECT_EQ(nan.finish(0.2, "").error, "non-finite logits");

  LoadgenStreamTracker cut(8);
  cut.on_status(200);
  cut.on_bytes(text_chunk("a"), 0.1);
  EXPECT_FALSE(cut.finish(0.2, "").ok);

  LoadgenStreamTracker refused(8);
  const LoadgenResult down = refused.finish(0.001, "request failed: Connection");
  EXPECT_FALSE(down.ok);
  EXPECT_EQ(down.error, "request failed: Connection");
}

TEST(LoadgenSummary, TotalsThroughputAndLatencies) {
  LoadgenResult a{
      .ok = true, .ttft_s = 0.1, .e2e_s = 0.5, .prompt_tokens = 10, .output_tokens = 5, .itl_s = {0.1, 0.1, 0.1, 0.1}};
  LoadgenResult b{.ok = true,
                  .ttft_s = 0.3,
                  .e2e_s = 0.9,
                  .prompt_tokens = 20,
                  .prompt_tokens_from_server = true,
                  .output_tokens = 3,
                  .itl_s = {0.2, 0.4}};
  LoadgenResult c{.ok = false, .error = "HTTP 503: full"};
  const LoadgenSummary s = loadgen_summarize({a, b, c, c}, 2.0);
  EXPECT_EQ(s.completed, 2);
  EXPECT_EQ(s.failed, 2);
  EXPECT_EQ(s.errors.at("HTTP 503: full"), 2);
  EXPECT_EQ(s.input_tokens, 30);
  EXPECT_EQ(s.output_tokens, 8);
  EXPECT_EQ(s.prompt_tokens_estimated, 1);
  EXPECT_DOUBLE_EQ(s.request_throughput, 1.0);
  EXPECT_DOUBLE_EQ(s.input_throughput, 15.0);
  EXPECT_DOUBLE_EQ(s.output_throughput, 4.0);
  EXPECT_DOUBLE_EQ(s.total_throughput, 19.0);
  EXPECT_NEAR(s.ttft_ms.mean, 200.0, 1e-9);
  EXPECT_NEAR(s.e2e_ms.max, 900.0, 1e-9);
  // TPOT: (500 - 100) / 4 = 100 and (900 - 300) / 2 = 300 ms.
  EXPECT_EQ(s.tpot_ms.count, 2);
  EXPECT_NEAR(s.tpot_ms.mean, 200.0, 1e-9);
  EXPECT_EQ(s.itl_ms.count, 6);
  EXPECT_NEAR(s.itl_ms.max, 400.0, 1e-9);
  const nlohmann::ordered_json j = loadgen_summary_json(s);
  EXPECT_EQ(j["completed"], 2);
  EXPECT_EQ(j["errors"]["HTTP 503: full"], 2);
  const std::string table = loadgen_format_table(s, {"head"});
  EXPECT_NE(table.find("Failed requests:"), std::string::npos);
  EXPECT_NE(table.find("HTTP 503: full"), std::string::npos);
}

TEST(LoadgenUrl, Forms) {
  auto u = loadgen_parse_url("http://127.0.0.1:30000");
  ASSERT_TRUE(u);
  EXPECT_EQ(u->scheme_host_port, "http://127.0.0.1:30000");
  EXPECT_EQ(u->base_path, "");
  u = loadgen_parse_url("localhost:8000/v1/");
  ASSERT_TRUE(u);
  EXPECT_EQ(u->scheme_host_port, "http://localhost:8000");
  EXPECT_EQ(u->base_path, "");
  u = loadgen_parse_url("https://example.com/proxy/v1");
  ASSERT_TRUE(u);
  EXPECT_EQ(u->scheme_host_port, "https://example.com");
  EXPECT_EQ(u->base_path, "/proxy");
  EXPECT_FALSE(loadgen_parse_url("ftp://host:1"));
  EXPECT_FALSE(loadgen_parse_url("http://host:port"));
  EXPECT_FALSE(loadgen_parse_url("http:///v1"));
}

}  // namespace
}  // namespace tern
