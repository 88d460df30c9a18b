#include "runtime/tp_runner.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <charconv>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>

#include "core/fnv.h"
#include "dist/gloo_communicator.h"
#include "dist/device_communicator.h"
#include "dist/loopback.h"
#include "runtime/cpu_runner.h"

#if TERN_RUNTIME_CUDA
#include "dist/cuda/nccl_communicator.h"
#include "dist/cuda/staged_communicator.h"
#include "runtime/cuda_runner.h"
#endif

namespace tern {
namespace {

// What every node must have been started with alike, or its ranks would hold other slices, caches or formats than
// node 0 plans for, with nothing failing: each option as exact floats (22 bits a piece), config.json by its bytes'
// FNV-1a hash (the same checkpoint may sit at different paths on different machines).
struct NodeOption {
  std::string flag;
  uint64_t value;
};
constexpr int kOptionPieces = 3;  // 3 x 22 bits

Expected<std::vector<NodeOption>> node_options(const std::filesystem::path& dir, const ModelLoadOptions& o) {
  std::ifstream in(dir / "config.json", std::ios::binary);
  if (!in) return make_error("{}: cannot read config.json to compare with the other nodes'", dir.string());
  const std::string config((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return std::vector<NodeOption>{
      {"config.json (its contents)", fnv1a64(config)},
      {"--enable-expert-parallel / --ep-size", o.expert_parallel ? 1u : 0u},
      {"--kv-cache-dtype", static_cast<uint64_t>(o.kv_cache_dtype)},
      {"--load-format", static_cast<uint64_t>(o.load_format)},
      {"--dummy-seed", o.dummy_seed},
      {"--speculative-algorithm", o.load_draft ? 1u : 0u},
      {"--speculative-num-steps", static_cast<uint64_t>(o.device_options.verify_rows)},
  };
}

// One thread per rank above 0; run() hands every rank the same job (rank 0 on the calling thread) and returns when
// all have finished.
class RankThreads {
 public:
  using Job = std::function<Expected<void>(int rank)>;

  explicit RankThreads(int world) : results_(static_cast<size_t>(world)) {
    for (int r = 1; r < world; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~RankThreads() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  std::vector<Expected<void>> run(const Job& job) {
    if (results_.empty()) return {};  // a front end: no ranks
    {
      std::lock_guard lock(mu_);
      job_ = &job;
      remaining_ = static_cast<int>(threads_.size());
      ++generation_;
    }
    cv_.notify_all();
    results_[0] = job(0);
    std::unique_lock lock(mu_);
    done_.wait(lock, [&] { return remaining_ == 0; });
    job_ = nullptr;
    return results_;
  }

 private:
  void loop(int rank) {
    uint64_t seen = 0;
    while (true) {
      const Job* job = nullptr;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      Expected<void> result = (*job)(rank);
      std::lock_guard lock(mu_);
      results_[static_cast<size_t>(rank)] = std::move(result);
      if (--remaining_ == 0) done_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_, done_;
  const Job* job_ = nullptr;
  uint64_t generation_ = 0;
  int remaining_ = 0;
  bool stop_ = false;
  std::vector<Expected<void>> results_;
  std::vector<std::thread> threads_;
};

// Sequence ids whose sequences were released on node 0, for the next plan to tell the other nodes (a sequence may
// outlive its runner, hence shared).
struct ReleaseQueue {
  std::mutex mu;
  std::vector<int64_t> ids;
};

// A sequence's slice on every rank of this node; `id` names it in the plans sent to the other nodes.
struct TpSequence final : DeviceSequenceState {
  int64_t id = 0;
  std::vector<SequenceCache> ranks;
  std::shared_ptr<ReleaseQueue> released;  // null on one node
  ~TpSequence() override {
    if (released == nullptr) return;
    std::lock_guard lock(released->mu);
    released->ids.push_back(id);
  }
};

// What node 0 sends the other nodes before each step (dist/communicator.h broadcast over the control group), as
// int64 words: op, logits wanted, the released sequence ids, then per sequence its id, cached length, tokens, KV
// block ids, state slot, and the speculative fields below. kStep: a forward step; kDraft: a draft step
// (ModelRunner::draft) over the sequences; kKeepRows: ModelRunner::keep_rows of each.
// A front end's steps that return tokens instead of logits: kSample (sample_step), a kStep whose rank 0 samples each
// sequence's row with the sampling row the plan carries (PlanSampleRow); kSampleRows (sample_rows_step), the same
// over every row a verification returns; kDraftArgmax (draft_argmax_step), a kDraft whose rank 0 returns each
// input's greedy proposal.
// The lists that grow with a sequence (its KV block ids, and the ids its penalties read) go as changes: every node
// holds the lists last sent for each sequence (HeldLists), and a plan carries how many of the held values still stand
// and the values after them, so that a decode step's plan does not grow with the context.
enum class PlanOp : int64_t {
  kStep = 1, kHeartbeat = 2, kStop = 3, kDraft = 4, kKeepRows = 5, kSample = 6, kSampleRows = 7, kDraftArgmax = 8
};

bool samples(PlanOp op) { return op == PlanOp::kSample || op == PlanOp::kSampleRows; }
bool carries_blocks(PlanOp op) { return op != PlanOp::kKeepRows; }

struct PlanSequence {
  int64_t id = 0, length = 0;
  std::vector<int32_t> tokens, kv_blocks;
  int32_t state_slot = -1;
  // kStep: SequenceInput::verify. kDraft: the DraftInput's position, hidden (0 the model's, 1 the draft's) and
  // source. kKeepRows: the rows kept.
  int64_t verify = 0, position = 0, hidden = 0, source = 0, rows = 0;
};

// One sequence's sampling in a kSample plan: the front end's Sampler's parameters and this step's draw from its
// stream (Sampler::next_draw), and the ids its penalties read (only when one is on).
struct PlanSampleRow {
  bool sample = false;  // false: the sequence is mid-prompt
  SamplingParams params;
  double draw = 0.0;
  std::vector<int32_t> prompt_ids, output_ids;
};

struct Plan {
  PlanOp op = PlanOp::kStep;
  LogitsFor which = LogitsFor::kLastToken;
  std::vector<int64_t> released;
  std::vector<PlanSequence> sequences;
  std::vector<PlanSampleRow> rows;  // kSample: one per sequence; kSampleRows: one per row the step returns
};

// A sequence's lists as the other nodes hold them, on node 0 (as sent) and on each of the others (as received).
struct HeldLists {
  std::vector<int32_t> kv_blocks, prompt_ids, output_ids;
};
using HeldMap = std::map<int64_t, HeldLists>;

// Which of the plan's sequences each sampling row belongs to (a verification's sequence has a row per token).
std::vector<size_t> row_sequences(const Plan& p) {
  std::vector<size_t> owner;
  for (size_t i = 0; i < p.sequences.size(); ++i) {
    const bool all = p.op == PlanOp::kSampleRows && p.sequences[i].verify != 0;
    owner.insert(owner.end(), all ? p.sequences[i].tokens.size() : 1, i);
  }
  return owner;
}

int64_t bits_of(float v) { return std::bit_cast<int32_t>(v); }
float float_of(int64_t w) { return std::bit_cast<float>(static_cast<int32_t>(w)); }

// `now` as a change to `held`: the length of their common start, the values after it; `held` becomes `now`.
void put_change(std::vector<int64_t>& w, std::vector<int32_t>& held, const std::vector<int32_t>& now) {
  const size_t keep = static_cast<size_t>(std::mismatch(held.begin(), held.end(), now.begin(), now.end()).first -
                                          held.begin());
  w.insert(w.end(), {static_cast<int64_t>(keep), static_cast<int64_t>(now.size() - keep)});
  w.insert(w.end(), now.begin() + static_cast<ptrdiff_t>(keep), now.end());
  held = now;
}

std::vector<int64_t> plan_words(const Plan& p, HeldMap& held) {
  std::vector<int64_t> w{static_cast<int64_t>(p.op), p.which == LogitsFor::kAllTokens ? 1 : 0,
                         static_cast<int64_t>(p.released.size())};
  w.insert(w.end(), p.released.begin(), p.released.end());
  for (const int64_t id : p.released) held.erase(id);
  w.push_back(static_cast<int64_t>(p.sequences.size()));
  for (const PlanSequence& q : p.sequences) {
    w.insert(w.end(), {q.id, q.length, static_cast<int64_t>(q.tokens.size())});
    w.insert(w.end(), q.tokens.begin(), q.tokens.end());
    if (carries_blocks(p.op)) put_change(w, held[q.id].kv_blocks, q.kv_blocks);
    w.insert(w.end(), {int64_t{q.state_slot}, q.verify, q.position, q.hidden, q.source, q.rows});
  }
  if (!samples(p.op)) return w;
  w.push_back(static_cast<int64_t>(p.rows.size()));
  const std::vector<size_t> owner = row_sequences(p);
  for (size_t i = 0; i < p.rows.size(); ++i) {
    const PlanSampleRow& r = p.rows[i];
    w.push_back(r.sample ? 1 : 0);
    if (!r.sample) continue;
    const SamplingParams& s = r.params;
    w.insert(w.end(), {bits_of(s.temperature), s.top_k, bits_of(s.top_p), bits_of(s.min_p),
                       bits_of(s.repetition_penalty), bits_of(s.presence_penalty), bits_of(s.frequency_penalty),
                       s.logprobs, std::bit_cast<int64_t>(r.draw)});
    w.push_back(static_cast<int64_t>(s.logit_bias.size()));
    for (const auto& [id, bias] : s.logit_bias) w.insert(w.end(), {int64_t{id}, bits_of(bias)});
    w.push_back(static_cast<int64_t>(s.banned_ids.size()));
    w.insert(w.end(), s.banned_ids.begin(), s.banned_ids.end());
    // (A plan with more rows than its sequences return is refused by every receiver: no lists for those.)
    if (!sampling_penalties_active(s) || i >= owner.size()) continue;
    HeldLists& lists = held[p.sequences[owner[i]].id];
    put_change(w, lists.prompt_ids, r.prompt_ids);
    put_change(w, lists.output_ids, r.output_ids);
  }
  return w;
}

Expected<Plan> plan_of(const std::vector<int64_t>& w, HeldMap& held) {
  size_t at = 0;
  auto next = [&]() -> Expected<int64_t> {
    if (at >= w.size()) return make_error("a step plan from node 0 ended early ({} words)", w.size());
    return w[at++];
  };
  auto count = [&]() -> Expected<size_t> {
    TERN_ASSIGN_OR_RETURN(const int64_t n, next());
    if (n < 0 || static_cast<size_t>(n) > w.size() - at) return make_error("a step plan from node 0 is malformed");
    return static_cast<size_t>(n);
  };
  // A list sent as a change to the one held (put_change): `into` gets the whole list, `held` becomes it.
  auto change = [&](std::vector<int32_t>& list, std::vector<int32_t>& into) -> Expected<void> {
    TERN_ASSIGN_OR_RETURN(const int64_t keep, next());
    if (keep < 0 || static_cast<size_t>(keep) > list.size()) {
      return make_error("a step plan from node 0 keeps {} ids of a list of {} this node holds", keep, list.size());
    }
    TERN_ASSIGN_OR_RETURN(const size_t n, count());
    list.resize(static_cast<size_t>(keep));
    for (size_t k = 0; k < n; ++k) list.push_back(static_cast<int32_t>(w[at++]));
    into = list;
    return {};
  };
  Plan p;
  TERN_ASSIGN_OR_RETURN(const int64_t op, next());
  if (op < 1 || op > 8) return make_error("a step plan from node 0 has op {}", op);
  p.op = static_cast<PlanOp>(op);
  TERN_ASSIGN_OR_RETURN(const int64_t all, next());
  p.which = all != 0 ? LogitsFor::kAllTokens : LogitsFor::kLastToken;
  TERN_ASSIGN_OR_RETURN(const size_t n_released, count());
  for (size_t i = 0; i < n_released; ++i) p.released.push_back(w[at++]);
  for (const int64_t id : p.released) held.erase(id);
  TERN_ASSIGN_OR_RETURN(const size_t n_seqs, count());
  for (size_t i = 0; i < n_seqs; ++i) {
    PlanSequence q;
    TERN_ASSIGN_OR_RETURN(q.id, next());
    TERN_ASSIGN_OR_RETURN(q.length, next());
    TERN_ASSIGN_OR_RETURN(const size_t n_tokens, count());
    for (size_t t = 0; t < n_tokens; ++t) q.tokens.push_back(static_cast<int32_t>(w[at++]));
    if (carries_blocks(p.op)) TERN_TRY(change(held[q.id].kv_blocks, q.kv_blocks));
    TERN_ASSIGN_OR_RETURN(const int64_t slot, next());
    q.state_slot = static_cast<int32_t>(slot);
    for (int64_t* field : {&q.verify, &q.position, &q.hidden, &q.source, &q.rows}) {
      TERN_ASSIGN_OR_RETURN(*field, next());
    }
    p.sequences.push_back(std::move(q));
  }
  if (!samples(p.op)) return p;
  TERN_ASSIGN_OR_RETURN(const size_t n_rows, count());
  const std::vector<size_t> owner = row_sequences(p);
  if (n_rows != owner.size()) {
    return make_error("a sampling plan from node 0 has {} rows for {} to sample", n_rows, owner.size());
  }
  for (size_t i = 0; i < n_rows; ++i) {
    PlanSampleRow r;
    TERN_ASSIGN_OR_RETURN(const int64_t sample, next());
    r.sample = sample != 0;
    if (r.sample) {
      int64_t f[9];
      for (int64_t& v : f) {
        TERN_ASSIGN_OR_RETURN(v, next());
      }
      r.params = SamplingParams{.temperature = float_of(f[0]), .top_k = static_cast<int32_t>(f[1]),
                                .top_p = float_of(f[2]), .min_p = float_of(f[3]), .repetition_penalty = float_of(f[4]),
                                .presence_penalty = float_of(f[5]), .frequency_penalty = float_of(f[6]),
                                .seed = 0, .logprobs = static_cast<int32_t>(f[7])};
      r.draw = std::bit_cast<double>(f[8]);
      TERN_ASSIGN_OR_RETURN(const size_t n_bias, count());
      if (n_bias > kSamplingMaxLogitBias || 2 * n_bias > w.size() - at) {
        return make_error("a sampling plan from node 0 has a logit bias of {} entries", n_bias);
      }
      for (size_t k = 0; k < n_bias; ++k, at += 2) {
        r.params.logit_bias.emplace_back(static_cast<int32_t>(w[at]), float_of(w[at + 1]));
      }
      TERN_ASSIGN_OR_RETURN(const size_t n_banned, count());
      if (n_banned > kSamplingMaxLogitBias || n_banned > w.size() - at) {
        return make_error("a sampling plan from node 0 bans {} token ids", n_banned);
      }
      for (size_t k = 0; k < n_banned; ++k) r.params.banned_ids.push_back(static_cast<int32_t>(w[at++]));
      if (sampling_penalties_active(r.params)) {
        HeldLists& lists = held[p.sequences[owner[i]].id];
        TERN_TRY(change(lists.prompt_ids, r.prompt_ids));
        TERN_TRY(change(lists.output_ids, r.output_ids));
      }
    }
    p.rows.push_back(std::move(r));
  }
  return p;
}

// A kSample step's tokens as words for the control group: per row 0, id, logprob bits, n top logprobs and their
// (id, bits) pairs; or 1, the reason's length and its characters (one per word).
std::vector<int64_t> sample_words(const SampleResults& results) {
  std::vector<int64_t> w;
  for (const Expected<SampledToken>& r : results) {
    if (r) {
      w.insert(w.end(), {0, r->id, bits_of(r->logprob), static_cast<int64_t>(r->top_logprobs.size())});
      for (const auto& [id, lp] : r->top_logprobs) w.insert(w.end(), {id, bits_of(lp)});
    } else {
      const std::string& why = r.error().message;
      w.insert(w.end(), {1, static_cast<int64_t>(why.size())});
      w.insert(w.end(), why.begin(), why.end());
    }
  }
  return w;
}

Expected<SampleResults> sample_results_of(const std::vector<int64_t>& w, size_t rows) {
  SampleResults out;
  size_t at = 0;
  auto next = [&]() -> Expected<int64_t> {
    if (at >= w.size()) return make_error("a sampled step from the ranks ended early ({} words)", w.size());
    return w[at++];
  };
  for (size_t i = 0; i < rows; ++i) {
    TERN_ASSIGN_OR_RETURN(const int64_t tag, next());
    TERN_ASSIGN_OR_RETURN(const int64_t a, next());
    if (tag == 1) {
      if (a < 0 || static_cast<size_t>(a) > w.size() - at) {
        return make_error("a sampled step from the ranks is malformed");
      }
      out.push_back(make_error("{}", std::string(w.begin() + static_cast<ptrdiff_t>(at),
                                                 w.begin() + static_cast<ptrdiff_t>(at + static_cast<size_t>(a)))));
      at += static_cast<size_t>(a);
      continue;
    }
    SampledToken t{.id = static_cast<int32_t>(a)};
    TERN_ASSIGN_OR_RETURN(const int64_t lp, next());
    t.logprob = float_of(lp);
    TERN_ASSIGN_OR_RETURN(const int64_t n_top, next());
    if (n_top < 0 || n_top > kSamplingMaxLogprobs) return make_error("a sampled step from the ranks is malformed");
    for (int64_t k = 0; k < n_top; ++k) {
      TERN_ASSIGN_OR_RETURN(const int64_t id, next());
      TERN_ASSIGN_OR_RETURN(const int64_t bits, next());
      t.top_logprobs.emplace_back(static_cast<int32_t>(id), float_of(bits));
    }
    out.push_back(std::move(t));
  }
  if (at != w.size()) return make_error("a sampled step from the ranks has {} words left over", w.size() - at);
  return out;
}

class TpRunner final : public ModelRunner {
 public:
  // `world` ranks over layout.nnodes processes, this one holding ranks [node_rank * local, (node_rank + 1) * local)
  // as threads; `devices`: each of this node's ranks' GPU (empty on the CPU).
  TpRunner(int world, std::vector<int> devices, const NodeLayout& layout)
      : world_(world), layout_(layout), local_(layout.ranks_on(world, layout.node_rank)),
        first_rank_(local_ > 0 ? layout.first_rank(world, layout.node_rank) : 0), group_(local_), threads_(local_),
        devices_(std::move(devices)),
        rank_comms_(static_cast<size_t>(local_)), device_comms_(static_cast<size_t>(local_)),
        runners_(static_cast<size_t>(local_)) {
    if (layout_.nnodes > 1 && layout_.node_rank == 0) released_ = std::make_shared<ReleaseQueue>();
  }
  ~TpRunner() override {
    if (control_ == nullptr || layout_.node_rank != 0) return;
    {
      std::lock_guard lock(control_mu_);
      stopping_ = true;
      // A failed group has lost a node (or will not hear from one): nothing to tell it.
      if (failed_.empty()) (void)send_locked(Plan{.op = PlanOp::kStop});
    }
    heartbeat_cv_.notify_all();
    if (heartbeat_.joinable()) heartbeat_.join();
  }

  // The other nodes' ranks wait for node 0's plans (and node 0 for them) over the control group, and every rank
  // talks to every other over Gloo (dist/gloo_communicator.h) through the store at layout.store_host:store_port,
  // which node 0 serves. One node: nothing to do (the ranks meet in the loopback group).
  Expected<void> join_nodes(std::chrono::milliseconds timeout) {
    if (layout_.nnodes <= 1) return {};
    GlooOptions control{.rank = layout_.node_rank, .world = layout_.nnodes, .store_host = layout_.store_host,
                        .store_port = layout_.store_port, .serve_store = layout_.node_rank == 0,
                        .prefix = "tern/control", .timeout = timeout};
    TERN_ASSIGN_OR_RETURN(control_, gloo_communicator_create(control));
    TERN_TRY(run_ranks("joining the ranks of every node", [&](int l) -> Expected<void> {
      GlooOptions rank{.rank = first_rank_ + l, .world = world_, .store_host = layout_.store_host,
                       .store_port = layout_.store_port, .prefix = "tern/ranks", .timeout = timeout};
      TERN_ASSIGN_OR_RETURN(rank_comms_[static_cast<size_t>(l)], gloo_communicator_create(rank));
      return {};
    }));
    if (layout_.node_rank == 0) heartbeat_ = std::thread([this] { heartbeat(); });
    return {};
  }

  // Every node compares its options with every other node's before loading; a difference fails start-up on all of
  // them, naming the option and the nodes.
  Expected<void> agree_on_options(const std::filesystem::path& dir, const ModelLoadOptions& options) {
    if (control_ == nullptr) return {};
    TERN_ASSIGN_OR_RETURN(const std::vector<NodeOption> mine, node_options(dir, options));
    std::vector<float> pieces;
    for (const NodeOption& o : mine) {
      for (int p = 0; p < kOptionPieces; ++p) pieces.push_back(static_cast<float>((o.value >> (22 * p)) & 0x3FFFFF));
    }
    std::vector<float> all(pieces.size() * static_cast<size_t>(layout_.nnodes));
    TERN_TRY(control_->all_gather(pieces, all));
    // Option i of node n, put back together from its pieces.
    auto value = [&](int n, size_t i) {
      uint64_t v = 0;
      for (int p = 0; p < kOptionPieces; ++p) {
        v |= static_cast<uint64_t>(all[n * pieces.size() + i * kOptionPieces + p]) << (22 * p);
      }
      return v;
    };
    for (int node = 1; node < layout_.nnodes; ++node) {
      for (size_t i = 0; i < mine.size(); ++i) {
        if (value(node, i) != value(0, i)) {
          return make_error("node {} was started with another {} than node 0 ({} against {}): every node needs the "
                            "same model and the same flags", node, mine[i].flag, value(node, i), value(0, i));
        }
      }
    }
    return {};
  }

  // The other nodes' part: the plans node 0 sends, each run on this node's ranks, until node 0 stops (or fails:
  // an error).
  Expected<void> serve_plans() {
    std::map<int64_t, std::unique_ptr<TpSequence>> sequences;
    while (true) {
      TERN_ASSIGN_OR_RETURN(const Plan plan, receive());
      if (plan.op == PlanOp::kStop) return {};
      if (plan.op == PlanOp::kHeartbeat) continue;
      for (const int64_t id : plan.released) sequences.erase(id);
      std::vector<std::vector<SequenceInput>> inputs(runners_.size());
      std::vector<std::vector<DraftInput>> drafts(runners_.size());
      auto gather = [&]() -> Expected<void> {
        for (const PlanSequence& q : plan.sequences) {
          auto& seq = sequences[q.id];
          if (seq == nullptr) {
            seq = std::make_unique<TpSequence>();
            seq->id = q.id;
            for (const auto& runner : runners_) seq->ranks.push_back(runner->new_sequence());
          }
          for (size_t l = 0; l < runners_.size(); ++l) {
            if (seq->ranks[l].length != q.length) {
              return make_error("sequence {}: this node's rank holds {} tokens, node 0 says {}", q.id,
                                seq->ranks[l].length, q.length);
            }
            const SequenceInput in{&seq->ranks[l], q.tokens, q.kv_blocks, q.state_slot, q.verify != 0};
            inputs[l].push_back(in);
            drafts[l].push_back(
                {in, q.position, q.hidden != 0 ? DraftHidden::kDraft : DraftHidden::kModel, q.source});
          }
        }
        return {};
      };
      std::vector<float> rank0_logits;
      std::vector<int64_t> rank0_tokens;
      Expected<void> ran = gather();
      if (ran) ran = run_ranks("a step", [&](int l) -> Expected<void> {
        TERN_TRY(bind(l));
        ModelRunner& runner = *runners_[static_cast<size_t>(l)];
        if (plan.op == PlanOp::kKeepRows) {
          for (size_t i = 0; i < plan.sequences.size(); ++i) {
            TERN_TRY(runner.keep_rows(*inputs[static_cast<size_t>(l)][i].cache, plan.sequences[i].rows));
          }
          return {};
        }
        if (samples(plan.op) && first_rank_ + l == 0) {
          TERN_ASSIGN_OR_RETURN(const SampleResults results,
                                sample_for_front_end(runner, inputs[0], plan.rows, plan.op == PlanOp::kSampleRows));
          rank0_tokens = sample_words(results);
          return {};
        }
        const bool draft = plan.op == PlanOp::kDraft || plan.op == PlanOp::kDraftArgmax;
        TERN_ASSIGN_OR_RETURN(std::vector<float> logits,
                              draft ? runner.draft(drafts[static_cast<size_t>(l)], plan.which)
                                    : runner.forward(inputs[static_cast<size_t>(l)], plan.which));
        if (first_rank_ + l != 0) return {};
        if (plan.op == PlanOp::kDraftArgmax) {  // each input's last row (kLastToken): the lowest id of the largest
          const size_t vocab = static_cast<size_t>(runner.config().vocab_size);
          for (size_t i = 0; i < logits.size() / vocab; ++i) {
            const auto row = logits.begin() + static_cast<ptrdiff_t>(i * vocab);
            rank0_tokens.push_back(std::max_element(row, row + static_cast<ptrdiff_t>(vocab)) - row);
          }
          return {};
        }
        rank0_logits = std::move(logits);
        return {};
      });
      // A front end waits for the step's result, its failure included (whatever failed here, a check or a rank).
      if (layout_.front_end && (samples(plan.op) || plan.op == PlanOp::kDraftArgmax)) {
        TERN_TRY(send_result(ran ? Expected<std::vector<int64_t>>(std::move(rank0_tokens))
                                 : Expected<std::vector<int64_t>>(tl::unexpected<Error>(ran.error()))));
      } else if (layout_.front_end && plan.op != PlanOp::kKeepRows) {
        TERN_TRY(send_result(ran ? Expected<std::vector<float>>(std::move(rank0_logits))
                                 : Expected<std::vector<float>>(tl::unexpected<Error>(ran.error()))));
      }
      TERN_TRY(ran);
    }
  }

  // Rank 0 of a front end's group: the step's tokens drawn with the front end's sampling rows, each through a Sampler
  // given that row's draw from the front end's stream, so that the token is the one the front end's Sampler would
  // have drawn from these logits.
  static Expected<SampleResults> sample_for_front_end(ModelRunner& runner, std::span<const SequenceInput> inputs,
                                                      const std::vector<PlanSampleRow>& plan_rows, bool all_rows) {
    std::vector<std::unique_ptr<Sampler>> samplers;
    std::vector<SampleRow> rows;
    for (const PlanSampleRow& r : plan_rows) {
      if (!r.sample) {
        rows.push_back({});
        continue;
      }
      samplers.push_back(std::make_unique<Sampler>(r.params));
      samplers.back()->give_draw(r.draw);
      rows.push_back({samplers.back().get(), r.prompt_ids, r.output_ids});
    }
    return all_rows ? runner.forward_sample_rows(inputs, rows) : runner.forward_sample(inputs, rows);
  }

  // The group's start-up check, before any weight is read: the device collectives joined (NCCL's group made) and
  // one timed all-reduce on every rank that must finish within `deadline` with the exact sum.
  Expected<TpGroupCheck> connect(std::chrono::milliseconds deadline) {
    TpGroupCheck check;
    check.world = world_;
    if (local_ == 0) {  // a front end: its ranks are the other nodes', checked there
      check.transport = fmt::format("the ranks of {} other nodes ({})", layout_.worker_nodes(), control_->describe());
      return check;
    }
    check.transport = host(0).describe();
    std::vector<double> ms(runners_.size(), 0.0);
#if TERN_RUNTIME_CUDA
    if (!devices_.empty()) {
      check.peers = cuda_peer_report(devices_);
#if TERN_HAVE_NCCL
      if (!shares_a_device()) {
        TERN_ASSIGN_OR_RETURN(const std::string version, nccl_version());
        check.transport = "NCCL " + version;
      }
#endif
    }
#endif
    const auto probe = [&](int r) -> Expected<void> {
      if (devices_.empty()) {
        std::vector<float> probe(kProbeElements, static_cast<float>(first_rank_ + r + 1));
        const auto start = std::chrono::steady_clock::now();
        TERN_TRY(host(r).all_reduce_sum(probe));
        ms[static_cast<size_t>(r)] =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        const float want = static_cast<float>(check.world * (check.world + 1) / 2);
        for (size_t i = 0; i < probe.size(); ++i) {
          if (probe[i] != want) {
            return make_error("rank {}: the all-reduce probe summed to {} at element {}, not {}", r, probe[i], i, want);
          }
        }
        return {};
      }
#if TERN_RUNTIME_CUDA
      const int device = devices_[static_cast<size_t>(r)];
      TERN_TRY(cuda_use_device(device));
      auto& comm = device_comms_[static_cast<size_t>(r)];
      if (shares_a_device()) {
        comm = staged_device_communicator(host(r));
        if (r == 0) check.transport = comm->describe();
      } else {
#if TERN_HAVE_NCCL
        TERN_ASSIGN_OR_RETURN(comm, nccl_communicator_create(host(r), device));
#else
        return make_error("this tern was built without NCCL: ranks on several GPUs are not available");
#endif
      }
      TERN_ASSIGN_OR_RETURN(ms[static_cast<size_t>(r)], cuda_all_reduce_probe(*comm, kProbeElements, deadline));
      return {};
#else
      (void)deadline;
      return make_error("this tern was built without CUDA");
#endif
    };
    TERN_TRY(run_ranks("the start-up check", probe));
    check.probe_bytes = static_cast<int64_t>(kProbeElements) * (devices_.empty() ? 4 : 2);
    check.all_reduce_ms = *std::max_element(ms.begin(), ms.end());
    return check;
  }

  // Every rank's slice loaded, then the KV capacity agreed: the fewest tokens any rank of any node holds, so that
  // node 0's scheduler hands out only block ids every rank has.
  Expected<void> load(const std::filesystem::path& dir, const ModelLoadOptions& options) {
    TERN_TRY(agree_on_options(dir, options));
    if (local_ == 0) return load_front_end(dir, options);
    TERN_TRY(load_ranks(dir, options));
    std::vector<int64_t> least(runners_.size(), 0);
    TERN_TRY(run_ranks("agreeing on the KV cache", [&](int r) -> Expected<void> {
      // As two exact floats (24 bits each) per rank.
      const int64_t tokens = runners_[static_cast<size_t>(r)]->kv_cache_tokens();
      const std::vector<float> mine{static_cast<float>(tokens >> 24), static_cast<float>(tokens & 0xFFFFFF)};
      std::vector<float> all(2 * static_cast<size_t>(world_));
      TERN_TRY(host(r).all_gather(mine, all));
      int64_t fewest = tokens;
      for (int k = 0; k < world_; ++k) {
        fewest = std::min(fewest, (static_cast<int64_t>(all[2 * k]) << 24) + static_cast<int64_t>(all[2 * k + 1]));
      }
      least[static_cast<size_t>(r)] = fewest;
      return {};
    }));
    kv_tokens_ = least.front();
    if (layout_.front_end) {  // the front end learns it from the node holding rank 0, the other nodes take part
      TERN_TRY(control_->broadcast(std::as_writable_bytes(std::span<int64_t>(&kv_tokens_, 1)), kResultRoot));
    }
    return {};
  }

  // A front end: the model's shapes for the scheduler (rank 0's slice, no weights), and the KV capacity the ranks
  // agreed on.
  Expected<void> load_front_end(const std::filesystem::path& dir, const ModelLoadOptions& options) {
    ModelLoadOptions shapes{.load_format = LoadFormat::kShapes,
                            .kv_cache_dtype = options.kv_cache_dtype,
                            .shard = {0, world_, options.expert_parallel},
                            .nvfp4_activations = options.nvfp4_activations,
                            .load_draft = options.load_draft};
    TERN_ASSIGN_OR_RETURN(front_model_, model_build_host(dir, shapes));
    device_ = options.device;
    return control_->broadcast(std::as_writable_bytes(std::span<int64_t>(&kv_tokens_, 1)), kResultRoot);
  }

  Expected<void> load_ranks(const std::filesystem::path& dir, const ModelLoadOptions& options) {
    return run_ranks("loading", [&](int r) -> Expected<void> {
      ModelLoadOptions rank_options = options;
      rank_options.tensor_parallel_size = 1;
      rank_options.communicator = &host(r);
      rank_options.shard = {first_rank_ + r, world_, options.expert_parallel};
      auto& runner = runners_[static_cast<size_t>(r)];
      if (devices_.empty()) {
        TERN_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> model, model_build_host(dir, rank_options));
        TERN_ASSIGN_OR_RETURN(runner, cpu_runner_create(std::move(model), &host(r)));
        return {};
      }
#if TERN_RUNTIME_CUDA
      const int device = devices_[static_cast<size_t>(r)];
      TERN_TRY(cuda_use_device(device));
      auto& comm = device_comms_[static_cast<size_t>(r)];
      rank_options.device_options.device = device;
      TERN_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> model, model_build_host(dir, rank_options));
      TERN_ASSIGN_OR_RETURN(runner, cuda_runner_create(std::move(model), rank_options.device_options, comm.get()));
      return {};
#else
      return make_error("this tern was built without CUDA");
#endif
    });
  }

  const CausalLm& model() const override { return local_ == 0 ? *front_model_ : runners_.front()->model(); }
  SequenceCache new_sequence() override {
    auto state = std::make_shared<TpSequence>();
    state->id = next_sequence_++;
    state->released = released_;
    for (const auto& runner : runners_) state->ranks.push_back(runner->new_sequence());
    SequenceCache cache;
    cache.device = std::move(state);
    return cache;
  }
  ModelDevice device() const override { return local_ == 0 ? device_ : runners_.front()->device(); }
  Expected<double> all_reduce_ms(int64_t elements, int repeats) override {
    if (!failed_.empty()) return make_error("the tensor-parallel group failed: {}", failed_);
    if (layout_.nnodes > 1) {
      return make_error("not timed: the ranks of the other {} nodes would have to join the collective",
                        layout_.nnodes - 1);
    }
    if (elements < 1 || repeats < 1) return make_error("all_reduce_ms: elements and repeats must be positive");
    std::vector<double> ms(runners_.size(), 0.0);
    const auto time_rank = [&](int r) -> Expected<void> {
      std::vector<double> each;
      for (int i = 0; i < repeats; ++i) {
        if (devices_.empty()) {
          std::vector<float> v(static_cast<size_t>(elements), 1.0f);
          const auto start = std::chrono::steady_clock::now();
          TERN_TRY(host(r).all_reduce_sum(v));
          each.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
          continue;
        }
#if TERN_RUNTIME_CUDA
        constexpr int kCallsPerRepeat = 20;  // back to back, as a step's all-reduces
        TERN_TRY(cuda_use_device(devices_[static_cast<size_t>(r)]));
        TERN_ASSIGN_OR_RETURN(const double t, cuda_all_reduce_ms(*device_comms_[static_cast<size_t>(r)],
                                                                 static_cast<size_t>(elements), kCallsPerRepeat,
                                                                 std::chrono::milliseconds(10000)));
        each.push_back(t);
#else
        return make_error("this tern was built without CUDA");
#endif
      }
      std::sort(each.begin(), each.end());
      ms[static_cast<size_t>(r)] = each[each.size() / 2];
      return {};
    };
    TERN_TRY(run_ranks("timing an all-reduce", time_rank));
    return *std::max_element(ms.begin(), ms.end());
  }
  int64_t plan_bytes_sent() const override { return plan_bytes_; }
  std::optional<std::string> failure() const override {
    if (failed_.empty()) return std::nullopt;
    return failed_;
  }
  std::string describe() const override {
    if (local_ == 0) {
      return fmt::format("{} tensor-parallel ranks on {} other nodes, this process their front end ({})", world_,
                         layout_.worker_nodes(), control_->describe());
    }
    return fmt::format("{} tensor-parallel ranks{} ({}): {}", world_,
                       layout_.nnodes > 1 ? fmt::format(" on {} nodes", layout_.nnodes) : std::string(),
                       host(0).describe(), runners_.front()->describe());
  }
  int64_t kv_cache_tokens() const override { return kv_tokens_; }

 private:
  Expected<std::vector<float>> step(std::span<const SequenceInput> batch, LogitsFor which,
                                    const Tracer* tracer) override {
    if (local_ == 0) {
      TERN_TRY(ModelRunner::check_inputs(batch));
      return remote<float>(step_plan(batch, which));
    }
    TERN_ASSIGN_OR_RETURN(const auto inputs, rank_inputs(batch));
    TERN_TRY(send_step(batch, which));
    std::vector<float> logits;
    TERN_TRY(run_ranks("a step", [&](int r) -> Expected<void> {
      TERN_TRY(bind(r));
      TERN_ASSIGN_OR_RETURN(std::vector<float> l, runners_[static_cast<size_t>(r)]->forward(
                                                      inputs[static_cast<size_t>(r)], which, r == 0 ? tracer : nullptr));
      if (r == 0) logits = std::move(l);
      return {};
    }));
    return logits;
  }

  // Rank 0 samples (the rows' Samplers and their random streams are used once); the others run the same step.
  Expected<SampleResults> sample_step(std::span<const SequenceInput> batch, std::span<const SampleRow> rows) override {
    if (local_ == 0) return sample_remotely(batch, rows, PlanOp::kSample);
    TERN_ASSIGN_OR_RETURN(const auto inputs, rank_inputs(batch));
    TERN_TRY(send_step(batch, LogitsFor::kLastToken));
    SampleResults results;
    TERN_TRY(run_ranks("a step", [&](int r) -> Expected<void> {
      TERN_TRY(bind(r));
      ModelRunner& runner = *runners_[static_cast<size_t>(r)];
      if (r == 0) {
        TERN_ASSIGN_OR_RETURN(results, runner.forward_sample(inputs[0], rows));
      } else {
        TERN_TRY(runner.forward(inputs[static_cast<size_t>(r)], LogitsFor::kLastToken));
      }
      return {};
    }));
    return results;
  }

  // A front end: the verification's rows sampled on rank 0 as sample_step's (the default brought the logits here).
  Expected<SampleResults> sample_rows_step(std::span<const SequenceInput> batch,
                                           std::span<const SampleRow> rows) override {
    if (local_ == 0) return sample_remotely(batch, rows, PlanOp::kSampleRows);
    return ModelRunner::sample_rows_step(batch, rows);
  }

  // A front end's sampling step: rank 0 samples with this process's Samplers' draws (the stream advanced here as a
  // local draw would advance it) and the ids the penalties read; the tokens come back.
  Expected<SampleResults> sample_remotely(std::span<const SequenceInput> batch, std::span<const SampleRow> rows,
                                          PlanOp op) {
    TERN_TRY(ModelRunner::check_inputs(batch));
    Plan plan = step_plan(batch, LogitsFor::kLastToken);
    plan.op = op;
    for (const SampleRow& row : rows) {
      PlanSampleRow& r = plan.rows.emplace_back();
      if (row.sampler == nullptr) continue;
      TERN_TRY(sampling_params_validate(row.sampler->params()));
      r.sample = true;
      r.params = row.sampler->params();
      // min_tokens' ban resolved for this row (its output holding the drafts before it), so the plan carries the ids
      // only where they apply and the ranks need not know the output.
      if (!sampling_ban_active(r.params, row.output_ids.size())) r.params.banned_ids.clear();
      r.params.banned_until = 0;
      r.draw = row.sampler->next_draw();
      if (sampling_penalties_active(r.params)) {
        r.prompt_ids.assign(row.prompt_ids.begin(), row.prompt_ids.end());
        r.output_ids.assign(row.output_ids.begin(), row.output_ids.end());
      }
    }
    TERN_ASSIGN_OR_RETURN(const std::vector<int64_t> words, remote<int64_t>(std::move(plan)));
    return sample_results_of(words, rows.size());
  }

  // Speculative decoding: every rank keeps the same rows of its slice of the sequence, and runs the same draft step
  // over its slice of the draft module (whose fc and norms are whole on every rank), rank 0's logits the step's;
  // the other nodes get both as plans.
  Expected<void> restore_verified(SequenceCache& seq, int64_t rows) override {
    TERN_ASSIGN_OR_RETURN(TpSequence* tp, tp_sequence(seq));
    if (control_ != nullptr) {
      Plan plan{.op = PlanOp::kKeepRows};
      plan.sequences.push_back({.id = tp->id, .length = seq.length, .rows = rows});
      TERN_TRY(send_plan(std::move(plan)));
    }
    return run_ranks("keeping verified rows", [&](int r) -> Expected<void> {
      TERN_TRY(bind(r));
      return runners_[static_cast<size_t>(r)]->keep_rows(tp->ranks[static_cast<size_t>(r)], rows);
    });
  }

  // A front end: the proposals come back, not the logits.
  Expected<std::vector<int32_t>> draft_argmax_step(std::span<const DraftInput> inputs,
                                                   std::span<const int64_t> hidden_rows) override {
    if (local_ != 0) return ModelRunner::draft_argmax_step(inputs, hidden_rows);
    TERN_ASSIGN_OR_RETURN(Plan plan, draft_plan(inputs, LogitsFor::kLastToken, nullptr));
    plan.op = PlanOp::kDraftArgmax;
    TERN_ASSIGN_OR_RETURN(const std::vector<int64_t> ids, remote<int64_t>(std::move(plan)));
    if (ids.size() != inputs.size()) {
      return make_error("the ranks returned {} draft proposals for {} inputs", ids.size(), inputs.size());
    }
    return std::vector<int32_t>(ids.begin(), ids.end());
  }

  // The draft step's plan for the other nodes, and (`ranks`) each local rank's inputs.
  Expected<Plan> draft_plan(std::span<const DraftInput> inputs, LogitsFor which,
                            std::vector<std::vector<DraftInput>>* ranks) const {
    Plan plan{.op = PlanOp::kDraft, .which = which};
    for (const DraftInput& in : inputs) {
      TERN_ASSIGN_OR_RETURN(TpSequence* tp, tp_sequence(*in.seq.cache));
      plan.sequences.push_back({tp->id, in.seq.cache->length, {in.seq.tokens.begin(), in.seq.tokens.end()},
                                {in.seq.kv_blocks.begin(), in.seq.kv_blocks.end()}, in.seq.state_slot, 0,
                                in.position, in.hidden == DraftHidden::kDraft ? 1 : 0, in.source});
      for (size_t r = 0; ranks != nullptr && r < runners_.size(); ++r) {
        DraftInput mine = in;
        mine.seq.cache = &tp->ranks[r];
        (*ranks)[r].push_back(mine);
      }
    }
    return plan;
  }

  Expected<std::vector<float>> draft_step(std::span<const DraftInput> inputs, LogitsFor which,
                                          std::span<const int64_t>) override {
    std::vector<std::vector<DraftInput>> ranks(runners_.size());
    TERN_ASSIGN_OR_RETURN(Plan plan, draft_plan(inputs, which, &ranks));
    if (local_ == 0) return remote<float>(std::move(plan));
    if (control_ != nullptr) TERN_TRY(send_plan(std::move(plan)));
    std::vector<float> logits;
    TERN_TRY(run_ranks("a draft step", [&](int r) -> Expected<void> {
      TERN_TRY(bind(r));
      TERN_ASSIGN_OR_RETURN(std::vector<float> l,
                            runners_[static_cast<size_t>(r)]->draft(ranks[static_cast<size_t>(r)], which));
      if (r == 0) logits = std::move(l);
      return {};
    }));
    return logits;
  }

  Expected<TpSequence*> tp_sequence(SequenceCache& cache) const {
    auto* seq = dynamic_cast<TpSequence*>(cache.device.get());
    if (seq == nullptr || seq->ranks.size() != runners_.size()) {
      return make_error("a sequence not made by this tensor-parallel runner was passed to it");
    }
    return seq;
  }

  // Rank r's GPU current on the thread running it (rank 0 runs on the caller's thread, which may use others).
  Expected<void> bind(int r) const {
#if TERN_RUNTIME_CUDA
    if (!devices_.empty()) return cuda_use_device(devices_[static_cast<size_t>(r)]);
#endif
    (void)r;
    return {};
  }

  // Each rank's view of the step: the same tokens and ids over its slice of each sequence, checked by every rank
  // here (check_inputs), so that a refused batch fails every rank alike instead of breaking the group.
  Expected<std::vector<std::vector<SequenceInput>>> rank_inputs(std::span<const SequenceInput> batch) const {
    std::vector<std::vector<SequenceInput>> inputs(runners_.size());
    for (const SequenceInput& in : batch) {
      TERN_ASSIGN_OR_RETURN(TpSequence* seq, tp_sequence(*in.cache));
      for (size_t r = 0; r < runners_.size(); ++r) {
        if (seq->ranks[r].length != in.cache->length) {
          return make_error("rank {} holds {} tokens of a sequence of {}", r, seq->ranks[r].length, in.cache->length);
        }
        inputs[r].push_back({&seq->ranks[r], in.tokens, in.kv_blocks, in.state_slot, in.verify});
      }
    }
    for (size_t r = 0; r < runners_.size(); ++r) {
      if (auto checked = runners_[r]->check_inputs(inputs[r]); !checked) {
        return tl::unexpected<Error>(checked.error());
      }
    }
    return inputs;
  }

  // Runs `job` on every rank; the first rank to fail aborts the group (so no rank waits for it in a collective) and
  // its reason is the error. A failed group stays failed.
  Expected<void> run_ranks(std::string_view what, const std::function<Expected<void>(int)>& job) {
    if (!failed_.empty()) return make_error("the tensor-parallel group failed earlier: {}", failed_);
    std::mutex mu;
    std::string first;
    const auto results = threads_.run([&](int r) -> Expected<void> {
      Expected<void> result = job(r);
      if (!result) {
        std::lock_guard lock(mu);
        if (first.empty()) {
          first = fmt::format("rank {}: {}", r, result.error().message);
          group_.abort(first);
        }
      }
      return result;
    });
    if (first.empty()) return {};
    failed_ = first;
    return make_error("{} failed on {} of {} tensor-parallel ranks; {}", what,
                      std::count_if(results.begin(), results.end(), [](const auto& e) { return !e.has_value(); }),
                      results.size(), first);
  }

  Communicator& host(int l) const {
    return layout_.nnodes > 1 ? *rank_comms_[static_cast<size_t>(l)] : group_.rank(l);
  }

  static Plan step_plan(std::span<const SequenceInput> batch, LogitsFor which) {
    Plan plan{.op = PlanOp::kStep, .which = which};
    for (const SequenceInput& in : batch) {
      const auto* seq = static_cast<const TpSequence*>(in.cache->device.get());
      plan.sequences.push_back({seq->id, in.cache->length, {in.tokens.begin(), in.tokens.end()},
                                {in.kv_blocks.begin(), in.kv_blocks.end()}, in.state_slot, in.verify ? 1 : 0});
    }
    return plan;
  }

  // Node 0: the step's plan to the other nodes, before its own ranks run it.
  Expected<void> send_step(std::span<const SequenceInput> batch, LogitsFor which) {
    if (control_ == nullptr) return {};
    return send_plan(step_plan(batch, which));
  }

  // A front end: the plan to the nodes, then rank 0's logits from the node holding it, under one hold of the control
  // group (no heartbeat between them). A step that failed there, or a lost node, breaks the group.
  template <class T>
  Expected<std::vector<T>> remote(Plan plan) {
    if (!failed_.empty()) return make_error("the tensor-parallel group failed earlier: {}", failed_);
    {
      std::lock_guard lock(released_->mu);
      plan.released.swap(released_->ids);
    }
    std::lock_guard lock(control_mu_);
    Expected<std::vector<T>> result = send_locked(plan).and_then([&] { return receive_result_locked<T>(); });
    if (!result) failed_ = result.error().message;
    return result;
  }

  // The step's result on the control group, from the node holding rank 0 (kResultRoot): a word n, then n values (the
  // logits as floats, or a kSample step's tokens as words), or for a step that failed -(length + 1) and the reason's
  // bytes. Every node takes part.
  template <class T>
  Expected<void> send_result(const Expected<std::vector<T>>& result) {
    const bool root = layout_.node_rank == kResultRoot;
    std::string reason = root && !result ? result.error().message : std::string();
    int64_t n = !root ? 0 : result ? static_cast<int64_t>(result->size()) : -static_cast<int64_t>(reason.size()) - 1;
    TERN_TRY(control_->broadcast(std::as_writable_bytes(std::span<int64_t>(&n, 1)), kResultRoot));
    if (n < -1) {
      reason.resize(static_cast<size_t>(-n - 1));
      return control_->broadcast(std::as_writable_bytes(std::span<char>(reason)), kResultRoot);
    }
    if (n <= 0) return {};
    std::vector<T> values = root ? *result : std::vector<T>(static_cast<size_t>(n));
    return control_->broadcast(std::as_writable_bytes(std::span<T>(values)), kResultRoot);
  }

  template <class T>
  Expected<std::vector<T>> receive_result_locked() {
    int64_t n = 0;
    TERN_TRY(control_->broadcast(std::as_writable_bytes(std::span<int64_t>(&n, 1)), kResultRoot));
    if (n < 0) {
      std::string reason(static_cast<size_t>(-n - 1), '\0');
      if (!reason.empty()) {
        TERN_TRY(control_->broadcast(std::as_writable_bytes(std::span<char>(reason)), kResultRoot));
      }
      return make_error("the step failed on the ranks: {}", reason);
    }
    if (n > (int64_t{1} << 32)) return make_error("a step result of {} values from node {}", n, kResultRoot);
    std::vector<T> values(static_cast<size_t>(n));
    if (n > 0) TERN_TRY(control_->broadcast(std::as_writable_bytes(std::span<T>(values)), kResultRoot));
    return values;
  }

  // Node 0: a plan to the other nodes, with the sequences released since the last one.
  Expected<void> send_plan(Plan plan) {
    {
      std::lock_guard lock(released_->mu);
      plan.released.swap(released_->ids);
    }
    std::lock_guard lock(control_mu_);
    auto sent = send_locked(plan);
    if (!sent) failed_ = sent.error().message;
    return sent;
  }

  Expected<void> send_locked(const Plan& plan) {
    std::vector<int64_t> words = plan_words(plan, held_);
    int64_t size = static_cast<int64_t>(words.size());
    plan_bytes_ += static_cast<int64_t>(sizeof(int64_t) * (words.size() + 1));
    TERN_TRY(control_->broadcast(std::as_writable_bytes(std::span<int64_t>(&size, 1)), 0));
    TERN_TRY(control_->broadcast(std::as_writable_bytes(std::span<int64_t>(words)), 0));
    last_sent_ = std::chrono::steady_clock::now();
    return {};
  }

  Expected<Plan> receive() {
    int64_t size = 0;
    TERN_TRY(control_->broadcast(std::as_writable_bytes(std::span<int64_t>(&size, 1)), 0));
    if (size < 0 || size > (int64_t{1} << 28)) return make_error("a step plan of {} words from node 0", size);
    std::vector<int64_t> words(static_cast<size_t>(size));
    TERN_TRY(control_->broadcast(std::as_writable_bytes(std::span<int64_t>(words)), 0));
    return plan_of(words, held_);
  }

  // Node 0, while no step runs: a plan every few seconds, so that the other nodes, waiting for the next plan with
  // the control group's deadline, can tell a quiet node 0 from a lost one.
  void heartbeat() {
    std::unique_lock lock(control_mu_);
    while (!stopping_) {
      heartbeat_cv_.wait_for(lock, kHeartbeat);
      if (stopping_ || std::chrono::steady_clock::now() - last_sent_ < kHeartbeat) continue;
      if (!send_locked(Plan{.op = PlanOp::kHeartbeat})) return;
    }
  }

  bool shares_a_device() const {
    std::vector<int> sorted = devices_;
    std::sort(sorted.begin(), sorted.end());
    return std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end();
  }

  static constexpr size_t kProbeElements = size_t{1} << 20;
  static constexpr int kResultRoot = 1;  // with a front end, the node holding rank 0
  static constexpr std::chrono::seconds kHeartbeat{5};

  const int world_;
  const NodeLayout layout_;
  const int local_, first_rank_;  // this node's ranks: [first_rank_, first_rank_ + local_)
  std::unique_ptr<Communicator> control_;  // several nodes: node 0 and the others' plan loops (serves the store)
  mutable LoopbackGroup group_;
  RankThreads threads_;
  const std::vector<int> devices_;
  std::vector<std::unique_ptr<Communicator>> rank_comms_;  // several nodes: each rank's Gloo communicator
  std::shared_ptr<ReleaseQueue> released_;
  int64_t kv_tokens_ = 0;  // the fewest KV tokens any rank holds (load)
  std::unique_ptr<CausalLm> front_model_;  // a front end: the model's shapes (load_front_end)
  ModelDevice device_ = ModelDevice::kCpu;  // a front end: the ranks' device
  int64_t next_sequence_ = 1;
  std::mutex control_mu_;  // one plan on the control group at a time (steps and heartbeats)
  std::condition_variable heartbeat_cv_;
  std::chrono::steady_clock::time_point last_sent_ = std::chrono::steady_clock::now();
  bool stopping_ = false;
  std::thread heartbeat_;
  // Declared before the runners, which use them, so that they outlive the runners.
  std::vector<std::unique_ptr<DeviceCommunicator>> device_comms_;
  std::vector<std::unique_ptr<ModelRunner>> runners_;
  std::string failed_;
  // Each sequence's lists as the other nodes hold them: node 0 (under control_mu_) as sent, the others as received.
  HeldMap held_;
  std::atomic<int64_t> plan_bytes_ = 0;  // node 0: the plans' bytes broadcast so far
};

// How the ranks spread over processes ("nodes"), from --nnodes, --node-rank and --dist-init-addr HOST:PORT.
Expected<NodeLayout> node_layout(const ModelLoadOptions& options) {
  NodeLayout n{.nnodes = options.nnodes, .node_rank = options.node_rank, .front_end = options.front_end};
  const int world = options.tensor_parallel_size;
  if (world < 1) return make_error("--tensor-parallel-size must be at least 1, got {}", world);
  if (n.nnodes < 1) return make_error("--nnodes must be at least 1, got {}", n.nnodes);
  if (n.node_rank < 0 || n.node_rank >= n.nnodes) {
    return make_error("--node-rank {} is outside [0, {}) (--nnodes {})", n.node_rank, n.nnodes, n.nnodes);
  }
  if (n.front_end && n.nnodes < 2) {
    return make_error("a front end without ranks needs the ranks on at least one other node (--nnodes {}): start "
                      "them with --distributed-executor-backend mp, or give --nnodes and start the other nodes",
                      n.nnodes);
  }
  if (world % n.worker_nodes() != 0) {
    return make_error("--tensor-parallel-size {} does not divide over {} nodes{}", world, n.worker_nodes(),
                      n.front_end ? " besides the front end" : fmt::format(" (--nnodes {})", n.nnodes));
  }
  if (n.nnodes == 1) return n;
  const std::string& addr = options.dist_init_addr;
  const size_t colon = addr.rfind(':');
  int port = -1;
  if (colon != std::string::npos && colon > 0) {
    const auto [ptr, ec] = std::from_chars(addr.data() + colon + 1, addr.data() + addr.size(), port);
    if (ec != std::errc() || ptr != addr.data() + addr.size()) port = -1;
  }
  if (port < 1 || port > 65535) {
    return make_error("--nnodes {} needs --dist-init-addr HOST:PORT (node 0's address and a free port), got '{}'",
                      n.nnodes, addr);
  }
  n.store_host = addr.substr(0, colon);
  n.store_port = port;
  return n;
}

// Each of this node's ranks' GPU (tp_rank_devices), the machine's GPUs counted.
Expected<std::vector<int>> rank_devices(const ModelLoadOptions& options, const NodeLayout& layout) {
  if (options.device != ModelDevice::kCuda) return std::vector<int>{};
  return tp_rank_devices(options.cuda_devices, options.tensor_parallel_size, layout, runner_cuda_device_count());
}

constexpr std::string_view kTpHint =
    "; check the group with `tern doctor --tensor-parallel-size N`: on PCIe machines a hang in NCCL's peer-to-peer "
    "path is usually fixed by NCCL_P2P_DISABLE=1 or by disabling ACS / the IOMMU in the BIOS; NCCL_DEBUG=INFO says "
    "what NCCL chose";

Expected<std::unique_ptr<TpRunner>> tp_group(const ModelLoadOptions& options, std::chrono::milliseconds deadline,
                                             TpGroupCheck* report) {
  TERN_ASSIGN_OR_RETURN(const NodeLayout layout, node_layout(options));
  TERN_ASSIGN_OR_RETURN(std::vector<int> devices, rank_devices(options, layout));
  const bool hint = devices.size() > 1 || layout.nnodes > 1;
  auto group = std::make_unique<TpRunner>(options.tensor_parallel_size, devices, layout);
  if (auto joined = group->join_nodes(options.tp_join_timeout); !joined) {
    return make_error("joining the other nodes at {}:{} failed: {}", layout.store_host, layout.store_port,
                      joined.error().message);
  }
  auto check = group->connect(deadline);
  if (!check) return make_error("tensor-parallel start-up check failed: {}{}", check.error().message, hint ? kTpHint : "");
  check->devices = std::move(devices);
  if (report != nullptr) *report = std::move(*check);
  return group;
}

}  // namespace

Expected<std::vector<int>> tp_rank_devices(const std::vector<int>& listed, int world, const NodeLayout& layout,
                                           int present) {
  const int local = layout.ranks_on(world, layout.node_rank);
  if (local == 0) return std::vector<int>{};  // a front end
  const int first = layout.first_rank(world, layout.node_rank);
  const bool nodes = layout.nnodes > 1;
  std::vector<int> devices;
  if (listed.empty()) {
    if (present < local) {
      return make_error("--tensor-parallel-size {} needs {} GPUs{}, {} present (--cuda-devices lists the GPU of "
                        "each rank; ranks may share one GPU, slowly, for testing)", world, local,
                        nodes ? " on each node" : "", present);
    }
    for (int r = 0; r < local; ++r) devices.push_back(r);
  } else if (static_cast<int>(listed.size()) == local) {
    devices = listed;
  } else if (nodes && static_cast<int>(listed.size()) == world) {  // every rank's: nodes sharing a machine
    devices.assign(listed.begin() + first, listed.begin() + first + local);
  } else {
    return make_error("--cuda-devices lists {} GPUs for --tensor-parallel-size {}{}", listed.size(), world,
                      nodes ? fmt::format(" ({} per node, or {} for every rank of nodes sharing a machine)", local,
                                          world)
                            : std::string());
  }
  for (const int d : devices) {
    if (d < 0 || d >= present) return make_error("--cuda-devices: GPU {} does not exist ({} present)", d, present);
  }
  return devices;
}

Expected<TpGroupCheck> tp_group_check(const ModelLoadOptions& options, std::chrono::milliseconds deadline) {
  TpGroupCheck check;
  TERN_TRY(tp_group(options, deadline, &check));
  return check;
}

Expected<std::unique_ptr<ModelRunner>> tp_runner_load(const std::filesystem::path& dir,
                                                      const ModelLoadOptions& options) {
  if (options.node_rank != 0) {
    return make_error("node {} runs ranks for node 0 (tp_worker_run), not a runner of its own", options.node_rank);
  }
  TERN_ASSIGN_OR_RETURN(std::unique_ptr<TpRunner> runner, tp_group(options, options.tp_check_deadline, nullptr));
  TERN_TRY(runner->load(dir, options));
  return std::unique_ptr<ModelRunner>(std::move(runner));
}

Expected<void> tp_worker_run(const std::filesystem::path& dir, const ModelLoadOptions& options) {
  if (options.nnodes <= 1 || options.node_rank == 0) {
    return make_error("--node-rank {} of --nnodes {} is node 0, which serves; the others run its ranks",
                      options.node_rank, options.nnodes);
  }
  TERN_ASSIGN_OR_RETURN(std::unique_ptr<TpRunner> runner, tp_group(options, options.tp_check_deadline, nullptr));
  TERN_TRY(runner->load(dir, options));
  return runner->serve_plans();
}

}  // namespace tern
