#include "models/cpu/cpu_ops.h"

#include <fmt/format.h>

#include "layers/attention.h"
#include "layers/gated_deltanet.h"
#include "layers/linear.h"
#include "layers/moe.h"
#include "layers/norms.h"

namespace tern {
namespace {

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

}  // namespace

Expected<std::unique_ptr<Block>> CpuOps::embedding(const CpuMatrix& table) {
  return std::make_unique<CpuEmbedding>(table, s_);
}
Expected<std::unique_ptr<Block>> CpuOps::attention(const RmsNorm& norm, const Attention& a) {
  return std::make_unique<CpuMixerBlock>(norm, a, s_);
}
Expected<std::unique_ptr<Block>> CpuOps::gated_deltanet(const RmsNorm& norm, const GatedDeltaNet& g) {
  return std::make_unique<CpuMixerBlock>(norm, g, s_);
}
Expected<std::unique_ptr<Block>> CpuOps::mlp(const RmsNorm& norm, const Mlp& m) {
  return std::make_unique<CpuFeedForwardBlock>(norm, m, s_);
}
Expected<std::unique_ptr<Block>> CpuOps::moe(const RmsNorm& norm, const Moe& m) {
  return std::make_unique<CpuFeedForwardBlock>(norm, m, s_);
}
Expected<std::unique_ptr<Block>> CpuOps::lm_head(const RmsNorm& final_norm, const Linear& head) {
  return std::make_unique<CpuHead>(final_norm, head, s_);
}
Expected<void> CpuOps::trace_output(std::string_view name) {
  if (s_.tracer) (*s_.tracer)(name, s_.out.data(), s_.batch.n_rows, s_.hidden);
  return {};
}

void CpuStep::begin(std::span<const SequenceInput> batch_inputs, LogitsFor which_rows, const Tracer* step_tracer) {
  inputs = batch_inputs;
  which = which_rows;
  tracer = step_tracer;
  batch = Batch{};
  for (const SequenceInput& in : inputs) {
    batch.sequences.push_back({batch.n_rows, static_cast<int64_t>(in.tokens.size()), in.cache->length, in.cache});
    batch.n_rows += static_cast<int64_t>(in.tokens.size());
  }
  const size_t n = static_cast<size_t>(batch.n_rows * hidden);
  x.assign(n, 0.0f);
  normed.assign(n, 0.0f);
  out.assign(n, 0.0f);
  logits.clear();
}

void CpuStep::end() {
  inputs = {};
  tracer = nullptr;
}

}  // namespace tern
