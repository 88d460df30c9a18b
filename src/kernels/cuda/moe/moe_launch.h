// Argument structs and unchecked launchers of the sparse Mixture-of-Experts kernels (docs/model-specs.md §2.6;
// CPU semantics in layers/moe.h). Activations are bf16 (uint16_t bit patterns), the math inside fp32. The .cu
// side cannot include core/error.h (nvcc rejects fmt's consteval format strings), so validation lives in moe.cc and
// callers use moe.h.
//
// One MoE block on the GPU, with the router GEMM, the SwiGLU activation and the shared expert done by the dense
// kernels (gemm_bf16 / gemm_nvfp4_w4a16, silu_mul):
//   logits [T, E]        = x . router^T                      gemm_bf16
//   topk ids, weights    = moe_route(logits)                 softmax (fp32), top-k, optional renormalisation; or
//                                                            sigmoid, grouped top-k on score + bias (DeepSeek-V3)
//   offsets, permutation = moe_align(ids)                    counting sort of the T*k (token, j) pairs by expert
//                                                            (at decode both in one launch: moe_route_align)
//   gate_up [T*k, 2I]    = moe_gemm(x gathered, W_gate_up)   one launch for all experts
//   act [T*k, I]         = silu_mul(gate_up)                 at decode: inside the down GEMM (x_silu_mul)
//   expert_out [T*k, H]  = moe_gemm(act, W_down)
//   y [T, H]             = moe_combine(expert_out, weights)  + sigmoid(shared_gate) * shared_out
//                                                            (no gate: + shared_out)
// Nothing here synchronises with the host: the host knows tokens, top_k and n_experts, never the per-expert counts,
// so every launch is sized for the worst case and blocks find their work in expert_offsets on the device.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/device.h"

namespace tern {

// Limits the kernels are built for (the launchers reject anything beyond them).
inline constexpr int64_t kMoeMaxExperts = 512;  // the align kernel keeps per-warp counts of every expert in smem
inline constexpr int64_t kMoeMaxTopK = 32;      // the route kernel keeps one selection per lane of a warp
inline constexpr int64_t kMoeMaxGroups = 32;    // sigmoid routing ranks one expert group per lane of a warp

// Softmax (fp32) over each row's logits, top-k with ties to the lower expert index (torch.topk, layers/moe.cc),
// optional renormalisation of the k probabilities to sum 1. The weights stay fp32, as layers/moe.cc keeps them.
// A NaN probability ranks below every number, so the ids are always k distinct experts in range.
//
// With sigmoid, DeepSeek-V3 / GLM-5's routing ("noaux_tc", layers/moe.cc route_sigmoid) instead, in fp32: score =
// 1 / (1 + exp(-logit)), choice = score + correction_bias[e]; the experts form n_group groups of n_experts / n_group
// consecutive ones, a group's worth is the sum of its two best choice values (its one value for groups of one), the
// topk_group best groups are kept (ties to the lower group), and the top_k experts of the kept groups by choice value
// are taken (ties to the lower expert index), in descending choice order. Each weight is the expert's unbiased
// score, divided by the winners' score sum (added in selection order) + 1e-20 when renormalize, then times
// routed_scaling. A NaN choice value ranks below every number; an expert outside the kept groups is never taken, so
// the ids are always k distinct experts of the kept groups. Softmax routing takes the defaults of these fields.
struct MoeRouteArgs {
  const uint16_t* logits = nullptr;  // [tokens, logits_stride] bf16, the first n_experts columns are used
  // Instead of `logits`, fp32 logits (sigmoid routing only): DeepSeek-V3 / GLM-5 compute their router in fp32.
  const float* logits_f32 = nullptr;
  int64_t logits_stride = 0;         // elements between rows, >= n_experts
  int32_t* topk_ids = nullptr;       // [tokens, top_k], in descending probability (choice value) order
  float* topk_weights = nullptr;     // [tokens, top_k]
  int64_t tokens = 0, n_experts = 0, top_k = 0;
  bool renormalize = true;
  bool sigmoid = false;                    // sigmoid routing (above) instead of softmax
  int64_t n_group = 1, topk_group = 1;     // n_experts % n_group == 0, topk_group <= n_group <= kMoeMaxGroups,
                                           // top_k <= topk_group * n_experts / n_group
  float routed_scaling = 1.0f;             // finite
  const float* correction_bias = nullptr;  // [n_experts] fp32 (device memory); null: none
};

// Counting sort of the tokens*top_k (token, j) pairs by expert, stable in pair order (pair index t*top_k + j), so
// an expert's rows are its tokens in ascending order. The buckets are experts expert_begin .. expert_begin +
// n_experts - 1 (bucket id - expert_begin); an id outside them lands in a bucket after the last expert:
// expert_offsets[n_experts] counts the valid pairs, and the rows past it belong to no expert (no GEMM writes them).
// Under expert parallelism those are the pairs of other ranks' experts (the route kernels choose among all of them).
struct MoeAlignArgs {
  const int32_t* topk_ids = nullptr;  // [tokens, top_k]
  int64_t tokens = 0, top_k = 0, n_experts = 0;
  int64_t expert_begin = 0;           // the expert of bucket 0
  int32_t* expert_offsets = nullptr;  // [n_experts + 1]: permuted rows of expert e are [off[e], off[e+1])
  int32_t* sorted_pairs = nullptr;    // [tokens*top_k]: pair index (t*top_k + j) at each permuted row
  int32_t* pair_row = nullptr;        // [tokens*top_k]: permuted row of each pair (the inverse)
  void* workspace = nullptr;          // from moe_align_workspace_bytes() (one block's sort needs none), 4-aligned
  size_t workspace_bytes = 0;
  // Optional: the decode GEMM's passes (below) for these offsets, [moe_decode_pass_slots(tokens * top_k,
  // n_experts)][4] int32, 16-byte aligned (a route + align of at most 32 pairs then takes the block kernel).
  int32_t* decode_passes = nullptr;
};

// The decode GEMM's work list (MoeAlignArgs::decode_passes, MoeGemmArgs::decode_passes): every expert with rows has
// ceil(rows / kMoeDecodePassRows) entries {expert, first row, end row, 0}, consecutive ranges of at most
// kMoeDecodePassRows of its permuted rows, experts in index order; the entries after the last, up to
// moe_decode_pass_slots, hold expert -1. Each pass gets its own blocks, so the passes of an expert that many tokens
// chose run side by side (its weight read from DRAM once, by the others from L2) rather than one after another in
// the same blocks, which the whole launch then waited for.
inline constexpr int64_t kMoeDecodePassRows = 8;
#ifdef __CUDACC__
__host__ __device__
#endif
inline constexpr int64_t moe_decode_pass_slots(int64_t rows, int64_t n_experts) {
  // sum over active experts of ceil(r_e / 8) <= active + rows / 8, and active <= min(rows, n_experts)
  return (rows < n_experts ? rows : n_experts) + rows / kMoeDecodePassRows;
}

// One projection of all experts, in one of three formats (device memory):
//   bf16:  [n_experts][n][k] at bf16_expert_stride elements apart.
//   NVFP4 (ModelOpt layout, W4A16): packed e2m1 [n_experts][n][k/2] and e4m3 block scales [n_experts][n][k/16] at
//          their expert strides (bytes), one fp32 weight_scale_2 per expert in global_scales.
//   FP8 (block-wise, DeepSeek-V3 / GLM-5-FP8 / Qwen3-FP8 layout, docs/model-specs.md §1.7; W8A16): e4m3fn codes
//          [n_experts][n][k] in `packed` at packed_expert_stride bytes (16-byte aligned, a multiple of 16), and fp32
//          scales [n_experts][n][ceil(k/128)] in row_scales at row_scales_expert_stride floats: the scale of row r
//          and 128-column block b, i.e. the checkpoint's weight_scale_inv [ceil(n/128)][ceil(k/128)] with each
//          block row repeated for its 128 rows. Weight = e4m3(code) * scale; global_scales is not read.
enum class MoeWeightFormat { kBf16, kNvfp4, kFp8 };

struct MoeExpertWeights {
  MoeWeightFormat format = MoeWeightFormat::kBf16;
  int64_t n_experts = 0, n = 0, k = 0;
  const uint16_t* bf16 = nullptr;
  int64_t bf16_expert_stride = 0;
  const uint8_t* packed = nullptr;  // NVFP4 packed e2m1, or FP8 e4m3 codes
  int64_t packed_expert_stride = 0;
  const uint8_t* scales = nullptr;  // NVFP4 e4m3 block scales
  int64_t scales_expert_stride = 0;
  const float* global_scales = nullptr;  // NVFP4: [n_experts]
  const float* row_scales = nullptr;     // FP8: [n_experts][n][ceil(k/128)]
  int64_t row_scales_expert_stride = 0;  // in floats
};

// Grouped GEMM over all experts in one launch: for each permuted row r of expert e,
// y[r, 0..n) = x[src(r)] . W_e^T, src(r) = sorted_pairs[r] / top_k when gather (x holds token rows), else r (x holds
// permuted rows already, as the down projection's input does). Rows past expert_offsets[n_experts] are not written.
//
// w2 (optional, n = 0: none) is a second projection of the same experts, k and format, computed in the same launch:
// y[r, y2_offset + 0..w2.n) = x[src(r)] . W2_e^T. NVFP4 checkpoints store gate and up as two stacks with their own
// global scales; with w = gate, w2 = up and y2_offset = I one decode grid spreads both over the SMs. (The prefill
// variant, compute-bound, runs w2 as a second launch.)
//
// x_silu_mul (decode variant only): x holds [gate | up] rows of 2k values (ldx >= 2k) and the GEMM's input row is
// act = silu(gate) * up, computed in fp32 and rounded once to bf16 exactly as silu_mul (elementwise.h) rounds, so
// the result is bit-identical to silu_mul followed by this GEMM on its output. Each block stages the act rows of its
// pass in shared memory (moe_gemm_silu_smem_bytes).
struct MoeGemmArgs {
  const uint16_t* x = nullptr;  // [tokens or rows, ldx] bf16
  int64_t ldx = 0;
  const int32_t* sorted_pairs = nullptr;  // needed when gather
  int64_t top_k = 1;
  bool gather = false;
  const int32_t* expert_offsets = nullptr;  // [n_experts + 1]
  MoeExpertWeights w;
  uint16_t* y = nullptr;  // [rows, ldy] bf16: columns [0, n) of each row are written (gate and up can share one
  int64_t ldy = 0;        // [rows, 2I] buffer, the up projection writing at y + I)
  int64_t rows = 0;       // tokens * top_k
  MoeExpertWeights w2;    // optional second projection (see above)
  int64_t y2_offset = 0;  // elements from a row of y to w2's column 0: w.n <= y2_offset <= ldy - w2.n
  bool x_silu_mul = false;  // x holds [gate | up] rows (see above)
  // Decode variant: an expert's rows are taken 8 * decode_token_tiles at a time (1 or 2; each pass streams the
  // expert's weight again, two tiles need twice the registers); 0: the launcher's rule. Benchmarks and tests force it.
  int decode_token_tiles = 0;
  // Routing in the launch (decode variant, one token: rows == top_k, gather, no x_silu_mul). When route.logits is
  // set, every block routes the token itself (route.tokens == 1), as moe_route would, and finds its expert among
  // the winners; one block writes what moe_route and moe_align would (route's topk_ids and topk_weights, align's
  // expert_offsets, sorted_pairs and pair_row, align sorting route's ids) for the launches after it. expert_offsets
  // and sorted_pairs above are then not read. At one token this saves the route launch and its wait. Softmax
  // routing only (route.sigmoid is an error; moe_forward routes a sigmoid token with moe_route_align first).
  MoeRouteArgs route;
  MoeAlignArgs align;
  // Decode variant: the pass list of expert_offsets (MoeAlignArgs::decode_passes, 16-byte aligned); each pass of
  // kMoeDecodePassRows rows (one token tile) gets its own blocks instead of the blocks of an expert taking its
  // passes in turn. expert_offsets is then not read (sorted_pairs still is, to gather). Not with decode_token_tiles
  // = 2 or route; the prefill kernels do not read it.
  const int32_t* decode_passes = nullptr;
};

// y[t] = sum_j topk_weights[t,j] * expert_out[pair_row[t*top_k+j]] summed in fp32 in ascending expert index order
// (as layers/moe.cc adds experts), then + sigmoid(shared_gate[t]) * shared_out[t] when shared_out is set, or
// + shared_out[t] unweighted when shared_gate is null (DeepSeek-V3 / GLM-5's shared experts); one bf16 rounding per
// output. Only the pairs of experts [expert_begin, expert_end) are summed (under expert parallelism this rank's; the
// rows of the others' pairs hold nothing).
struct MoeCombineArgs {
  const uint16_t* expert_out = nullptr;  // [tokens*top_k, hidden] bf16, permuted rows
  const int32_t* pair_row = nullptr;     // [tokens*top_k]
  const int32_t* topk_ids = nullptr;     // [tokens, top_k]: only the summation order is taken from them
  const float* topk_weights = nullptr;   // [tokens, top_k]
  const uint16_t* shared_out = nullptr;  // optional [tokens, hidden] bf16
  const uint16_t* shared_gate = nullptr; // optional [tokens] bf16 at shared_gate_stride elements apart, only with
  int64_t shared_gate_stride = 1;        // shared_out; null: the shared expert is added unweighted
  uint16_t* y = nullptr;                 // [tokens, hidden] bf16
  int64_t tokens = 0, top_k = 0, hidden = 0;
  int32_t expert_begin = 0, expert_end = INT32_MAX;
};

// The key the combines order a token's pairs by: the expert id, or INT_MAX (after every id) for an expert outside
// [begin, end), whose pair they leave out.
#ifdef __CUDACC__
__host__ __device__
#endif
inline int moe_combine_key(int32_t id, int32_t begin, int32_t end) { return id >= begin && id < end ? id : INT_MAX; }

enum class MoeGemmVariant {
  kAuto,         // decode while tokens (= rows / top_k) <= kMoeDecodeMaxTokens, else prefill
  kDecode,       // weight streaming: any row count (an expert's rows are taken 16 at a time), best for few rows
  kPrefill,      // tensor-core tiles over each expert's rows: wgmma where it fits (below; for NVFP4 the kernel with
                 // the weight in registers), else mma.sync
  kPrefillMma,   // the mma.sync prefill kernel (every GPU), as a fallback and to compare against
};

// Up to here each expert has at most this many rows (a token picks an expert once), so decode reads each active
// expert's weight about once per 16 rows while prefill's 64-row tiles would be mostly padding.
inline constexpr int64_t kMoeDecodeMaxTokens = 64;

// Shared memory of a decode block with x_silu_mul for k (the act rows of one pass plus the largest split-K
// reduction buffer); the launcher rejects a k whose blocks would not fit the device's per-block opt-in limit.
size_t moe_gemm_silu_smem_bytes(int64_t k);

// Route and align in one single-block launch (moe_route's choices, then moe_align's counting sort of the ids just
// chosen, kept in shared memory) for up to this many pairs (tokens * top_k), as at decode; the outputs are the two
// kernels' bits.
inline constexpr int64_t kMoeRouteAlignMaxPairs = 2048;

// Unchecked launches on ctx.stream() for arguments the checked launchers have validated (counts >= 1).
void moe_route_launch(const DeviceContext& ctx, const MoeRouteArgs& args);
void moe_align_launch(const DeviceContext& ctx, const MoeAlignArgs& args);
// The ints of MoeAlignArgs::workspace moe_align_launch needs (0 when one block sorts them all).
size_t moe_align_workspace_ints(int64_t tokens, int64_t top_k, int64_t n_experts);
void moe_route_align_launch(const DeviceContext& ctx, const MoeRouteArgs& route, const MoeAlignArgs& align);
void moe_combine_launch(const DeviceContext& ctx, const MoeCombineArgs& args);
void moe_gemm_launch_decode(const DeviceContext& ctx, const MoeGemmArgs& args);
void moe_gemm_launch_prefill(const DeviceContext& ctx, const MoeGemmArgs& args);

// The prefill variant on Hopper's wgmma (moe_gemm_prefill_sm90.cu): for a device of compute capability 9.0 in a build
// with sm_90a machine code, bf16 or NVFP4 weights (FP8 takes the mma.sync kernel), k % 64 == 0 for every
// projection, x 16-byte aligned with ldx % 8 == 0. Same results as moe_gemm_launch_prefill (the same exact products,
// summed in fp32).
bool moe_gemm_prefill_sm90_fits(const DeviceContext& ctx, const MoeGemmArgs& args);
void moe_gemm_launch_prefill_sm90(const DeviceContext& ctx, const MoeGemmArgs& args);
// The NVFP4 variant with the weight in registers, which kPrefill takes first (docs/perf/gpu.md §moe-prefill-rs):
// NVFP4 weights and k % 128 == 0 for every projection, the rest as moe_gemm_prefill_sm90_fits. Same results.
bool moe_gemm_prefill_rs_fits(const DeviceContext& ctx, const MoeGemmArgs& args);
// shape >= 0 forces one of moe_gemm_prefill_rs_shapes() (for moe_bench --rs-shapes); -1: the launcher's choice.
void moe_gemm_launch_prefill_rs(const DeviceContext& ctx, const MoeGemmArgs& args, int shape = -1);
std::vector<std::string> moe_gemm_prefill_rs_shapes();

}  // namespace tern
