#include "models/cpu/cpu_ops.h"

#include <fmt/format.h>

#include <algorithm>

#include "layers/attention.h"
#include "layers/gated_deltanet.h"
#include "layers/linear.h"
#include "layers/mla.h"
#include "layers/moe.h"
#include "layers/norms.h"
#include "models/shard.h"

namespace tern {
namespace {

// A rank holding part of the vocabulary writes the rows it holds and zeros for the others; the sum over the ranks
// is then every row.
class CpuEmbedding final : public Block {
 public:
  CpuEmbedding(const CpuMatrix& table, VocabRange vocab, CpuStep& s) : table_(table), vocab_(vocab), s_(s) {}
  Expected<void> forward(int64_t) const override {
    int64_t row = 0;
    for (const SequenceInput& in : s_.inputs) {
      for (const int32_t id : in.tokens) {
        if (id < 0 || id >= vocab_.full) {
          return make_error("token id {} is outside the vocabulary [0, {})", id, vocab_.full);
        }
        float* x = &s_.x[row++ * s_.hidden];
        if (id >= vocab_.begin && id < vocab_.begin + table_.rows) {
          cpu_matrix_row(table_, id - vocab_.begin, x);
        } else {
          std::fill(x, x + s_.hidden, 0.0f);
        }
      }
    }
    return s_.all_reduce(s_.x);
  }

 private:
  const CpuMatrix& table_;
  const VocabRange vocab_;
  CpuStep& s_;
};

class CpuMixerBlock final : public Block {
 public:
  CpuMixerBlock(const RmsNorm& norm, const Mixer& mixer, CpuStep& s) : norm_(norm), mixer_(mixer), s_(s) {}
  Expected<void> forward(int64_t layer) const override {
    norm_.forward(s_.x.data(), s_.batch.n_rows, s_.normed.data());
    mixer_.forward(s_.normed.data(), s_.out.data(), s_.batch, layer, s_.tracer);
    return s_.add_out();
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
    TERN_TRY(s_.add_out());
    if (s_.tracer) (*s_.tracer)(trace_name(layer, "out"), s_.x.data(), s_.batch.n_rows, s_.hidden);
    return {};
  }

 private:
  const RmsNorm& norm_;
  const FeedForward& ffn_;
  CpuStep& s_;
};

// Only the rows whose logits are wanted (each sequence's last, or all of it when verified) go through the final norm
// and lm_head, unless the step keeps every row's normed hidden state for a draft module. Under tensor parallelism each rank computes its vocabulary rows'
// logits and every rank gathers all of them (padded to equal ranges: models/shard.h's vocab_shard_rows).
class CpuHead final : public Block {
 public:
  CpuHead(const RmsNorm& norm, const Linear& head, VocabRange vocab, CpuStep& s)
      : norm_(norm), head_(head), vocab_(vocab), s_(s) {}
  Expected<void> forward(int64_t) const override {
    const int64_t hidden = s_.hidden;
    const float* source = s_.x.data();
    if (s_.keep_hidden) {  // every row normed, once
      s_.hidden_out.resize(s_.x.size());
      norm_.forward(s_.x.data(), s_.batch.n_rows, s_.hidden_out.data());
      source = s_.hidden_out.data();
    }
    std::vector<float> rows;
    for (const BatchSlice& seq : s_.batch.sequences) {
      const int64_t n = s_.which == LogitsFor::kAllTokens || seq.verify ? seq.n_rows : 1;
      const float* first = source + (seq.row_begin + seq.n_rows - n) * hidden;
      rows.insert(rows.end(), first, first + n * hidden);
    }
    const int64_t n = static_cast<int64_t>(rows.size()) / hidden;
    if (!s_.keep_hidden) norm_.forward(rows.data(), n, rows.data());
    if (s_.tracer) (*s_.tracer)("final_norm", rows.data(), n, hidden);
    const int64_t local = head_.out_features();
    std::vector<float> mine(static_cast<size_t>(n * local), 0.0f);
    head_.forward(rows.data(), n, mine.data());
    if (s_.comm == nullptr || s_.comm->world() == 1) {
      s_.logits = std::move(mine);
      return {};
    }
    return gather(mine, n);
  }

 private:
  Expected<void> gather(const std::vector<float>& mine, int64_t n) const {
    const int64_t world = s_.comm->world(), local = head_.out_features(), full = vocab_.full;
    const int64_t range = vocab_shard_rows(full, world);
    std::vector<float> padded(static_cast<size_t>(n * range), 0.0f), all(static_cast<size_t>(world * n * range));
    for (int64_t r = 0; r < n; ++r) std::copy_n(&mine[r * local], local, &padded[r * range]);
    TERN_TRY(s_.comm->all_gather(padded, all));
    s_.logits.assign(static_cast<size_t>(n * full), 0.0f);
    for (int64_t k = 0; k < world; ++k) {
      const int64_t begin = std::min(full, k * range), rows_k = std::min(full, begin + range) - begin;
      for (int64_t r = 0; r < n; ++r) std::copy_n(&all[(k * n + r) * range], rows_k, &s_.logits[r * full + begin]);
    }
    return {};
  }

  const RmsNorm& norm_;
  const Linear& head_;
  const VocabRange vocab_;
  CpuStep& s_;
};

// fc([norm_embedding(x) ; norm_hidden(h)]) into the stream, row by row; fc is whole on every rank, so the stream
// stays replicated without a sum.
class CpuDraftInput final : public Block {
 public:
  CpuDraftInput(const RmsNorm& norm_embedding, const RmsNorm& norm_hidden, const Linear& fc, CpuStep& s)
      : norm_embedding_(norm_embedding), norm_hidden_(norm_hidden), fc_(fc), s_(s) {}
  Expected<void> forward(int64_t) const override {
    const int64_t m = s_.batch.n_rows, h = s_.hidden;
    if (static_cast<int64_t>(s_.hidden_in.size()) != m * h) {
      return make_error("the draft step was given {} hidden values for {} rows of {}", s_.hidden_in.size(), m, h);
    }
    std::vector<float> joined(static_cast<size_t>(m * 2 * h));
    for (int64_t r = 0; r < m; ++r) {
      norm_embedding_.forward(&s_.x[r * h], 1, &joined[r * 2 * h]);
      norm_hidden_.forward(&s_.hidden_in[r * h], 1, &joined[r * 2 * h + h]);
    }
    fc_.forward(joined.data(), m, s_.x.data());
    return {};
  }

 private:
  const RmsNorm& norm_embedding_;
  const RmsNorm& norm_hidden_;
  const Linear& fc_;
  CpuStep& s_;
};

}  // namespace

Expected<std::unique_ptr<Block>> CpuOps::draft_input(const RmsNorm& norm_embedding, const RmsNorm& norm_hidden,
                                                     const Linear& fc) {
  return std::make_unique<CpuDraftInput>(norm_embedding, norm_hidden, fc, s_);
}

Expected<std::unique_ptr<Block>> CpuOps::embedding(const CpuMatrix& table, VocabRange vocab) {
  return std::make_unique<CpuEmbedding>(table, vocab, s_);
}
Expected<std::unique_ptr<Block>> CpuOps::attention(const RmsNorm& norm, const Attention& a) {
  return std::make_unique<CpuMixerBlock>(norm, a, s_);
}
Expected<std::unique_ptr<Block>> CpuOps::gated_deltanet(const RmsNorm& norm, const GatedDeltaNet& g) {
  return std::make_unique<CpuMixerBlock>(norm, g, s_);
}
Expected<std::unique_ptr<Block>> CpuOps::mla(const RmsNorm& norm, const MlaAttention& a) {
  return std::make_unique<CpuMixerBlock>(norm, a, s_);
}
Expected<std::unique_ptr<Block>> CpuOps::mlp(const RmsNorm& norm, const Mlp& m) {
  return std::make_unique<CpuFeedForwardBlock>(norm, m, s_);
}
Expected<std::unique_ptr<Block>> CpuOps::moe(const RmsNorm& norm, const Moe& m) {
  return std::make_unique<CpuFeedForwardBlock>(norm, m, s_);
}
Expected<std::unique_ptr<Block>> CpuOps::lm_head(const RmsNorm& final_norm, const Linear& head, VocabRange vocab) {
  return std::make_unique<CpuHead>(final_norm, head, vocab, s_);
}
Expected<void> CpuOps::trace_output(std::string_view name) {
  if (s_.tracer) (*s_.tracer)(name, s_.out.data(), s_.batch.n_rows, s_.hidden);
  return {};
}

void CpuStep::begin(std::span<const SequenceInput> batch_inputs, LogitsFor which_rows, const Tracer* step_tracer,
                    std::span<const int64_t> positions) {
  inputs = batch_inputs;
  which = which_rows;
  tracer = step_tracer;
  batch = Batch{};
  for (size_t i = 0; i < inputs.size(); ++i) {
    const SequenceInput& in = inputs[i];
    const int64_t past = positions.empty() ? in.cache->length : positions[i];
    batch.sequences.push_back({batch.n_rows, static_cast<int64_t>(in.tokens.size()), past, in.cache, in.verify});
    batch.n_rows += static_cast<int64_t>(in.tokens.size());
  }
  const size_t n = static_cast<size_t>(batch.n_rows * hidden);
  x.assign(n, 0.0f);
  normed.assign(n, 0.0f);
  out.assign(n, 0.0f);
  logits.clear();
}

Expected<void> CpuStep::all_reduce(std::vector<float>& v) {
  if (comm == nullptr || comm->world() == 1) return {};
  return comm->all_reduce_sum(v);
}

Expected<void> CpuStep::add_out() {
  TERN_TRY(all_reduce(out));
  for (size_t i = 0; i < x.size(); ++i) x[i] += out[i];
  return {};
}

void CpuStep::end() {
  inputs = {};
  tracer = nullptr;
}

}  // namespace tern
