#include "models/selftest_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "layers/attention.h"
#include "layers/block_ops.h"
#include "layers/gated_deltanet.h"
#include "layers/mla.h"
#include "layers/moe.h"
#include "layers/norms.h"
#include "ops/attention_op.h"
#include "ops/elementwise_op.h"
#include "ops/gdn_op.h"
#include "ops/gemm_op.h"
#include "ops/mla_op.h"
#include "ops/moe_op.h"
#include "ops/sampling_op.h"
#include "ops/silu_gemv_op.h"

namespace tern {
namespace {

using Shapes = std::set<std::pair<int64_t, int64_t>>;  // {N, K}

RmsNormForm form_of(const RmsNorm& n) {
  return n.zero_centred ? RmsNormForm::kZeroCentred : RmsNormForm::kPlain;
}

// A BlockOps that makes no blocks: each placement records the cases the block's ops need on a GPU.
class Planner final : public BlockOps {
 public:
  Planner(std::vector<int64_t> batches, int64_t verify_rows) : batches_(std::move(batches)), verify_rows_(verify_rows) {
    gemm_rows_ = batches_;
    for (int64_t b : batches_) {
      if (verify_rows_ > 0 && std::find(gemm_rows_.begin(), gemm_rows_.end(), b * verify_rows_) == gemm_rows_.end()) {
        gemm_rows_.push_back(b * verify_rows_);
      }
    }
  }

  Expected<std::unique_ptr<Block>> embedding(const CpuMatrix& table, VocabRange) override {
    hidden_ = table.cols;
    for (int64_t b : batches_) add("embedding", embedding_case(b, table.rows, table.cols));
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> attention(const RmsNorm& norm, const Attention& a) override {
    block_norm(norm);
    const AttentionShape& s = a.shape();
    const RmsNorm& q_norm = a.weights().q_norm;
    add("rms_norm", rms_norm_case(batches_.front(), s.n_heads, s.head_dim, form_of(q_norm), false));
    // The CPU path's RoPE is the NeoX (rotate-half) layout.
    add("rope", rope_case(batches_.front(), s.n_heads, s.head_dim, a.rope().rotary_dim(), false,
                          static_cast<int64_t>(a.rope().theta())));
    for (int64_t b : batches_) {
      add("attention", attention_case(b, 1, 1000, s.n_heads, s.n_kv_heads, s.head_dim, s.gated));
      if (verify_rows_ > 0) {
        add("attention", attention_case(b, verify_rows_, 1000, s.n_heads, s.n_kv_heads, s.head_dim, s.gated));
      }
    }
    add("attention", attention_case(2, kPrefill, 0, s.n_heads, s.n_kv_heads, s.head_dim, s.gated));
    projections(a.input_projections());
    linear(a.weights().o_proj);
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> gated_deltanet(const RmsNorm& norm, const GatedDeltaNet& g) override {
    block_norm(norm);
    const GatedDeltaNetShape& s = g.shape();
    const int64_t channels = 2 * s.n_key_heads * s.key_dim + s.n_value_heads * s.value_dim;
    add("rms_norm", rms_norm_case(batches_.front(), s.n_value_heads, s.value_dim, RmsNormForm::kGated, false));
    for (int64_t b : batches_) {
      add("gdn_conv", gdn_conv_case(b, 1, channels, s.conv_kernel));
      add("gdn_delta_rule", gdn_delta_rule_case(b, 1, s.n_key_heads, s.n_value_heads, s.key_dim, s.value_dim));
    }
    // Speculative verifications: each row's state also kept (GdnSequences::row_slots).
    if (verify_rows_ > 0) {
      for (int64_t b : batches_) {
        add("gdn_conv", gdn_conv_case(b, verify_rows_, channels, s.conv_kernel, true));
        add("gdn_delta_rule",
            gdn_delta_rule_case(b, verify_rows_, s.n_key_heads, s.n_value_heads, s.key_dim, s.value_dim, true));
      }
    }
    add("gdn_conv", gdn_conv_case(2, kPrefill, channels, s.conv_kernel));
    // The gated norm in the recurrent kernel, as the model runs it: one sequence, one token.
    add("gdn_delta_rule_norm", gdn_delta_rule_case(1, 1, s.n_key_heads, s.n_value_heads, s.key_dim, s.value_dim));
    add("gdn_delta_rule", gdn_delta_rule_case(2, kPrefill, s.n_key_heads, s.n_value_heads, s.key_dim, s.value_dim));
    projections(g.input_projections());
    linear(g.weights().out_proj);
    return nullptr;
  }
  // GLM-5 / DeepSeek-V3 in the weight-absorbed form, as CudaOps runs it.
  Expected<std::unique_ptr<Block>> mla(const RmsNorm& norm, const MlaAttention& a) override {
    block_norm(norm);
    const MlaShape& s = a.shape();
    const MlaWeights& w = a.weights();
    const bool q_lora = s.q_lora_rank > 0, indexer = s.index_topk > 0 && w.indexer.has_value();
    // The query LoRA's norm, and the latent's (which a GPU runs inside its latent-cache write; tested as the norm op).
    if (q_lora) add("rms_norm", rms_norm_case(batches_.front(), 1, s.q_lora_rank, form_of(w.q_a_norm), false));
    add("rms_norm", rms_norm_case(batches_.front(), 1, s.kv_lora_rank, form_of(w.kv_a_norm), false));
    // Attention over the latent cache: causal without DSA, else over each row's selection. The fp64 reference costs
    // rows x heads x keys x latent, and a row selects a strict subset only with more keys than topk, so a large
    // index_topk (GLM-5's 2048) is tested at 256 keys selected out of 1000 and more: the kernel walks a selection
    // list the same way at any length.
    const int64_t qk = s.qk_nope_head_dim + s.qk_rope_head_dim;
    const int64_t topk = s.index_topk > 0 ? std::min<int64_t>(s.index_topk, 256) : 0;
    // The cache's form: bf16, or FP8 entries with the model's tile scales.
    const MlaCacheCase cache = !s.latent_fp8                             ? MlaCacheCase::kBf16
                               : *s.latent_fp8 == LatentFp8Scales::kPow2 ? MlaCacheCase::kFp8Pow2
                                                                         : MlaCacheCase::kFp8;
    for (int64_t b : batches_) {
      add("mla_attention",
          mla_attention_case(b, 1, 1000, s.n_heads, s.kv_lora_rank, s.qk_rope_head_dim, topk, qk, cache));
    }
    // A prefill chunk; with DSA starting kPrefill / 2 tokens short of topk, so that its first rows list every key and
    // the later ones select.
    add("mla_attention", mla_attention_case(2, kPrefill, std::max<int64_t>(0, topk - kPrefill / 2), s.n_heads,
                                            s.kv_lora_rank, s.qk_rope_head_dim, topk, qk, cache));
    // The projections as CudaOps groups them: [q_a_proj (or q_proj) | kv_a_proj | the indexer's wk | weights_proj]
    // over the block's normed input, and [q_b_proj | the indexer's wq_b] over the normed q_a output (no norm fused).
    std::vector<const Linear*> in_parts{q_lora ? &w.q_a_proj : &w.q_proj, &w.kv_a_proj}, q_parts;
    if (q_lora) q_parts.push_back(&w.q_b_proj);
    if (indexer) {
      const MlaIndexerWeights& ix = *w.indexer;
      in_parts.push_back(&ix.wk);
      in_parts.push_back(&ix.weights_proj);
      q_parts.push_back(&ix.wq_b);
      // The lightning indexer's top-k at the model's index_topk: decode rows with more keys than it, and a prefill
      // chunk whose first rows have no more than it.
      const int64_t past = std::max<int64_t>(1000, 2 * s.index_topk);
      for (int64_t b : batches_) {
        add("indexer_select", indexer_select_case(b, 1, past, s.index_heads, s.index_head_dim, s.index_topk));
      }
      add("indexer_select", indexer_select_case(1, kPrefill, std::max<int64_t>(0, s.index_topk - kPrefill / 2),
                                                s.index_heads, s.index_head_dim, s.index_topk));
      // One long row: a GPU spreads the top-k of a few rows this long over several blocks (a thread-block cluster
      // exchanging histograms, kernels/cuda/mla/indexer_launch.h), a path the short rows above never take.
      add("indexer_select", indexer_select_case(1, 1, kLongRowKeys, s.index_heads, s.index_head_dim, s.index_topk));
    }
    projections(in_parts);
    int64_t q_n = 0, q_count = 0, q_fp8_n = 0, q_fp8_count = 0;
    for (const Linear* l : q_parts) {
      linear(*l);
      if (is_fp8(*l)) {
        q_fp8_n += l->out_features();
        ++q_fp8_count;
      }
      if (!is_bf16(*l)) continue;
      q_n += l->out_features();
      ++q_count;
    }
    if (q_count > 1) bf16_.insert({q_n, q_parts.front()->in_features()});
    if (q_fp8_count > 1) fp8_.insert({q_fp8_n, q_parts.front()->in_features()});
    linear(w.o_proj);
    // The per-head products around the attention (W_UK^T of each head's q_nope, W_UV of its latent output) are
    // batched gemm_bf16 calls over strided heads; the gemm_bf16 op's harness has no batch, so they have no case here.
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> mlp(const RmsNorm& norm, const Mlp& m) override {
    block_norm(norm);
    const MlpWeights& w = m.weights();
    for (int64_t b : batches_) add("silu_mul", silu_mul_case(b, w.gate_proj.out_features()));
    projections(m.input_projections());
    silu_down(w.down_proj);
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> moe(const RmsNorm& norm, const Moe& m) override {
    block_norm(norm);
    const MoeWeights& w = m.weights();
    if (w.experts.empty()) return make_error("{}: an MoE block without experts", w.router.name());
    const int64_t hidden = w.router.in_features(), inter = w.experts.front().gate_proj.out_features(),
                  top_k = m.shape().top_k;
    const Linear& gate = w.experts.front().gate_proj;
    const MoeCaseFormat format = is_nvfp4(gate) ? MoeCaseFormat::kNvfp4
                                 : is_fp8(gate) ? MoeCaseFormat::kFp8
                                                : MoeCaseFormat::kBf16;
    const bool shared = w.shared_expert != nullptr;
    // The block's router (softmax, or GLM-5 / DeepSeek-V3's sigmoid with its groups and correction bias) and how
    // its shared expert is added.
    const MoeShape& s = m.shape();
    // Under expert parallelism, this rank's share of the router's experts.
    const MoeCaseRouting routing{.sigmoid = s.sigmoid,
                                 .n_group = s.sigmoid ? s.n_group : 1,
                                 .topk_group = s.sigmoid ? s.topk_group : 1,
                                 .correction_bias = s.sigmoid && !w.correction_bias.empty(),
                                 .shared_gate = s.shared_gate,
                                 .expert_begin = w.first_expert,
                                 .local_experts = static_cast<int64_t>(w.experts.size())};
    for (int64_t b : batches_) add("silu_mul", silu_mul_case(b * top_k, inter));
    // The decode batches, then a prefill chunk (past the decode kernels' token limit: the grouped prefill GEMM).
    for (int64_t b : batches_) {
      add("moe", moe_case(b, hidden, inter, w.router.out_features(), top_k, format, shared, routing));
    }
    add("moe", moe_case(kPrefill, hidden, inter, w.router.out_features(), top_k, format, shared, routing));
    projections(m.input_projections());
    if (w.shared_expert) silu_down(w.shared_expert->weights().down_proj);
    Shapes& experts = format == MoeCaseFormat::kNvfp4 ? nvfp4_ : format == MoeCaseFormat::kFp8 ? fp8_ : bf16_;
    experts.insert({inter, hidden});
    experts.insert({hidden, inter});
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> lm_head(const RmsNorm&, const Linear& head, VocabRange) override {
    linear(head);
    if (is_bf16(head)) normed_.insert({head.out_features(), head.in_features()});
    for (int64_t rows : {1, 8}) add("sampling", sampling_case(rows, head.out_features()));
    return nullptr;
  }
  // The draft module's fc; its norms are the model's kind (rms_norm's cases already cover the hidden width).
  Expected<std::unique_ptr<Block>> draft_input(const RmsNorm&, const RmsNorm&, const Linear& fc) override {
    linear(fc);
    return nullptr;
  }
  Expected<void> trace_output(std::string_view) override { return {}; }

  // The GEMM ops last: their cases are the shapes every block reported, lead first.
  SelftestCaseTable finish() {
    const auto bf16 = selftest_lead_first({bf16_.begin(), bf16_.end()});
    const auto fp4 = selftest_lead_first({nvfp4_.begin(), nvfp4_.end()});
    if (!bf16.empty()) table_.push_back({"gemm_bf16", gemm_selftest_cases(bf16, gemm_rows_)});
    // The norm in front of the decode GEMV (one row), on every projection that follows a norm; the first layer's
    // has no residual to add.
    const auto normed = selftest_lead_first({normed_.begin(), normed_.end()});
    for (auto [n, k] : normed) add("rms_norm_gemv", rms_norm_gemv_case(n, k, form_, true));
    if (!normed.empty()) add("rms_norm_gemv", rms_norm_gemv_case(normed[0].first, normed[0].second, form_, false));
    for (auto [n, k] : selftest_lead_first({silu_.begin(), silu_.end()})) {
      add("silu_mul_gemv", silu_mul_gemv_case(n, k));
    }
    // A verification of one sequence runs the SiLU GEMV over its rows where the device's GEMV takes a few rows.
    if (verify_rows_ > 0) {
      for (auto [n, k] : silu_) add("silu_mul_gemv", silu_mul_gemv_case(n, k, verify_rows_));
    }
    if (!fp4.empty()) table_.push_back({"gemm_nvfp4", quantized_gemm_cases(fp4)});
    // The dense NVFP4 GEMMs again with their activations quantized (W4A4), which a device with FP4 tensor cores may
    // run instead (selftest_fallback_of); the routed experts have no W4A4 kernel.
    const auto w4a4 = selftest_lead_first({w4a4_.begin(), w4a4_.end()});
    if (!w4a4.empty()) table_.push_back({"gemm_nvfp4_w4a4", gemm_selftest_cases(w4a4, gemm_rows_)});
    const auto fp8 = selftest_lead_first({fp8_.begin(), fp8_.end()});
    if (!fp8.empty()) table_.push_back({"gemm_fp8", quantized_gemm_cases(fp8)});
    return std::move(table_);
  }

  // A quantized GEMM's cases: every shape at the GEMM rows, and the lead shape at the rows the batch kernel runs with
  // four and with eight token tiles (kernels/cuda/gemm/weight_batch.cuh), where a server batches that many rows.
  std::vector<SelfTestCase> quantized_gemm_cases(const std::vector<std::pair<int64_t, int64_t>>& shapes) const {
    std::vector<SelfTestCase> cases = gemm_selftest_cases(shapes, gemm_rows_);
    for (int64_t rows : {kBatchKernelRows, 2 * kBatchKernelRows}) {
      if (std::find(gemm_rows_.begin(), gemm_rows_.end(), rows) != gemm_rows_.end()) continue;
      cases.push_back(gemm_selftest_cases({shapes.front()}, {rows}).front());
    }
    return cases;
  }

 private:
  static constexpr int64_t kPrefill = 128;
  static constexpr int64_t kLongRowKeys = 32768;
  static constexpr int64_t kBatchKernelRows = 32;

  // A case once per op, in the order reported.
  void add(const std::string& op, SelfTestCase c) {
    auto it = std::find_if(table_.begin(), table_.end(), [&](const auto& e) { return e.first == op; });
    if (it == table_.end()) {
      table_.push_back({op, {std::move(c)}});
      return;
    }
    const bool seen =
        std::any_of(it->second.begin(), it->second.end(), [&](const SelfTestCase& x) { return x.dims == c.dims; });
    if (!seen) it->second.push_back(std::move(c));
  }
  // The decoder norm in front of a block: the residual add and the norm, at every batch size.
  void block_norm(const RmsNorm& norm) {
    form_ = form_of(norm);
    for (int64_t b : batches_) add("rms_norm", rms_norm_case(b, 1, hidden_, form_, true));
  }
  void linear(const Linear& l) {
    (is_nvfp4(l) ? nvfp4_ : is_fp8(l) ? fp8_ : bf16_).insert({l.out_features(), l.in_features()});
    if (is_nvfp4(l)) w4a4_.insert({l.out_features(), l.in_features()});
  }
  // Each part at its own shape, and each run of parts a device computes as one GEMM (layers/linear.h
  // projection_runs, as DeviceWeights::projection stacks them) at the run's shape; a first run in BF16 is also the
  // GEMV a decode step may fuse the block's norm into (cuda_ops.cc norm_project).
  void projections(const std::vector<const Linear*>& parts) {
    for (const Linear* l : parts) linear(*l);
    const int64_t k = parts.front()->in_features();
    const std::vector<ProjectionRun> runs = projection_runs(parts);
    for (const ProjectionRun& r : runs) {
      if (r.end - r.begin == 1 && r.rows == parts[r.begin]->out_features()) continue;  // the part's own shape
      switch (r.kind) {
        case LinearKind::kNvfp4:
        case LinearKind::kW4a4:
          nvfp4_.insert({r.rows, k});
          w4a4_.insert({r.rows, k});
          break;
        case LinearKind::kFp8: fp8_.insert({r.rows, k}); break;
        case LinearKind::kBf16: bf16_.insert({r.rows, k}); break;
      }
    }
    if (runs.front().kind == LinearKind::kBf16) normed_.insert({runs.front().rows, k});
  }
  // A down projection that reads a SiLU-and-mul (dense MLPs, shared experts).
  void silu_down(const Linear& down) {
    linear(down);
    if (is_bf16(down)) silu_.insert({down.out_features(), down.in_features()});
  }

  std::vector<int64_t> batches_;
  int64_t verify_rows_ = 0;
  std::vector<int64_t> gemm_rows_;  // the GEMMs' rows: the batches, then each batch's verification rows
  int64_t hidden_ = 0;
  RmsNormForm form_ = RmsNormForm::kPlain;
  Shapes bf16_, nvfp4_, fp8_, normed_, silu_;
  Shapes w4a4_;  // the dense NVFP4 GEMMs (not the routed experts')
  SelftestCaseTable table_;
};

// Why no implementation of a selection's op was chosen: each candidate's reason.
std::string unchosen_reasons(const Selection& s) {
  std::string why;
  for (const CandidateReport& c : s.candidates) {
    why += fmt::format("{}{}: {}", why.empty() ? "" : "; ", c.name, c.reason.empty() ? "failed" : c.reason);
  }
  return why.empty() ? std::string("no implementation for this device") : why;
}

}  // namespace

Expected<Nvfp4ActivationsChoice> nvfp4_activations_of(const std::string& requested, bool cuda, bool mla,
                                                     std::span<const Selection> selections) {
  using enum Nvfp4Activations;
  if (requested == "dequantize") return Nvfp4ActivationsChoice{kDequantize, "W4A16 (--nvfp4-activations dequantize)"};
  if (requested != "auto" && requested != "quantize") {
    return make_error("--nvfp4-activations '{}': expected auto, dequantize or quantize", requested);
  }
  const bool quantize = requested == "quantize";
  if (!cuda) {
    return quantize ? Nvfp4ActivationsChoice{kQuantize, "W4A4 on every NVFP4 layer (--nvfp4-activations quantize)"}
                    : Nvfp4ActivationsChoice{kDequantize, "W4A16 (the CPU's default; --nvfp4-activations quantize "
                                                          "quantizes the activations)"};
  }
  if (mla && !quantize) {
    return Nvfp4ActivationsChoice{kDequantize, "W4A16 (W4A4 is not supported for MLA models yet)"};
  }
  const auto it = std::find_if(selections.begin(), selections.end(),
                               [](const Selection& s) { return s.op == "gemm_nvfp4_w4a4"; });
  std::string unverified;
  if (it == selections.end()) {
    unverified = "the self-test did not run gemm_nvfp4_w4a4 (no dense NVFP4 layer, or --selftest off)";
  } else if (it->chosen != "fp4-native") {
    unverified = fmt::format("gemm_nvfp4_w4a4 has no verified FP4 tensor-core implementation here ({})",
                             it->chosen.empty() ? unchosen_reasons(*it) : "chose " + it->chosen);
  }
  if (quantize) {
    if (!unverified.empty()) {
      return make_error("--nvfp4-activations quantize: {}; use auto (W4A16 on this GPU) or dequantize", unverified);
    }
    return Nvfp4ActivationsChoice{kQuantize, "W4A4 on every NVFP4 layer on the FP4 tensor cores (--nvfp4-activations "
                                             "quantize; gemm_nvfp4_w4a4 fp4-native verified)"};
  }
  if (!unverified.empty()) return Nvfp4ActivationsChoice{kDequantize, "W4A16: " + unverified};
  return Nvfp4ActivationsChoice{kQuantizeDense, "W4A4 on the FP4 tensor cores for the dense NVFP4 layers "
                                                "(gemm_nvfp4_w4a4 fp4-native verified); the routed experts W4A16 (no "
                                                "W4A4 expert kernel yet)"};
}

bool selftest_has_nvfp4(std::span<const Selection> selections) {
  return std::any_of(selections.begin(), selections.end(), [](const Selection& s) { return s.op == "gemm_nvfp4"; });
}

std::string selftest_fallback_of(const std::string& op) { return op == "gemm_nvfp4_w4a4" ? "gemm_nvfp4" : ""; }

std::vector<std::pair<int64_t, int64_t>> selftest_lead_first(const std::vector<std::pair<int64_t, int64_t>>& shapes) {
  // `--selftest fast` runs each op's first case only, and its time decides between implementations: on a
  // microsecond-long kernel that choice was noise (see docs/perf/gpu.md §lead-case).
  constexpr int64_t kLeadMaxElements = int64_t{1} << 26;
  std::vector<std::pair<int64_t, int64_t>> out = shapes;
  auto lead = out.begin();
  for (auto it = out.begin(); it != out.end(); ++it) {
    const int64_t size = it->first * it->second, best = lead->first * lead->second;
    if (size <= kLeadMaxElements && (size > best || best > kLeadMaxElements)) lead = it;
  }
  if (!out.empty()) std::rotate(out.begin(), lead, lead + 1);
  return out;
}

Expected<SelftestCaseTable> selftest_cases_of(const CausalLm& model, const std::vector<int64_t>& batches,
                                              int64_t verify_rows) {
  if (batches.empty()) return make_error("the self-test needs at least one batch size");
  if (verify_rows < 0) return make_error("the self-test's verification rows ({}) must not be negative", verify_rows);
  Planner planner(batches, verify_rows);
  TERN_TRY(model.visit_blocks(planner, verify_rows > 0 && model.draft != nullptr));
  return planner.finish();
}

}  // namespace tern
