// What the start-up self-test chose for a model's device, as the typed choices the device's blocks act on
// (models/gpu/cuda_ops.h): which attention and Gated DeltaNet kernels run, and which fusions are on. The
// implementation names the ops register (gemm_cuda.cc, attention_cuda.cc, ...) are read here and nowhere else.
#pragma once

#include <span>

#include "ops/registry.h"

namespace tern {

enum class AttentionChoice {
  kAuto,     // both verified: each call picks by its query length
  kDecode,   // cuda-decode only (split-K flash decoding)
  kPrefill,  // cuda-prefill only (tensor-core tiles)
};
enum class GdnChoice {
  kAuto,       // both verified: recurrent for short queries, chunked otherwise
  kRecurrent,  // cuda-recurrent only
  kChunked,    // cuda-chunked only
};

struct KernelChoices {
  AttentionChoice attention = AttentionChoice::kAuto;
  GdnChoice gdn = GdnChoice::kAuto;
  // gemm_bf16 chose "gemv": BF16 projections of a decode step (few rows) through tern's own GEMV, not cuBLASLt.
  bool bf16_gemv = false;
  // rms_norm_gemv chose "fused": at one row each RMSNorm runs inside the BF16 GEMV that reads it (with bf16_gemv).
  bool norm_gemv = false;
  // silu_mul_gemv chose "fused": at one row the MLP's SiLU-and-mul is folded into the down GEMV (with bf16_gemv).
  bool silu_gemv = false;
  // gdn_delta_rule_norm chose "fused": at one sequence of one token, a GDN layer's gated RMSNorm runs inside its
  // recurrent delta-rule kernel.
  bool gdn_norm_in_rule = false;
  // gemm_nvfp4_w4a4 chose "fp4-native": the dense NVFP4 GEMMs may run with quantized activations on the FP4 tensor
  // cores (W4A4), where the model's layers ask for it (models/weights.h Nvfp4Activations).
  bool nvfp4_w4a4 = false;

  bool operator==(const KernelChoices&) const = default;
};

// The choices of a self-test's selections. A kernel family (attention, gdn_delta_rule) runs the implementation
// forced, else the only one that passed, else both (auto). Ops the device does not run keep their defaults.
KernelChoices kernel_choices_of(std::span<const Selection> selections);

}  // namespace tern
