#include "cli/bench_command.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <string_view>

#include "cli/bench_plan.h"
#include "cli/bench_traffic.h"
#include "cli/model_options.h"
#if TERN_HAVE_CUDA
#include <cuda_profiler_api.h>

#include "kernels/cuda/roofline.h"
#endif

namespace tern {
namespace {

struct BenchOptions {
  ModelCliOptions model;
  std::vector<int64_t> prefill_lens{512, 4096};
  std::vector<int64_t> batch_sizes{1, 8, 32, 128};
  int64_t context = 1024;
  int64_t steps = 32;
  int64_t repeats = 3;
  uint64_t seed = 1;
  bool json = false;
  bool profile_step = false;  // the last decode step of each batch size between cudaProfilerStart/Stop
  bool plan_only = false;     // bench_plan.h: rank 0's slice from the config, nothing run
  double hbm_gbs = 4800;      // --plan-only's bandwidth (H200's HBM3e, as NVIDIA states it)
  // --speculative-algorithm mtp: the decode rows are speculative steps whose drafts are accepted with this
  // probability each (in order, up to the first rejection), whatever the weights say (dummy weights accept nothing).
  double speculative_accept_rate = 0.7;
};

// For `ncu --profile-from-start off` and `nsys --capture-range=cudaProfilerApi`: only the bracketed step is profiled.
void profiler_bracket(bool on, bool start) {
#if TERN_HAVE_CUDA
  if (on) (void)(start ? cudaProfilerStart() : cudaProfilerStop());
#else
  (void)on;
  (void)start;
#endif
}

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& id : ids) id = pick(rng);
  return ids;
}

// What the model is compared against: measured on the GPU that runs it; nothing on the CPU.
std::optional<nlohmann::ordered_json> measure_roofline(const ModelRunner& model, int device) {
#if TERN_HAVE_CUDA
  if (model.device() != ModelDevice::kCuda) return std::nullopt;
  DeviceContext ctx(device);
  auto r = roofline_measure(ctx);
  if (!r) {
    fmt::print(stderr, "tern bench: no hardware limits measured: {}\n", r.error().message);
    return std::nullopt;
  }
  return nlohmann::ordered_json{{"copy_gbs", r->copy_gbs}, {"gemm_bf16_tflops", r->gemm_tflops}};
#else
  (void)model;
  (void)device;
  return std::nullopt;
#endif
}

// One prompt of `length` tokens in a fresh sequence: median seconds over the repeats after one warm-up. profile:
// the last repeat is bracketed for a profiler.
Expected<double> time_prefill(ModelRunner& model, int64_t length, int64_t repeats, bool profile,
                              std::mt19937_64& rng) {
  std::vector<double> times;
  for (int64_t r = 0; r <= repeats; ++r) {
    const std::vector<int32_t> ids = random_ids(length, model.config().vocab_size, rng);
    SequenceCache seq = model.new_sequence();
    const std::vector<SequenceInput> batch{{&seq, ids}};
    profiler_bracket(profile && r == repeats, true);
    const auto start = Clock::now();
    TERN_TRY(model.forward(batch, LogitsFor::kLastToken));
    if (r > 0) times.push_back(seconds_since(start));
    profiler_bracket(profile && r == repeats, false);
  }
  return median(times);
}

// `batch` sequences prefilled to `context` tokens, then greedy decode steps of one token each: the median step
// time over o.steps steps after two untimed ones (for a CUDA graph: the eager warm-up and the capture).
// The median decode step and, where the runner sends step plans to other nodes, the plan bytes a timed step sent.
struct DecodeTiming {
  double step_s = 0.0;
  double plan_bytes_per_step = 0.0;
};

Expected<DecodeTiming> time_decode(ModelRunner& model, int64_t batch, const BenchOptions& o, int64_t max_chunk,
                                   std::mt19937_64& rng) {
  std::vector<SequenceCache> caches;
  std::vector<std::vector<int32_t>> prompts, outputs(static_cast<size_t>(batch));
  std::vector<Sampler> samplers(static_cast<size_t>(batch), Sampler(SamplingParams{.temperature = 0.0f}));
  for (int64_t s = 0; s < batch; ++s) {
    caches.push_back(model.new_sequence());
    prompts.push_back(random_ids(o.context, model.config().vocab_size, rng));
    for (int64_t done = 0; done < o.context; done += max_chunk) {
      const int64_t n = std::min(max_chunk, o.context - done);
      const std::vector<SequenceInput> chunk{{&caches.back(), std::span(prompts.back()).subspan(done, n)}};
      TERN_TRY(model.forward(chunk, LogitsFor::kLastToken));
    }
  }
  std::vector<int32_t> next = random_ids(batch, model.config().vocab_size, rng);
  std::vector<double> times;
  int64_t plan_bytes = 0;
  for (int64_t step = 0; step < o.steps + 2; ++step) {
    std::vector<SequenceInput> inputs;
    std::vector<SampleRow> rows;
    for (int64_t s = 0; s < batch; ++s) {
      inputs.push_back({&caches[s], std::span(next).subspan(s, 1)});
      rows.push_back({&samplers[s], prompts[s], outputs[s]});
    }
    const bool last = step == o.steps + 1;
    profiler_bracket(o.profile_step && last, true);
    const auto start = Clock::now();
    const int64_t sent = model.plan_bytes_sent();
    TERN_ASSIGN_OR_RETURN(SampleResults sampled, model.forward_sample(inputs, rows));
    if (step >= 2) {
      times.push_back(seconds_since(start));
      plan_bytes += model.plan_bytes_sent() - sent;
    }
    profiler_bracket(o.profile_step && last, false);
    for (int64_t s = 0; s < batch; ++s) {
      if (!sampled[s]) return tl::unexpected<Error>(sampled[s].error());
      outputs[s].push_back(sampled[s]->id);
      next[s] = sampled[s]->id;
    }
  }
  return DecodeTiming{.step_s = median(times),
                      .plan_bytes_per_step = static_cast<double>(plan_bytes) / static_cast<double>(o.steps)};
}

// Speculative decode steps (runtime/speculative.h's step, with the acceptance drawn instead of computed, so that
// dummy weights can be timed at a chosen acceptance): per step each of `batch` sequences verifies its last token and
// K drafts, keeps 1 + a rows (a accepted, each draft with probability p until the first rejection), the draft module
// runs over the kept rows and then K - 1 chained rows. The median step time over o.steps steps after two untimed
// ones, and the mean tokens a step yields per sequence.
struct SpecTiming {
  double step_s = 0, tokens_per_step = 0;
  // Medians of the step's parts: the greedy verification (every row sampled on the device), keep_rows, the draft
  // module over the kept rows, and the K - 1 chained draft rows.
  double verify_s = 0, keep_s = 0, extend_s = 0, chain_s = 0;
};

Expected<SpecTiming> time_speculative(ModelRunner& model, int64_t batch, const BenchOptions& o, int64_t max_chunk,
                                      std::mt19937_64& rng) {
  const int k = speculative_steps_of(o.model);
  const int64_t vocab = model.config().vocab_size;
  std::vector<SequenceCache> caches;
  for (int64_t s = 0; s < batch; ++s) {
    caches.push_back(model.new_sequence());
    const std::vector<int32_t> prompt = random_ids(o.context, vocab, rng);
    for (int64_t done = 0; done < o.context; done += max_chunk) {
      const int64_t n = std::min(max_chunk, o.context - done);
      const std::vector<SequenceInput> chunk{{&caches.back(), std::span(prompt).subspan(done, n)}};
      TERN_TRY(model.forward(chunk, LogitsFor::kLastToken));
    }
  }
  std::bernoulli_distribution accept(o.speculative_accept_rate);
  Sampler greedy(SamplingParams{.temperature = 0.0f});
  std::vector<double> times, verify_t, keep_t, extend_t, chain_t;
  int64_t yielded = 0, timed_steps = 0;
  for (int64_t step = 0; step < o.steps + 2; ++step) {
    std::vector<std::vector<int32_t>> rows(static_cast<size_t>(batch)), next(static_cast<size_t>(batch));
    std::vector<SequenceInput> verify;
    std::vector<int64_t> keep(static_cast<size_t>(batch)), start(static_cast<size_t>(batch));
    for (int64_t s = 0; s < batch; ++s) {
      rows[s] = random_ids(k + 1, vocab, rng);
      int64_t a = 0;
      while (a < k && accept(rng)) ++a;
      keep[s] = a + 1;
      next[s] = random_ids(a + 1, vocab, rng);
      start[s] = caches[s].length;
      verify.push_back({&caches[s], rows[s]});
      verify.back().verify = true;
    }
    // The greedy verification the server runs (runtime/speculative.cc): every row sampled where the logits are.
    std::vector<SampleRow> sample_rows;
    for (int64_t s = 0; s < batch; ++s) {
      for (int j = 0; j <= k; ++j) sample_rows.push_back({&greedy, rows[s], {}});
    }
    const bool last = step == o.steps + 1;
    profiler_bracket(o.profile_step && last, true);
    const auto begin = Clock::now();
    TERN_ASSIGN_OR_RETURN(SampleResults verified_ids, model.forward_sample_rows(verify, sample_rows));
    const auto verified = Clock::now();
    profiler_bracket(o.profile_step && last, false);
    for (const auto& id : verified_ids) {
      if (!id) return tl::unexpected<Error>(id.error());
    }
    std::vector<DraftInput> extend;
    for (int64_t s = 0; s < batch; ++s) {
      TERN_TRY(model.keep_rows(caches[s], keep[s]));
      extend.push_back({{&caches[s], next[s]}, start[s], DraftHidden::kModel, s});
    }
    const auto kept = Clock::now();
    TERN_ASSIGN_OR_RETURN(std::vector<int32_t> proposal, model.draft_argmax(extend));
    const auto extended = Clock::now();
    for (int c = 1; c < k; ++c) {
      std::vector<DraftInput> chain;
      for (int64_t s = 0; s < batch; ++s) {
        chain.push_back({{&caches[s], std::span(proposal).subspan(s, 1)}, start[s] + keep[s] + c - 1,
                         DraftHidden::kDraft, s});
      }
      TERN_ASSIGN_OR_RETURN(proposal, model.draft_argmax(chain));
    }
    if (step >= 2) {
      times.push_back(seconds_since(begin));
      const auto s = [](Clock::time_point a, Clock::time_point b) {
        return std::chrono::duration<double>(b - a).count();
      };
      verify_t.push_back(s(begin, verified));
      keep_t.push_back(s(verified, kept));
      extend_t.push_back(s(kept, extended));
      chain_t.push_back(seconds_since(extended));
      for (int64_t s = 0; s < batch; ++s) yielded += keep[s];
      timed_steps += batch;
    }
  }
  return SpecTiming{.step_s = median(times),
                    .tokens_per_step =
                        static_cast<double>(yielded) / static_cast<double>(std::max<int64_t>(timed_steps, 1)),
                    .verify_s = median(verify_t),
                    .keep_s = median(keep_t),
                    .extend_s = median(extend_t),
                    .chain_s = median(chain_t)};
}

int fail(const std::string& message) {
  fmt::print(stderr, "tern bench: {}\n", message);
  return 2;
}

Expected<void> check_options(const BenchOptions& o) {
  for (int64_t n : o.prefill_lens) {
    if (n < 1) return make_error("--prefill {} is not a positive length", n);
  }
  for (int64_t b : o.batch_sizes) {
    if (b < 1) return make_error("--batch {} is not a positive batch size", b);
  }
  if (o.prefill_lens.empty() && o.batch_sizes.empty()) {
    return make_error("--prefill 0 and --batch 0: no rows to time");
  }
  if (o.context < 1 || o.steps < 1 || o.repeats < 1) {
    return make_error("--context {}, --steps {} and --repeats {} must be positive", o.context, o.steps, o.repeats);
  }
  if (!(o.hbm_gbs > 0)) return make_error("--hbm-gbs {} is not a positive bandwidth", o.hbm_gbs);
  if (!(o.speculative_accept_rate >= 0 && o.speculative_accept_rate <= 1)) {
    return make_error("--speculative-accept-rate {} is not a probability", o.speculative_accept_rate);
  }
  return {};
}

nlohmann::ordered_json prefill_row(const StepTraffic& t, int64_t length, double s,
                                   const std::optional<nlohmann::ordered_json>& roof) {
  const double tflops = prefill_flops(t, length) / s / 1e12;
  nlohmann::ordered_json row{{"kind", "prefill"},
                             {"tokens", length},
                             {"ms", s * 1e3},
                             {"tokens_per_s", static_cast<double>(length) / s},
                             {"tflops", tflops}};
  row["pct_of_gemm"] =
      roof ? nlohmann::ordered_json(100 * tflops / (*roof)["gemm_bf16_tflops"].get<double>()) : nullptr;
  return row;
}

nlohmann::ordered_json decode_row(const StepTraffic& t, int64_t batch, const BenchOptions& o, const DecodeTiming& d,
                                  const std::optional<nlohmann::ordered_json>& roof) {
  const double s = d.step_s;
  // The context grows by one per step: the timed steps average o.context + 2 + steps / 2 cached tokens.
  const double context = static_cast<double>(o.context) + 2 + static_cast<double>(o.steps) / 2;
  const double bytes = decode_step_bytes(t, batch, context), gbs = bytes / s / 1e9;
  nlohmann::ordered_json row{{"kind", "decode"},
                             {"batch", batch},
                             {"context", o.context},
                             {"ms_per_step", s * 1e3},
                             {"tokens_per_s", static_cast<double>(batch) / s},
                             {"bytes_per_step", bytes},
                             {"gbs", gbs}};
  row["pct_of_copy"] = roof ? nlohmann::ordered_json(100 * gbs / (*roof)["copy_gbs"].get<double>()) : nullptr;
  // Several nodes (or rank processes): what node 0 broadcast to the others per step, the step plan.
  if (d.plan_bytes_per_step > 0) row["plan_bytes_per_step"] = d.plan_bytes_per_step;
  return row;
}

std::string percent(const nlohmann::ordered_json& v) {
  return v.is_null() ? std::string("-") : fmt::format("{:.1f}%", v.get<double>());
}

// This process's resident host memory after the load, and its peak (Linux /proc/self/status, GiB); null where the
// file is not there.
nlohmann::ordered_json host_memory_report() {
  std::ifstream in("/proc/self/status");
  nlohmann::ordered_json out;
  for (std::string line; std::getline(in, line);) {
    for (const auto& [key, name] : {std::pair{"VmRSS:", "resident_gib"}, std::pair{"VmHWM:", "peak_gib"}}) {
      if (line.starts_with(key)) out[name] = std::stod(line.substr(std::string_view(key).size())) / (1 << 20);
    }
  }
  return out.size() == 2 ? out : nlohmann::ordered_json(nullptr);
}

void print_table(const nlohmann::ordered_json& report) {
  fmt::print("{}\nloaded in {:.1f} s (weights, caches and the start-up self-test)\n",
             report["device"].get<std::string>(), report["load_s"].get<double>());
  if (const auto& mem = report["host_memory"]; !mem.is_null()) {
    fmt::print("host memory after the load: {:.2f} GiB resident, {:.2f} GiB at the peak\n",
               mem["resident_gib"].get<double>(), mem["peak_gib"].get<double>());
  }
  fmt::print("weights{}: {:.2f} GB\n", report["tensor_parallel_size"].get<int64_t>() > 1 ? " per rank" : "",
             report["weights"]["per_rank_bytes"].get<double>() / 1e9);
  print_tensor_parallel_report(report);
  if (!report["roofline"].is_null()) {
    fmt::print("limits measured now: copy {:.0f} GB/s (read + write), BF16 GEMM {:.0f} TFLOP/s\n",
               report["roofline"]["copy_gbs"].get<double>(), report["roofline"]["gemm_bf16_tflops"].get<double>());
  }
  fmt::print("{:<8} {:>6} {:>8} {:>11} {:>12} {:>10} {:>9}\n", "kind", "batch", "tokens", "ms", "tokens/s", "GB/s|TF/s",
             "of limit");
  for (const auto& r : report["rows"]) {
    if (r["kind"] == "prefill") {
      fmt::print("{:<8} {:>6} {:>8} {:>11.2f} {:>12.0f} {:>10.1f} {:>9}\n", "prefill", 1, r["tokens"].get<int64_t>(),
                 r["ms"].get<double>(), r["tokens_per_s"].get<double>(), r["tflops"].get<double>(),
                 percent(r["pct_of_gemm"]));
    } else if (r["kind"] == "decode") {
      fmt::print("{:<8} {:>6} {:>8} {:>11.3f} {:>12.1f} {:>10.0f} {:>9}{}\n", "decode", r["batch"].get<int64_t>(),
                 r["context"].get<int64_t>(), r["ms_per_step"].get<double>(), r["tokens_per_s"].get<double>(),
                 r["gbs"].get<double>(), percent(r["pct_of_copy"]),
                 r.contains("plan_bytes_per_step") ? fmt::format("   step plan to the other nodes: {:.0f} bytes",
                                                                 r["plan_bytes_per_step"].get<double>())
                                                     : std::string());
    } else {
      fmt::print("{:<8} {:>6} {:>8} {:>11.3f} {:>12.1f}   {:.2f} tokens per step, {:.2f}x the plain step (ms: "
                 "verify {:.3f}, keep {:.3f}, draft {:.3f} + chain {:.3f})\n",
                 "spec", r["batch"].get<int64_t>(), r["context"].get<int64_t>(), r["ms_per_step"].get<double>(),
                 r["tokens_per_s"].get<double>(), r["tokens_per_step"].get<double>(),
                 r["speedup_over_plain"].get<double>(), r["ms_verify"].get<double>(), r["ms_keep"].get<double>(),
                 r["ms_draft_extend"].get<double>(), r["ms_draft_chain"].get<double>());
    }
  }
}

// The all-reduces of each decode row timed on the runner's ranks (ModelRunner::all_reduce_ms at the row's message
// size, times the step's count), with the share of the measured step they would take if none overlapped; the
// reason instead where they cannot be timed. The step itself is not instrumented: its collectives run inside CUDA
// graphs on the GPU.
void add_measured_all_reduces(nlohmann::ordered_json& report, ModelRunner& m, const StepTraffic& t, int world) {
  if (world <= 1) return;
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const auto& r : report["rows"]) {
    if (r["kind"] != "decode") continue;
    const int64_t batch = r["batch"].get<int64_t>();
    auto ms = m.all_reduce_ms(batch * t.hidden, 5);
    if (!ms) {
      report["measured_note"] = fmt::format("not measured: {}", ms.error().message);
      return;
    }
    const StepCollectives c = step_collectives(t, world, batch, batch);
    const double per_step = *ms * static_cast<double>(c.all_reduces);
    rows.push_back({{"batch", batch},
                    {"ms_each", *ms},
                    {"ms_per_step", per_step},
                    {"share_of_step", per_step / r["ms_per_step"].get<double>()}});
  }
  report["all_reduce_ms_per_step_measured"] = std::move(rows);
  const bool gpu = m.device() == ModelDevice::kCuda;
  report["measured_note"] = fmt::format(
      "measured apart from the step: one all-reduce of batch x {} activations on the ranks ({}), the slowest rank's "
      "median of 5{}, times the {} a step runs",
      t.hidden, gpu ? "bf16" : "fp32", gpu ? " batches of 20 back to back" : "",
      step_collectives(t, world, 1, 1).all_reduces);
}

int run_bench(const BenchOptions& o) {
  if (auto ok = check_options(o); !ok) return fail(ok.error().message);
  if (o.plan_only) {
    const auto expert_parallel = expert_parallel_of(o.model);
    if (!expert_parallel) return fail(expert_parallel.error().message);
    return run_bench_plan({.model_dir = o.model.model_dir,
                           .world = o.model.tensor_parallel_size,
                           .expert_parallel = *expert_parallel,
                           .batch_sizes = o.batch_sizes,
                           .context = o.context,
                           .hbm_gbs = o.hbm_gbs,
                           .json = o.json,
                           .kv_cache_dtype = o.model.kv_cache_dtype});
  }
  const int64_t max_prefill = o.prefill_lens.empty() ? 1 : std::ranges::max(o.prefill_lens);
  const int64_t max_batch = o.batch_sizes.empty() ? 1 : std::ranges::max(o.batch_sizes);
  const int64_t chunk = std::min<int64_t>(o.context, 4096);
  const int spec = speculative_steps_of(o.model);
  const DeviceModelOptions sizes{.max_batch_tokens = std::max({max_prefill, chunk, max_batch * (spec + 1)}),
                                 .max_sequences = max_batch,
                                 .kv_cache_tokens = std::max(max_batch * (o.context + (o.steps + 2) * (spec + 1) + 16),
                                                             max_prefill + 16),
                                 .max_context_tokens = o.context + (o.steps + 2) * (spec + 1) + 16};
  const auto load_start = Clock::now();
  auto model = load_model_from_options(o.model, sizes);
  if (!model) return fail(model.error().message);
  const double load_s = seconds_since(load_start);
  ModelRunner& m = **model;
  // Counted from the model's shapes (rank 0's slice): a device runner releases its host weights once placed.
  auto kv_cache_dtype = kv_cache_dtype_of(o.model.kv_cache_dtype);
  auto expert_parallel = expert_parallel_of(o.model);
  if (!kv_cache_dtype || !expert_parallel) {
    return fail(!kv_cache_dtype ? kv_cache_dtype.error().message : expert_parallel.error().message);
  }
  auto shapes = model_build_host(o.model.model_dir, {.load_format = LoadFormat::kShapes,
                                                     .kv_cache_dtype = *kv_cache_dtype,
                                                     .shard = {0, o.model.tensor_parallel_size, *expert_parallel}});
  if (!shapes) return fail(shapes.error().message);
  const StepTraffic traffic = step_traffic_of(**shapes);
  shapes->reset();
  nlohmann::ordered_json report{{"model", o.model.model_dir},
                                {"device", m.describe()},
                                {"load_s", load_s},
                                {"host_memory", host_memory_report()}};
  // Rank 0's GPU (runtime/tp_runner.h: --cuda-devices, else rank r on GPU r).
  const int rank0_device = o.model.tensor_parallel_size == 1 ? o.model.cuda_device
                           : o.model.cuda_devices.empty()    ? 0
                                                             : o.model.cuda_devices.front();
  const auto roof = measure_roofline(m, rank0_device);
  report["roofline"] = roof ? *roof : nlohmann::ordered_json(nullptr);
  // Every number from here on is one rank's (a tensor-parallel runner's model() is rank 0's slice).
  report["weights"] = {{"per_rank_bytes", weight_bytes(traffic)},
                       {"embedding_bytes", traffic.embedding_bytes},
                       {"dense_bytes", traffic.dense_weight_bytes},
                       {"expert_bytes", traffic.expert_bytes},
                       {"moe_layers", traffic.moe_layers},
                       {"experts", traffic.n_experts},
                       {"router_experts", traffic.router_experts},
                       {"top_k", traffic.top_k}};
  add_tensor_parallel_report(report, traffic, o.model.tensor_parallel_size, o.batch_sizes,
                             o.model.tensor_parallel_size > 1 ? "not measured" : "no collectives at one rank");
  report["rows"] = nlohmann::ordered_json::array();
  std::mt19937_64 rng(o.seed);
  for (int64_t length : o.prefill_lens) {
    auto s = time_prefill(m, length, o.repeats, o.profile_step, rng);
    if (!s) return fail(fmt::format("prefill of {} tokens: {}", length, s.error().message));
    report["rows"].push_back(prefill_row(traffic, length, *s, roof));
  }
  for (int64_t batch : o.batch_sizes) {
    auto s = time_decode(m, batch, o, chunk, rng);
    if (!s) return fail(fmt::format("decode at batch {}: {}", batch, s.error().message));
    report["rows"].push_back(decode_row(traffic, batch, o, *s, roof));
    if (spec == 0) continue;
    auto t = time_speculative(m, batch, o, chunk, rng);
    if (!t) return fail(fmt::format("speculative decode at batch {}: {}", batch, t.error().message));
    const double tokens_per_s = static_cast<double>(batch) * t->tokens_per_step / t->step_s;
    report["rows"].push_back({{"kind", "speculative"},
                              {"batch", batch},
                              {"context", o.context},
                              {"num_steps", spec},
                              {"accept_rate", o.speculative_accept_rate},
                              {"ms_per_step", t->step_s * 1e3},
                              {"tokens_per_step", t->tokens_per_step},
                              {"tokens_per_s", tokens_per_s},
                              {"speedup_over_plain", tokens_per_s * s->step_s / static_cast<double>(batch)},
                              {"ms_verify", t->verify_s * 1e3},
                              {"ms_keep", t->keep_s * 1e3},
                              {"ms_draft_extend", t->extend_s * 1e3},
                              {"ms_draft_chain", t->chain_s * 1e3}});
  }
  add_measured_all_reduces(report, m, traffic, o.model.tensor_parallel_size);
  report["device"] = m.describe();  // now with its graphs
  if (o.json) {
    fmt::print("{}\n", report.dump(1));
  } else {
    print_table(report);
  }
  return 0;
}

}  // namespace

void register_bench_command(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "bench", "Offline throughput: prefill and decode rows, each against the limit measured in the same run");
  add_model_options(*cmd, o->model);
  cmd->add_option("--prefill", o->prefill_lens, "Prompt lengths to time (one sequence each; 0: none)")->delimiter(',');
  cmd->add_option("--batch", o->batch_sizes, "Decode batch sizes (0: none)")->delimiter(',');
  cmd->add_option("--context", o->context, "Cached tokens per sequence before the timed decode steps");
  cmd->add_option("--steps", o->steps, "Timed decode steps per batch size (after two untimed ones)");
  cmd->add_option("--repeats", o->repeats, "Timed repeats of each prefill (after one untimed)");
  cmd->add_option("--seed", o->seed, "Seed of the random prompt ids");
  cmd->add_flag("--json", o->json, "Print one JSON object");
  cmd->add_flag("--plan-only", o->plan_only,
                "Print what each of the --tp ranks holds and moves per decode step (weights, KV cache, collectives, "
                "the time at --hbm-gbs) from the config's shapes, without loading or running anything");
  cmd->add_option("--hbm-gbs", o->hbm_gbs, "--plan-only: the memory bandwidth (GB/s) of the decode time per step");
  cmd->add_flag("--profile-step", o->profile_step,
                "Bracket the last prefill of each length and the last decode step (speculative: its verification) of "
                "each batch size with cudaProfilerStart/Stop (for ncu / nsys)");
  add_speculative_options(*cmd, o->model);
  cmd->add_option("--speculative-accept-rate", o->speculative_accept_rate,
                  "With --speculative-algorithm: each draft is accepted with this probability (in order, up to the "
                  "first rejection) instead of by the model, so that dummy weights time a chosen acceptance "
                  "(default 0.7)");
  cmd->callback([o] {
    // A lone 0: no rows of that kind (to time or profile the other kind alone).
    if (o->prefill_lens == std::vector<int64_t>{0}) o->prefill_lens.clear();
    if (o->batch_sizes == std::vector<int64_t>{0}) o->batch_sizes.clear();
    throw CLI::RuntimeError(run_bench(*o));
  });
}

}  // namespace tern
