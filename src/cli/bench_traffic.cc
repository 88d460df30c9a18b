#include "cli/bench_traffic.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <random>
#include <vector>

#include "layers/attention.h"
#include "layers/block_ops.h"
#include "layers/gated_deltanet.h"
#include "layers/mla.h"
#include "layers/moe.h"
#include "models/shard.h"

namespace tern {
namespace {

double matrix_bytes(const CpuMatrix& m) {
  const double elements = static_cast<double>(m.rows) * static_cast<double>(m.cols);
  if (m.format == CpuWeightFormat::kNvfp4) return elements / 2 + elements / 16;
  if (m.format == CpuWeightFormat::kFp8Block128) {
    // The codes and each row's fp32 scales of its 128-column blocks: what the CPU and CUDA paths hold and read (the
    // checkpoint's [rows / 128, cols / 128] grid expanded per row, docs/model-specs.md §1.7).
    return elements + 4.0 * static_cast<double>(m.rows) * static_cast<double>((m.cols + 127) / 128);
  }
  return elements * 2;
}

double matrix_params(const Linear& l) {
  return static_cast<double>(l.out_features()) * static_cast<double>(l.in_features());
}

// Bytes and parameters of the linears given, summed.
void add_linears(std::initializer_list<const Linear*> linears, double& bytes, double& params) {
  for (const Linear* l : linears) {
    bytes += matrix_bytes(l->matrix());
    params += matrix_params(*l);
  }
}

void add_mlp(const MlpWeights& w, double& bytes, double& params) {
  add_linears({&w.gate_proj, &w.up_proj, &w.down_proj}, bytes, params);
}

// Counts what each block moves and computes per token, placed as a device would place it (no blocks made).
class TrafficCounter final : public BlockOps {
 public:
  explicit TrafficCounter(bool tied_config) : tied_config_(tied_config) {}
  Expected<std::unique_ptr<Block>> embedding(const CpuMatrix& table, VocabRange vocab) override {
    table_ = table.data;  // read one row per token: held, not counted per step
    t_.embedding_bytes = matrix_bytes(table);
    t_.hidden = table.cols;
    t_.vocab = vocab.full;
    ++t_.summed_blocks;
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> attention(const RmsNorm&, const Attention& a) override {
    ++t_.summed_blocks;
    const AttentionWeights& w = a.weights();
    add_linears({&w.q_proj, &w.k_proj, &w.v_proj, &w.o_proj}, t_.dense_weight_bytes, dense_params_);
    const AttentionShape& s = a.shape();
    t_.kv_bytes_per_token += 2.0 * static_cast<double>(s.n_kv_heads * s.head_dim) * 2;
    t_.attention_flops_per_token2 += 2.0 * static_cast<double>(s.n_heads * s.head_dim);
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> gated_deltanet(const RmsNorm&, const GatedDeltaNet& g) override {
    ++t_.summed_blocks;
    const GatedDeltaNetWeights& w = g.weights();
    add_linears({&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a, &w.in_proj_qkvz, &w.in_proj_ba, &w.out_proj},
                t_.dense_weight_bytes, dense_params_);
    const GatedDeltaNetShape& s = g.shape();
    const double state = static_cast<double>(s.n_value_heads * s.key_dim * s.value_dim) * 4;
    const double conv =
        static_cast<double>((2 * s.n_key_heads * s.key_dim + s.n_value_heads * s.value_dim) * (s.conv_kernel - 1)) * 2;
    t_.state_bytes_per_sequence += state + conv;
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> mla(const RmsNorm&, const MlaAttention& a) override {
    ++t_.summed_blocks;
    const MlaWeights& w = a.weights();
    add_linears({&w.q_a_proj, &w.q_b_proj, &w.q_proj, &w.kv_a_proj, &w.kv_b_proj, &w.o_proj}, t_.dense_weight_bytes,
                dense_params_);
    if (w.indexer) {
      add_linears({&w.indexer->wq_b, &w.indexer->wk, &w.indexer->weights_proj}, t_.dense_weight_bytes, dense_params_);
    }
    const MlaShape& s = a.shape();
    // The latent cache: [c | k_pe] per token (bf16, or the FP8 entry), and the indexer's key.
    t_.kv_bytes_per_token += static_cast<double>(s.latent_fp8 ? latent_fp8_bytes(s.kv_lora_rank, s.qk_rope_head_dim)
                                                               : (s.kv_lora_rank + s.qk_rope_head_dim) * 2) +
                             static_cast<double>(s.index_head_dim) * 2;
    t_.attention_flops_per_token2 += 2.0 * static_cast<double>(s.n_heads * (s.qk_nope_head_dim + s.qk_rope_head_dim));
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> mlp(const RmsNorm&, const Mlp& m) override {
    ++t_.summed_blocks;
    add_mlp(m.weights(), t_.dense_weight_bytes, dense_params_);
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> moe(const RmsNorm&, const Moe& m) override {
    ++t_.summed_blocks;
    const MoeWeights& w = m.weights();
    add_linears({&w.router}, t_.dense_weight_bytes, dense_params_);
    if (w.shared_expert) {
      add_mlp(w.shared_expert->weights(), t_.dense_weight_bytes, dense_params_);
      add_linears({&w.shared_expert_gate}, t_.dense_weight_bytes, dense_params_);
    }
    if (!w.experts.empty()) {
      double bytes = 0, params = 0;
      add_mlp(w.experts.front(), bytes, params);
      t_.expert_bytes = bytes;
      t_.n_experts = static_cast<int64_t>(w.experts.size());
      t_.router_experts = w.router.out_features();
      t_.top_k = m.shape().top_k;
      // Each token's top_k experts, of which this rank holds n_experts / router_experts on average (all of them,
      // sliced, under tensor parallelism; a share of whole ones under expert parallelism).
      expert_params_ += params * static_cast<double>(t_.top_k * t_.n_experts) / static_cast<double>(t_.router_experts);
      ++t_.moe_layers;
    }
    return nullptr;
  }
  Expected<std::unique_ptr<Block>> lm_head(const RmsNorm&, const Linear& head, VocabRange) override {
    add_linears({&head}, t_.dense_weight_bytes, dense_params_);
    // Tied: the one table, held once. (The config must say so too: a shapes-only store's tensors share one buffer.)
    if (tied_config_ && head.matrix().data == table_) t_.embedding_bytes = 0;
    return nullptr;
  }
  // Not visited: step_traffic_of counts the model's own step (CausalLm::visit_blocks without the draft module).
  Expected<std::unique_ptr<Block>> draft_input(const RmsNorm&, const RmsNorm&, const Linear&) override {
    return nullptr;
  }
  Expected<void> trace_output(std::string_view) override { return {}; }

  StepTraffic finish() {
    t_.linear_flops_per_token = 2 * (dense_params_ + expert_params_);
    return t_;
  }

 private:
  StepTraffic t_;
  const bool tied_config_;
  const void* table_ = nullptr;
  double dense_params_ = 0, expert_params_ = 0;
};

}  // namespace

StepTraffic step_traffic_of(const CausalLm& model) {
  TrafficCounter counter(model.config().tie_word_embeddings);
  (void)model.visit_blocks(counter);  // the counter's placements never fail
  return counter.finish();
}

double expected_distinct_experts(int64_t n_experts, int64_t top_k, int64_t tokens) {
  if (n_experts <= 0) return 0;
  const double e = static_cast<double>(n_experts);
  return e * (1.0 - std::pow(1.0 - static_cast<double>(top_k) / e, static_cast<double>(tokens)));
}

double expected_busiest_rank_experts(int64_t n_experts, int64_t ranks, int64_t top_k, int64_t tokens) {
  if (n_experts <= 0 || ranks < 1 || n_experts % ranks != 0 || top_k > n_experts) return 0;
  const int64_t per_rank = n_experts / ranks;
  std::mt19937_64 rng(0x5eed);
  std::uniform_int_distribution<int64_t> pick(0, n_experts - 1);
  std::vector<char> hit(static_cast<size_t>(n_experts));
  std::vector<int64_t> rank_hits(static_cast<size_t>(ranks)), chosen;
  double total = 0;
  for (int draw = 0; draw < kExpertDraws; ++draw) {
    std::fill(hit.begin(), hit.end(), 0);
    for (int64_t t = 0; t < tokens; ++t) {
      chosen.clear();
      while (static_cast<int64_t>(chosen.size()) < top_k) {  // top_k distinct experts, each set equally likely
        const int64_t e = pick(rng);
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      for (int64_t e : chosen) hit[e] = 1;
    }
    std::fill(rank_hits.begin(), rank_hits.end(), 0);
    for (int64_t e = 0; e < n_experts; ++e) rank_hits[e / per_rank] += hit[e];
    total += static_cast<double>(*std::max_element(rank_hits.begin(), rank_hits.end()));
  }
  return total / kExpertDraws;
}

double decode_step_bytes(const StepTraffic& t, int64_t batch, double context) {
  // The router's experts any of the batch chose that this rank holds: all of them (each a slice) under tensor
  // parallelism; under expert parallelism the busiest rank's share, which the step waits for.
  const int64_t ranks = t.n_experts > 0 ? t.router_experts / t.n_experts : 1;
  const double experts = t.router_experts <= 0 ? 0
                         : ranks > 1 ? expected_busiest_rank_experts(t.router_experts, ranks, t.top_k, batch)
                                     : expected_distinct_experts(t.router_experts, t.top_k, batch);
  // The Gated DeltaNet state is read and written back.
  return t.dense_weight_bytes + static_cast<double>(t.moe_layers) * experts * t.expert_bytes +
         static_cast<double>(batch) * (context * t.kv_bytes_per_token + 2 * t.state_bytes_per_sequence);
}

double weight_bytes(const StepTraffic& t) {
  return t.dense_weight_bytes + static_cast<double>(t.moe_layers * t.n_experts) * t.expert_bytes + t.embedding_bytes;
}

double rank_memory_bytes(const StepTraffic& t, int64_t batch, int64_t context) {
  const double b = static_cast<double>(batch);
  return weight_bytes(t) + b * (static_cast<double>(context) * t.kv_bytes_per_token + t.state_bytes_per_sequence);
}

StepCollectives step_collectives(const StepTraffic& t, int64_t world, int64_t tokens, int64_t logit_rows) {
  if (world <= 1) return {};
  constexpr double kBf16 = 2;
  return {.all_reduces = t.summed_blocks,
          .all_reduce_bytes = static_cast<double>(tokens * t.hidden) * kBf16,
          .all_gather_bytes =
              static_cast<double>(logit_rows * vocab_shard_rows(t.vocab, world) * world) * kBf16};
}

double prefill_flops(const StepTraffic& t, int64_t tokens) {
  const double n = static_cast<double>(tokens);
  return t.linear_flops_per_token * n + t.attention_flops_per_token2 * n * n;
}

namespace {

// This rank's length of a split dimension of `extent`.
Expected<double> rank_length(const Shard& shard, int64_t extent, ShardRank rank, const std::string& tensor) {
  TERN_ASSIGN_OR_RETURN(const std::vector<ShardPiece> pieces, shard_pieces(shard, extent, rank, tensor));
  return static_cast<double>(shard_pieces_length(pieces));
}

// Bytes of this rank's slice of a linear [out, in], NVFP4 or BF16.
Expected<double> rank_linear_bytes(const std::string& module, int64_t out, int64_t in, const Shard& shard,
                                   bool nvfp4, ShardRank rank) {
  const bool by_columns = shard.dim == ShardDim::kInput;
  TERN_ASSIGN_OR_RETURN(const double length, rank_length(shard, by_columns ? in : out, rank, module + ".weight"));
  const double elements = length * static_cast<double>(by_columns ? out : in);
  return nvfp4 ? elements / 2 + elements / 16 : elements * 2;
}

}  // namespace

Expected<SchemaRankBytes> schema_rank_bytes(const WeightSchema& schema, const std::optional<QuantConfig>& quant,
                                            ShardRank rank) {
  const bool nvfp4_config = quant && quant->quant_algo.find("NVFP4") != std::string::npos;
  auto nvfp4 = [&](const std::string& module) { return nvfp4_config && !quant->producer_excludes(module); };
  SchemaRankBytes b;
  for (const LinearSpec& l : schema.linears) {
    if (l.role == LinearRole::kLmHead && schema.tied_embeddings) continue;  // the embedding table itself
    TERN_ASSIGN_OR_RETURN(const double bytes,
                          rank_linear_bytes(l.module, l.out_features, l.in_features, l.shard, nvfp4(l.module), rank));
    b.linear_bytes += bytes;
  }
  for (const ExpertGroupSpec& g : schema.expert_groups) {
    TERN_ASSIGN_OR_RETURN(const ExpertGroupRank mine, expert_group_rank(g, rank));
    for (int64_t x = mine.first; x < mine.first + mine.count; ++x) {
      const std::string e = fmt::format("{}.{}.", g.prefix, x);
      TERN_ASSIGN_OR_RETURN(const double gate, rank_linear_bytes(e + "gate_proj", g.intermediate, g.hidden,
                                                                 mine.gate_up, nvfp4(e + "gate_proj"), rank));
      TERN_ASSIGN_OR_RETURN(const double up, rank_linear_bytes(e + "up_proj", g.intermediate, g.hidden,
                                                               mine.gate_up, nvfp4(e + "up_proj"), rank));
      TERN_ASSIGN_OR_RETURN(const double down, rank_linear_bytes(e + "down_proj", g.hidden, g.intermediate,
                                                                 mine.down, nvfp4(e + "down_proj"), rank));
      b.expert_bytes += gate + up + down;
    }
  }
  b.linear_bytes += b.expert_bytes;
  for (const ParamSpec& p : schema.params) {
    if (p.shard.dim != ShardDim::kVocab || p.shape.size() != 2) continue;  // embed_tokens; norms etc. left out
    TERN_ASSIGN_OR_RETURN(const double rows, rank_length(p.shard, p.shape[0], rank, p.name));
    b.embedding_bytes += rows * static_cast<double>(p.shape[1]) * 2;
  }
  for (const StateSpec& st : schema.states) {
    if (st.shape.empty()) continue;
    TERN_ASSIGN_OR_RETURN(double elements, rank_length(st.shard, st.shape[0], rank, st.name));
    for (size_t d = 1; d < st.shape.size(); ++d) elements *= static_cast<double>(st.shape[d]);
    if (st.name.ends_with("_cache")) {
      b.cache_bytes_per_token += elements * 2;
    } else {
      b.state_bytes_per_sequence += elements * (st.name.ends_with("recurrent_state") ? 4 : 2);
    }
  }
  return b;
}

}  // namespace tern
