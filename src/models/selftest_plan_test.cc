// The self-test cases a model's blocks report (models/selftest_plan.h), checked against what the fixtures'
// config.json implies, computed here from the config's numbers: the fused GEMMs the CUDA blocks run, the norm-fused
// and SiLU-fused GEMVs, the attention, GDN and MoE cases at the model's head counts and widths.
#include "models/selftest_plan.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "layers/attention.h"
#include "layers/moe.h"
#include "ops/attention_op.h"
#include "ops/elementwise_op.h"
#include "ops/gdn_op.h"
#include "ops/gemm_op.h"
#include "ops/gemm_w4a4_op.h"
#include "ops/gemm_w4a4_test_util.h"
#include "ops/mla_op.h"
#include "ops/moe_op.h"
#include "ops/silu_gemv_op.h"
#include "runtime/fp8_checkpoint_test_util.h"

namespace tern {
namespace {

std::unique_ptr<CausalLm> host(const std::string& fixture, LoadFormat format = LoadFormat::kAuto) {
  auto m = model_build_host(std::string(TERN_FIXTURES_DIR) + "/" + fixture, {.load_format = format});
  EXPECT_TRUE(m.has_value()) << (m ? "" : m.error().message);
  return m ? std::move(*m) : nullptr;
}

const std::vector<SelfTestCase>* cases_of(const SelftestCaseTable& t, const std::string& op) {
  for (const auto& [name, cases] : t) {
    if (name == op) return &cases;
  }
  return nullptr;
}

bool has(const SelftestCaseTable& t, const std::string& op, const SelfTestCase& want) {
  const auto* cases = cases_of(t, op);
  return cases != nullptr &&
         std::any_of(cases->begin(), cases->end(), [&](const SelfTestCase& c) { return c.dims == want.dims; });
}

TEST(SelftestPlan, Qwen35BlocksReportTheirOpsAtTheConfigsShapes) {
  auto model = host("qwen3_5_moe");
  ASSERT_TRUE(model);
  const ModelConfig& c = model->config();
  auto table = selftest_cases_of(*model, {1, 8});
  ASSERT_TRUE(table.has_value()) << table.error().message;
  const int64_t h = c.hidden_size, hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  // Gated attention: q_proj carries [query | gate] per head, so the fused q|k|v GEMM is 2 nq hd + 2 nkv hd wide.
  // Each fused GEMM's rows end with zero rows up to a multiple of 8 (layers/linear.h).
  const int64_t qkv =
      fused_projection_rows(2 * c.num_attention_heads * c.head_dim + 2 * c.num_key_value_heads * c.head_dim);
  const int64_t gdn_in = fused_projection_rows((2 * hk * dk + hv * dv) + hv * dv + hv + hv);  // qkv | z | b | a
  const int64_t router = fused_projection_rows(2 * c.shared_expert_intermediate_size + c.num_experts + 1);
  EXPECT_TRUE(has(*table, "gemm_bf16", gemm_selftest_cases({{qkv, h}}, {1}).front()));
  EXPECT_TRUE(has(*table, "gemm_bf16", gemm_selftest_cases({{gdn_in, h}}, {8}).front()));
  EXPECT_TRUE(has(*table, "gemm_bf16", gemm_selftest_cases({{router, h}}, {1}).front()));
  for (const int64_t n : {qkv, gdn_in, router, c.vocab_size}) {
    EXPECT_TRUE(has(*table, "rms_norm_gemv", rms_norm_gemv_case(n, h, RmsNormForm::kZeroCentred, true))) << n;
  }
  EXPECT_TRUE(has(*table, "silu_mul_gemv", silu_mul_gemv_case(h, c.shared_expert_intermediate_size)));
  EXPECT_TRUE(has(*table, "attention",
                  attention_case(8, 1, 1000, c.num_attention_heads, c.num_key_value_heads, c.head_dim, true)));
  EXPECT_TRUE(has(*table, "gdn_delta_rule_norm", gdn_delta_rule_case(1, 1, hk, hv, dk, dv)));
  EXPECT_TRUE(has(*table, "gdn_conv", gdn_conv_case(2, 128, 2 * hk * dk + hv * dv, c.linear_conv_kernel_dim)));
  EXPECT_TRUE(
      has(*table, "moe", moe_case(8, h, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, false, true)));
  // A prefill chunk too (128 tokens, past the decode kernels' 64): the grouped prefill GEMM is self-tested.
  EXPECT_TRUE(
      has(*table, "moe", moe_case(128, h, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, false, true)));
  EXPECT_TRUE(has(*table, "rms_norm", rms_norm_case(1, 1, h, RmsNormForm::kZeroCentred, true)));
  EXPECT_TRUE(has(*table, "rms_norm", rms_norm_case(1, hv, dv, RmsNormForm::kGated, false)));
  EXPECT_EQ(cases_of(*table, "gemm_nvfp4"), nullptr);  // a BF16 checkpoint
  // Every op once, every case of an op once.
  std::set<std::string> ops;
  for (const auto& [op, cases] : *table) {
    EXPECT_TRUE(ops.insert(op).second) << op;
    std::set<std::vector<int64_t>> dims;
    for (const SelfTestCase& x : cases) EXPECT_TRUE(dims.insert(x.dims).second) << op << " " << x.label;
  }
}

// GLM-5's MLA blocks (the tiny fixture: 4 heads, a latent of 32 + 16, qk_head_dim 48, a DSA indexer of 16 heads of 32
// with topk 16 in every layer) report the latent attention with its selection, the indexer's top-k, both LoRA norms
// and the projections as the CUDA block groups them.
TEST(SelftestPlan, GlmMlaBlocksReportTheirOpsAtTheConfigsShapes) {
  auto model = host("glm_moe_dsa");
  ASSERT_TRUE(model);
  const ModelConfig& c = model->config();
  ASSERT_EQ(c.num_attention_heads, 4);
  ASSERT_EQ(c.kv_lora_rank, 32);
  ASSERT_EQ(c.qk_rope_head_dim, 16);
  ASSERT_EQ(c.index_n_heads, 16);
  ASSERT_EQ(c.index_head_dim, 32);
  ASSERT_EQ(c.index_topk, 16);
  auto table = selftest_cases_of(*model, {1, 8});
  ASSERT_TRUE(table.has_value()) << table.error().message;
  const int64_t h = c.hidden_size, heads = c.num_attention_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  for (const int64_t b : {1, 8}) {
    EXPECT_TRUE(has(*table, "mla_attention", mla_attention_case(b, 1, 1000, heads, 32, 16, 16, qk))) << b;
    EXPECT_TRUE(has(*table, "indexer_select", indexer_select_case(b, 1, 1000, 16, 32, 16))) << b;
  }
  // The prefill chunks start at position 0 (topk 16 is less than half a chunk of 128).
  EXPECT_TRUE(has(*table, "mla_attention", mla_attention_case(2, 128, 0, heads, 32, 16, 16, qk)));
  EXPECT_TRUE(has(*table, "indexer_select", indexer_select_case(1, 128, 0, 16, 32, 16)));
  // One decode row of 32768 keys: the top-k's path over several blocks per row on a GPU.
  EXPECT_TRUE(has(*table, "indexer_select", indexer_select_case(1, 1, 32768, 16, 32, 16)));
  // The lead case (what `--selftest fast` runs) is the one-row decode step.
  const auto* mla = cases_of(*table, "mla_attention");
  ASSERT_NE(mla, nullptr);
  EXPECT_EQ(mla->front().dims, mla_attention_case(1, 1, 1000, heads, 32, 16, 16, qk).dims);
  // The q_a and kv_a norms (both 32 wide here), one row.
  EXPECT_TRUE(has(*table, "rms_norm", rms_norm_case(1, 1, c.q_lora_rank, RmsNormForm::kPlain, false)));
  EXPECT_TRUE(has(*table, "rms_norm", rms_norm_case(1, 1, c.kv_lora_rank, RmsNormForm::kPlain, false)));
  // [q_a_proj | kv_a_proj | wk | weights_proj] over the normed input (with the norm fused in front at decode),
  // [q_b_proj | wq_b] over the normed q_a output, o_proj.
  const int64_t in_n =
      fused_projection_rows(c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim + c.index_n_heads);
  const int64_t q_n = fused_projection_rows(heads * qk + c.index_n_heads * c.index_head_dim);
  EXPECT_TRUE(has(*table, "gemm_bf16", gemm_selftest_cases({{in_n, h}}, {1}).front()));
  EXPECT_TRUE(has(*table, "rms_norm_gemv", rms_norm_gemv_case(in_n, h, RmsNormForm::kPlain, true)));
  EXPECT_TRUE(has(*table, "gemm_bf16", gemm_selftest_cases({{q_n, c.q_lora_rank}}, {8}).front()));
  EXPECT_FALSE(has(*table, "rms_norm_gemv", rms_norm_gemv_case(q_n, c.q_lora_rank, RmsNormForm::kPlain, true)));
  EXPECT_TRUE(has(*table, "gemm_bf16", gemm_selftest_cases({{h, heads * c.v_head_dim}}, {1}).front()));
  // Every op once, every case of an op once.
  std::set<std::string> ops;
  for (const auto& [op, cases] : *table) {
    EXPECT_TRUE(ops.insert(op).second) << op;
    std::set<std::vector<int64_t>> dims;
    for (const SelfTestCase& x : cases) EXPECT_TRUE(dims.insert(x.dims).second) << op << " " << x.label;
  }
}

TEST(SelftestPlan, Nvfp4ExpertsAreTestedInTheirFormat) {
  auto model = host("qwen3_5_moe_nvfp4");
  ASSERT_TRUE(model);
  const ModelConfig& c = model->config();
  auto table = selftest_cases_of(*model, {1});
  ASSERT_TRUE(table.has_value()) << table.error().message;
  const int64_t h = c.hidden_size, i = c.moe_intermediate_size;
  EXPECT_TRUE(has(*table, "gemm_nvfp4", gemm_selftest_cases({{i, h}}, {1}).front()));
  EXPECT_TRUE(has(*table, "gemm_nvfp4", gemm_selftest_cases({{h, i}}, {1}).front()));
  EXPECT_TRUE(has(*table, "moe", moe_case(1, h, i, c.num_experts, c.num_experts_per_tok, true, true)));
}

// Under expert parallelism a rank's MoE cases are its share of the router's experts, whole (rank 1 of 2: experts
// 4..7 of the fixture's 8, at the full expert width), so the self-test runs the kernels as that rank does.
TEST(SelftestPlan, ExpertParallelRanksTestTheirShareOfTheExperts) {
  auto model = model_build_host(std::string(TERN_FIXTURES_DIR) + "/qwen3_5_moe_nvfp4", {.shard = {1, 2, true}});
  ASSERT_TRUE(model.has_value()) << model.error().message;
  const ModelConfig& c = (*model)->config();
  auto table = selftest_cases_of(**model, {1});
  ASSERT_TRUE(table.has_value()) << table.error().message;
  const int64_t h = c.hidden_size, i = c.moe_intermediate_size, e = c.num_experts;
  const SelfTestCase share = moe_case(1, h, i, e, c.num_experts_per_tok, true, true,
                                      {.expert_begin = e / 2, .local_experts = e / 2});
  EXPECT_EQ(share.dims.size(), 13u);
  EXPECT_TRUE(has(*table, "moe", share));
  EXPECT_FALSE(has(*table, "moe", moe_case(1, h, i, e, c.num_experts_per_tok, true, true)));
}

// A block-wise FP8 checkpoint's linears run as gemm_fp8 on a device (q|k|v as one stacked weight), its experts as
// FP8 MoE cases; nothing of it is planned as BF16 or NVFP4.
TEST(SelftestPlan, Fp8CheckpointsAreTestedInTheirFormat) {
  fp8_test::Fp8Pair pair("qwen3_moe");
  auto m = model_build_host(pair.fp8.string(), {});
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const ModelConfig& c = (*m)->config();
  auto table = selftest_cases_of(**m, {1});
  ASSERT_TRUE(table.has_value()) << table.error().message;
  const int64_t h = c.hidden_size, i = c.moe_intermediate_size;
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  EXPECT_TRUE(has(*table, "gemm_fp8", gemm_selftest_cases({{q + 2 * kv, h}}, {1}).front()));
  EXPECT_TRUE(has(*table, "gemm_fp8", gemm_selftest_cases({{h, q}}, {1}).front()));  // o_proj
  EXPECT_TRUE(has(*table, "gemm_fp8", gemm_selftest_cases({{i, h}}, {1}).front()));
  EXPECT_TRUE(has(*table, "gemm_fp8", gemm_selftest_cases({{c.vocab_size, h}}, {1}).front()));  // lm_head
  // The weight-only GEMMs' batch kernel (17..64 rows), at both of its token-tile counts, on the lead shape.
  const auto* fp8 = cases_of(*table, "gemm_fp8");
  ASSERT_NE(fp8, nullptr);
  const auto lead = std::make_pair(fp8->front().dims[1], fp8->front().dims[2]);
  EXPECT_TRUE(has(*table, "gemm_fp8", gemm_selftest_cases({lead}, {32}).front()));
  EXPECT_TRUE(has(*table, "gemm_fp8", gemm_selftest_cases({lead}, {64}).front()));
  EXPECT_TRUE(has(*table, "moe", moe_case(1, h, i, c.num_experts, c.num_experts_per_tok, MoeCaseFormat::kFp8, false)));
  EXPECT_FALSE(has(*table, "moe", moe_case(1, h, i, c.num_experts, c.num_experts_per_tok, false, false)));
  EXPECT_EQ(cases_of(*table, "gemm_nvfp4"), nullptr);
  const auto* bf16 = cases_of(*table, "gemm_bf16");
  if (bf16 != nullptr) {
    EXPECT_FALSE(has(*table, "gemm_bf16", gemm_selftest_cases({{q + 2 * kv, h}}, {1}).front()));
  }
}

// NVFP4 input projections run as one stacked weight on a device (q|k|v here: the fixture's gated attention is NVFP4,
// its q rows doubled by the output gate), so the plan tests that shape too, besides each part's.
TEST(SelftestPlan, StackedNvfp4ProjectionsAreTestedAtTheirShape) {
  auto model = host("qwen3_5_moe_nvfp4");
  ASSERT_TRUE(model);
  const ModelConfig& c = model->config();
  auto table = selftest_cases_of(*model, {1});
  ASSERT_TRUE(table.has_value()) << table.error().message;
  const int64_t h = c.hidden_size, q = 2 * c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  EXPECT_TRUE(has(*table, "gemm_nvfp4", gemm_selftest_cases({{q + 2 * kv, h}}, {1}).front()));
  EXPECT_TRUE(has(*table, "gemm_nvfp4", gemm_selftest_cases({{kv, h}}, {1}).front()));
  const auto* fp4 = cases_of(*table, "gemm_nvfp4");
  ASSERT_NE(fp4, nullptr);
  const auto lead = std::make_pair(fp4->front().dims[1], fp4->front().dims[2]);
  EXPECT_TRUE(has(*table, "gemm_nvfp4", gemm_selftest_cases({lead}, {32}).front()));
  EXPECT_TRUE(has(*table, "gemm_nvfp4", gemm_selftest_cases({lead}, {64}).front()));
}

// The dense NVFP4 GEMMs are planned again with quantized activations (gemm_nvfp4_w4a4, which a GPU with FP4 tensor
// cores may run instead of W4A16), each part and the stacked q|k|v; the routed experts' shapes are not (no W4A4
// expert kernel), and the op falls back to gemm_nvfp4 where nothing verifies it.
TEST(SelftestPlan, DenseNvfp4GemmsArePlannedWithQuantizedActivationsTooExpertsNot) {
  auto model = host("qwen3_5_moe_nvfp4");
  ASSERT_TRUE(model);
  const ModelConfig& c = model->config();
  auto table = selftest_cases_of(*model, {1});
  ASSERT_TRUE(table.has_value()) << table.error().message;
  const int64_t h = c.hidden_size, q = 2 * c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  const int64_t o_in = c.num_attention_heads * c.head_dim, i = c.moe_intermediate_size;
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{q + 2 * kv, h}, {q, h}, {kv, h}, {h, o_in}}) {
    EXPECT_TRUE(has(*table, "gemm_nvfp4_w4a4", gemm_selftest_cases({{n, k}}, {1}).front())) << n << " x " << k;
  }
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{i, h}, {h, i}}) {
    EXPECT_TRUE(has(*table, "gemm_nvfp4", gemm_selftest_cases({{n, k}}, {1}).front())) << n << " x " << k;
    EXPECT_FALSE(has(*table, "gemm_nvfp4_w4a4", gemm_selftest_cases({{n, k}}, {1}).front())) << n << " x " << k;
  }
  EXPECT_EQ(selftest_fallback_of("gemm_nvfp4_w4a4"), "gemm_nvfp4");
  EXPECT_EQ(selftest_fallback_of("gemm_nvfp4"), "");
  EXPECT_EQ(selftest_fallback_of("attention"), "");
  // A BF16 checkpoint has none.
  auto bf16 = host("qwen3_5_moe");
  ASSERT_TRUE(bf16);
  auto bf16_table = selftest_cases_of(*bf16, {1});
  ASSERT_TRUE(bf16_table.has_value());
  EXPECT_EQ(cases_of(*bf16_table, "gemm_nvfp4_w4a4"), nullptr);
}

// --nvfp4-activations auto on simulated GPUs, from the selection of the fixture's planned W4A4 cases (nothing runs:
// a supported candidate is chosen untested): a B200 or an RTX PRO 6000, whose FP4 tensor cores the binary targets,
// run the dense NVFP4 layers W4A4 and the experts W4A16; an H200 runs W4A16 and says why; `quantize` is refused
// there; the CPU, `dequantize` and MLA models run W4A16.
TEST(Nvfp4ActivationsChoice, AutoRunsW4a4WhereTheFp4GemmIsVerified) {
  auto model = host("qwen3_5_moe_nvfp4");
  ASSERT_TRUE(model);
  auto table = selftest_cases_of(*model, {1, 8});
  ASSERT_TRUE(table.has_value()) << table.error().message;
  const auto* cases = cases_of(*table, "gemm_nvfp4_w4a4");
  ASSERT_NE(cases, nullptr);
  auto select_on = [&](const std::string& device_name) {
    return std::vector<Selection>{w4a4_test::select_on(device_name, w4a4_test::kFullImage, *cases)};
  };
  using enum Nvfp4Activations;
  for (const std::string name : {"b200", "rtx-pro-6000"}) {
    const std::vector<Selection> blackwell = select_on(name);
    auto choice = nvfp4_activations_of("auto", true, false, blackwell);
    ASSERT_TRUE(choice.has_value()) << choice.error().message;
    EXPECT_EQ(choice->policy, kQuantizeDense) << name << ": " << choice->why;
    EXPECT_NE(choice->why.find("routed experts W4A16"), std::string::npos) << choice->why;
    auto forced = nvfp4_activations_of("quantize", true, false, blackwell);
    ASSERT_TRUE(forced.has_value()) << forced.error().message;
    EXPECT_EQ(forced->policy, kQuantize);
    EXPECT_EQ(nvfp4_activations_of("dequantize", true, false, blackwell)->policy, kDequantize);
    EXPECT_EQ(nvfp4_activations_of("auto", true, true, blackwell)->policy, kDequantize) << "an MLA model";
  }
  const std::vector<Selection> hopper = select_on("h200");
  ASSERT_TRUE(hopper.front().chosen.empty());
  auto choice = nvfp4_activations_of("auto", true, false, hopper);
  ASSERT_TRUE(choice.has_value()) << choice.error().message;
  EXPECT_EQ(choice->policy, kDequantize);
  EXPECT_NE(choice->why.find("sm_90"), std::string::npos) << choice->why;
  auto refused = nvfp4_activations_of("quantize", true, false, hopper);
  ASSERT_FALSE(refused.has_value());
  EXPECT_NE(refused.error().message.find("FP4 tensor-core"), std::string::npos) << refused.error().message;
  EXPECT_EQ(nvfp4_activations_of("auto", true, false, {})->policy, kDequantize) << "no self-test ran";
  EXPECT_FALSE(nvfp4_activations_of("quantize", true, false, {}).has_value()) << "no self-test ran";
  EXPECT_EQ(nvfp4_activations_of("auto", false, false, {})->policy, kDequantize) << "the CPU";
  EXPECT_EQ(nvfp4_activations_of("quantize", false, false, {})->policy, kQuantize) << "the CPU";
  EXPECT_FALSE(nvfp4_activations_of("w4a8", true, false, hopper).has_value());
}

// The policy the choice comes to, applied by the weight store: quantize-dense quantizes the attention projections'
// inputs and not the routed experts'; quantize both; dequantize neither.
TEST(Nvfp4ActivationsChoice, ThePolicyReachesTheLayers) {
  using enum Nvfp4Activations;
  for (const Nvfp4Activations policy : {kDequantize, kQuantizeDense, kQuantize}) {
    auto m = model_build_host(std::string(TERN_FIXTURES_DIR) + "/qwen3_5_moe_nvfp4", {.nvfp4_activations = policy});
    ASSERT_TRUE(m.has_value()) << m.error().message;
    const auto* attention = dynamic_cast<const Attention*>((*m)->layers.at(1).mixer.get());
    const auto* moe = dynamic_cast<const Moe*>((*m)->layers.at(1).ffn.get());
    ASSERT_NE(attention, nullptr);
    ASSERT_NE(moe, nullptr);
    EXPECT_EQ(attention->weights().q_proj.quantizes_input(), policy != kDequantize);
    EXPECT_EQ(attention->weights().o_proj.quantizes_input(), policy != kDequantize);
    EXPECT_EQ(moe->weights().experts.at(0).gate_proj.quantizes_input(), policy == kQuantize);
    EXPECT_EQ(moe->weights().experts.at(0).down_proj.quantizes_input(), policy == kQuantize);
  }
  auto mla = model_build_host(std::string(TERN_FIXTURES_DIR) + "/glm_moe_dsa", {.nvfp4_activations = kQuantizeDense});
  ASSERT_FALSE(mla.has_value());
  EXPECT_NE(mla.error().message.find("not supported for MLA models"), std::string::npos) << mla.error().message;
}

// The lead GEMM (what `--selftest fast` times) is the largest projection of at most 2^26 weights, not lm_head.
TEST(SelftestPlan, LeadShapeIsTheLargestBelowTheLimit) {
  const auto lead = selftest_lead_first({{4096, 4096}, {151936, 4096}, {12288, 4096}, {1024, 4096}});
  ASSERT_EQ(lead.size(), 4u);
  EXPECT_EQ(lead.front(), (std::pair<int64_t, int64_t>{12288, 4096}));
  EXPECT_TRUE(selftest_lead_first({}).empty());
}

// A config-only directory plans from the shapes and formats its dummy weights would have, with no weights made.
TEST(SelftestPlan, ShapesOnlyHostHasTheDummyWeightsShapesAndFormats) {
  auto dummy = host("qwen3_5_moe_nvfp4", LoadFormat::kDummy);
  auto shapes = host("qwen3_5_moe_nvfp4", LoadFormat::kShapes);
  ASSERT_TRUE(dummy && shapes);
  auto a = selftest_cases_of(*dummy, {1, 8});
  auto b = selftest_cases_of(*shapes, {1, 8});
  ASSERT_TRUE(a.has_value() && b.has_value());
  ASSERT_EQ(a->size(), b->size());
  for (size_t k = 0; k < a->size(); ++k) {
    EXPECT_EQ((*a)[k].first, (*b)[k].first);
    ASSERT_EQ((*a)[k].second.size(), (*b)[k].second.size()) << (*a)[k].first;
    for (size_t j = 0; j < (*a)[k].second.size(); ++j) EXPECT_EQ((*a)[k].second[j].dims, (*b)[k].second[j].dims);
  }
  EXPECT_TRUE(cases_of(*b, "gemm_nvfp4") != nullptr);  // the exporter's formats, not all BF16
}

// With speculative decoding the plan adds the verifications' shapes and the draft module's blocks: the GDN ops with
// row states at verify_rows rows per sequence, attention over verify_rows query rows, GEMMs at batch x verify_rows
// rows, and the draft module's fc (a shape the model itself has not); without it none of them.
TEST(SelftestPlan, SpeculativeVerificationsAndTheDraftModuleAreTested) {
  const std::string demo = std::string(TERN_SOURCE_DIR) + "/demo/tern-demo-bf16";
  auto model = model_build_host(demo, {.load_format = LoadFormat::kShapes, .load_draft = true});
  ASSERT_TRUE(model.has_value()) << model.error().message;
  const ModelConfig& c = (*model)->config();
  const int64_t h = c.hidden_size, hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, channels = 2 * hk * dk + hv * dv;
  const int64_t rows = 4;  // --speculative-num-steps 3
  auto plain = selftest_cases_of(**model, {1, 8});
  auto spec = selftest_cases_of(**model, {1, 8}, rows);
  ASSERT_TRUE(plain.has_value() && spec.has_value());
  for (int64_t b : {1, 8}) {
    const SelfTestCase conv = gdn_conv_case(b, rows, channels, c.linear_conv_kernel_dim, true);
    const SelfTestCase delta = gdn_delta_rule_case(b, rows, hk, hv, dk, dv, true);
    const SelfTestCase attention = attention_case(b, rows, 1000, c.num_attention_heads, c.num_key_value_heads,
                                                  c.head_dim, /*gated=*/true);  // Qwen3.5 gates its attention
    const SelfTestCase fc = gemm_selftest_cases({{h, 2 * h}}, {b * rows}).front();
    const SelfTestCase silu = silu_mul_gemv_case(h, c.shared_expert_intermediate_size, rows);
    EXPECT_TRUE(has(*spec, "silu_mul_gemv", silu)) << "the shared expert's SiLU GEMV over a verification's rows";
    EXPECT_FALSE(has(*plain, "silu_mul_gemv", silu));
    EXPECT_TRUE(has(*spec, "gdn_conv", conv)) << b;
    EXPECT_TRUE(has(*spec, "gdn_delta_rule", delta)) << b;
    for (const auto& [op, want] : {std::pair{"gdn_conv", conv}, std::pair{"gdn_delta_rule", delta}}) {
      const auto* cases = cases_of(*spec, op);
      ASSERT_NE(cases, nullptr);
      const auto it =
          std::find_if(cases->begin(), cases->end(), [&](const SelfTestCase& c) { return c.dims == want.dims; });
      ASSERT_NE(it, cases->end());
      EXPECT_TRUE(it->in_fast) << op << ": the verification kernels are tested by --selftest fast too";
    }
    EXPECT_TRUE(has(*spec, "attention", attention)) << b;
    EXPECT_TRUE(has(*spec, "gemm_bf16", fc)) << b;
    EXPECT_FALSE(has(*plain, "gdn_conv", conv)) << b;
    EXPECT_FALSE(has(*plain, "gdn_delta_rule", delta)) << b;
    EXPECT_FALSE(has(*plain, "attention", attention)) << b;
    EXPECT_FALSE(has(*plain, "gemm_bf16", fc)) << b;
  }
  EXPECT_FALSE(has(*plain, "gemm_bf16", gemm_selftest_cases({{h, 2 * h}}, {1}).front()))
      << "the draft module's fc is planned only with speculative decoding";
  EXPECT_FALSE(selftest_cases_of(**model, {1}, -1).has_value());
}

// --kv-cache-dtype fp8_e4m3 on an MLA model: the plan tests mla_attention over FP8 entries with the architecture's
// tile scales (GLM-5: fp32, dims[8] = 1; DeepSeek-V3: powers of two, 2), as the cache the model then runs; without it
// the bf16 cases (8 dims). A model without MLA, or a latent not in whole 128-value tiles, is refused by name.
TEST(SelftestPlan, Fp8LatentCacheIsPlannedWithTheArchitecturesScales) {
  auto mla_cache_dims = [](const std::filesystem::path& dir, KvCacheDtype dtype) -> std::set<size_t> {
    auto model = model_build_host(dir, {.load_format = LoadFormat::kShapes, .kv_cache_dtype = dtype});
    EXPECT_TRUE(model.has_value()) << dir << ": " << (model ? "" : model.error().message);
    if (!model) return {};
    auto table = selftest_cases_of(**model, {1, 8});
    EXPECT_TRUE(table.has_value());
    const auto* cases = table ? cases_of(*table, "mla_attention") : nullptr;
    EXPECT_NE(cases, nullptr) << dir;
    std::set<size_t> kinds;  // dims.size() * 10 + the cache kind
    for (const SelfTestCase& c : cases ? *cases : std::vector<SelfTestCase>{}) {
      kinds.insert(c.dims.size() * 10 + (c.dims.size() == 9 ? static_cast<size_t>(c.dims[8]) : 0));
    }
    return kinds;
  };
  const std::filesystem::path glm = std::string(TERN_SOURCE_DIR) + "/bench/configs/glm-5-nvfp4-slice";
  EXPECT_EQ(mla_cache_dims(glm, KvCacheDtype::kFp8E4m3), std::set<size_t>{91});
  EXPECT_EQ(mla_cache_dims(glm, KvCacheDtype::kAuto), std::set<size_t>{80});
  // The same shapes as DeepSeek-V3 (its model_type and architecture; no indexer, which glm_moe_dsa alone reads).
  const std::filesystem::path deepseek = std::filesystem::temp_directory_path() / "tern_selftest_plan_deepseek_v3";
  std::filesystem::create_directories(deepseek);
  {
    std::ifstream in(glm / "config.json");
    nlohmann::json config = nlohmann::json::parse(in);
    config["model_type"] = "deepseek_v3";
    config["architectures"] = {"DeepseekV3ForCausalLM"};
    for (const char* glm_only :
         {"index_head_dim", "index_n_heads", "index_topk", "indexer_types", "indexer_rope_interleave"}) {
      config.erase(glm_only);
    }
    std::ofstream(deepseek / "config.json") << config.dump(1);
  }
  EXPECT_EQ(mla_cache_dims(deepseek, KvCacheDtype::kFp8E4m3), std::set<size_t>{92});
  std::filesystem::remove_all(deepseek);

  auto qwen = model_build_host(std::string(TERN_FIXTURES_DIR) + "/qwen3",
                               {.load_format = LoadFormat::kShapes, .kv_cache_dtype = KvCacheDtype::kFp8E4m3});
  ASSERT_FALSE(qwen.has_value());
  EXPECT_NE(qwen.error().message.find("FP8 cache is the multi-head latent attention form"), std::string::npos)
      << qwen.error().message;
  auto tiny = model_build_host(std::string(TERN_FIXTURES_DIR) + "/glm_moe_dsa",
                               {.load_format = LoadFormat::kShapes, .kv_cache_dtype = KvCacheDtype::kFp8E4m3});
  ASSERT_FALSE(tiny.has_value());
  EXPECT_NE(tiny.error().message.find("kv_lora_rank a multiple of 128"), std::string::npos) << tiny.error().message;
}

}  // namespace
}  // namespace tern
