#include "cli/doctor_command.h"

#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "io/linear_weight.h"
#include "io/model_config.h"
#include "io/quant_config.h"
#include "models/weight_schema.h"
#include "ops/gemm_op.h"
#include "ops/registry.h"
#if TERN_HAVE_CUDA
#include "kernels/cuda/device.h"
#include "ops/gemm_cuda.h"
#endif

namespace tern {
namespace {

struct DoctorOptions {
  std::string model_dir;
  std::string selftest = "full";
  std::string device = "auto";
  bool json = false;
};

using Shapes = std::set<std::pair<int64_t, int64_t>>;  // {N, K}

struct ModelGemms {
  Shapes bf16, nvfp4;
};

// Whether a linear is NVFP4: from the checkpoint's tensors when there are any, else from the quantization config
// (a config-only directory, as used with --load-format dummy).
bool linear_is_nvfp4(const std::optional<SafetensorsSet>& tensors, const std::optional<QuantConfig>& quant,
                     const std::string& module, int64_t out, int64_t in) {
  if (tensors) {
    auto w = linear_weight_resolve(*tensors, module, out, in);
    return w && w->format == WeightFormat::kNvfp4;
  }
  return quant && !quant->is_excluded(module);
}

Expected<ModelGemms> model_gemm_shapes(const std::filesystem::path& dir) {
  TERN_ASSIGN_OR_RETURN(ModelConfig config, model_config_load(dir));
  TERN_ASSIGN_OR_RETURN(std::optional<QuantConfig> quant, quant_config_load(dir));
  std::optional<SafetensorsSet> tensors;
  if (auto set = SafetensorsSet::open_dir(dir)) tensors.emplace(std::move(*set));
  const std::string prefix = tensors ? weight_schema_text_prefix(*tensors) : weight_schema_default_text_prefix(config);
  const WeightSchema schema = weight_schema_build(config, prefix);
  ModelGemms g;
  for (const LinearSpec& l : schema.linears) {
    if (l.role == LinearRole::kLmHead && schema.tied_embeddings && tensors && !tensors->find("lm_head.weight")) {
      g.bf16.insert({l.out_features, l.in_features});
      continue;
    }
    const bool nvfp4 = linear_is_nvfp4(tensors, quant, l.module, l.out_features, l.in_features);
    (nvfp4 ? g.nvfp4 : g.bf16).insert({l.out_features, l.in_features});
  }
  for (const ExpertGroupSpec& e : schema.expert_groups) {
    const bool fused = tensors && tensors->find(e.prefix + ".gate_up_proj") != nullptr;
    const bool nvfp4 = !fused && linear_is_nvfp4(tensors, quant, e.prefix + ".0.gate_proj", e.intermediate, e.hidden);
    Shapes& s = nvfp4 ? g.nvfp4 : g.bf16;
    s.insert({e.intermediate, e.hidden});
    s.insert({e.hidden, e.intermediate});
  }
  return g;
}

std::vector<std::pair<int64_t, int64_t>> as_vector(const Shapes& s) { return {s.begin(), s.end()}; }

nlohmann::ordered_json device_json(const DeviceDescription& d) {
  return {{"name", d.name}, {"backend", d.backend == Backend::kCpu ? "cpu" : "cuda"}, {"arch", d.arch()},
          {"compute_units", d.sm_count}, {"smem_per_block_optin", d.smem_per_block_optin},
          {"memory_bytes", d.memory_bytes}};
}

nlohmann::ordered_json selection_json(const Selection& s) {
  nlohmann::ordered_json candidates = nlohmann::ordered_json::array();
  for (const CandidateReport& c : s.candidates) {
    candidates.push_back({{"name", c.name}, {"status", std::string(candidate_status_name(c.status))},
                          {"reason", c.reason}, {"max_error", c.max_error}, {"tolerance", c.bound},
                          {"seconds", c.seconds}});
  }
  return {{"op", s.op}, {"chosen", s.chosen.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(s.chosen)},
          {"tested", s.tested}, {"selftest_seconds", s.selftest_seconds}, {"candidates", candidates}};
}

void print_selection(const Selection& s) {
  fmt::print("  {:<12} -> {}\n", s.op, s.chosen.empty() ? "NO VERIFIED IMPLEMENTATION" : s.chosen);
  for (const CandidateReport& c : s.candidates) {
    if (c.status == CandidateStatus::kPassed) {
      fmt::print("      {:<14} passed: max error {:.3g} (tolerance {:.3g}), {:.3f} ms\n", c.name, c.max_error, c.bound,
                 c.seconds * 1e3);
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
  ModelGemms gemms{.bf16 = {{4096, 4096}}, .nvfp4 = {{4096, 4096}}};  // a generic shape without a model
  if (!o.model_dir.empty()) {
    auto shapes = model_gemm_shapes(o.model_dir);
    if (!shapes) {
      fmt::print(stderr, "tern doctor: {}\n", shapes.error().message);
      return 2;
    }
    gemms = std::move(*shapes);
  }
  Registry registry;
  if (auto ok = gemm_register_cpu(registry); !ok) {
    fmt::print(stderr, "tern doctor: {}\n", ok.error().message);
    return 2;
  }
  std::vector<DeviceDescription> devices = {cpu_device_describe()};
#if TERN_HAVE_CUDA
  for (const DeviceDescription& d : cuda_devices_describe()) devices.push_back(d);
  if (devices.size() > 1 && o.device != "cpu") {
    if (auto ok = gemm_register_cuda(registry, std::make_shared<DeviceContext>(0)); !ok) {
      fmt::print(stderr, "tern doctor: {}\n", ok.error().message);
      return 2;
    }
  }
#endif
  if (o.device != "auto" && o.device != "cpu" && o.device != "cuda") {
    fmt::print(stderr, "tern doctor: unknown --device '{}' (auto, cpu or cuda)\n", o.device);
    return 2;
  }
  if (o.device == "cuda" && devices.size() < 2) {
    fmt::print(stderr, "tern doctor: --device cuda, but no CUDA device is available to this binary\n");
    return 2;
  }
  // The device that would serve: the first GPU unless the CPU is asked for.
  const DeviceDescription device = (o.device != "cpu" && devices.size() > 1) ? devices[1] : devices[0];
  const std::vector<int64_t> batch_sizes = {1, 8};
  std::vector<Selection> selections;
  for (const auto& [op, shapes] : {std::pair{"gemm_bf16", &gemms.bf16}, std::pair{"gemm_nvfp4", &gemms.nvfp4}}) {
    if (shapes->empty()) continue;
    const auto cases = gemm_selftest_cases(as_vector(*shapes), batch_sizes);
    auto s = registry_select(registry, op, device, cases, {.mode = *mode});
    if (!s) {
      fmt::print(stderr, "tern doctor: {}\n", s.error().message);
      return 2;
    }
    selections.push_back(std::move(*s));
  }
  int n_missing = 0;
  for (const Selection& s : selections) n_missing += s.chosen.empty() ? 1 : 0;
  const std::string verdict =
      n_missing == 0 ? fmt::format("ok: every op the model needs ({}) has an implementation verified on this machine",
                                   selections.size())
                     : fmt::format("NOT OK: {} op(s) have no verified implementation on this machine", n_missing);
  if (o.json) {
    nlohmann::ordered_json j;
    j["devices"] = nlohmann::ordered_json::array();
    for (const DeviceDescription& d : devices) j["devices"].push_back(device_json(d));
    j["selftest_device"] = device.name;
    j["binary"] = {{"cuda", TERN_DOCTOR_CUDA_ARCHS[0] != '\0'}, {"cuda_architectures", TERN_DOCTOR_CUDA_ARCHS}};
    j["model"] = o.model_dir.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(o.model_dir);
    j["ops"] = nlohmann::ordered_json::array();
    for (const Selection& s : selections) j["ops"].push_back(selection_json(s));
    j["verdict"] = verdict;
    fmt::print("{}\n", j.dump(2));
  } else {
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
    fmt::print("ops on {}{}\n", device.name,
               o.model_dir.empty() ? "" : fmt::format(" (shapes of {}, batch sizes 1 and 8)", o.model_dir));
    for (const Selection& s : selections) print_selection(s);
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
  cmd->callback([o] { throw CLI::RuntimeError(run_doctor(*o)); });
}

}  // namespace tern
