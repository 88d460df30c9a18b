#include "cli/model_options.h"

#include "cli/rank_processes.h"
#include "io/model_config.h"
#include "models/selftest_plan.h"
#include "runtime/speculative.h"
#include "runtime/tp_runner.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>

namespace tern {
namespace {

// The selections (empty with --selftest off and nothing forced); device.kernels set from them.
Expected<std::vector<Selection>> selftest_before_load(const ModelCliOptions& o, bool cuda, DeviceModelOptions& device) {
  TERN_ASSIGN_OR_RETURN(const KvCacheDtype kv_cache_dtype, kv_cache_dtype_of(o.kv_cache_dtype));
  const std::string mode_name = o.selftest == "auto" ? (cuda ? "fast" : "off") : o.selftest;
  TERN_ASSIGN_OR_RETURN(SelftestMode mode, selftest_mode_parse(mode_name));
  TERN_ASSIGN_OR_RETURN(const auto forced, o.backends.forced());
  bool any_forced = false;
  for (const auto& [op, name] : forced) any_forced = any_forced || name != "auto";
  if (mode == SelftestMode::kOff) {
    if (cuda) {
      fmt::print(stderr, "warning: --selftest off: the GPU kernels are NOT verified on this device before serving; wrong output or "
                   "NaN from an unsupported kernel will not be caught at start-up (run `tern doctor` to check)\n");
    }
    if (!any_forced) return std::vector<Selection>{};
  }
  TERN_ASSIGN_OR_RETURN(const bool expert_parallel, expert_parallel_of(o));
  // With speculative decoding the verifications' shapes are tested too.
  const ModelSelftestOptions selftest{
      .mode = mode == SelftestMode::kOff ? SelftestMode::kFast : mode,
      .device = cuda ? "cuda" : "cpu",
      .forced = forced,
      .tensor_parallel_size = o.tensor_parallel_size,
      .expert_parallel = expert_parallel,
      .verify_rows = speculative_verify_rows(o.speculative_algorithm, o.speculative_num_steps),
      .kv_cache_dtype = kv_cache_dtype};
  TERN_ASSIGN_OR_RETURN(ModelSelftestReport r, model_selftest_run(o.model_dir, selftest));
  // stderr: stdout carries the commands' results (JSON).
  fmt::print(stderr, "self-test on {}: {} ops in {:.2f} s: {}\n", r.device.name, r.selections.size(), r.seconds,
             r.verdict);
  std::string chosen;
  for (const Selection& s : r.selections) {
    const std::string fallback = selftest_fallback_of(s.op);
    const std::string name = !s.chosen.empty() || fallback.empty() ? s.chosen : "none (" + fallback + ")";
    chosen += fmt::format("{}{}={}", chosen.empty() ? "" : " ", s.op, name);
  }
  fmt::print(stderr, "self-test chose: {}\n", chosen);
  for (const Selection& s : r.selections) {
    if (s.chosen.empty() && selftest_fallback_of(s.op).empty()) {
      std::string why;
      for (const CandidateReport& c : s.candidates) why += fmt::format("; {}: {}", c.name, c.reason);
      return make_error("self-test: no implementation of '{}' passed on {}{}", s.op, r.device.name, why);
    }
  }
  device.kernels = kernel_choices_of(r.selections);
  if (!r.notes.empty()) return make_error("self-test: {}", r.notes.front());
  return std::move(r.selections);
}

}  // namespace


void add_model_options(CLI::App& cmd, ModelCliOptions& o) {
  cmd.add_option("--model", o.model_dir, "Checkpoint directory (config.json + safetensors)")->required();
  cmd.add_option("--load-format", o.load_format, "auto: the checkpoint's weights; dummy: random weights from config.json")
      ->check(CLI::IsMember({"auto", "dummy"}));
  cmd.add_option("--nvfp4-activations", o.nvfp4_activations,
                 "NVFP4 layers: dequantize (W4A16, activations unquantized), quantize (W4A4, with input_scale), or "
                 "auto: W4A4 for the dense layers where the self-test verified the GPU's FP4 tensor cores "
                 "(Blackwell), W4A16 otherwise")
      ->check(CLI::IsMember({"auto", "dequantize", "quantize"}));
  cmd.add_option("--device", o.device, "Where to run: cuda, cpu, or auto (cuda when this build has it and a GPU is "
                 "present)")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd.add_option("--cuda-device", o.cuda_device, "CUDA device ordinal for --device cuda");
  cmd.add_option("--dummy-seed", o.dummy_seed, "Seed of --load-format dummy weights");
  add_kv_cache_option(cmd, o.kv_cache_dtype);
  cmd.add_flag("--enforce-eager", o.enforce_eager, "Launch every decode step's kernels from the host (no CUDA graphs)");
  cmd.add_flag("--no-pdl", o.no_pdl,
               "Launch each kernel only after the previous one finished (no programmatic "
               "dependent launch)");
  cmd.add_option("--selftest", o.selftest, "Start-up self-test of every kernel on the model's shapes: fast, full, off, or "
                 "auto (fast on a GPU, off on the CPU)")->check(CLI::IsMember({"auto", "off", "fast", "full"}));
  add_parallel_options(cmd, o);
  add_backend_options(cmd, o.backends);
}

void add_parallel_options(CLI::App& cmd, ModelCliOptions& o) {
  cmd.add_option("--tensor-parallel-size,--tp", o.tensor_parallel_size,
                 "Split the model over this many tensor-parallel ranks, each with its slice of every weight (CPU: "
                 "threads of this process)")
      ->check(CLI::Range(1, 256));
  cmd.add_option("--cuda-devices", o.cuda_devices,
                 "The GPU of each tensor-parallel rank, e.g. 0,1,2,3 (default: rank r on GPU r; ranks sharing a GPU "
                 "are staged through the host, for testing)")
      ->delimiter(',')
      ->check(CLI::Range(0, 1023));
  cmd.add_option("--nnodes", o.nnodes, "Processes (machines) the tensor-parallel ranks spread over, each running "
                 "--tensor-parallel-size / --nnodes of them")
      ->check(CLI::Range(1, 256));
  cmd.add_option("--node-rank", o.node_rank, "This process's place among --nnodes: 0 serves (and hosts the "
                 "rendezvous); the others run its steps and exit when it stops")
      ->check(CLI::Range(0, 255));
  cmd.add_option("--dist-init-addr", o.dist_init_addr, "HOST:PORT where node 0 serves the rendezvous (the same on "
                 "every node)");
  cmd.add_option("--dist-timeout", o.dist_timeout_s, "Seconds the nodes may take to join, and any one of them to "
                 "answer a collective, before it counts as lost")
      ->check(CLI::Range(1, 86400));
  cmd.add_option("--distributed-executor-backend", o.distributed_executor_backend,
                 "How the tensor-parallel ranks run: threads (of this process) or mp (one process per rank, started "
                 "by tern; this process serves and runs rank 0, or none with --front-end)")
      ->check(CLI::IsMember({"threads", "mp"}));
  cmd.add_flag("--front-end", o.front_end,
               "Node 0 runs no rank: it serves (HTTP, tokenizer, scheduler); rank 0 samples with its requests' "
               "random streams and sends the tokens back; the ranks run on the other --nnodes nodes, or with "
               "--distributed-executor-backend mp in one process each (the same flag on every node)");
  add_expert_parallel_options(cmd, o.enable_expert_parallel, o.expert_parallel_size);
}

void add_expert_parallel_options(CLI::App& cmd, bool& enable, int& size) {
  cmd.add_flag("--enable-expert-parallel", enable,
               "Each tensor-parallel rank holds whole routed experts (1 / --tp of them) instead of a slice of every "
               "expert; attention, dense layers and shared experts split as before, and the block's one all-reduce "
               "sums the experts' outputs");
  cmd.add_option("--expert-parallel-size,--ep-size", size,
                 "SGLang's form of --enable-expert-parallel: equal to --tensor-parallel-size (or 1: off)")
      ->check(CLI::Range(1, 256));
}

Expected<bool> expert_parallel_of(bool enable, int size, int tensor_parallel_size) {
  if (size > 1 && size != tensor_parallel_size) {
    return make_error("--expert-parallel-size {}: tern spreads the experts over the tensor-parallel ranks, so it must "
                      "equal --tensor-parallel-size ({}) or be 1", size, tensor_parallel_size);
  }
  return enable || size > 1;
}

Expected<bool> expert_parallel_of(const ModelCliOptions& o) {
  return expert_parallel_of(o.enable_expert_parallel, o.expert_parallel_size, o.tensor_parallel_size);
}

void add_backend_options(CLI::App& cmd, BackendFlags& b) {
  cmd.add_option("--attention-backend", b.attention, "auto, or an implementation of `attention` (tern doctor lists them)");
  cmd.add_option("--moe-backend", b.moe, "auto, or an implementation of `moe`");
  cmd.add_option("--gemm-backend", b.gemm, "auto, or an implementation of `gemm_bf16`");
  cmd.add_option("--fp4-gemm-backend", b.fp4_gemm, "auto, or an implementation of `gemm_nvfp4`");
  cmd.add_option("--gdn-backend", b.gdn, "auto, or an implementation of `gdn_delta_rule`");
  cmd.add_option("--kernel", b.kernels,
                 "OP=IMPL: force an implementation of any op by the names `tern doctor` "
                 "lists (repeatable; it must pass its self-test)");
}

void add_speculative_options(CLI::App& cmd, ModelCliOptions& o) {
  add_speculative_options(cmd, o.speculative_algorithm, o.speculative_num_steps);
}

void add_speculative_options(CLI::App& cmd, std::string& algorithm, int& num_steps) {
  cmd.add_option("--speculative-algorithm", algorithm,
                 "Speculative decoding: mtp (alias nextn) drafts with the model's own multi-token-prediction layers")
      ->transform(CLI::IsMember({"mtp", "nextn"}, CLI::ignore_case))
      ->transform([](std::string v) { return v == "nextn" ? std::string("mtp") : v; });
  cmd.add_option("--speculative-num-steps", num_steps,
                 fmt::format("Draft tokens per step with --speculative-algorithm (1-{}; default 3)",
                             kMaxSpeculativeSteps))
      ->check(CLI::Range(1, kMaxSpeculativeSteps));
}

int speculative_steps_of(const ModelCliOptions& o) {
  return o.speculative_algorithm.empty() ? 0 : o.speculative_num_steps;
}

int64_t speculative_verify_rows(const std::string& algorithm, int num_steps) {
  return algorithm.empty() ? 0 : num_steps + 1;
}

Expected<KvCacheDtype> kv_cache_dtype_of(const std::string& name) {
  if (name == "auto") return KvCacheDtype::kAuto;
  if (name == "bf16" || name == "bfloat16") return KvCacheDtype::kBf16;
  if (name == "fp8" || name == "fp8_e4m3" || name == "fp8_ds_mla") return KvCacheDtype::kFp8E4m3;
  return make_error("--kv-cache-dtype '{}': expected auto, bf16 (bfloat16) or fp8_e4m3 (fp8, fp8_ds_mla); tern has no "
                    "other cache form", name);
}

void add_kv_cache_option(CLI::App& cmd, std::string& kv_cache_dtype) {
  cmd.add_option("--kv-cache-dtype", kv_cache_dtype,
                 "How attention caches keys: auto or bf16; fp8_e4m3 (also fp8, fp8_ds_mla) for multi-head latent "
                 "attention models (GLM-5, DeepSeek-V3): 656 bytes per token and layer instead of 1152, the latent "
                 "in e4m3 with one scale per 128 values")
      ->check([](const std::string& v) {
        auto parsed = kv_cache_dtype_of(v);
        return parsed ? std::string() : parsed.error().message;
      });
}

Expected<std::unique_ptr<ModelRunner>> load_model_from_options(const ModelCliOptions& o,
                                                               const DeviceModelOptions& sizes) {
  ModelLoadOptions options;
  TERN_ASSIGN_OR_RETURN(options.kv_cache_dtype, kv_cache_dtype_of(o.kv_cache_dtype));
  const bool cuda = o.device == "cuda" || (o.device == "auto" && runner_cuda_device_count() > 0);
  options.device = cuda ? ModelDevice::kCuda : ModelDevice::kCpu;
  options.device_options = sizes;
  options.device_options.device = o.cuda_device;
  options.device_options.cuda_graphs = !o.enforce_eager;
  options.device_options.programmatic_launch = !o.no_pdl;
  TERN_ASSIGN_OR_RETURN(const std::vector<Selection> selections, selftest_before_load(o, cuda, options.device_options));
  options.load_format = o.load_format == "dummy" ? LoadFormat::kDummy : LoadFormat::kAuto;
  TERN_ASSIGN_OR_RETURN(const ModelConfig config, model_config_load(o.model_dir));
  TERN_ASSIGN_OR_RETURN(const Nvfp4ActivationsChoice nvfp4, nvfp4_activations_of(o.nvfp4_activations, cuda,
                                                                               config.attention == AttentionKind::kMla,
                                                                               selections));
  options.nvfp4_activations = nvfp4.policy;
  if (selftest_has_nvfp4(selections) || o.nvfp4_activations != "auto") {
    fmt::print(stderr, "NVFP4 layers: {}\n", nvfp4.why);
  }
  options.dummy_seed = o.dummy_seed;
  options.load_draft = !o.speculative_algorithm.empty();
  options.device_options.verify_rows = speculative_steps_of(o) + 1;
  options.tensor_parallel_size = o.tensor_parallel_size;
  TERN_ASSIGN_OR_RETURN(options.expert_parallel, expert_parallel_of(o));
  options.cuda_devices = o.cuda_devices;
  options.nnodes = o.nnodes;
  options.node_rank = o.node_rank;
  options.dist_init_addr = o.dist_init_addr;
  options.front_end = o.front_end;
  options.tp_join_timeout = std::chrono::seconds(o.dist_timeout_s);
  // With --front-end even one rank gets a process of its own.
  const bool rank_processes = o.distributed_executor_backend == "mp" && (o.tensor_parallel_size > 1 || o.front_end) &&
                              o.node_rank == 0;
  if (rank_processes) {
    if (o.nnodes > 1) {
      return make_error("--distributed-executor-backend mp starts one process per rank on this machine; with --nnodes "
                        "{}, start each node's process yourself (its ranks run as threads)", o.nnodes);
    }
    std::string addr = o.dist_init_addr;
    if (addr.empty()) {
      TERN_ASSIGN_OR_RETURN(addr, free_loopback_addr());
    }
    // One process per rank, and this one besides them with --front-end. On GPUs each takes its rank's (from every
    // rank's list: rank r on GPU r unless --cuda-devices says otherwise).
    const int processes = o.tensor_parallel_size + (o.front_end ? 1 : 0);
    std::vector<std::string> extra;
    if (cuda && o.cuda_devices.empty()) {
      options.cuda_devices.clear();
      for (int r = 0; r < o.tensor_parallel_size; ++r) options.cuda_devices.push_back(r);
      extra = {"--cuda-devices", fmt::format("{}", fmt::join(options.cuda_devices, ","))};
    }
    TERN_TRY(start_rank_processes(processes, addr, extra));
    options.nnodes = processes;
    options.dist_init_addr = addr;
  }
  if (o.node_rank > 0) {
    // Not node 0: this process runs its share of the ranks for node 0's command, and the command ends here.
    const int nodes = std::max(o.nnodes - (o.front_end ? 1 : 0), 1);
    const int local = o.tensor_parallel_size / nodes, first = (o.node_rank - (o.front_end ? 1 : 0)) * local;
    fmt::print(stderr, "node {} of {}: running ranks {}..{} of {} for node 0 at {}\n", o.node_rank, o.nnodes, first,
               first + local - 1, o.tensor_parallel_size, o.dist_init_addr);
    const Expected<void> ran = tp_worker_run(o.model_dir, options);
    if (!ran) fmt::print(stderr, "node {}: {}\n", o.node_rank, ran.error().message);
    else fmt::print(stderr, "node {}: node 0 stopped; exiting\n", o.node_rank);
    throw CLI::RuntimeError(ran ? 0 : 1);
  }
  auto model = runner_load(o.model_dir, options);
  if (model && rank_processes) rank_processes_formed_group();
  if (model) {
    for (const std::string& notice : (*model)->model().notices) fmt::print(stderr, "{}: {}\n", o.model_dir, notice);
  }
  return model;
}

Expected<std::vector<int32_t>> parse_id_list(const std::string& text) {
  std::vector<int32_t> ids;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    int32_t id = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), id);
    if (item.empty() || ec != std::errc() || ptr != item.data() + item.size() || id < 0) {
      return make_error("--prompt-ids: '{}' is not a token id (expected non-negative integers like 1,2,3)", item);
    }
    ids.push_back(id);
    begin = end + 1;
  }
  return ids;
}

}  // namespace tern
