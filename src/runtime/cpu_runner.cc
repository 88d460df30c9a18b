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
    step_.keep_hidden = has_draft();
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
    model_hidden_ = std::move(step_.hidden_out);
    return std::move(step_.logits);
  }

  Expected<void> restore_verified(SequenceCache& seq, int64_t rows) override {
    for (LayerCache& layer : seq.layers) {
      if (layer.verified.empty()) continue;
      if (rows > static_cast<int64_t>(layer.verified.size())) {
        return make_error("keep_rows: {} rows asked of a layer that kept {}", rows, layer.verified.size());
      }
      RecurrentStates& kept = layer.verified[static_cast<size_t>(rows - 1)];
      layer.conv_state = std::move(kept.conv_state);
      layer.recurrent_state = std::move(kept.recurrent_state);
      layer.verified.clear();
    }
    return {};
  }

  Expected<std::vector<float>> draft_step(std::span<const DraftInput> inputs, LogitsFor which,
                                          std::span<const int64_t> hidden_rows) override {
    const std::vector<float>& source = inputs.front().hidden == DraftHidden::kModel ? model_hidden_ : draft_hidden_;
    const int64_t h = step_.hidden;
    std::vector<float> hidden_in(hidden_rows.size() * static_cast<size_t>(h));
    for (size_t k = 0; k < hidden_rows.size(); ++k) {
      const int64_t row = hidden_rows[k];
      if (row < 0 || (row + 1) * h > static_cast<int64_t>(source.size())) {
        return make_error("a draft row reads hidden row {} of a step of {}", row, source.size() / h);
      }
      std::copy_n(&source[row * h], h, &hidden_in[k * h]);
    }
    std::vector<SequenceInput> seqs;
    std::vector<int64_t> positions;
    for (const DraftInput& in : inputs) {
      seqs.push_back(in.seq);
      seqs.back().verify = false;
      positions.push_back(in.position);
    }
    step_.begin(seqs, which, nullptr, positions);
    step_.hidden_in = std::move(hidden_in);
    const Expected<void> ran = run_draft();
    step_.end();
    if (!ran) return tl::unexpected<Error>(ran.error());
    draft_hidden_ = std::move(step_.hidden_out);
    return std::move(step_.logits);
  }

  CpuStep step_;
  CpuOps ops_;
  std::vector<float> model_hidden_, draft_hidden_;  // every row's hidden state (CpuStep::hidden_out) of the last
                                                    // step of each
};

}  // namespace

Expected<std::unique_ptr<ModelRunner>> cpu_runner_create(std::unique_ptr<CausalLm> model, Communicator* comm) {
  auto runner = std::make_unique<CpuRunner>(std::move(model), comm);
  TERN_TRY(runner->place());
  return std::unique_ptr<ModelRunner>(std::move(runner));
}

}  // namespace tern
