#include "models/model_info.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <set>

#include "core/latent_fp8.h"
#include "io/linear_weight.h"
#include "io/safetensors.h"
#include "models/weight_schema.h"

namespace tern {
namespace {

std::string shape_string(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

bool is_float_dtype(DType d) { return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32; }

// Matches the checkpoint's tensors against the schema, accumulating counts and problems in `info`.
class Matcher {
 public:
  Matcher(const SafetensorsSet& tensors, ModelInfo& info) : tensors_(tensors), info_(info) {}

  const std::set<std::string>& skipped_reasons() const { return skipped_reasons_; }

  void match(const WeightSchema& schema) {
    for (const ParamSpec& p : schema.params) match_param(p);
    for (const LinearSpec& l : schema.linears) match_linear(l, schema.tied_embeddings);
    for (const ExpertGroupSpec& g : schema.expert_groups) match_experts(g);
    for (const TensorView* t : tensors_.tensors()) classify_leftover(*t, schema);
  }

 private:
  void consume(const TensorView& t) {
    consumed_.insert(t.name);
    info_.weight_bytes += static_cast<int64_t>(t.data.size());
  }

  void match_param(const ParamSpec& p) {
    const TensorView* t = tensors_.find(p.name);
    if (t == nullptr) return problem("tensor '{}' {} is missing", p.name, shape_string(p.shape));
    if (t->shape != p.shape || !is_float_dtype(t->dtype)) {
      return problem("tensor '{}' must be a float tensor {}, found {} {}", p.name, shape_string(p.shape),
                     dtype_name(t->dtype), shape_string(t->shape));
    }
    consume(*t);
    info_.total_parameters += t->numel();
  }

  void add_linear(const LinearWeight& w, int64_t count) {
    for (const std::string& name : linear_weight_tensor_names(w)) consume(*tensors_.find(name));
    info_.total_parameters += w.num_parameters() * count;
    info_.linear_layers[std::string(weight_format_name(w.format))] += count;
  }

  void match_linear(const LinearSpec& spec, bool tied_embeddings) {
    if (spec.role == LinearRole::kLmHead && tied_embeddings && tensors_.find(spec.module + ".weight") == nullptr) {
      info_.linear_layers["bf16"] += 1;  // the tied head reuses embed_tokens, already counted
      return;
    }
    auto w = linear_weight_resolve(tensors_, spec.module, spec.out_features, spec.in_features);
    if (!w) return problem("{}", w.error().message);
    if (spec.has_bias && w->bias == nullptr) return problem("tensor '{}.bias' is missing", spec.module);
    add_linear(*w, 1);
    check_exclusion(*w);
  }

  void match_experts(const ExpertGroupSpec& g) {
    const int64_t h = g.hidden, i = g.intermediate, e = g.num_experts;
    const TensorView* gate_up = tensors_.find(g.prefix + ".gate_up_proj");
    if (gate_up != nullptr) return match_fused_experts(g, *gate_up);
    for (int64_t x = 0; x < e; ++x) {
      for (auto [name, out, in] : {std::tuple{"gate_proj", i, h}, {"up_proj", i, h}, {"down_proj", h, i}}) {
        auto w = linear_weight_resolve(tensors_, fmt::format("{}.{}.{}", g.prefix, x, name), out, in);
        if (!w) {
          problem("{}", w.error().message);
          continue;
        }
        add_linear(*w, 1);
        check_exclusion(*w);
      }
    }
  }

  void match_fused_experts(const ExpertGroupSpec& g, const TensorView& gate_up) {
    const int64_t h = g.hidden, i = g.intermediate, e = g.num_experts;
    const TensorView* down = tensors_.find(g.prefix + ".down_proj");
    const std::vector<int64_t> gate_up_shape{e, 2 * i, h}, down_shape{e, h, i};
    if (gate_up.shape != gate_up_shape || !is_float_dtype(gate_up.dtype)) {
      return problem("tensor '{}' must be a float tensor {}, found {} {}", gate_up.name, shape_string(gate_up_shape),
                     dtype_name(gate_up.dtype), shape_string(gate_up.shape));
    }
    if (down == nullptr) return problem("tensor '{}.down_proj' {} is missing", g.prefix, shape_string(down_shape));
    if (down->shape != down_shape || down->dtype != gate_up.dtype) {
      return problem("tensor '{}' must be {} {}, found {} {}", down->name, dtype_name(gate_up.dtype),
                     shape_string(down_shape), dtype_name(down->dtype), shape_string(down->shape));
    }
    consume(gate_up);
    consume(*down);
    info_.total_parameters += gate_up.numel() + down->numel();
    const std::string format = gate_up.dtype == DType::kBF16 ? "bf16" : gate_up.dtype == DType::kF16 ? "f16" : "f32";
    info_.linear_layers[format] += 3 * e;
  }

  // The exclude list is a cross-check only: the files decide (docs/model-specs.md §1.1).
  void check_exclusion(const LinearWeight& w) {
    if (!info_.quant) return;
    const bool excluded = info_.quant->is_excluded(w.module);
    if (w.format == WeightFormat::kNvfp4 && excluded) {
      note("'{}' is stored as NVFP4 although the quantization config excludes it", w.module);
    } else if (w.format != WeightFormat::kNvfp4 && !excluded && info_.quant->quant_algo.find("NVFP4") != std::string::npos) {
      note("'{}' is stored as {} although the quantization config does not exclude it", w.module,
           weight_format_name(w.format));
    }
  }

  void classify_leftover(const TensorView& t, const WeightSchema& schema) {
    if (consumed_.contains(t.name)) return;
    for (size_t k = 0; k < schema.skipped_prefixes.size(); ++k) {
      if (t.name.starts_with(schema.skipped_prefixes[k])) {
        info_.skipped_bytes += static_cast<int64_t>(t.data.size());
        skipped_reasons_.insert(schema.skipped_reasons[k]);
        return;
      }
    }
    problem("tensor '{}' {} {} is not part of a {} model", t.name, dtype_name(t.dtype), shape_string(t.shape),
            architecture_name(info_.config.architecture));
  }

  template <class... Args>
  void problem(fmt::format_string<Args...> f, Args&&... args) {
    info_.problems.push_back(fmt::format(f, std::forward<Args>(args)...));
  }
  template <class... Args>
  void note(fmt::format_string<Args...> f, Args&&... args) {
    if (info_.notes.size() < 20) info_.notes.push_back(fmt::format(f, std::forward<Args>(args)...));
  }

  const SafetensorsSet& tensors_;
  ModelInfo& info_;
  std::set<std::string> consumed_;
  std::set<std::string> skipped_reasons_;
};

void count_layers(ModelInfo& info) {
  const ModelConfig& c = info.config;
  const bool fp8_latent = c.attention == AttentionKind::kMla && c.kv_lora_rank % kLatentFp8Tile == 0;
  if (fp8_latent) info.kv_bytes_per_token_fp8 = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const bool linear = c.layer_types[static_cast<size_t>(i)] == LayerType::kLinearAttention;
    (linear ? info.linear_attention_layers : info.full_attention_layers)++;
    (c.is_moe_layer(i) ? info.moe_layers : info.dense_mlp_layers)++;
    if (linear) {  // conv state over the q, k and v channels (bf16), the recurrent state per value head (fp32)
      const int64_t channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim +
                               c.linear_num_value_heads * c.linear_value_head_dim;
      info.state_bytes_per_sequence += channels * (c.linear_conv_kernel_dim - 1) * 2 +
                                       c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4;
    } else if (c.attention == AttentionKind::kMla) {
      // A layer with its own DSA indexer caches its key too (a "shared" one reuses another layer's selection).
      const bool own_indexer = c.index_topk > 0 && (c.indexer_types.empty() ||
                                                    c.indexer_types[static_cast<size_t>(i)] == IndexerType::kFull);
      const int64_t key = own_indexer ? c.index_head_dim * 2 : 0;
      info.kv_bytes_per_token += (c.kv_lora_rank + c.qk_rope_head_dim) * 2 + key;
      if (fp8_latent) *info.kv_bytes_per_token_fp8 += latent_fp8_bytes(c.kv_lora_rank, c.qk_rope_head_dim) + key;
    } else {
      info.kv_bytes_per_token += 2 * c.num_key_value_heads * c.head_dim * 2;
    }
  }
}

}  // namespace

Expected<ModelInfo> model_info_inspect(const std::filesystem::path& model_dir) {
  ModelInfo info;
  info.model_dir = model_dir;
  TERN_ASSIGN_OR_RETURN(info.config, model_config_load(model_dir));
  TERN_ASSIGN_OR_RETURN(info.quant, quant_config_load(model_dir));
  TERN_ASSIGN_OR_RETURN(SafetensorsSet tensors, SafetensorsSet::open_dir(model_dir));
  info.num_files = static_cast<int64_t>(tensors.num_files());
  info.num_tensors = static_cast<int64_t>(tensors.tensors().size());
  info.text_prefix = weight_schema_text_prefix(tensors);
  count_layers(info);

  const WeightSchema schema = weight_schema_build(info.config, info.text_prefix);
  Matcher matcher(tensors, info);
  matcher.match(schema);
  for (const std::string& reason : matcher.skipped_reasons()) info.notes.push_back("skipped: " + reason);

  info.active_parameters = info.total_parameters;
  for (const ExpertGroupSpec& g : schema.expert_groups) {
    info.active_parameters -= (g.num_experts - info.config.num_experts_per_tok) * g.parameters_per_expert();
  }
  for (const char* format : {"nvfp4", "bf16"}) info.linear_layers.try_emplace(format, 0);
  return info;
}

namespace {

std::string human_count(int64_t n) {
  if (n >= 1'000'000'000) return fmt::format("{:.2f} B", n / 1e9);
  if (n >= 1'000'000) return fmt::format("{:.2f} M", n / 1e6);
  if (n >= 1'000) return fmt::format("{:.2f} K", n / 1e3);
  return fmt::format("{}", n);
}

std::string human_bytes(int64_t n) {
  if (n >= (int64_t{1} << 30)) return fmt::format("{:.2f} GiB", n / double(int64_t{1} << 30));
  if (n >= (int64_t{1} << 20)) return fmt::format("{:.2f} MiB", n / double(int64_t{1} << 20));
  return fmt::format("{:.1f} KiB", n / 1024.0);
}

// Per-token sizes: bytes below 10 KiB, else KiB.
std::string token_bytes(int64_t n) {
  return n < 10 * 1024 ? fmt::format("{} B", n) : fmt::format("{:.1f} KiB", n / 1024.0);
}

std::string cache_summary(const ModelInfo& info) {
  const ModelConfig& c = info.config;
  std::string s = fmt::format("{} per token over {} {} layers", token_bytes(info.kv_bytes_per_token),
                              info.full_attention_layers, c.attention == AttentionKind::kMla ? "MLA" : "attention");
  s += c.attention == AttentionKind::kMla ? " (latent and DSA key, bf16)" : " (bf16 K and V)";
  if (info.kv_bytes_per_token_fp8) {
    s += fmt::format("; {} with --kv-cache-dtype fp8_e4m3", token_bytes(*info.kv_bytes_per_token_fp8));
  }
  if (info.state_bytes_per_sequence > 0) {
    s += fmt::format("; {} of Gated DeltaNet state per sequence", human_bytes(info.state_bytes_per_sequence));
  }
  return s;
}

// ", yarn x4 over 32768 positions" for a scaled RoPE; nothing for the default one.
std::string rope_scaling_summary(const RopeConfig& r) {
  if (r.type == "default") return "";
  if (r.original_max_position_embeddings > 0) {
    return fmt::format(", {} RoPE x{:g} over {} positions", r.type, r.factor, r.original_max_position_embeddings);
  }
  return fmt::format(", {} RoPE x{:g}", r.type, r.factor);
}

std::string attention_summary(const ModelConfig& c) {
  if (c.attention == AttentionKind::kMla) {
    return fmt::format("MLA, {} heads, q_lora {} kv_lora {}, qk {}+{} (rope), v {}{}", c.num_attention_heads,
                       c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                       rope_scaling_summary(c.rope));
  }
  return fmt::format("{}{} heads, {} KV heads, head dim {}, rotary dim {}, theta {:g}{}",
                     c.attention == AttentionKind::kGatedGqa ? "gated, " : "", c.num_attention_heads,
                     c.num_key_value_heads, c.head_dim, c.rope.rotary_dim, c.rope.theta, rope_scaling_summary(c.rope));
}

}  // namespace

nlohmann::ordered_json model_info_to_json(const ModelInfo& info) {
  const ModelConfig& c = info.config;
  nlohmann::ordered_json j;
  j["model_dir"] = info.model_dir.string();
  j["architecture"] = std::string(architecture_name(c.architecture));
  j["model_type"] = c.model_type;
  j["text_prefix"] = info.text_prefix;
  j["layers"] = {{"total", c.num_hidden_layers},
                 {"full_attention", info.full_attention_layers},
                 {"linear_attention", info.linear_attention_layers},
                 {"moe", info.moe_layers},
                 {"dense_mlp", info.dense_mlp_layers}};
  j["experts"] = {{"num_experts", c.num_experts}, {"top_k", c.num_experts_per_tok}};
  j["parameters"] = {{"total", info.total_parameters}, {"active_per_token", info.active_parameters}};
  nlohmann::ordered_json linear = {{"nvfp4", info.linear_layers.at("nvfp4")}, {"bf16", info.linear_layers.at("bf16")}};
  for (const auto& [format, count] : info.linear_layers) {
    if (!linear.contains(format)) linear[format] = count;
  }
  j["linear_layers"] = linear;
  j["memory"] = {{"weight_bytes", info.weight_bytes}, {"skipped_bytes", info.skipped_bytes}};
  j["cache"] = {{"kv_bytes_per_token", info.kv_bytes_per_token},
                {"kv_bytes_per_token_fp8", info.kv_bytes_per_token_fp8 ? nlohmann::ordered_json(
                                                                             *info.kv_bytes_per_token_fp8)
                                                                       : nlohmann::ordered_json()},
                {"state_bytes_per_sequence", info.state_bytes_per_sequence}};
  j["files"] = {{"safetensors", info.num_files}, {"tensors", info.num_tensors}};
  if (info.quant) {
    j["quantization"] = {{"method", "modelopt"},
                         {"quant_algo", info.quant->quant_algo},
                         {"group_size", info.quant->group_size},
                         {"source", info.quant->source}};
  } else {
    j["quantization"] = nullptr;
  }
  j["problems"] = info.problems;
  j["notes"] = info.notes;
  return j;
}

std::string model_info_to_text(const ModelInfo& info) {
  const ModelConfig& c = info.config;
  std::string s;
  auto line = [&](std::string_view key, const std::string& value) { s += fmt::format("{:<16}{}\n", key, value); };
  line("model", info.model_dir.string());
  line("architecture", fmt::format("{} (text model under '{}')", architecture_name(c.architecture), info.text_prefix));
  std::string layers = fmt::format("{}", c.num_hidden_layers);
  if (info.linear_attention_layers > 0) {
    layers += fmt::format(": {} linear-attention (Gated DeltaNet) + {} full-attention", info.linear_attention_layers,
                          info.full_attention_layers);
  }
  layers += fmt::format("; {} MoE + {} dense MLP", info.moe_layers, info.dense_mlp_layers);
  line("layers", layers);
  line("attention", attention_summary(c));
  if (c.num_experts > 0) {
    line("experts", fmt::format("{} routed, top-{}, expert width {}{}", c.num_experts, c.num_experts_per_tok,
                                c.moe_intermediate_size,
                                c.shared_expert_intermediate_size > 0 || c.n_shared_experts > 0 ? ", shared expert"
                                                                                                : ""));
  }
  line("vocabulary", fmt::format("{}, hidden size {}", c.vocab_size, c.hidden_size));
  line("parameters", fmt::format("{} total, {} active per token", human_count(info.total_parameters),
                                 human_count(info.active_parameters)));
  std::vector<std::string> formats;
  int64_t n_linear = 0;
  for (const auto& [format, count] : info.linear_layers) {
    n_linear += count;
    if (count > 0) formats.push_back(fmt::format("{} {}", count, format));
  }
  line("linear layers", fmt::format("{}: {}", n_linear, fmt::join(formats, ", ")));
  line("quantization", info.quant ? fmt::format("ModelOpt {} (group {}), from {}", info.quant->quant_algo,
                                                info.quant->group_size, info.quant->source)
                                  : "none");
  line("memory", fmt::format("{} of weights as stored{}", human_bytes(info.weight_bytes),
                             info.skipped_bytes ? fmt::format(" (+{} skipped)", human_bytes(info.skipped_bytes)) : ""));
  line("cache", cache_summary(info));
  for (const std::string& n : info.notes) line("note", n);
  if (info.problems.empty()) line("problems", "none");
  for (const std::string& p : info.problems) line("problem", p);
  return s;
}

}  // namespace tern
