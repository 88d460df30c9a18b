#include "runtime/cuda_runner.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <map>
#include <thread>

#include "core/formats.h"
#include "models/gpu/cuda_ops.h"
#include "runtime/cuda_sampler.h"

namespace tern {
namespace {

// ---- Cache bookkeeping: KV blocks and Gated DeltaNet state slots, shared with the sequences holding them. ----

struct CachePool {
  std::vector<int32_t> free_blocks;  // a stack: the most recently freed block is reused first
  std::vector<int32_t> free_slots;
};

class CudaSequence final : public DeviceSequenceState {
 public:
  explicit CudaSequence(std::shared_ptr<CachePool> pool) : pool_(std::move(pool)) {}
  ~CudaSequence() override {
    pool_->free_blocks.insert(pool_->free_blocks.end(), blocks.rbegin(), blocks.rend());
    if (slot >= 0) pool_->free_slots.push_back(slot);
  }
  CudaSequence(const CudaSequence&) = delete;
  CudaSequence& operator=(const CudaSequence&) = delete;

  std::vector<int32_t> blocks;
  int32_t slot = -1;

 private:
  std::shared_ptr<CachePool> pool_;
};

// Per-step metadata, host side, laid out as one int32 array copied to the device in one transfer. A decode step
// (one token per sequence, logits of the last rows) rounds its block-table width up to a power of two and sizes
// attention for that many blocks, and is filled up with padding rows to the next batch-size bucket (with or
// without CUDA graphs, so that --enforce-eager launches what a graph replays), so the kernels' launch shapes
// depend only on (n_seqs, max_blocks): the key under which the step's CUDA graph is kept. Its outputs do not
// depend on whether a graph replays it.
struct HostStepPlan {
  bool decode = false;
  // Replayed as a CUDA graph: a decode step, a verification of the same row count in every sequence, or a draft
  // module's chained row per sequence. Padded to the batch bucket with `rows` rows per padding sequence, its block
  // tables `max_blocks` wide (a power of two).
  bool graphed = false;
  bool draft = false;  // the draft module's step
  int64_t rows = 1;    // rows per sequence of a graphed step
  int64_t tokens = 0, n_seqs = 0, max_query_len = 0, max_seq_len = 0, max_blocks = 0;
  int64_t real_seqs = 0;  // the step's own sequences, first; the padding rows after them
  int64_t max_rows = 0;   // row_slots per sequence (CudaStep::row_slots), when the step verifies
  std::vector<int32_t> ids, positions, slot_mapping, query_start, seq_lens, block_tables, state_slot, seq_past,
      head_rows, row_slots, hidden_rows;
};

class CudaRunner final : public DeviceRunner {
 public:
  CudaRunner(std::unique_ptr<CausalLm> model, const DeviceModelOptions& options, DeviceCommunicator* comm)
      : DeviceRunner(std::move(model)),
        options_(options),
        comm_(comm),
        ctx_(options.device),
        ops_(ctx_, options, config().hidden_size, comm),
        pool_(std::make_shared<CachePool>()) {}
  ~CudaRunner() override {
    drop_graphs();
    if (meta_host_ != nullptr) cudaFreeHost(meta_host_);
  }

  using DeviceRunner::place;

  int64_t kv_cache_tokens() const override { return ops_.kv_blocks() * options_.kv_block_size; }
  // The checks of plan_step and sequence_ids that change nothing: step sizes, token ids, a scheduler's ids against
  // the cache, and room in the pool for the leased sequences' new blocks and slots.
  Expected<void> check_inputs(std::span<const SequenceInput> batch) const override;
  ModelDevice device() const override { return ModelDevice::kCuda; }
  std::string describe() const override {
    const auto captured = std::count_if(graphs_.begin(), graphs_.end(), [](const auto& g) { return g.second.exec; });
    return fmt::format("cuda:{} {} ({:.2f} GiB of weights, KV cache {} tokens in blocks of {}, {}{}{})", options_.device,
                       ctx_.props().name, static_cast<double>(ops_.weight_bytes()) / (1 << 30), kv_cache_tokens(),
                       options_.kv_block_size,
                       graphs_enabled_ ? fmt::format("{} decode graphs, captured at load in {:.2f} s", captured,
                                                     capture_seconds_)
                                       : std::string("eager decode"),
                       pdl_ ? ", programmatic launch in decode steps" : "",
                       comm_ ? fmt::format(", rank {} of {} ({})", comm_->rank(), comm_->world(), comm_->describe())
                             : std::string());
  }

 private:
  BlockOps& ops() override { return ops_; }
  Expected<void> finish_load() override;
  std::shared_ptr<DeviceSequenceState> new_device_state() override { return std::make_shared<CudaSequence>(pool_); }
  Expected<std::vector<float>> step(std::span<const SequenceInput> batch, LogitsFor which,
                                    const Tracer* tracer) override;
  Expected<SampleResults> sample_step(std::span<const SequenceInput> batch, std::span<const SampleRow> rows) override;
  Expected<SampleResults> sample_rows_step(std::span<const SequenceInput> batch,
                                           std::span<const SampleRow> rows) override;
  // The plan of a model step (verifications of one length replayed as a graph), uploaded and queued.
  Expected<HostStepPlan> run_step(std::span<const SequenceInput> batch, LogitsFor which, const Tracer* tracer);
  Expected<void> restore_verified(SequenceCache& seq, int64_t rows) override;
  Expected<std::vector<float>> draft_step(std::span<const DraftInput> inputs, LogitsFor which,
                                          std::span<const int64_t> hidden_rows) override;
  Expected<std::vector<int32_t>> draft_argmax_step(std::span<const DraftInput> inputs,
                                                   std::span<const int64_t> hidden_rows) override;
  // The draft module's step queued on the stream (draft_step and draft_argmax_step): its logits in logits_, the
  // plan returned.
  Expected<HostStepPlan> run_draft_step(std::span<const DraftInput> inputs, LogitsFor which,
                                        std::span<const int64_t> hidden_rows);

  // A sequence's KV blocks (at least need_blocks) and state slot: the scheduler's, checked, when the input carries
  // them; else its lease's, grown from this runner's pool.
  struct SequenceIds {
    std::span<const int32_t> blocks;
    int32_t state_slot = -1;
  };
  Expected<SequenceIds> sequence_ids(const SequenceInput& in, int64_t need_blocks);
  // check_inputs for sequences whose rows start at past[i] (their caches' lengths, or a draft step's positions).
  Expected<void> check_batch(std::span<const SequenceInput> batch, std::span<const int64_t> past) const;
  // The plan of a model step (past = the caches' lengths) or a draft step (past = the inputs' positions; no
  // verification, every row's hidden state read from hidden_rows).
  // `graphed`: the step is padded to its bucket and block-table width as a graph step (rows per sequence: the
  // first sequence's; the caller checked they are all alike).
  Expected<HostStepPlan> plan_step(std::span<const SequenceInput> batch, bool decode, LogitsFor which,
                                   std::span<const int64_t> past, bool graphed = false, bool draft = false);
  // The Gated DeltaNet slot holding a sequence's state (logical slot: the scheduler's or its lease's). Each
  // logical slot owns verify_rows + 1 of the device's slots: the state's, and one per row of a verification,
  // which keep_rows makes the state's by pointing the sequence there (no copy).
  int32_t state_of(int32_t logical) const { return logical < 0 ? logical : state_at_[static_cast<size_t>(logical)]; }
  // Padding rows up to `n_seqs` sequences of one token each: token 0 at position 0 of a fresh sequence, its K and V
  // written to the spare block and its Gated DeltaNet state to the spare slot (CudaOps), its logits ignored. Then
  // the block tables, `width` blocks per sequence.
  // A graphed step's padding (p.rows rows per padding sequence) is the same, at positions 0 .. rows - 1.
  void pad_decode(HostStepPlan& p, int64_t n_seqs, std::span<const std::span<const int32_t>> tables) const;
  // Whether a step of n sequences of `rows` rows each can be a graphed step (its padded rows fit the buffers).
  bool graph_fits(int64_t n, int64_t rows) const {
    return graphs_enabled_ && decode_bucket(n) * rows <= options_.max_batch_tokens &&
           decode_bucket(n) <= options_.max_sequences;
  }
  // The batch-size bucket of a decode step of n sequences (the graphs' batch sizes: 1, 2, 4, 8, then steps of 8).
  int64_t decode_bucket(int64_t n) const;
  // Captures the decode graph of every bucket and block-table width up to max_context_tokens, at load, so that no
  // step pays a capture (a shape beyond them is captured on its second use, as before).
  Expected<void> capture_decode_graphs();
  // Uploads the plan and hands its device view to the blocks, with the logits buffer grown for its rows.
  // A draft step (hidden_in set: the hidden states its input block reads) keeps its rows' hidden states in the
  // draft's buffer, a model step in the model's.
  Expected<void> begin_step(const HostStepPlan& plan, LogitsFor which, const Tracer* tracer,
                            const uint16_t* hidden_in = nullptr);
  // The model's layer loop, on the stream, with no synchronisation. Programmatic launch hides the gaps between a
  // decode step's short kernels; in a prefill, whose kernels run many waves, it costs (see docs/perf/gpu.md
  // §model-path), so it is on in decode steps only.
  Expected<void> run_body();  // the model's layer loop, or the draft module's in a draft step
  // run_body, through the step's CUDA graph when it is a graphed step: the first step of a shape runs eagerly
  // (cuBLASLt plans, lazily loaded kernels), the second is captured, later ones replay it. A capture that fails
  // turns graphs off, loudly.
  Expected<void> run_decode(const HostStepPlan& plan);
  // The first n rows of the step's logits, as fp32 on the host (waits for the stream).
  Expected<std::vector<float>> download_logits(int64_t n);
  struct DecodeGraph;
  // Captures the body of the step begun into g (no launch). False when the capture failed: graphs are then off for
  // good, with a warning.
  Expected<bool> capture(DecodeGraph& g, const HostStepPlan& plan);
  void drop_graphs();

  DeviceModelOptions options_;
  DeviceCommunicator* comm_ = nullptr;  // the tensor-parallel group, or null
  DeviceContext ctx_;
  CudaOps ops_;
  std::shared_ptr<CachePool> pool_;
  bool pdl_ = false;  // programmatic launch wanted and taken by the device (decode steps only: run_body)

  DeviceBuffer logits_;  // [rows, vocab] bf16: max_sequences rows, grown on demand (drops graphs)
  DeviceBuffer meta_buffer_;
  int32_t* meta_ = nullptr;            // device copy of the step plan
  int32_t* meta_host_ = nullptr;       // pinned staging
  size_t meta_capacity_ = 0;           // int32 elements
  std::vector<uint16_t> logits_host_;  // bf16 staging of the logits
  // The graphs of graphed steps (HostStepPlan::graphed); they bake in every buffer address, so a reallocated meta_
  // or logits_ drops them all.
  struct DecodeGraph {
    bool warmed = false;
    cudaGraphExec_t exec = nullptr;
  };
  // Keyed by (n_seqs, block-table width, rows per sequence, draft step).
  std::map<std::tuple<int64_t, int64_t, int64_t, bool>, DecodeGraph> graphs_;
  bool graphs_enabled_ = true;
  std::vector<int64_t> buckets_;  // decode batch sizes, ascending, the last = the most a step holds
  double capture_seconds_ = 0;
  CudaSampler sampler_;  // sized for sampler_rows_ rows
  int64_t sampler_rows_ = 0;
  // The device slot of each logical state slot's current state (identity without a draft module).
  std::vector<int32_t> state_at_;
  // The sequences verified in the last model step: their logical slot and the slots of their rows' states.
  struct Verified {
    int32_t logical = -1;
    std::vector<int32_t> row_slots;
  };
  std::map<const SequenceCache*, Verified> verified_;
};

Expected<void> CudaRunner::finish_load() {
  pdl_ = options_.programmatic_launch && programmatic_launch_probe(ctx_);
  // Collectives staged through the host (ranks sharing one GPU) cannot be captured: those steps run eagerly.
  graphs_enabled_ = options_.cuda_graphs && ops_.graph_capturable();
  TERN_TRY(ops_.allocate());
  // The sampler takes a decode step's rows, or a verification's (forward_sample_rows).
  sampler_rows_ = options_.max_sequences * std::max<int64_t>(ops_.verify_rows(), 1);
  TERN_TRY(sampler_.allocate(sampler_rows_, ops_.vocab()));
  // Logits of a decode step (or a verification) at the largest batch, allocated now so that no graph sees this
  // buffer move.
  const int64_t logit_rows = options_.max_sequences * std::max<int64_t>(ops_.verify_rows(), 1);
  if (!DeviceBuffer::try_allocate(static_cast<size_t>(logit_rows * ops_.vocab()) * 2, logits_)) {
    return make_error("out of device memory for the logits of {} rows", logit_rows);
  }
  for (int64_t b = ops_.kv_blocks() - 1; b >= 0; --b) pool_->free_blocks.push_back(static_cast<int32_t>(b));
  for (int64_t s = options_.max_sequences - 1; s >= 0; --s) pool_->free_slots.push_back(static_cast<int32_t>(s));
  const int64_t group = ops_.verify_rows() + 1;
  for (int64_t s = 0; s < options_.max_sequences; ++s) state_at_.push_back(static_cast<int32_t>(s * group));
  const int64_t most = std::min(options_.max_sequences, options_.max_batch_tokens);
  for (int64_t b = 1; b < most; b = b < 8 ? 2 * b : b + 8) buckets_.push_back(b);
  buckets_.push_back(most);
  // The step plan's largest size (a full prefill's rows and every sequence's whole block table), so that no step
  // reallocates it and drops the graphs.
  const int64_t seqs = options_.max_sequences, rows = std::max(options_.max_batch_tokens, logit_rows);
  meta_capacity_ = static_cast<size_t>(5 * rows + 6 * seqs + seqs * ops_.verify_rows() +
                                       seqs * std::max<int64_t>(ops_.kv_blocks(), 1) + 64);
  TERN_CUDA_CHECK(cudaMallocHost(&meta_host_, meta_capacity_ * 4));
  meta_buffer_ = DeviceBuffer(meta_capacity_ * 4);
  meta_ = meta_buffer_.as<int32_t>();
  return capture_decode_graphs();
}

int64_t CudaRunner::decode_bucket(int64_t n) const {
  const auto it = std::lower_bound(buckets_.begin(), buckets_.end(), n);
  return it == buckets_.end() ? n : *it;
}

void CudaRunner::pad_decode(HostStepPlan& p, int64_t n_seqs, std::span<const std::span<const int32_t>> tables) const {
  const int64_t bs = options_.kv_block_size;
  const bool has_kv = ops_.kv_blocks() > 0;
  while (p.n_seqs < n_seqs) {
    for (int64_t i = 0; i < p.rows; ++i) {
      p.ids.push_back(0);
      p.positions.push_back(static_cast<int32_t>(i));
      p.slot_mapping.push_back(has_kv ? static_cast<int32_t>(ops_.spare_block() * bs + i) : 0);
      p.head_rows.push_back(static_cast<int32_t>(p.tokens + i));
      if (p.draft) p.hidden_rows.push_back(0);
    }
    p.tokens += p.rows;
    p.query_start.push_back(static_cast<int32_t>(p.tokens));
    p.seq_lens.push_back(static_cast<int32_t>(p.rows));
    p.state_slot.push_back(ops_.spare_slot());
    p.seq_past.push_back(0);
    if (!p.row_slots.empty()) p.row_slots.resize(p.row_slots.size() + static_cast<size_t>(p.max_rows), -1);
    p.n_seqs += 1;
    p.max_query_len = std::max(p.max_query_len, p.rows);
  }
  p.block_tables.assign(static_cast<size_t>(p.n_seqs * p.max_blocks), has_kv ? ops_.spare_block() : 0);
  for (int64_t s = 0; s < p.n_seqs; ++s) {
    if (s < static_cast<int64_t>(tables.size())) {
      const std::span<const int32_t> blocks = tables[s].first(std::min<size_t>(tables[s].size(), p.max_blocks));
      std::copy(blocks.begin(), blocks.end(), p.block_tables.begin() + s * p.max_blocks);
    }
  }
}

Expected<void> CudaRunner::capture_decode_graphs() {
  if (!graphs_enabled_) return {};
  const auto start = std::chrono::steady_clock::now();
  const int64_t bs = options_.kv_block_size, kv_blocks = ops_.kv_blocks();
  const int64_t context = options_.max_context_tokens > 0 ? options_.max_context_tokens : kv_blocks * bs;
  // The block-table widths plan_step gives decode steps: powers of two, capped at the cache's blocks.
  const int64_t widest = decode_graph_max_blocks(context, kv_blocks, bs);
  std::vector<int64_t> widths;
  for (int64_t w = 1; w < widest; w *= 2) widths.push_back(w);
  widths.push_back(widest);
  for (const int64_t n : buckets_) {
    bool warmed = false;
    for (const int64_t w : widths) {
      HostStepPlan p;
      p.decode = p.graphed = true;
      p.max_blocks = w;
      p.max_seq_len = w * bs;
      p.query_start.push_back(0);
      pad_decode(p, n, {});
      DecodeGraph& g = graphs_[{n, w, 1, false}];
      TERN_TRY(begin_step(p, LogitsFor::kLastToken, nullptr));
      if (!warmed) {  // cuBLASLt plans and lazily loaded kernels of this batch size, outside the capture
        TERN_TRY(run_body());
        warmed = true;
      }
      // The next plan is staged in the same pinned buffer: this one's copy (and warm-up) must be done first.
      TERN_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream()));
      g.warmed = true;
      TERN_ASSIGN_OR_RETURN(const bool captured, capture(g, p));
      if (!captured) return {};  // decode steps run eagerly from now on
    }
  }
  const cudaError_t status = cudaStreamSynchronize(ctx_.stream());
  if (status != cudaSuccess) {
    return make_error("CUDA error while capturing the decode graphs: {}", cudaGetErrorString(status));
  }
  capture_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {};
}

Expected<CudaRunner::SequenceIds> CudaRunner::sequence_ids(const SequenceInput& in, int64_t need_blocks) {
  const int64_t bs = options_.kv_block_size, kv_blocks = ops_.kv_blocks();
  const bool needs_blocks = kv_blocks > 0, needs_slot = ops_.has_gdn();
  if (!in.kv_blocks.empty() || in.state_slot >= 0) {  // a scheduler's ids: checked by check_inputs, never allocated
    return SequenceIds{in.kv_blocks, in.state_slot};
  }
  auto* seq = dynamic_cast<CudaSequence*>(in.cache->device.get());
  if (seq == nullptr) return make_error("a sequence was not created by this CUDA model (new_sequence())");
  while (needs_blocks && static_cast<int64_t>(seq->blocks.size()) < need_blocks) {
    if (pool_->free_blocks.empty()) {
      return make_error("the KV cache is full ({} tokens); finish or cancel requests, or raise --max-total-tokens",
                        kv_blocks * bs);
    }
    seq->blocks.push_back(pool_->free_blocks.back());
    pool_->free_blocks.pop_back();
  }
  if (needs_slot && seq->slot < 0) {
    if (pool_->free_slots.empty()) {
      return make_error("no free state slot: {} sequences are alive", options_.max_sequences);
    }
    seq->slot = pool_->free_slots.back();
    pool_->free_slots.pop_back();
  }
  return SequenceIds{seq->blocks, seq->slot};
}

Expected<void> CudaRunner::check_inputs(std::span<const SequenceInput> batch) const {
  std::vector<int64_t> past;
  for (const SequenceInput& in : batch) past.push_back(in.cache->length);
  return check_batch(batch, past);
}

Expected<void> CudaRunner::check_batch(std::span<const SequenceInput> batch, std::span<const int64_t> past) const {
  TERN_TRY(ModelRunner::check_inputs(batch));
  if (static_cast<int64_t>(batch.size()) > options_.max_sequences) {
    return make_error("{} sequences in one step; this model was set up for at most {}", batch.size(),
                      options_.max_sequences);
  }
  const int64_t bs = options_.kv_block_size, kv_blocks = ops_.kv_blocks();
  const bool needs_blocks = kv_blocks > 0, needs_slot = ops_.has_gdn();
  int64_t tokens = 0, new_blocks = 0, new_slots = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const SequenceInput& in = batch[i];
    const int64_t n = static_cast<int64_t>(in.tokens.size()), need_blocks = (past[i] + n + bs - 1) / bs;
    tokens += n;
    if (in.verify && needs_slot && n > ops_.verify_rows()) {
      return make_error("a verification of {} rows; this model was loaded for at most {} (a draft module and "
                        "--speculative-num-steps {})", n, ops_.verify_rows(), ops_.verify_rows() - 1);
    }
    if (!in.kv_blocks.empty() || in.state_slot >= 0) {
      if (needs_blocks && static_cast<int64_t>(in.kv_blocks.size()) < need_blocks) {
        return make_error("a sequence of {} tokens came with {} KV blocks of {} tokens", need_blocks * bs,
                          in.kv_blocks.size(), bs);
      }
      for (const int32_t b : needs_blocks ? in.kv_blocks : std::span<const int32_t>{}) {
        if (b < 0 || b >= kv_blocks) return make_error("KV block {} is outside the cache's {} blocks", b, kv_blocks);
      }
      if (needs_slot && (in.state_slot < 0 || in.state_slot >= options_.max_sequences)) {
        return make_error("state slot {} is outside the {} this model holds", in.state_slot, options_.max_sequences);
      }
      continue;
    }
    const auto* seq = dynamic_cast<const CudaSequence*>(in.cache->device.get());
    if (seq == nullptr) return make_error("a sequence was not created by this CUDA model (new_sequence())");
    if (needs_blocks) new_blocks += std::max<int64_t>(0, need_blocks - static_cast<int64_t>(seq->blocks.size()));
    if (needs_slot && seq->slot < 0) ++new_slots;
  }
  if (new_blocks > static_cast<int64_t>(pool_->free_blocks.size())) {
    return make_error("the KV cache is full ({} tokens); finish or cancel requests, or raise --max-total-tokens",
                      kv_blocks * bs);
  }
  if (new_slots > static_cast<int64_t>(pool_->free_slots.size())) {
    return make_error("no free state slot: {} sequences are alive", options_.max_sequences);
  }
  if (tokens > options_.max_batch_tokens) {
    return make_error("{} tokens in one step; this model was set up for at most {} (--max-batch-tokens)", tokens,
                      options_.max_batch_tokens);
  }
  return {};
}

Expected<HostStepPlan> CudaRunner::plan_step(std::span<const SequenceInput> batch, bool decode, LogitsFor which,
                                             std::span<const int64_t> past_of, bool graphed, bool draft) {
  TERN_TRY(check_batch(batch, past_of));  // sizes, token ids, ids and room: nothing below refuses the batch for them
  HostStepPlan p;
  p.decode = decode;
  p.graphed = graphed || decode;
  p.draft = draft;
  p.rows = batch.empty() ? 1 : static_cast<int64_t>(batch.front().tokens.size());
  p.n_seqs = static_cast<int64_t>(batch.size());
  const int64_t bs = options_.kv_block_size, kv_blocks = ops_.kv_blocks();
  const bool verifies = ops_.has_gdn() && std::any_of(batch.begin(), batch.end(), [](const SequenceInput& in) {
    return in.verify;
  });
  if (verifies) p.max_rows = ops_.verify_rows();
  p.query_start.push_back(0);
  std::vector<std::span<const int32_t>> tables;
  for (size_t s = 0; s < batch.size(); ++s) {
    const SequenceInput& in = batch[s];
    const int64_t past = past_of[s], n = static_cast<int64_t>(in.tokens.size());
    const int64_t need_blocks = (past + n + bs - 1) / bs;
    TERN_ASSIGN_OR_RETURN(const SequenceIds ids, sequence_ids(in, need_blocks));
    tables.push_back(ids.blocks);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = past + i;
      p.ids.push_back(in.tokens[i]);
      p.positions.push_back(static_cast<int32_t>(pos));
      p.slot_mapping.push_back(kv_blocks == 0 ? 0 : static_cast<int32_t>(ids.blocks[pos / bs] * bs + pos % bs));
      if (which == LogitsFor::kAllTokens || in.verify || i == n - 1) {
        p.head_rows.push_back(static_cast<int32_t>(p.tokens + i));
      }
      if (draft) p.hidden_rows.push_back(0);  // the caller's (draft_step)
    }
    if (verifies) {
      // A verified sequence's rows' states go to the other slots of its group, in order.
      const size_t first = p.row_slots.size();
      p.row_slots.resize(first + static_cast<size_t>(p.max_rows), -1);
      if (in.verify) {
        const int32_t at = state_of(ids.state_slot), group = static_cast<int32_t>(p.max_rows + 1);
        const int32_t base = at / group * group;
        Verified& v = verified_[in.cache];
        v.logical = ids.state_slot;
        v.row_slots.clear();
        for (int32_t k = 0; k <= p.max_rows; ++k) {
          if (base + k != at) v.row_slots.push_back(base + k);
        }
        std::copy(v.row_slots.begin(), v.row_slots.end(), p.row_slots.begin() + static_cast<ptrdiff_t>(first));
      }
    }
    p.tokens += n;
    p.query_start.push_back(static_cast<int32_t>(p.tokens));
    p.seq_lens.push_back(static_cast<int32_t>(past + n));
    p.state_slot.push_back(state_of(ids.state_slot));
    p.seq_past.push_back(static_cast<int32_t>(past));
    p.max_query_len = std::max(p.max_query_len, n);
    p.max_seq_len = std::max(p.max_seq_len, past + n);
    p.max_blocks = std::max(p.max_blocks, need_blocks);
  }
  p.max_blocks = std::max<int64_t>(p.max_blocks, 1);
  if (p.graphed && kv_blocks > 0) {
    p.max_blocks = std::min(std::bit_ceil(static_cast<uint64_t>(p.max_blocks)), static_cast<uint64_t>(kv_blocks));
    p.max_seq_len = p.max_blocks * bs;
  }
  p.real_seqs = p.n_seqs;
  pad_decode(p, p.graphed ? decode_bucket(p.n_seqs) : p.n_seqs, tables);
  return p;
}

Expected<void> CudaRunner::begin_step(const HostStepPlan& p, LogitsFor, const Tracer* tracer,
                                     const uint16_t* hidden_in) {
  CudaStep step{.decode = p.decode,
                .graphed = p.graphed,
                .draft = p.draft,
                .tokens = p.tokens,
                .n_seqs = p.n_seqs,
                .max_query_len = p.max_query_len,
                .max_seq_len = p.max_seq_len,
                .max_blocks = p.max_blocks,
                .n_head_rows = static_cast<int64_t>(p.head_rows.size()),
                .max_rows = p.max_rows,
                .keep_hidden = hidden_in != nullptr ? ops_.draft_hidden() : ops_.model_hidden(),
                .hidden_in = hidden_in,
                .tracer = tracer};
  const std::vector<int32_t>* parts[] = {&p.ids,          &p.positions,  &p.slot_mapping, &p.query_start,
                                         &p.seq_lens,     &p.block_tables, &p.state_slot, &p.seq_past,
                                         &p.head_rows,    &p.row_slots,  &p.hidden_rows};
  const int32_t** targets[] = {&step.ids,         &step.positions,   &step.slot_mapping, &step.query_start,
                               &step.seq_lens,    &step.block_tables, &step.state_slot,  &step.seq_past,
                               &step.head_rows,   &step.row_slots,   &step.hidden_rows};
  size_t total = 0;
  for (const auto* v : parts) total += (v->size() + 3) / 4 * 4;  // 16-byte aligned parts
  if (total > meta_capacity_) {
    drop_graphs();
    if (meta_host_ != nullptr) TERN_CUDA_CHECK(cudaFreeHost(meta_host_));
    meta_capacity_ = std::max(total, 2 * meta_capacity_);
    TERN_CUDA_CHECK(cudaMallocHost(&meta_host_, meta_capacity_ * 4));
    meta_buffer_ = DeviceBuffer(meta_capacity_ * 4);  // the previous step has finished (forward synchronizes)
    meta_ = meta_buffer_.as<int32_t>();
  }
  size_t offset = 0;
  for (size_t i = 0; i < std::size(parts); ++i) {
    std::copy(parts[i]->begin(), parts[i]->end(), meta_host_ + offset);
    *targets[i] = parts[i]->empty() ? nullptr : meta_ + offset;
    offset += (parts[i]->size() + 3) / 4 * 4;
  }
  TERN_CUDA_CHECK(cudaMemcpyAsync(meta_, meta_host_, total * 4, cudaMemcpyHostToDevice, ctx_.stream()));
  const size_t logit_bytes = static_cast<size_t>(step.n_head_rows * ops_.vocab()) * 2;
  if (logits_.size_bytes() < logit_bytes) {
    drop_graphs();
    if (!DeviceBuffer::try_allocate(logit_bytes, logits_)) {
      return make_error("out of device memory for {} rows of logits", step.n_head_rows);
    }
  }
  step.logits = logits_.as<uint16_t>();
  ops_.begin_step(step);
  return {};
}

Expected<void> CudaRunner::run_body() {
  ctx_.set_programmatic_launch(pdl_ && ops_.step().graphed);
  return ops_.step().draft ? run_draft() : run_model();
}

void CudaRunner::drop_graphs() {
  for (auto& [key, g] : graphs_) {
    if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
  }
  graphs_.clear();
}

Expected<void> CudaRunner::run_decode(const HostStepPlan& plan) {
  if (!graphs_enabled_ || !plan.graphed) return run_body();
  DecodeGraph& g = graphs_[{plan.n_seqs, plan.max_blocks, plan.rows, plan.draft}];
  if (g.exec == nullptr && !g.warmed) {
    g.warmed = true;
    return run_body();
  }
  if (g.exec == nullptr) {
    TERN_ASSIGN_OR_RETURN(const bool captured, capture(g, plan));
    if (!captured) return run_body();
  }
  TERN_CUDA_CHECK(cudaGraphLaunch(g.exec, ctx_.stream()));
  return {};
}

Expected<bool> CudaRunner::capture(DecodeGraph& g, const HostStepPlan& plan) {
  cudaGraph_t graph = nullptr;
  TERN_CUDA_CHECK(cudaStreamBeginCapture(ctx_.stream(), cudaStreamCaptureModeThreadLocal));
  const Expected<void> ran = run_body();
  const cudaError_t ended = cudaStreamEndCapture(ctx_.stream(), &graph);
  cudaError_t made = ended;
  if (ran && ended == cudaSuccess) made = cudaGraphInstantiate(&g.exec, graph, 0);
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (ran && made == cudaSuccess) return true;
  (void)cudaGetLastError();
  g.exec = nullptr;
  graphs_enabled_ = false;
  spdlog::warn("CUDA graph capture of a {} step ({} sequences of {} rows) failed ({}); steps run eagerly from now on",
               plan.draft ? "draft" : plan.decode ? "decode" : "verification", plan.n_seqs, plan.rows,
               ran ? cudaGetErrorString(made) : ran.error().message);
  return false;
}

Expected<std::vector<float>> CudaRunner::step(std::span<const SequenceInput> batch, LogitsFor which,
                                             const Tracer* tracer) {
  TERN_ASSIGN_OR_RETURN(const HostStepPlan plan, run_step(batch, which, tracer));
  if (plan.tokens == 0) return std::vector<float>{};
  return download_logits(plan.graphed ? plan.real_seqs * plan.rows : ops_.step().n_head_rows);
}

// The device sampler has no logit bias and no banned ids: a step with a row that has either (a ban only while it
// applies to that row's output, sampling_ban_active) samples on the host (the CPU Sampler, the reference the device
// sampler follows).
bool any_logit_bias(std::span<const SampleRow> rows) {
  return std::any_of(rows.begin(), rows.end(), [](const SampleRow& r) {
    return r.sampler != nullptr && (!r.sampler->params().logit_bias.empty() ||
                                    sampling_ban_active(r.sampler->params(), r.output_ids.size()));
  });
}

Expected<SampleResults> CudaRunner::sample_rows_step(std::span<const SequenceInput> batch,
                                                    std::span<const SampleRow> rows) {
  if (any_logit_bias(rows)) return ModelRunner::sample_rows_step(batch, rows);
  for (const SampleRow& r : rows) {
    if (r.sampler != nullptr) TERN_TRY(sampling_params_validate(r.sampler->params()));
  }
  if (static_cast<int64_t>(rows.size()) > sampler_rows_) {
    return make_error("{} rows to sample in one step; this runner samples at most {}", rows.size(), sampler_rows_);
  }
  TERN_TRY(sampler_.upload(ctx_, rows));
  TERN_ASSIGN_OR_RETURN(const HostStepPlan plan, run_step(batch, LogitsFor::kLastToken, nullptr));
  if (plan.tokens == 0) return make_error("forward_sample_rows: the step has no tokens");
  const int64_t n = static_cast<int64_t>(rows.size());
  TERN_TRY(sampler_.launch(ctx_, logits_.as<uint16_t>(), n));
  return sampler_.download(ctx_, rows, logits_.as<uint16_t>(), n);
}

Expected<HostStepPlan> CudaRunner::run_step(std::span<const SequenceInput> batch, LogitsFor which,
                                            const Tracer* tracer) {
  // A verification is never a decode step, whatever its length: its states are kept per row.
  const bool decode = which == LogitsFor::kLastToken && tracer == nullptr &&
                      std::all_of(batch.begin(), batch.end(), [](const SequenceInput& in) {
                        return in.tokens.size() == 1 && !in.verify;
                      });
  // Verifications of the same length in every sequence: a graph per (bucket, width, length), its logits every row.
  const size_t rows = batch.empty() ? 0 : batch.front().tokens.size();
  const bool verify_graph = !decode && rows > 1 && tracer == nullptr && which == LogitsFor::kLastToken &&
                            graph_fits(static_cast<int64_t>(batch.size()), static_cast<int64_t>(rows)) &&
                            std::all_of(batch.begin(), batch.end(), [&](const SequenceInput& in) {
                              return in.verify && in.tokens.size() == rows;
                            });
  verified_.clear();
  std::vector<int64_t> past;
  for (const SequenceInput& in : batch) past.push_back(in.cache->length);
  TERN_ASSIGN_OR_RETURN(const HostStepPlan plan, plan_step(batch, decode, which, past, verify_graph));
  if (plan.tokens == 0) return plan;
  TERN_TRY(begin_step(plan, which, tracer));
  TERN_TRY(run_decode(plan));
  return plan;
}

Expected<std::vector<float>> CudaRunner::download_logits(int64_t n) {
  const int64_t vocab = ops_.vocab();
  logits_host_.resize(static_cast<size_t>(n * vocab));
  TERN_CUDA_CHECK(cudaMemcpyAsync(logits_host_.data(), logits_.data(), logits_host_.size() * 2, cudaMemcpyDeviceToHost,
                                  ctx_.stream()));
  const cudaError_t status = cudaStreamSynchronize(ctx_.stream());
  if (status != cudaSuccess) return make_error("CUDA error in the forward step: {}", cudaGetErrorString(status));
  std::vector<float> logits(logits_host_.size());
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = bf16_to_float(logits_host_[i]);
  return logits;
}

Expected<SampleResults> CudaRunner::sample_step(std::span<const SequenceInput> batch,
                                               std::span<const SampleRow> rows) {
  if (any_logit_bias(rows)) return ModelRunner::sample_rows_step(batch, rows);
  for (const SampleRow& r : rows) {
    if (r.sampler != nullptr) TERN_TRY(sampling_params_validate(r.sampler->params()));
  }
  const bool decode =
      std::all_of(batch.begin(), batch.end(), [](const SequenceInput& in) { return in.tokens.size() == 1; });
  verified_.clear();
  std::vector<int64_t> past;
  for (const SequenceInput& in : batch) past.push_back(in.cache->length);
  TERN_ASSIGN_OR_RETURN(const HostStepPlan plan, plan_step(batch, decode, LogitsFor::kLastToken, past));
  if (plan.tokens == 0) return make_error("forward_sample: the step has no tokens");
  TERN_TRY(begin_step(plan, LogitsFor::kLastToken, nullptr));
  TERN_TRY(sampler_.upload(ctx_, rows));
  TERN_TRY(run_decode(plan));
  const int64_t n = decode ? plan.real_seqs : ops_.step().n_head_rows;
  TERN_TRY(sampler_.launch(ctx_, logits_.as<uint16_t>(), n));
  return sampler_.download(ctx_, rows, logits_.as<uint16_t>(), n);
}

Expected<void> CudaRunner::restore_verified(SequenceCache& seq, int64_t rows) {
  if (!ops_.has_gdn()) return {};  // nothing but KV entries, which later steps overwrite
  const auto it = verified_.find(&seq);
  if (it == verified_.end()) return make_error("keep_rows: the sequence was not verified in this runner's last step");
  const Verified& v = it->second;
  if (rows < 1 || rows > static_cast<int64_t>(v.row_slots.size())) {
    return make_error("keep_rows: {} rows asked of a verification that kept {}", rows, v.row_slots.size());
  }
  state_at_[static_cast<size_t>(v.logical)] = v.row_slots[static_cast<size_t>(rows - 1)];
  verified_.erase(it);
  return {};
}

Expected<HostStepPlan> CudaRunner::run_draft_step(std::span<const DraftInput> inputs, LogitsFor which,
                                                  std::span<const int64_t> hidden_rows) {
  if (ops_.model_hidden() == nullptr) return make_error("{}: the draft module was not placed", describe());
  std::vector<SequenceInput> batch;
  std::vector<int64_t> past;
  for (const DraftInput& in : inputs) {
    batch.push_back(in.seq);
    batch.back().verify = false;
    past.push_back(in.position);
  }
  for (const int64_t row : hidden_rows) {
    if (row < 0 || row >= options_.max_batch_tokens) {
      return make_error("a draft row reads hidden row {} of a step of at most {}", row, options_.max_batch_tokens);
    }
  }
  // Chained rows (one per sequence): a graph per (bucket, width), as a decode step.
  const bool chained = inputs.front().hidden == DraftHidden::kDraft;
  const bool graphed = chained && graph_fits(static_cast<int64_t>(batch.size()), 1);
  TERN_ASSIGN_OR_RETURN(HostStepPlan plan, plan_step(batch, false, which, past, graphed, true));
  if (plan.tokens == 0) return plan;
  std::copy(hidden_rows.begin(), hidden_rows.end(), plan.hidden_rows.begin());
  TERN_TRY(begin_step(plan, which, nullptr, chained ? ops_.draft_hidden() : ops_.model_hidden()));
  TERN_TRY(run_decode(plan));
  return plan;
}

Expected<std::vector<float>> CudaRunner::draft_step(std::span<const DraftInput> inputs, LogitsFor which,
                                                   std::span<const int64_t> hidden_rows) {
  TERN_ASSIGN_OR_RETURN(const HostStepPlan plan, run_draft_step(inputs, which, hidden_rows));
  if (plan.tokens == 0) return std::vector<float>{};
  return download_logits(plan.graphed ? plan.real_seqs : ops_.step().n_head_rows);
}

Expected<std::vector<int32_t>> CudaRunner::draft_argmax_step(std::span<const DraftInput> inputs,
                                                            std::span<const int64_t> hidden_rows) {
  TERN_ASSIGN_OR_RETURN(const HostStepPlan plan, run_draft_step(inputs, LogitsFor::kLastToken, hidden_rows));
  const int64_t n = static_cast<int64_t>(inputs.size());
  if (plan.tokens == 0 || n == 0) return std::vector<int32_t>{};
  // The device sampler with greedy parameters: only the ids come back.
  std::vector<Sampler> greedy(inputs.size(), Sampler(SamplingParams{.temperature = 0.0f}));
  std::vector<SampleRow> rows;
  for (Sampler& g : greedy) rows.push_back({&g, {}, {}});
  TERN_TRY(sampler_.upload(ctx_, rows));
  TERN_TRY(sampler_.launch(ctx_, logits_.as<uint16_t>(), n));
  TERN_ASSIGN_OR_RETURN(const SampleResults got, sampler_.download(ctx_, rows, logits_.as<uint16_t>(), n));
  std::vector<int32_t> ids;
  for (const Expected<SampledToken>& t : got) {
    if (!t) return make_error("the draft module's proposal: {}", t.error().message);
    ids.push_back(t->id);
  }
  return ids;
}

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

Expected<void> cuda_use_device(int device) {
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return make_error("CUDA device {}: {}", device, cudaGetErrorString(e));
  }
  return {};
}

Expected<double> cuda_all_reduce_ms(DeviceCommunicator& comm, size_t n, int calls,
                                   std::chrono::milliseconds deadline) {
  cudaStream_t stream = nullptr;
  cudaEvent_t begin = nullptr, end = nullptr;
  TERN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  TERN_CUDA_CHECK(cudaEventCreate(&begin));
  TERN_CUDA_CHECK(cudaEventCreate(&end));
  auto done = [&](Expected<double> result) {
    cudaEventDestroy(begin);
    cudaEventDestroy(end);
    cudaStreamDestroy(stream);
    return result;
  };
  DeviceBuffer buffer(std::max<size_t>(n, 1) * 2);
  if (cudaMemsetAsync(buffer.data(), 0, n * 2, stream) != cudaSuccess) {
    return done(make_error("rank {}: could not clear the all-reduce buffer", comm.rank()));
  }
  // The untimed first call, then the timed batch; poll, so that a peer that never joins is a deadline, not a hang.
  for (int batch = 0; batch < 2; ++batch) {
    const int count = batch == 0 ? 1 : calls;
    if (batch == 1) TERN_CUDA_CHECK(cudaEventRecord(begin, stream));
    for (int i = 0; i < count; ++i) {
      if (auto r = comm.all_reduce_sum_bf16(buffer.as<uint16_t>(), n, stream); !r) {
        return done(tl::unexpected(r.error()));
      }
    }
    if (batch == 1) TERN_CUDA_CHECK(cudaEventRecord(end, stream));
    const auto start = std::chrono::steady_clock::now();
    cudaError_t status = cudaErrorNotReady;
    while ((status = cudaStreamQuery(stream)) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() - start > deadline) {
        comm.abort();
        return done(make_error("rank {}: {} all-reduces over {} ranks ({}) did not finish within {} ms", comm.rank(),
                               count, comm.world(), comm.describe(), deadline.count()));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (status != cudaSuccess) {
      return done(make_error("rank {}: the timed all-reduces failed: {}", comm.rank(), cudaGetErrorString(status)));
    }
  }
  float ms = 0.0f;
  TERN_CUDA_CHECK(cudaEventElapsedTime(&ms, begin, end));
  return done(static_cast<double>(ms) / std::max(calls, 1));
}

Expected<double> cuda_all_reduce_probe(DeviceCommunicator& comm, size_t n, std::chrono::milliseconds deadline) {
  cudaStream_t stream = nullptr;
  TERN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceBuffer buffer(n * 2);
  const std::vector<uint16_t> mine(n, float_to_bf16(static_cast<float>(comm.rank() + 1)));
  std::vector<uint16_t> got(n, 0);
  auto fail = [&](std::string why) -> Expected<double> {
    cudaStreamDestroy(stream);
    return make_error("{}", why);
  };
  if (cudaMemcpyAsync(buffer.data(), mine.data(), n * 2, cudaMemcpyHostToDevice, stream) != cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess) {
    return fail(fmt::format("rank {}: could not stage the all-reduce probe", comm.rank()));
  }
  const auto start = std::chrono::steady_clock::now();
  if (auto r = comm.all_reduce_sum_bf16(buffer.as<uint16_t>(), n, stream); !r) return fail(r.error().message);
  // Poll, so that a peer that never joins is a deadline, not a hang.
  cudaError_t status = cudaErrorNotReady;
  while ((status = cudaStreamQuery(stream)) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() - start > deadline) {
      comm.abort();
      return fail(fmt::format("rank {}: an all-reduce over {} ranks ({}) did not finish within {} ms", comm.rank(),
                              comm.world(), comm.describe(), deadline.count()));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (status != cudaSuccess) {
    return fail(fmt::format("rank {}: the all-reduce probe failed: {}", comm.rank(), cudaGetErrorString(status)));
  }
  if (cudaMemcpy(got.data(), buffer.data(), n * 2, cudaMemcpyDeviceToHost) != cudaSuccess) {
    return fail(fmt::format("rank {}: could not read the all-reduce probe back", comm.rank()));
  }
  cudaStreamDestroy(stream);
  const float want = static_cast<float>(comm.world() * (comm.world() + 1) / 2);
  for (size_t i = 0; i < n; ++i) {
    if (bf16_to_float(got[i]) != want) {
      return make_error("rank {}: the all-reduce probe summed to {} at element {}, not {} ({})", comm.rank(),
                        bf16_to_float(got[i]), i, want, comm.describe());
    }
  }
  return ms;
}

std::vector<std::string> cuda_peer_report(const std::vector<int>& devices) {
  std::vector<std::string> lines;
  for (const int a : devices) {
    for (const int b : devices) {
      if (a == b) continue;
      int can = 0;
      const cudaError_t e = cudaDeviceCanAccessPeer(&can, a, b);
      lines.push_back(fmt::format("GPU {} -> GPU {}: {}", a, b,
                                  e != cudaSuccess ? fmt::format("unknown ({})", cudaGetErrorString(e))
                                  : can        ? "peer access"
                                               : "no peer access (NCCL goes through host memory)"));
    }
  }
  return lines;
}

Expected<std::unique_ptr<ModelRunner>> cuda_runner_create(std::unique_ptr<CausalLm> model,
                                                          const DeviceModelOptions& options,
                                                          DeviceCommunicator* comm) {
  const int n_devices = cuda_device_count();
  if (n_devices == 0) return make_error("--device cuda: no CUDA device is available");
  if (options.device < 0 || options.device >= n_devices) {
    return make_error("--device cuda: device {} does not exist ({} present)", options.device, n_devices);
  }
  if (options.max_batch_tokens < 1 || options.max_sequences < 1 || options.kv_block_size < 8 ||
      (options.kv_block_size & (options.kv_block_size - 1)) != 0) {
    return make_error(
        "bad device options: max_batch_tokens {} and max_sequences {} must be >= 1, kv_block_size {} a "
        "power of two >= 8",
        options.max_batch_tokens, options.max_sequences, options.kv_block_size);
  }
  auto runner = std::make_unique<CudaRunner>(std::move(model), options, comm);
  TERN_TRY(runner->place());
  return std::unique_ptr<ModelRunner>(std::move(runner));
}

}  // namespace tern
