// The start-up self-test of a model's ops: every registered implementation of every op the model needs (GEMMs in
// the model's weight formats, norms, RoPE, SiLU-and-mul, embedding, attention, Gated DeltaNet, MoE) runs on the
// device that would serve, on the model's real shapes at the batch sizes the engine runs, and is verified against
// its reference (ops/registry.h). `tern doctor` prints the result; `tern serve` and `tern generate` run it before
// loading weights and refuse to start when an op has no verified implementation or a forced backend fails.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/causal_lm.h"
#include "ops/device.h"
#include "ops/registry.h"

namespace tern {

struct ModelSelftestOptions {
  SelftestMode mode = SelftestMode::kFast;
  std::string device = "auto";                // auto (the first GPU if any) | cpu | cuda
  std::map<std::string, std::string> forced;  // op -> implementation name ("auto" entries are ignored)
  std::vector<int64_t> batch_sizes = {1, 8};
  int tensor_parallel_size = 1;  // plan rank 0's shapes of the model split this many ways
  bool expert_parallel = false;  // the routed experts split whole among the ranks (ShardRank::expert_parallel)
  int64_t verify_rows = 0;       // speculative decoding's rows per verification (0: none); models/selftest_plan.h
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;  // the cache form whose kernels the plan tests
};

struct ModelSelftestReport {
  std::vector<DeviceDescription> devices;  // every device seen (the CPU first)
  DeviceDescription device;                // the one the ops were tested on
  std::vector<Selection> selections;       // one per op the model needs
  std::vector<std::string> notes;          // ops the model needs that no implementation covers yet
  int n_missing = 0;                       // ops without a verified implementation
  double seconds = 0.0;                    // wall time of the whole self-test
  std::string verdict;
};

// `model_dir` empty: generic shapes (a 4096 x 4096 GEMM). Errors: an unreadable model, a bad --device, an
// implementation forced for an op the model does not run, an unknown forced implementation, or a forced
// implementation that fails (the message says which and why).
Expected<ModelSelftestReport> model_selftest_run(const std::string& model_dir, const ModelSelftestOptions& options);

// The backend flags shared by serve, generate and doctor, as op -> implementation name: the named ones and any op
// through `--kernel OP=IMPL` (repeatable).
struct BackendFlags {
  std::string attention = "auto", moe = "auto", gemm = "auto", fp4_gemm = "auto", gdn = "auto";
  std::vector<std::string> kernels;  // "OP=IMPL"
  // Errors: a --kernel entry without '=' or with an empty side, or one op forced to two different implementations.
  Expected<std::map<std::string, std::string>> forced() const;
};

}  // namespace tern
