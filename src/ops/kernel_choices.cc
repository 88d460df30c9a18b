#include "ops/kernel_choices.h"

#include <string>

namespace tern {
namespace {

// 0: both of a family's implementations are usable; 1: only `a`; 2: only `b` (forced, or the other failed or
// cannot run the model's shapes here). Neither usable: 0, and the device's own shape rules decide.
int family_choice(const Selection& s, const std::string& a, const std::string& b) {
  if (s.forced) return s.chosen == a ? 1 : s.chosen == b ? 2 : 0;
  bool a_ok = false, b_ok = false;
  for (const CandidateReport& c : s.candidates) {
    const bool usable = c.status != CandidateStatus::kFailed && c.status != CandidateStatus::kUnsupported;
    a_ok = a_ok || (c.name == a && usable);
    b_ok = b_ok || (c.name == b && usable);
  }
  return a_ok && b_ok ? 0 : a_ok ? 1 : b_ok ? 2 : 0;
}

}  // namespace

KernelChoices kernel_choices_of(std::span<const Selection> selections) {
  KernelChoices k;
  for (const Selection& s : selections) {
    if (s.op == "attention") {
      const int c = family_choice(s, "cuda-decode", "cuda-prefill");
      k.attention = c == 1 ? AttentionChoice::kDecode : c == 2 ? AttentionChoice::kPrefill : AttentionChoice::kAuto;
    } else if (s.op == "gdn_delta_rule") {
      const int c = family_choice(s, "cuda-recurrent", "cuda-chunked");
      k.gdn = c == 1 ? GdnChoice::kRecurrent : c == 2 ? GdnChoice::kChunked : GdnChoice::kAuto;
    } else if (s.op == "gemm_bf16") {
      k.bf16_gemv = s.chosen == "gemv";
    } else if (s.op == "rms_norm_gemv") {
      k.norm_gemv = s.chosen == "fused";
    } else if (s.op == "silu_mul_gemv") {
      k.silu_gemv = s.chosen == "fused";
    } else if (s.op == "gdn_delta_rule_norm") {
      k.gdn_norm_in_rule = s.chosen == "fused";
    } else if (s.op == "gemm_nvfp4_w4a4") {
      k.nvfp4_w4a4 = s.chosen == "fp4-native";
    }
  }
  return k;
}

}  // namespace tern
