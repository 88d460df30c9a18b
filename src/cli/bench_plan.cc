#include "cli/bench_plan.h"

#include <fmt/format.h>

#include <chrono>

#include "cli/model_options.h"
#include "io/model_config.h"
#include "io/quant_config.h"
#include "models/causal_lm.h"
#include "models/shard.h"
#include "models/weight_schema.h"

namespace tern {
namespace {

using Json = nlohmann::ordered_json;

constexpr double kGB = 1e9, kMB = 1e6;

int fail(const std::string& message) {
  fmt::print(stderr, "tern bench: {}\n", message);
  return 2;
}

std::string measured_note_for_plan(int world) {
  return world > 1 ? fmt::format("measured: needs the run (tern bench --tensor-parallel-size {} without --plan-only)",
                                 world)
                   : "no collectives at one rank";
}

// The plan of a model tern builds: its rank-0 blocks counted.
Json plan_from_blocks(const CausalLm& model, const BenchPlanOptions& o) {
  const StepTraffic t = step_traffic_of(model);
  Json report{{"weights",
               {{"per_rank_bytes", weight_bytes(t)},
                {"dense_bytes", t.dense_weight_bytes},
                {"expert_bytes", static_cast<double>(t.moe_layers * t.n_experts) * t.expert_bytes},
                {"embedding_bytes", t.embedding_bytes},
                {"moe_layers", t.moe_layers},
                {"experts", t.n_experts},
                {"router_experts", t.router_experts},
                {"top_k", t.top_k}}},
              {"kv_bytes_per_token", t.kv_bytes_per_token},
              {"state_bytes_per_sequence", t.state_bytes_per_sequence},
              {"hbm_gbs", o.hbm_gbs}};
  add_tensor_parallel_report(report, t, o.world, o.batch_sizes, measured_note_for_plan(o.world));
  report["rows"] = Json::array();
  for (int64_t batch : o.batch_sizes) {
    const double bytes = decode_step_bytes(t, batch, static_cast<double>(o.context));
    const double s = bytes / (o.hbm_gbs * kGB);
    const StepCollectives c = step_collectives(t, o.world, batch, batch);
    report["rows"].push_back({{"batch", batch},
                              {"context", o.context},
                              {"memory_bytes", rank_memory_bytes(t, batch, o.context)},
                              {"decode_bytes_per_step", bytes},
                              {"decode_ms_per_step_at_hbm", s * 1e3},
                              {"tokens_per_s_at_hbm", static_cast<double>(batch) / s},
                              {"all_reduce_bytes_per_step", static_cast<double>(c.all_reduces) * c.all_reduce_bytes},
                              {"logits_all_gather_bytes", c.all_gather_bytes}});
  }
  return report;
}

std::string gb(const Json& v) { return fmt::format("{:.2f} GB", v.get<double>() / kGB); }

void print_plan(const Json& r) {
  fmt::print("plan: {} over {} tensor-parallel rank(s): rank 0's slice, from the config's shapes; nothing loaded on a "
             "device ({:.1f} s)\n",
             r["model"].get<std::string>(), r["tensor_parallel_size"].get<int64_t>(), r["plan_s"].get<double>());
  const Json& w = r["weights"];
  fmt::print("weights per rank: {} = {} linears outside the routed experts (lm_head included) + {} routed experts",
             gb(w["per_rank_bytes"]), gb(w["dense_bytes"]), gb(w["expert_bytes"]));
  if (w.contains("moe_layers") && w["moe_layers"].get<int64_t>() > 0) {
    const int64_t held = w["experts"].get<int64_t>(), all = w.value("router_experts", held);
    // Under expert parallelism a rank holds a share of the experts whole, and a step waits for the busiest rank.
    fmt::print(" ({} MoE layers x {}, top-{}{})", w["moe_layers"].get<int64_t>(),
               held == all ? fmt::format("{} experts", held) : fmt::format("{} of the {} experts, whole", held, all),
               w["top_k"].get<int64_t>(), held == all ? "" : "; a decode step's bytes are the busiest rank's");
  }
  fmt::print(" + {} embedding rows\n", gb(w["embedding_bytes"]));
  fmt::print("caches per rank: {:.1f} KB per token (KV caches), {:.2f} MB per sequence (Gated DeltaNet state)\n",
             r["kv_bytes_per_token"].get<double>() / 1e3, r["state_bytes_per_sequence"].get<double>() / kMB);
  print_tensor_parallel_report(r);
  fmt::print("decode bound by HBM at {:.0f} GB/s (--hbm-gbs); memory: weights, KV cache and state, no activations\n",
             r["hbm_gbs"].get<double>());
  fmt::print("{:>6} {:>8} {:>15} {:>14} {:>10} {:>11} {:>17} {:>14}\n", "batch", "context", "memory/rank GB",
             "bytes/step GB", "ms/step", "tokens/s", "all-reduce MB/step", "all-gather MB");
  for (const Json& row : r["rows"]) {
    fmt::print("{:>6} {:>8} {:>15.2f} {:>14.3f} {:>10.3f} {:>11.1f} {:>17.3f} {:>14.3f}\n",
               row["batch"].get<int64_t>(), row["context"].get<int64_t>(), row["memory_bytes"].get<double>() / kGB,
               row["decode_bytes_per_step"].get<double>() / kGB, row["decode_ms_per_step_at_hbm"].get<double>(),
               row["tokens_per_s_at_hbm"].get<double>(), row["all_reduce_bytes_per_step"].get<double>() / kMB,
               row["logits_all_gather_bytes"].get<double>() / kMB);
  }
}

}  // namespace

void add_tensor_parallel_report(Json& report, const StepTraffic& t, int64_t world,
                                const std::vector<int64_t>& batch_sizes, const std::string& measured_note) {
  report["tensor_parallel_size"] = world;
  const StepCollectives one = step_collectives(t, world, 1, 1);
  Json c{{"note", "computed from the blocks' shapes, bf16 as the CUDA runner moves them, at the batch as given (a "
                  "CUDA graph step pads it to its bucket: 1, 2, 4, 8, then multiples of 8); not measured"},
         {"all_reduces_per_step", one.all_reduces},
         {"hidden", t.hidden},
         {"vocab_range_per_rank", world > 1 ? vocab_shard_rows(t.vocab, world) : t.vocab},
         {"decode", Json::array()}};
  for (int64_t batch : batch_sizes) {
    const StepCollectives s = step_collectives(t, world, batch, batch);
    c["decode"].push_back({{"batch", batch},
                           {"all_reduce_bytes_each", s.all_reduce_bytes},
                           {"all_reduce_bytes_per_step", static_cast<double>(s.all_reduces) * s.all_reduce_bytes},
                           {"logits_all_gather_bytes", s.all_gather_bytes}});
  }
  report["collectives_computed"] = std::move(c);
  report["all_reduce_ms_per_step_measured"] = nullptr;
  report["measured_note"] = measured_note;
}

void print_tensor_parallel_report(const Json& r) {
  const int64_t world = r["tensor_parallel_size"].get<int64_t>();
  if (world <= 1) return;
  const Json& c = r["collectives_computed"];
  fmt::print("tensor parallel: {} ranks; every byte and FLOP here is one rank's (rank 0's slice)\n", world);
  fmt::print("collectives per decode step, computed (bf16), not measured: {} all-reduces of batch x {} x 2 B, one "
             "all-gather of the logits (batch x {} padded vocabulary rows x {} ranks x 2 B)\n",
             c["all_reduces_per_step"].get<int64_t>(), c["hidden"].get<int64_t>(),
             c["vocab_range_per_rank"].get<int64_t>(), world);
  for (const Json& d : c["decode"]) {
    fmt::print("  batch {:>4}: all-reduce {:.1f} KB each, {:.3f} MB per step; logits all-gather {:.3f} MB\n",
               d["batch"].get<int64_t>(), d["all_reduce_bytes_each"].get<double>() / 1e3,
               d["all_reduce_bytes_per_step"].get<double>() / kMB, d["logits_all_gather_bytes"].get<double>() / kMB);
  }
  fmt::print("all-reduce time per step: {}\n", r["measured_note"].get<std::string>());
  if (const auto& measured = r["all_reduce_ms_per_step_measured"]; measured.is_array()) {
    for (const Json& d : measured) {
      fmt::print("  batch {:>4}: {:.3f} ms each, {:.3f} ms per step, {:.1f}% of the measured step\n",
                 d["batch"].get<int64_t>(), d["ms_each"].get<double>(), d["ms_per_step"].get<double>(),
                 100.0 * d["share_of_step"].get<double>());
    }
  }
}

int run_bench_plan(const BenchPlanOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  const std::string what = fmt::format("--plan-only --tensor-parallel-size {}", o.world);
  auto config = model_config_load(o.model_dir);
  if (!config) return fail(fmt::format("{}: {}", what, config.error().message));
  Json report{{"model", o.model_dir}, {"plan_only", true}, {"tensor_parallel_size", o.world}};
  auto kv_cache_dtype = kv_cache_dtype_of(o.kv_cache_dtype);
  if (!kv_cache_dtype) return fail(kv_cache_dtype.error().message);
  auto model = model_build_host(o.model_dir, {.load_format = LoadFormat::kShapes,
                                              .kv_cache_dtype = *kv_cache_dtype,
                                              .shard = {0, o.world, o.expert_parallel}});
  if (!model) return fail(fmt::format("{}: {}", what, model.error().message));
  report.update(plan_from_blocks(**model, o));
  report["plan_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (o.json) {
    fmt::print("{}\n", report.dump(1));
  } else {
    print_plan(report);
  }
  return 0;
}

}  // namespace tern
