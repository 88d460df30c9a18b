#include "models/cpu/cpu_runner.h"

#include <fmt/format.h>

#include "layers/attention.h"
#include "layers/gated_deltanet.h"
#include "layers/linear.h"
#include "layers/moe.h"
#include "layers/norms.h"

namespace tern {
namespace {

// One step as the CPU blocks see it: the residual stream x, the normed input of the running block and its output,
// all [batch.n_rows, hidden] fp32.
struct CpuStep {
  std::span<const SequenceInput> inputs;
  Batch batch;
  LogitsFor which = LogitsFor::kLastToken;
  const Tracer* tracer = nullptr;
  int64_t hidden = 0;
  std::vector<float> x, normed, out, logits;

  void add_out() {
    for (size_t i = 0; i < x.size(); ++i) x[i] += out[i];
  }
};

class CpuEmbedding final : public Block {
 public:
  CpuEmbedding(const CpuMatrix& table, CpuStep& s) : table_(table), s_(s) {}
  Expected<void> forward(int64_t) const override {
    int64_t row = 0;
    for (const SequenceInput& in : s_.inputs) {
      for (const int32_t id : in.tokens) {
        if (id < 0 || id >= table_.rows) {
          return make_error("token id {} is outside the vocabulary [0, {})", id, table_.rows);
        }
        cpu_matrix_row(table_, id, &s_.x[row++ * s_.hidden]);
      }
    }
    return {};
  }

 private:
  const CpuMatrix& table_;
  CpuStep& s_;
};

class CpuMixerBlock final : public Block {
 public:
  CpuMixerBlock(const RmsNorm& norm, const Mixer& mixer, CpuStep& s) : norm_(norm), mixer_(mixer), s_(s) {}
  Expected<void> forward(int64_t layer) const override {
    norm_.forward(s_.x.data(), s_.batch.n_rows, s_.normed.data());
    mixer_.forward(s_.normed.data(), s_.out.data(), s_.batch, layer, s_.tracer);
    s_.add_out();
    return {};
  }

 private:
  const RmsNorm& norm_;
  const Mixer& mixer_;
  CpuStep& s_;
};

class CpuFeedForwardBlock final : public Block {
 public:
  CpuFeedForwardBlock(const RmsNorm& norm, const FeedForward& ffn, CpuStep& s) : norm_(norm), ffn_(ffn), s_(s) {}
  Expected<void> forward(int64_t layer) const override {
    norm_.forward(s_.x.data(), s_.batch.n_rows, s_.normed.data());
    ffn_.forward(s_.normed.data(), s_.out.data(), s_.batch.n_rows, trace_name(layer, ""), s_.tracer);
    s_.add_out();
    if (s_.tracer) (*s_.tracer)(trace_name(layer, "out"), s_.x.data(), s_.batch.n_rows, s_.hidden);
    return {};
  }

 private:
  const RmsNorm& norm_;
  const FeedForward& ffn_;
  CpuStep& s_;
};

// Only the rows whose logits are wanted go through the final norm and lm_head.
class CpuHead final : public Block {
 public:
  CpuHead(const RmsNorm& norm, const Linear& head, CpuStep& s) : norm_(norm), head_(head), s_(s) {}
  Expected<void> forward(int64_t) const override {
    const int64_t hidden = s_.hidden;
    std::vector<float> rows;
    if (s_.which == LogitsFor::kAllTokens) {
      rows = s_.x;
    } else {
      for (const BatchSlice& seq : s_.batch.sequences) {
        const float* last = &s_.x[(seq.row_begin + seq.n_rows - 1) * hidden];
        rows.insert(rows.end(), last, last + hidden);
      }
    }
    const int64_t n = static_cast<int64_t>(rows.size()) / hidden;
    norm_.forward(rows.data(), n, rows.data());
    if (s_.tracer) (*s_.tracer)("final_norm", rows.data(), n, hidden);
    s_.logits.assign(static_cast<size_t>(n * head_.out_features()), 0.0f);
    head_.forward(rows.data(), n, s_.logits.data());
    return {};
  }

 private:
  const RmsNorm& norm_;
  const Linear& head_;
  CpuStep& s_;
};

class CpuOps final : public BlockOps {
 public:
  explicit CpuOps(CpuStep& s) : s_(s) {}
  Expected<std::unique_ptr<Block>> embedding(const CpuMatrix& table) override {
    return std::make_unique<CpuEmbedding>(table, s_);
  }
  Expected<std::unique_ptr<Block>> attention(const RmsNorm& norm, const Attention& a) override {
    return std::make_unique<CpuMixerBlock>(norm, a, s_);
  }
  Expected<std::unique_ptr<Block>> gated_deltanet(const RmsNorm& norm, const GatedDeltaNet& g) override {
    return std::make_unique<CpuMixerBlock>(norm, g, s_);
  }
  Expected<std::unique_ptr<Block>> mlp(const RmsNorm& norm, const Mlp& m) override {
    return std::make_unique<CpuFeedForwardBlock>(norm, m, s_);
  }
  Expected<std::unique_ptr<Block>> moe(const RmsNorm& norm, const Moe& m) override {
    return std::make_unique<CpuFeedForwardBlock>(norm, m, s_);
  }
  Expected<std::unique_ptr<Block>> lm_head(const RmsNorm& final_norm, const Linear& head) override {
    return std::make_unique<CpuHead>(final_norm, head, s_);
  }
  Expected<void> all_reduce_output() override { return {}; }
  Expected<void> trace_output(std::string_view name) override {
    if (s_.tracer) (*s_.tracer)(name, s_.out.data(), s_.batch.n_rows, s_.hidden);
    return {};
  }

 private:
  CpuStep& s_;
};

class CpuRunner final : public ModelRunner {
 public:
  explicit CpuRunner(int64_t hidden) : ops_(step_) { step_.hidden = hidden; }
  BlockOps& ops() override { return ops_; }
  Expected<void> finish_load() override { return {}; }
  std::shared_ptr<DeviceSequenceState> new_sequence() override { return nullptr; }
  ModelDevice device() const override { return ModelDevice::kCpu; }
  std::string describe() const override { return "cpu"; }
  int64_t kv_cache_tokens() const override { return 0; }

  Expected<std::vector<float>> forward(std::span<const SequenceInput> batch, LogitsFor which, const Tracer* tracer,
                                       const StepBody& body) override {
    CpuStep& s = step_;
    s.inputs = batch;
    s.which = which;
    s.tracer = tracer;
    s.batch = Batch{};
    for (const SequenceInput& in : batch) {
      s.batch.sequences.push_back({s.batch.n_rows, static_cast<int64_t>(in.tokens.size()), in.cache->length, in.cache});
      s.batch.n_rows += static_cast<int64_t>(in.tokens.size());
    }
    const size_t n = static_cast<size_t>(s.batch.n_rows * s.hidden);
    s.x.assign(n, 0.0f);
    s.normed.assign(n, 0.0f);
    s.out.assign(n, 0.0f);
    const Expected<void> ran = body();
    s.inputs = {};
    s.tracer = nullptr;
    if (!ran) return tl::unexpected<Error>(ran.error());
    return std::move(s.logits);
  }

 private:
  CpuStep step_;
  CpuOps ops_;
};

}  // namespace

std::unique_ptr<ModelRunner> cpu_runner_create(const ModelConfig& config) {
  return std::make_unique<CpuRunner>(config.hidden_size);
}

}  // namespace tern
