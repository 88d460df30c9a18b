#include "cli/doctor_command.h"

#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "cli/model_options.h"
#include "cli/model_selftest.h"
#include "cli/version_command.h"
#include "ops/registry.h"
#include "ops/cuda_modules.h"

namespace tern {
namespace {

struct DoctorOptions {
  std::string model_dir;
  std::string selftest = "full";
  std::string device = "auto";
  bool json = false;
  BackendFlags backends;
};

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
  fmt::print("  {:<14} -> {}{}\n", s.op, s.chosen.empty() ? "NO VERIFIED IMPLEMENTATION" : s.chosen,
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
  auto report = model_selftest_run(o.model_dir, {.mode = *mode, .device = o.device, .forced = *forced});
  if (!report) {
    fmt::print(stderr, "tern doctor: {}\n", report.error().message);
    return 2;
  }
  const auto& devices = report->devices;
  const DeviceDescription& device = report->device;
  const auto& selections = report->selections;
  const int n_missing = report->n_missing;
  const std::string& verdict = report->verdict;
  // What the binary holds for the first GPU, module by module (cudaFuncGetAttributes).
  std::vector<CudaModuleReport> modules;
#if TERN_HAVE_CUDA
  modules = cuda_modules_describe();
#endif
  const std::vector<LibraryVersion> libraries = linked_library_versions();
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
    j["selftest_seconds"] = report->seconds;
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
    fmt::print("self-test time\n  {:.2f} s\n", report->seconds);
    fmt::print("verdict\n  {}\n", verdict);
  }
  return n_missing == 0 ? 0 : 1;
}

}  // namespace

void register_doctor_command(CLI::App& app) {
  auto o = std::make_shared<DoctorOptions>();
  CLI::App* cmd = app.add_subcommand("doctor", "Check which kernels are verified on this machine, and why");
  cmd->add_option("--model", o->model_dir, "Self-test on this model's shapes (checkpoint or config-only directory)");
  cmd->add_option("--selftest", o->selftest, "fast (one case per op) or full (every shape)");
  cmd->add_option("--device", o->device, "auto (the first GPU if any), cpu or cuda");
  cmd->add_flag("--json", o->json, "Print one JSON object");
  add_backend_options(*cmd, o->backends);
  cmd->callback([o] { throw CLI::RuntimeError(run_doctor(*o)); });
}

}  // namespace tern
