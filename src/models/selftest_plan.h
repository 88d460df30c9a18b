// The start-up self-test's cases for a model, reported by its blocks: the host blocks are visited by a planning
// device (a BlockOps that makes no blocks), and each adds the cases of the ops a GPU runs for it, at the shapes and
// in the weight formats it runs them, including the GEMMs of the projections the CUDA blocks fuse
// (Block::input_projections: q|k|v, GDN's input projections, gate|up, the MoE block's router group). So a new block
// brings its own cases, and nothing in cli/ restates a model's ops.
#pragma once

#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "models/causal_lm.h"
#include "ops/registry.h"

namespace tern {

// Op name -> its cases, in the order the blocks reported them; each op's first case is the one `--selftest fast`
// runs (for the GEMMs: the largest projection below lm_head size, cli/model_selftest.cc's lead rule).
using SelftestCaseTable = std::vector<std::pair<std::string, std::vector<SelfTestCase>>>;

// `batches`: the decode batch sizes to test at (each op's decode-like cases), then one prefill. `verify_rows` > 0:
// the model serves with speculative decoding, verifying that many rows per sequence: the cases add the
// verifications' shapes (the Gated DeltaNet row states, attention over a verification's rows, the GEMMs at
// batch x verify_rows rows) and, when the model has its draft module loaded, the draft module's blocks.
Expected<SelftestCaseTable> selftest_cases_of(const CausalLm& model, const std::vector<int64_t>& batches,
                                              int64_t verify_rows = 0);

// The op a device runs instead of `op` when no implementation of `op` is verified on it, or "" when `op` has no
// such fallback and a model that needs it cannot be served: gemm_nvfp4_w4a4 (the dense NVFP4 GEMMs with quantized
// activations, on FP4 tensor cores) falls back to gemm_nvfp4 (W4A16).
std::string selftest_fallback_of(const std::string& op);

// What --nvfp4-activations comes to on the device that serves (`cuda`), after its self-test (`selections`, empty
// where none ran): the policy the model is built with, and a line saying why for the start-up log and `tern doctor`.
//   auto: on a GPU whose self-test verified the FP4 tensor-core GEMM (gemm_nvfp4_w4a4 "fp4-native": Blackwell),
//         W4A4 on the dense NVFP4 layers and W4A16 on the routed experts (no W4A4 expert kernel yet), as vLLM and
//         SGLang run ModelOpt NVFP4 checkpoints there; W4A16 everywhere else (the CPU, Hopper, MLA models).
//   dequantize: W4A16 everywhere.  quantize: W4A4 on every NVFP4 layer; on a GPU, an error unless the FP4 GEMM is
//         verified there.
// Whether the self-test planned NVFP4 GEMMs (the model has NVFP4 layers), so that the choice is worth reporting.
bool selftest_has_nvfp4(std::span<const Selection> selections);
struct Nvfp4ActivationsChoice {
  Nvfp4Activations policy = Nvfp4Activations::kDequantize;
  std::string why;
};
Expected<Nvfp4ActivationsChoice> nvfp4_activations_of(const std::string& requested, bool cuda, bool mla,
                                                     std::span<const Selection> selections);

// The shapes with the lead one first: the largest of at most 2^26 weights (an lm_head is above it).
std::vector<std::pair<int64_t, int64_t>> selftest_lead_first(const std::vector<std::pair<int64_t, int64_t>>& shapes);

}  // namespace tern
