#include "cli/model_selftest.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "io/linear_weight.h"
#include "io/model_config.h"
#include "io/quant_config.h"
#include "models/weight_schema.h"
#include "ops/attention_op.h"
#include "ops/elementwise_op.h"
#include "ops/gdn_op.h"
#include "ops/gemm_op.h"
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
#include "ops/moe_cuda.h"
#include "ops/sampling_cuda.h"
#include "ops/silu_gemv_cuda.h"
#endif

namespace tern {
namespace {

using Shapes = std::set<std::pair<int64_t, int64_t>>;  // {N, K}

struct ModelGemms {
  Shapes bf16, nvfp4;
  Shapes normed_bf16;  // the BF16 GEMMs that read an RMSNorm's output: each block's first projection, the lm_head
  Shapes silu_bf16;    // the BF16 down projections that read a SiLU-and-mul (dense MLPs, shared experts)
  bool experts_nvfp4 = false;
};

// Whether a linear is NVFP4: from the checkpoint's tensors when there are any, else from the quantization config
// as the exporter applies it (a config-only directory, as used with --load-format dummy).
bool linear_is_nvfp4(const std::optional<SafetensorsSet>& tensors, const std::optional<QuantConfig>& quant,
                     const std::string& module, int64_t out, int64_t in) {
  if (tensors) {
    auto w = linear_weight_resolve(*tensors, module, out, in);
    return w && w->format == WeightFormat::kNvfp4;
  }
  return quant && !quant->producer_excludes(module);  // as the dummy weights are made (layers/weights.cc)
}

// The projection a linear is computed in by the CUDA model (models/gpu/gpu_model.cc fuses the linears that read the
// same input into one projection, whose adjacent BF16 parts are one GEMM): "" for one of its own.
std::string fused_group(const LinearSpec& l) {
  const auto ends = [&](std::string_view suffix) { return l.module.ends_with(suffix); };
  const bool gate_or_up = ends(".gate_proj") || ends(".up_proj");
  if (l.role == LinearRole::kAttention && (ends(".q_proj") || ends(".k_proj") || ends(".v_proj"))) return "attn";
  if (l.role == LinearRole::kLinearAttention && !ends(".out_proj")) return "gdn";
  if (l.role == LinearRole::kMlp && gate_or_up) return "mlp";
  if (l.role == LinearRole::kRouter || l.role == LinearRole::kSharedExpertGate ||
      (l.role == LinearRole::kSharedExpert && gate_or_up)) {
    return "moe";
  }
  return "";
}

Expected<ModelGemms> model_gemm_shapes(const std::filesystem::path& dir, const ModelConfig& config) {
  TERN_ASSIGN_OR_RETURN(std::optional<QuantConfig> quant, quant_config_load(dir));
  std::optional<SafetensorsSet> tensors;
  if (auto set = SafetensorsSet::open_dir(dir)) tensors.emplace(std::move(*set));
  const std::string prefix = tensors ? weight_schema_text_prefix(*tensors) : weight_schema_default_text_prefix(config);
  const WeightSchema schema = weight_schema_build(config, prefix);
  ModelGemms g;
  // Per (layer, group): the BF16 parts' summed out_features (the GEMM's n; an NVFP4 part is a GEMM of its own),
  // their in_features and count.
  struct Fused {
    int64_t n = 0, k = 0, parts = 0;
  };
  std::map<std::pair<int64_t, std::string>, Fused> fused;
  for (const LinearSpec& l : schema.linears) {
    if (l.role == LinearRole::kLmHead && schema.tied_embeddings && tensors && !tensors->find("lm_head.weight")) {
      g.bf16.insert({l.out_features, l.in_features});
      g.normed_bf16.insert({l.out_features, l.in_features});
      continue;
    }
    const bool nvfp4 = linear_is_nvfp4(tensors, quant, l.module, l.out_features, l.in_features);
    (nvfp4 ? g.nvfp4 : g.bf16).insert({l.out_features, l.in_features});
    if (l.role == LinearRole::kLmHead && !nvfp4) g.normed_bf16.insert({l.out_features, l.in_features});
    const bool down =
        (l.role == LinearRole::kMlp || l.role == LinearRole::kSharedExpert) && l.module.ends_with(".down_proj");
    if (down && !nvfp4) g.silu_bf16.insert({l.out_features, l.in_features});
    if (const std::string group = fused_group(l); !group.empty() && !nvfp4) {
      Fused& f = fused[{l.layer, group}];
      f = {.n = f.n + l.out_features, .k = l.in_features, .parts = f.parts + 1};
    }
  }
  for (const auto& [key, f] : fused) {  // the shapes the model's fused BF16 GEMMs run at
    if (f.parts > 1) g.bf16.insert({f.n, f.k});
    g.normed_bf16.insert({f.n, f.k});  // every group is a block's first projection
  }
  for (const ExpertGroupSpec& e : schema.expert_groups) {
    const bool fused = tensors && tensors->find(e.prefix + ".gate_up_proj") != nullptr;
    const bool nvfp4 = !fused && linear_is_nvfp4(tensors, quant, e.prefix + ".0.gate_proj", e.intermediate, e.hidden);
    g.experts_nvfp4 = g.experts_nvfp4 || nvfp4;
    Shapes& s = nvfp4 ? g.nvfp4 : g.bf16;
    s.insert({e.intermediate, e.hidden});
    s.insert({e.hidden, e.intermediate});
  }
  return g;
}

using CaseTable = std::vector<std::pair<std::string, std::vector<SelfTestCase>>>;  // op -> cases (first = fast)

void add_case(CaseTable& table, const std::string& op, SelfTestCase c) {
  for (auto& [name, cases] : table) {
    if (name == op) {
      cases.push_back(std::move(c));
      return;
    }
  }
  table.push_back({op, {std::move(c)}});
}

// The shapes with the lead one first: the largest of at most kLeadMaxElements weights (an lm_head is above it).
// `--selftest fast` runs each op's first case only, and its time decides between implementations: on a
// microsecond-long kernel that choice is noise, on a projection of tens of MB it is the model's (see
// docs/perf/gpu.md §lead-case).
std::vector<std::pair<int64_t, int64_t>> lead_first(const Shapes& shapes) {
  constexpr int64_t kLeadMaxElements = int64_t{1} << 26;
  std::vector<std::pair<int64_t, int64_t>> out(shapes.begin(), shapes.end());
  auto lead = out.begin();
  for (auto it = out.begin(); it != out.end(); ++it) {
    const int64_t size = it->first * it->second, best = lead->first * lead->second;
    if (size <= kLeadMaxElements && (size > best || best > kLeadMaxElements)) lead = it;
  }
  if (!out.empty()) std::rotate(out.begin(), lead, lead + 1);
  return out;
}

// Decode-like cases (one new token per sequence over a cached context) at each batch size, then a prefill.
void add_model_cases(CaseTable& t, const ModelConfig& c, const ModelGemms& g, const std::vector<int64_t>& batches,
                     std::vector<std::string>& notes) {
  const RmsNormForm norm_form = c.architecture == Architecture::kQwen35Moe || c.architecture == Architecture::kQwen3Next
                                    ? RmsNormForm::kZeroCentred
                                    : RmsNormForm::kPlain;
  const bool has_attention = std::count(c.layer_types.begin(), c.layer_types.end(), LayerType::kFullAttention) > 0;
  const bool has_gdn = std::count(c.layer_types.begin(), c.layer_types.end(), LayerType::kLinearAttention) > 0;
  const bool has_moe = std::count(c.moe_layers.begin(), c.moe_layers.end(), true) > 0;
  const bool has_dense = std::count(c.moe_layers.begin(), c.moe_layers.end(), false) > 0;
  const int64_t prefill = 128;
  for (int64_t b : batches) {
    add_case(t, "embedding", embedding_case(b, c.vocab_size, c.hidden_size));
    add_case(t, "rms_norm", rms_norm_case(b, 1, c.hidden_size, norm_form, true));
    if (has_dense && c.intermediate_size > 0) add_case(t, "silu_mul", silu_mul_case(b, c.intermediate_size));
    if (has_moe) add_case(t, "silu_mul", silu_mul_case(b * c.num_experts_per_tok, c.moe_intermediate_size));
  }
  if (has_attention && c.attention != AttentionKind::kMla) {
    const bool gated = c.attention == AttentionKind::kGatedGqa;
    add_case(t, "rms_norm", rms_norm_case(batches.front(), c.num_attention_heads, c.head_dim, norm_form, false));
    add_case(t, "rope", rope_case(batches.front(), c.num_attention_heads, c.head_dim, c.rope.rotary_dim,
                                  c.rope.interleaved, static_cast<int64_t>(c.rope.theta)));
    for (int64_t b : batches) {
      add_case(t, "attention", attention_case(b, 1, 1000, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                              gated));
    }
    add_case(t, "attention",
             attention_case(2, prefill, 0, c.num_attention_heads, c.num_key_value_heads, c.head_dim, gated));
  } else if (has_attention) {
    notes.push_back("attention (MLA / DSA): no implementation yet, so this model cannot be served");
  }
  if (has_gdn) {
    const int64_t hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
    const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
    const int64_t channels = 2 * hk * dk + hv * dv;
    add_case(t, "rms_norm", rms_norm_case(batches.front(), hv, dv, RmsNormForm::kGated, false));
    for (int64_t b : batches) {
      add_case(t, "gdn_conv", gdn_conv_case(b, 1, channels, c.linear_conv_kernel_dim));
      add_case(t, "gdn_delta_rule", gdn_delta_rule_case(b, 1, hk, hv, dk, dv));
    }
    add_case(t, "gdn_conv", gdn_conv_case(2, prefill, channels, c.linear_conv_kernel_dim));
    // The gated norm in the recurrent kernel, as the model runs it: one sequence, one token.
    add_case(t, "gdn_delta_rule_norm", gdn_delta_rule_case(1, 1, hk, hv, dk, dv));
    add_case(t, "gdn_delta_rule", gdn_delta_rule_case(2, prefill, hk, hv, dk, dv));
  }
  if (has_moe && c.router_scoring == RouterScoring::kSoftmax) {
    const bool shared = c.shared_expert_intermediate_size > 0;
    for (int64_t b : batches) {
      add_case(t, "moe", moe_case(b, c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                                  g.experts_nvfp4, shared));
    }
  } else if (has_moe) {
    notes.push_back("moe (sigmoid routing with groups): no implementation yet, so this model cannot be served");
  }
  const std::vector<std::pair<int64_t, int64_t>> bf16 = lead_first(g.bf16), fp4 = lead_first(g.nvfp4);
  for (int64_t rows : {1, 8}) add_case(t, "sampling", sampling_case(rows, c.vocab_size));
  if (!bf16.empty()) t.push_back({"gemm_bf16", gemm_selftest_cases(bf16, batches)});
  // The norm in front of the decode GEMV (one row), on every projection that follows a norm; the first layer's has
  // no residual to add.
  const std::vector<std::pair<int64_t, int64_t>> normed = lead_first(g.normed_bf16);
  for (auto [n, k] : normed) add_case(t, "rms_norm_gemv", rms_norm_gemv_case(n, k, norm_form, true));
  if (!normed.empty()) {
    add_case(t, "rms_norm_gemv", rms_norm_gemv_case(normed[0].first, normed[0].second, norm_form, false));
  }
  for (auto [n, k] : lead_first(g.silu_bf16)) add_case(t, "silu_mul_gemv", silu_mul_gemv_case(n, k));
  if (!fp4.empty()) t.push_back({"gemm_nvfp4", gemm_selftest_cases(fp4, batches)});
}

Expected<void> register_all(Registry& registry, bool cuda) {
  TERN_TRY(gemm_register_cpu(registry));
  TERN_TRY(elementwise_register_cpu(registry));
  TERN_TRY(attention_register_cpu(registry));
  TERN_TRY(gdn_register_cpu(registry));
  TERN_TRY(moe_register_cpu(registry));
  TERN_TRY(sampling_register_cpu(registry));
  TERN_TRY(silu_gemv_register_cpu(registry));
#if TERN_HAVE_CUDA
  if (cuda) {
    auto context = std::make_shared<DeviceContext>(0);
    TERN_TRY(gemm_register_cuda(registry, context));
    TERN_TRY(elementwise_register_cuda(registry, context));
    TERN_TRY(attention_register_cuda(registry, context));
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
  CaseTable table;
  if (model_dir.empty()) {
    table.push_back({"gemm_bf16", gemm_selftest_cases({{4096, 4096}}, o.batch_sizes)});
    table.push_back({"gemm_nvfp4", gemm_selftest_cases({{4096, 4096}}, o.batch_sizes)});
  } else {
    TERN_ASSIGN_OR_RETURN(ModelConfig config, model_config_load(model_dir));
    TERN_ASSIGN_OR_RETURN(ModelGemms gemms, model_gemm_shapes(model_dir, config));
    add_model_cases(table, config, gemms, o.batch_sizes, r.notes);
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
    r.n_missing += s.chosen.empty() ? 1 : 0;
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
