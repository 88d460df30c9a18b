#include "cli/model_selftest.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>

#include "io/model_config.h"
#include "io/safetensors.h"
#include "models/causal_lm.h"
#include "models/selftest_plan.h"
#include "models/weight_schema.h"
#include "ops/attention_op.h"
#include "ops/elementwise_op.h"
#include "ops/gdn_op.h"
#include "ops/gemm_op.h"
#include "ops/gemm_w4a4_op.h"
#include "ops/mla_op.h"
#include "ops/moe_op.h"
#include "ops/sampling_op.h"
#include "ops/silu_gemv_op.h"
#if TERN_HAVE_CUDA
#include "kernels/cuda/device.h"
#include "ops/attention_cuda.h"
#include "ops/cuda_util.h"
#include "ops/elementwise_cuda.h"
#include "ops/gdn_cuda.h"
#include "ops/gemm_cuda.h"
#include "ops/gemm_w4a4_cuda.h"
#include "ops/mla_cuda.h"
#include "ops/moe_cuda.h"
#include "ops/sampling_cuda.h"
#include "ops/silu_gemv_cuda.h"
#endif

namespace tern {
namespace {

Expected<void> register_all(Registry& registry, bool cuda) {
  TERN_TRY(gemm_register_cpu(registry));
  TERN_TRY(gemm_w4a4_register_cpu(registry));
  TERN_TRY(elementwise_register_cpu(registry));
  TERN_TRY(attention_register_cpu(registry));
  TERN_TRY(mla_register_cpu(registry));
  TERN_TRY(gdn_register_cpu(registry));
  TERN_TRY(moe_register_cpu(registry));
  TERN_TRY(sampling_register_cpu(registry));
  TERN_TRY(silu_gemv_register_cpu(registry));
#if TERN_HAVE_CUDA
  if (cuda) {
    auto context = std::make_shared<DeviceContext>(0);
    TERN_TRY(gemm_register_cuda(registry, context));
    TERN_TRY(gemm_w4a4_register_cuda(registry, context));
    TERN_TRY(elementwise_register_cuda(registry, context));
    TERN_TRY(attention_register_cuda(registry, context));
    TERN_TRY(mla_register_cuda(registry, context));
    TERN_TRY(gdn_register_cuda(registry, context));
    TERN_TRY(moe_register_cuda(registry, context));
    TERN_TRY(sampling_register_cuda(registry, context));
    TERN_TRY(silu_gemv_register_cuda(registry, context));
  }
#else
  (void)cuda;
#endif
  return {};
}

// The cases the model's blocks report (models/selftest_plan.h), from its host blocks: the checkpoint's, mapped, or
// for a directory with a config only, the shapes and formats its dummy weights would have. Under tensor
// parallelism, rank 0's slice: the shapes every rank runs (the last ranks' vocabulary ranges may be shorter). With
// verification rows (speculative decoding), the verifications' shapes and the draft module's blocks too.
Expected<SelftestCaseTable> planned_cases(const std::string& model_dir, const ModelConfig& config,
                                          const ModelSelftestOptions& o) {
  const bool has_weights = SafetensorsSet::open_dir(model_dir).has_value();
  ModelLoadOptions load{.load_format = has_weights ? LoadFormat::kAuto : LoadFormat::kShapes,
                        .kv_cache_dtype = o.kv_cache_dtype};
  load.shard = {0, o.tensor_parallel_size, o.expert_parallel};
  load.load_draft = o.verify_rows > 0 && weight_schema_has_draft(config);
  TERN_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> host, model_build_host(model_dir, load));
  return selftest_cases_of(*host, o.batch_sizes, o.verify_rows);
}

}  // namespace

Expected<std::map<std::string, std::string>> BackendFlags::forced() const {
  std::map<std::string, std::string> out{
      {"attention", attention}, {"moe", moe}, {"gemm_bf16", gemm}, {"gemm_nvfp4", fp4_gemm}, {"gdn_delta_rule", gdn}};
  for (const std::string& entry : kernels) {
    const size_t eq = entry.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == entry.size()) {
      return make_error("--kernel '{}': expected OP=IMPL (e.g. silu_mul_gemv=separate; tern doctor lists both)", entry);
    }
    const std::string op = entry.substr(0, eq), name = entry.substr(eq + 1);
    std::string& slot = out[op];
    if (!slot.empty() && slot != "auto" && slot != name) {
      return make_error("--kernel '{}': op '{}' is already forced to '{}'", entry, op, slot);
    }
    slot = name;
  }
  return out;
}

Expected<ModelSelftestReport> model_selftest_run(const std::string& model_dir, const ModelSelftestOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  if (o.device != "auto" && o.device != "cpu" && o.device != "cuda") {
    return make_error("unknown --device '{}' (auto, cpu or cuda)", o.device);
  }
  ModelSelftestReport r;
  r.devices = {cpu_device_describe()};
#if TERN_HAVE_CUDA
  for (const DeviceDescription& d : cuda_devices_describe()) r.devices.push_back(d);
#endif
  if (o.device == "cuda" && r.devices.size() < 2) {
    return make_error("--device cuda, but no CUDA device is available to this binary");
  }
  const bool cuda = o.device != "cpu" && r.devices.size() > 1;
  r.device = cuda ? r.devices[1] : r.devices[0];
  SelftestCaseTable table;
  if (model_dir.empty()) {
    table.push_back({"gemm_bf16", gemm_selftest_cases({{4096, 4096}}, o.batch_sizes)});
    table.push_back({"gemm_nvfp4", gemm_selftest_cases({{4096, 4096}}, o.batch_sizes)});
  } else {
    TERN_ASSIGN_OR_RETURN(const ModelConfig config, model_config_load(model_dir));  // a bad config stops here
    if (auto planned = planned_cases(model_dir, config, o)) {
      table = std::move(*planned);
    } else {
      r.notes.push_back(fmt::format("this model cannot be served yet: {}", planned.error().message));
    }
  }
  for (const auto& [op, name] : o.forced) {
    if (name == "auto") continue;
    bool used = false;
    std::string ops;
    for (const auto& entry : table) {
      used = used || entry.first == op;
      ops += (ops.empty() ? "" : ", ") + entry.first;
    }
    if (!used) {
      return make_error("'{}' is forced to '{}', but the self-test runs no op '{}' here (its ops: {})", op, name, op,
                        ops);
    }
  }
  Registry registry;
  TERN_TRY(register_all(registry, cuda));
  for (const auto& [op, cases] : table) {
    SelectOptions select{.mode = o.mode};
    if (auto it = o.forced.find(op); it != o.forced.end()) select.forced = it->second;
    TERN_ASSIGN_OR_RETURN(Selection s, registry_select(registry, op, r.device, cases, select));
    r.n_missing += s.chosen.empty() && selftest_fallback_of(op).empty() ? 1 : 0;
    r.selections.push_back(std::move(s));
  }
  r.n_missing += static_cast<int>(r.notes.size());
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.verdict = r.n_missing == 0
                  ? fmt::format("ok: every op the model needs ({}) has an implementation verified on this machine",
                                r.selections.size())
                  : fmt::format("NOT OK: {} op(s) have no verified implementation on this machine", r.n_missing);
  return r;
}

}  // namespace tern
