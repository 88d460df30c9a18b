// The registry of kernel implementations and the start-up self-test that chooses among them.
//
// Every op (gemm_bf16, gemm_nvfp4, attention_decode, ...) has a harness that makes fresh random inputs for a case
// (the model's real shapes) and computes the reference output, and named implementations ("cpu", "cublaslt",
// "w4a16", "fp4-native", ...) that each declare what they need from the device and this binary. Selection runs
// every supported implementation on the actual device, rejects any whose output is unwritten, non-finite, all
// zero, beyond its tolerance or not repeatable, and keeps the fastest of the rest. A user may force one by name;
// if it fails, selection fails with the reason, never silently falls back.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "ops/device.h"
#include "ops/verify.h"

namespace tern {

enum class SelftestMode { kOff, kFast, kFull };
Expected<SelftestMode> selftest_mode_parse(std::string_view text);  // "off" | "fast" | "full"

struct SelfTestCase {
  std::string label;          // e.g. "M=1 N=4096 K=4096"
  std::vector<int64_t> dims;  // the op's own meaning (documented by its harness)
  // Also run by `--selftest fast` (which otherwise runs each op's first case only): a case that reaches kernel code
  // no other case of the op does (the Gated DeltaNet kernels' speculative-verification instances).
  bool in_fast = false;
};

// Base of each op's input bundle; the harness creates it, implementations read their op's concrete type.
struct OpInputs {
  virtual ~OpInputs() = default;
};

struct OpHarness {
  std::string op;
  std::function<Expected<std::unique_ptr<OpInputs>>(const SelfTestCase&, uint64_t seed)> make_inputs;
  std::function<std::vector<float>(const OpInputs&)> reference;
};

struct RunOutput {
  std::vector<float> values;  // the output widened to float; unwritten elements keep the poison pattern
  double seconds = 0.0;       // time of one call on the device
};

// A lower-priority implementation is chosen over a higher-priority one that passed only when its self-test time
// is shorter by more than this fraction: closer timings are within the run-to-run noise of one GPU (see
// docs/perf/gpu.md §select-margin).
inline constexpr double kSelectMargin = 0.05;

struct Implementation {
  std::string op;
  std::string name;
  Backend backend = Backend::kCpu;
  int priority = 0;            // order for --selftest off and for near-ties (higher first; kSelectMargin)
  Tolerance tolerance;         // for this implementation's number format
  // "" when it can run this case on this device (resources, instructions, machine code), else the reason.
  std::function<std::string(const DeviceDescription&, const SelfTestCase&)> unsupported_reason;
  std::function<Expected<RunOutput>(const OpInputs&)> run;
  // Self-tested and reported, but chosen only when forced (--kernel OP=IMPL): for a kernel whose self-test time does
  // not predict its cost in the model.
  bool opt_in = false;
};

class Registry {
 public:
  Expected<void> add_harness(OpHarness harness);
  Expected<void> add(Implementation implementation);
  const OpHarness* harness(std::string_view op) const;
  std::vector<const Implementation*> implementations(std::string_view op) const;  // priority order
  std::vector<std::string> ops() const;

 private:
  std::map<std::string, OpHarness, std::less<>> harnesses_;
  std::vector<Implementation> implementations_;
};

enum class CandidateStatus { kUnsupported, kFailed, kPassed, kNotTested };
std::string_view candidate_status_name(CandidateStatus status);

struct CandidateReport {
  std::string name;
  CandidateStatus status = CandidateStatus::kNotTested;
  std::string reason;        // why unsupported or failed (the first failing case named)
  double max_error = 0.0;    // worst over the cases
  double bound = 0.0;
  double seconds = 0.0;      // summed over the cases
  bool opt_in = false;       // Implementation::opt_in: never chosen unless forced
};

struct Selection {
  std::string op;
  std::string chosen;        // empty: no implementation was verified for this op on this device
  bool forced = false;
  bool tested = true;        // false under --selftest off
  std::vector<CandidateReport> candidates;
  double selftest_seconds = 0.0;

  const CandidateReport* candidate(std::string_view name) const;  // null when no candidate has that name
};

struct SelectOptions {
  std::string forced = "auto";  // an implementation name or "auto"
  SelftestMode mode = SelftestMode::kFull;
  uint64_t seed = 0x7465726eu;  // fresh inputs per run come from seeding with the start time in production
};

// Errors: unknown op, unknown forced name (lists the registered ones), or a forced implementation that is
// unsupported or fails its self-test. With "auto", failing candidates are reported, not errors.
Expected<Selection> registry_select(const Registry& registry, std::string_view op, const DeviceDescription& device,
                                    std::span<const SelfTestCase> cases, const SelectOptions& options);

}  // namespace tern
