#include "cli/doctor_command.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "cli/model_options.h"
#include "cli/model_selftest.h"
#include "cli/version_command.h"
#include "io/model_config.h"
#include "models/selftest_plan.h"
#include "ops/registry.h"
#include "ops/cuda_modules.h"
#include "runtime/tp_runner.h"

namespace tern {
namespace {

struct DoctorOptions {
  std::string model_dir;
  std::string selftest = "full";
  std::string device = "auto";
  bool json = false;
  BackendFlags backends;
  int tensor_parallel_size = 1;
  bool enable_expert_parallel = false;
  int expert_parallel_size = 0;
  std::vector<int> cuda_devices;
  std::string speculative_algorithm;  // set: the self-test adds speculative verifications' shapes
  int speculative_num_steps = 3;
  std::string kv_cache_dtype = "auto";  // the cache form whose kernels are tested
};

// The tensor-parallel group's start-up check (runtime/tp_runner.h), run when --tensor-parallel-size > 1.
struct TpSection {
  bool ran = false;
  Expected<TpGroupCheck> check = make_error("not run");
};

TpSection tp_section(const DoctorOptions& o) {
  TpSection t;
  if (o.tensor_parallel_size <= 1) return t;
  t.ran = true;
  ModelLoadOptions options;
  const bool cuda = o.device == "cuda" || (o.device == "auto" && runner_cuda_device_count() > 0);
  options.device = cuda ? ModelDevice::kCuda : ModelDevice::kCpu;
  options.tensor_parallel_size = o.tensor_parallel_size;
  options.cuda_devices = o.cuda_devices;
  t.check = tp_group_check(options, std::chrono::seconds(30));
  return t;
}

nlohmann::ordered_json tp_json(const TpSection& t) {
  if (!t.ran) return nlohmann::ordered_json();
  if (!t.check) return {{"ok", false}, {"error", t.check.error().message}};
  const TpGroupCheck& c = *t.check;
  return {{"ok", true},         {"world", c.world},           {"devices", c.devices},
          {"transport", c.transport}, {"peers", c.peers}, {"probe_bytes", c.probe_bytes},
          {"all_reduce_ms", c.all_reduce_ms}};
}

void print_tp(const TpSection& t, int world) {
  if (!t.ran) return;
  fmt::print("tensor parallelism ({} ranks)\n", world);
  if (!t.check) {
    fmt::print("  NOT OK: {}\n", t.check.error().message);
    return;
  }
  const TpGroupCheck& c = *t.check;
  fmt::print("  ranks on {}\n", c.devices.empty() ? std::string("the CPU (threads)")
                                                 : fmt::format("GPUs {}", fmt::join(c.devices, ", ")));
  fmt::print("  collectives: {}\n", c.transport);
  for (const std::string& p : c.peers) fmt::print("  {}\n", p);
  fmt::print("  all-reduce of {:.1f} MiB on every rank: {:.3f} ms (exact sum on every rank)\n",
             static_cast<double>(c.probe_bytes) / (1 << 20), c.all_reduce_ms);
}

nlohmann::ordered_json device_json(const DeviceDescription& d) {
  return {{"name", d.name}, {"backend", d.backend == Backend::kCpu ? "cpu" : "cuda"}, {"arch", d.arch()},
          {"compute_units", d.sm_count}, {"smem_per_block_optin", d.smem_per_block_optin},
          {"memory_bytes", d.memory_bytes}};
}

nlohmann::ordered_json selection_json(const Selection& s) {
  nlohmann::ordered_json candidates = nlohmann::ordered_json::array();
  for (const CandidateReport& c : s.candidates) {
    candidates.push_back({{"name", c.name},
                          {"status", std::string(candidate_status_name(c.status))},
                          {"reason", c.reason},
                          {"opt_in", c.opt_in},
                          {"max_error", c.max_error},
                          {"tolerance", c.bound},
                          {"seconds", c.seconds}});
  }
  return {{"op", s.op},
          {"chosen", s.chosen.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(s.chosen)},
          {"forced", s.forced},
          {"tested", s.tested},
          {"selftest_seconds", s.selftest_seconds},
          {"candidates", candidates}};
}

void print_selection(const Selection& s) {
  const std::string fallback = selftest_fallback_of(s.op);
  const std::string none = fallback.empty() ? "NO VERIFIED IMPLEMENTATION"
                                            : fmt::format("none verified here: its layers run {} instead", fallback);
  fmt::print("  {:<14} -> {}{}\n", s.op, s.chosen.empty() ? none : s.chosen,
             s.forced && !s.chosen.empty() ? " (forced)" : "");
  for (const CandidateReport& c : s.candidates) {
    if (c.status == CandidateStatus::kPassed) {
      fmt::print("      {:<14} passed: max error {:.3g} (tolerance {:.3g}), {:.3f} ms{}\n", c.name, c.max_error,
                 c.bound, c.seconds * 1e3, c.opt_in ? fmt::format(" (opt-in: --kernel {}={})", s.op, c.name) : "");
    } else {
      fmt::print("      {:<14} {}: {}\n", c.name, candidate_status_name(c.status), c.reason);
    }
  }
}

int run_doctor(const DoctorOptions& o) {
  auto mode = selftest_mode_parse(o.selftest);
  if (!mode) {
    fmt::print(stderr, "tern doctor: {}\n", mode.error().message);
    return 2;
  }
  auto forced = o.backends.forced();
  if (!forced) {
    fmt::print(stderr, "tern doctor: {}\n", forced.error().message);
    return 2;
  }
  auto kv_cache_dtype = kv_cache_dtype_of(o.kv_cache_dtype);
  if (!kv_cache_dtype) {
    fmt::print(stderr, "tern doctor: {}\n", kv_cache_dtype.error().message);
    return 2;
  }
  auto expert_parallel = expert_parallel_of(o.enable_expert_parallel, o.expert_parallel_size, o.tensor_parallel_size);
  if (!expert_parallel) {
    fmt::print(stderr, "tern doctor: {}\n", expert_parallel.error().message);
    return 2;
  }
  // The shapes rank 0 of the tensor-parallel group runs, and with speculative decoding its verifications'.
  const ModelSelftestOptions selftest{
      .mode = *mode,
      .device = o.device,
      .forced = *forced,
      .tensor_parallel_size = o.tensor_parallel_size,
      .expert_parallel = *expert_parallel,
      .verify_rows = speculative_verify_rows(o.speculative_algorithm, o.speculative_num_steps),
      .kv_cache_dtype = *kv_cache_dtype};
  auto report = model_selftest_run(o.model_dir, selftest);
  if (!report) {
    fmt::print(stderr, "tern doctor: {}\n", report.error().message);
    return 2;
  }
  const auto& devices = report->devices;
  const DeviceDescription& device = report->device;
  const auto& selections = report->selections;
  const int n_missing = report->n_missing;
  std::string verdict = report->verdict;
  // What the binary holds for the first GPU, module by module (cudaFuncGetAttributes).
  std::vector<CudaModuleReport> modules;
#if TERN_HAVE_CUDA
  modules = cuda_modules_describe();
#endif
  const std::vector<LibraryVersion> libraries = linked_library_versions();
  const TpSection tp = tp_section(o);
  // Which path the NVFP4 layers take on this device (--nvfp4-activations auto), where the model has any.
  std::optional<Nvfp4ActivationsChoice> nvfp4;
  if (selftest_has_nvfp4(selections)) {
    const auto config = model_config_load(o.model_dir);
    const bool mla = config && config->attention == AttentionKind::kMla;
    if (auto choice = nvfp4_activations_of("auto", device.backend == Backend::kCuda, mla, selections)) nvfp4 = *choice;
  }
  if (tp.ran && !tp.check) verdict = "NOT OK: the tensor-parallel group failed its check: " + tp.check.error().message;
  if (o.json) {
    nlohmann::ordered_json j;
    j["build"] = build_info_json(libraries);
    j["devices"] = nlohmann::ordered_json::array();
    for (const DeviceDescription& d : devices) j["devices"].push_back(device_json(d));
    j["selftest_device"] = device.name;
    j["binary"] = {{"cuda", TERN_DOCTOR_CUDA_ARCHS[0] != '\0'}, {"cuda_architectures", TERN_DOCTOR_CUDA_ARCHS},
                   {"modules", nlohmann::ordered_json::array()}};
    for (const auto& [module, runs, detail] : modules) {
      j["binary"]["modules"].push_back({{"module", module}, {"runs", runs}, {"detail", detail}});
    }
    j["model"] = o.model_dir.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(o.model_dir);
    j["ops"] = nlohmann::ordered_json::array();
    for (const Selection& s : selections) j["ops"].push_back(selection_json(s));
    j["missing"] = report->notes;
    j["nvfp4_layers"] = nvfp4 ? nlohmann::ordered_json{{"w4a4", nvfp4->policy != Nvfp4Activations::kDequantize},
                                                       {"experts_w4a4", nvfp4->policy == Nvfp4Activations::kQuantize},
                                                       {"why", nvfp4->why}}
                              : nlohmann::ordered_json();
    j["selftest_seconds"] = report->seconds;
    j["tensor_parallel"] = tp_json(tp);
    j["verdict"] = verdict;
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print("{}\n", build_info_text(libraries));
    fmt::print("devices\n");
    for (const DeviceDescription& d : devices) {
      if (d.backend == Backend::kCpu) {
        fmt::print("  {} ({} threads)\n", d.name, d.sm_count);
      } else {
        fmt::print("  {}: {}, {} SMs, {} KiB shared memory per block (opt-in), {:.1f} GiB\n", d.name, d.arch(),
                   d.sm_count, d.smem_per_block_optin / 1024, d.memory_bytes / double(int64_t{1} << 30));
      }
    }
    fmt::print("binary\n  CUDA kernels: {}\n", TERN_DOCTOR_CUDA_ARCHS[0] != '\0'
                                                     ? fmt::format("built for {}", TERN_DOCTOR_CUDA_ARCHS)
                                                     : std::string("not built (CPU-only binary)"));
    for (const auto& [module, runs, detail] : modules) fmt::print("  {:<18} {}\n", module, detail);
    fmt::print("ops on {}{}\n", device.name,
               o.model_dir.empty() ? "" : fmt::format(" (shapes of {}, batch sizes 1 and 8)", o.model_dir));
    for (const Selection& s : selections) print_selection(s);
    for (const std::string& note : report->notes) fmt::print("  {}\n", note);
    if (nvfp4) fmt::print("NVFP4 layers\n  {}\n", nvfp4->why);
    fmt::print("self-test time\n  {:.2f} s\n", report->seconds);
    print_tp(tp, o.tensor_parallel_size);
    fmt::print("verdict\n  {}\n", verdict);
  }
  return n_missing == 0 && (!tp.ran || tp.check.has_value()) ? 0 : 1;
}

}  // namespace

void register_doctor_command(CLI::App& app) {
  auto o = std::make_shared<DoctorOptions>();
  CLI::App* cmd = app.add_subcommand("doctor", "Check which kernels are verified on this machine, and why");
  cmd->add_option("--model", o->model_dir, "Self-test on this model's shapes (checkpoint or config-only directory)");
  cmd->add_option("--selftest", o->selftest,
                  "fast (each op's first case, and the cases marked for it) or full (every shape)");
  cmd->add_option("--device", o->device, "auto (the first GPU if any), cpu or cuda");
  add_kv_cache_option(*cmd, o->kv_cache_dtype);
  cmd->add_flag("--json", o->json, "Print one JSON object");
  add_backend_options(*cmd, o->backends);
  cmd->add_option("--tensor-parallel-size,--tp", o->tensor_parallel_size,
                  "Also check a tensor-parallel group of this many ranks: peer access, NCCL, a timed all-reduce")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--cuda-devices", o->cuda_devices, "The GPU of each rank (default: rank r on GPU r)")
      ->delimiter(',')
      ->check(CLI::Range(0, 1023));
  add_expert_parallel_options(*cmd, o->enable_expert_parallel, o->expert_parallel_size);
  add_speculative_options(*cmd, o->speculative_algorithm, o->speculative_num_steps);
  cmd->callback([o] { throw CLI::RuntimeError(run_doctor(*o)); });
}

}  // namespace tern
