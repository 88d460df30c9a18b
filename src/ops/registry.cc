#include "ops/registry.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>

namespace tern {

Expected<SelftestMode> selftest_mode_parse(std::string_view text) {
  if (text == "off") return SelftestMode::kOff;
  if (text == "fast") return SelftestMode::kFast;
  if (text == "full") return SelftestMode::kFull;
  return make_error("unknown self-test mode '{}' (expected off, fast or full)", text);
}

std::string_view candidate_status_name(CandidateStatus status) {
  switch (status) {
    case CandidateStatus::kUnsupported: return "unsupported";
    case CandidateStatus::kFailed: return "failed";
    case CandidateStatus::kPassed: return "passed";
    case CandidateStatus::kNotTested: return "not tested";
  }
  return "?";
}

Expected<void> Registry::add_harness(OpHarness harness) {
  if (harnesses_.contains(harness.op)) return make_error("op '{}' already has a self-test harness", harness.op);
  harnesses_.emplace(harness.op, std::move(harness));
  return {};
}

Expected<void> Registry::add(Implementation implementation) {
  for (const Implementation& i : implementations_) {
    if (i.op == implementation.op && i.name == implementation.name) {
      return make_error("op '{}' already has an implementation named '{}'", i.op, i.name);
    }
  }
  implementations_.push_back(std::move(implementation));
  return {};
}

const OpHarness* Registry::harness(std::string_view op) const {
  auto it = harnesses_.find(op);
  return it == harnesses_.end() ? nullptr : &it->second;
}

std::vector<const Implementation*> Registry::implementations(std::string_view op) const {
  std::vector<const Implementation*> out;
  for (const Implementation& i : implementations_) {
    if (i.op == op) out.push_back(&i);
  }
  std::stable_sort(out.begin(), out.end(), [](auto* a, auto* b) { return a->priority > b->priority; });
  return out;
}

std::vector<std::string> Registry::ops() const {
  std::vector<std::string> out;
  for (const auto& [op, harness] : harnesses_) out.push_back(op);
  return out;
}

namespace {

// Runs one implementation over every case; the first failure ends its test.
void test_candidate(const Implementation& impl, const std::vector<std::unique_ptr<OpInputs>>& inputs,
                    const std::vector<std::vector<float>>& references, std::span<const SelfTestCase> cases,
                    CandidateReport& report) {
  report.status = CandidateStatus::kPassed;
  for (size_t c = 0; c < inputs.size(); ++c) {
    auto fail = [&](const std::string& why) {
      report.status = CandidateStatus::kFailed;
      report.reason = fmt::format("{}: {}", cases[c].label, why);
    };
    auto first = impl.run(*inputs[c]);
    if (!first) return fail(first.error().message);
    const Verdict verdict = verify_output(first->values, references[c], impl.tolerance);
    report.max_error = std::max(report.max_error, verdict.max_error);
    report.bound = std::max(report.bound, verdict.bound);
    if (!verdict.pass) return fail(verdict.reason);
    auto second = impl.run(*inputs[c]);
    if (!second) return fail(second.error().message);
    const Verdict repeat = verify_repeatable(first->values, second->values);
    if (!repeat.pass) return fail(repeat.reason);
    report.seconds += std::min(first->seconds, second->seconds);
  }
}

Expected<void> check_forced(std::string_view op, const SelectOptions& options,
                            const std::vector<const Implementation*>& impls) {
  if (options.forced == "auto") return {};
  std::vector<std::string> names;
  for (auto* i : impls) names.push_back(i->name);
  if (std::find(names.begin(), names.end(), options.forced) == names.end()) {
    return make_error("{}: no implementation named '{}' (registered: {}, or auto)", op, options.forced,
                      fmt::join(names, ", "));
  }
  return {};
}

}  // namespace

const CandidateReport* Selection::candidate(std::string_view name) const {
  for (const CandidateReport& c : candidates) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

Expected<Selection> registry_select(const Registry& registry, std::string_view op, const DeviceDescription& device,
                                    std::span<const SelfTestCase> cases, const SelectOptions& options) {
  const OpHarness* harness = registry.harness(op);
  if (harness == nullptr) return make_error("unknown op '{}' (known: {})", op, fmt::join(registry.ops(), ", "));
  const auto impls = registry.implementations(op);
  TERN_TRY(check_forced(op, options, impls));
  const auto start = std::chrono::steady_clock::now();
  Selection sel{.op = std::string(op), .forced = options.forced != "auto", .tested = options.mode != SelftestMode::kOff};

  // The cases run: all of them, or in fast mode the first and those marked in_fast.
  std::vector<SelfTestCase> run_cases;
  for (size_t c = 0; c < cases.size(); ++c) {
    if (options.mode != SelftestMode::kFast || c == 0 || cases[c].in_fast) run_cases.push_back(cases[c]);
  }
  std::vector<std::unique_ptr<OpInputs>> inputs;
  std::vector<std::vector<float>> references;
  if (sel.tested) {
    for (size_t c = 0; c < run_cases.size(); ++c) {
      TERN_ASSIGN_OR_RETURN(auto in, harness->make_inputs(run_cases[c], options.seed + c));
      references.push_back(harness->reference(*in));
      inputs.push_back(std::move(in));
    }
  }
  for (const Implementation* impl : impls) {
    if (sel.forced && impl->name != options.forced) continue;
    CandidateReport& report = sel.candidates.emplace_back(CandidateReport{.name = impl->name, .opt_in = impl->opt_in});
    for (size_t c = 0; c < cases.size() && report.reason.empty(); ++c) {
      const std::string why = impl->unsupported_reason ? impl->unsupported_reason(device, cases[c]) : "";
      if (!why.empty()) {
        report.status = CandidateStatus::kUnsupported;
        report.reason = fmt::format("{}: {}", cases[c].label, why);
      }
    }
    if (report.status == CandidateStatus::kUnsupported || !sel.tested) continue;
    test_candidate(*impl, inputs, references, run_cases, report);
  }
  sel.selftest_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const CandidateReport* best = nullptr;
  for (const CandidateReport& r : sel.candidates) {  // candidates are in priority order: near-ties keep the first
    const bool ran_ok = sel.tested ? r.status == CandidateStatus::kPassed : r.status == CandidateStatus::kNotTested;
    const bool usable = ran_ok && (!r.opt_in || sel.forced);
    const bool faster = sel.tested && best != nullptr && r.seconds < best->seconds * (1.0 - kSelectMargin);
    if (usable && (best == nullptr || faster)) best = &r;
  }
  if (best != nullptr) sel.chosen = best->name;
  if (sel.forced && best == nullptr) {
    const CandidateReport& r = sel.candidates.front();
    return make_error("{}: the forced implementation '{}' is {}: {}", op, r.name, candidate_status_name(r.status),
                      r.reason);
  }
  return sel;
}

}  // namespace tern
