#include "runtime/cpu_runner.h"

#include <fmt/format.h>

#include "models/cpu/cpu_ops.h"

namespace tern {
namespace {

class CpuRunner final : public DeviceRunner {
 public:
  CpuRunner(std::unique_ptr<CausalLm> model, Communicator* comm) : DeviceRunner(std::move(model)), ops_(step_) {
    step_.hidden = config().hidden_size;
    step_.comm = comm;
  }
  using DeviceRunner::place;

  ModelDevice device() const override { return ModelDevice::kCpu; }
  std::string describe() const override {
    return step_.comm == nullptr ? "cpu" : fmt::format("cpu, rank {} of {}", step_.comm->rank(), step_.comm->world());
  }
  int64_t kv_cache_tokens() const override { return 0; }

 private:
  BlockOps& ops() override { return ops_; }
  Expected<void> finish_load() override { return {}; }
  std::shared_ptr<DeviceSequenceState> new_device_state() override { return nullptr; }
  Expected<std::vector<float>> step(std::span<const SequenceInput> batch, LogitsFor which,
                                    const Tracer* tracer) override {
    step_.begin(batch, which, tracer);
    const Expected<void> ran = run_model();
    step_.end();
    if (!ran) return tl::unexpected<Error>(ran.error());
    return std::move(step_.logits);
  }

  CpuStep step_;
  CpuOps ops_;
};

}  // namespace

Expected<std::unique_ptr<ModelRunner>> cpu_runner_create(std::unique_ptr<CausalLm> model, Communicator* comm) {
  auto runner = std::make_unique<CpuRunner>(std::move(model), comm);
  TERN_TRY(runner->place());
  return std::unique_ptr<ModelRunner>(std::move(runner));
}

}  // namespace tern
