// What every layer's forward sees: the activations of several sequences stacked row-wise (one row per new token),
// where each sequence's rows sit, how many tokens it has cached, and its cache. Linear layers run over all rows at
// once; attention and Gated DeltaNet run per sequence over its slice.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace tern {

// A Gated DeltaNet layer's states at one point of a sequence.
struct RecurrentStates {
  std::vector<float> conv_state;           // [conv_channels, kernel - 1]
  std::vector<float> recurrent_state;      // [n_value_heads, key_dim, value_dim]
};

// Per layer, per sequence: the KV cache of an attention layer or the states of a Gated DeltaNet layer.
struct LayerCache {
  std::vector<float> k, v;                 // [tokens, n_kv_heads, head_dim]
  std::vector<float> conv_state;           // [conv_channels, kernel - 1]
  std::vector<float> recurrent_state;      // [n_value_heads, key_dim, value_dim]
  // The states after each row of the sequence's last verification step (SequenceInput::verify), so that
  // ModelRunner::keep_rows can set the layer back to any of them.
  std::vector<RecurrentStates> verified;
  // MLA (layers/mla.h): k holds each token's latent [c | roped k_pe], v the DSA indexer's keys, and `selected` the
  // keys each row of the last step attended to (read by the "shared" DSA layers after it).
  std::vector<std::vector<int32_t>> selected;
};

// What a sequence holds on a device when the model runs there (KV blocks, state slots); released with the
// sequence.
struct DeviceSequenceState {
  virtual ~DeviceSequenceState() = default;
};

struct SequenceCache {
  std::vector<LayerCache> layers;
  std::shared_ptr<DeviceSequenceState> device;  // set when the model runs on a device
  int64_t length = 0;  // tokens already processed
  int64_t verified_rows = 0;  // rows of the last step, when it verified this sequence (SequenceInput::verify)
};

// One sequence of a step: its cache and the tokens appended after what the cache holds.
struct SequenceInput {
  SequenceCache* cache = nullptr;
  std::span<const int32_t> tokens;
  // Where the sequence's state lives on a device with a paged KV cache, when a scheduler allocated it (the serving
  // engine: runtime/scheduler.h owns the ids): the KV blocks holding its tokens, in order (at least enough for
  // cache->length + tokens.size()), and its recurrent-state slot. Empty / -1: the sequence's own cache lease
  // (ModelRunner::new_sequence) takes them from the runner as it grows, for callers without a scheduler.
  std::span<const int32_t> kv_blocks;
  int32_t state_slot = -1;
  // Speculative verification: these tokens are the last one and drafts after it. The step returns logits for every
  // row of this sequence (whatever LogitsFor says) and keeps the recurrent states after each row, so that
  // ModelRunner::keep_rows can keep the rows up to the first rejected draft. A mode, not a shape: a verification of
  // k + 1 tokens and a prefill chunk of k + 1 tokens differ only here.
  bool verify = false;
};

// Which rows of a step get logits: every token's, or each sequence's last.
enum class LogitsFor { kAllTokens, kLastToken };

struct BatchSlice {
  int64_t row_begin = 0;
  int64_t n_rows = 0;
  int64_t past = 0;  // cached tokens before these rows (the first row's position)
  SequenceCache* cache = nullptr;
  bool verify = false;  // SequenceInput::verify
};

struct Batch {
  std::vector<BatchSlice> sequences;
  int64_t n_rows = 0;
};

// Receives named intermediates ("layers.3.mixer_out", ...): rows x cols fp32, one row per batch row.
using Tracer = std::function<void(std::string_view name, const float* data, int64_t rows, int64_t cols)>;

inline std::string trace_name(int64_t layer, std::string_view what) { return fmt::format("layers.{}.{}", layer, what); }

}  // namespace tern
