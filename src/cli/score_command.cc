#include "cli/score_command.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>

#include "cli/model_options.h"

namespace tern {
namespace {

struct ScoreOptions {
  ModelCliOptions model;
  std::string prompt_ids;
  int64_t top_k = 16;
  bool json = false;
};

int run_score(const ScoreOptions& o) {
  auto ids = parse_id_list(o.prompt_ids);
  if (!ids) return fmt::print(stderr, "tern score: {}\n", ids.error().message), 2;
  const int64_t n = std::max<int64_t>(static_cast<int64_t>(ids->size()), 1);
  auto model = load_model_from_options(o.model, DeviceModelOptions{.max_batch_tokens = n, .max_sequences = 1,
                                                                   .kv_cache_tokens = n});
  if (!model) return fmt::print(stderr, "tern score: {}\n", model.error().message), 2;
  SequenceCache seq = (*model)->new_sequence();
  const std::vector<SequenceInput> batch{{&seq, *ids}};
  auto logits = (*model)->forward(batch, LogitsFor::kAllTokens);
  if (!logits) return fmt::print(stderr, "tern score: {}\n", logits.error().message), 2;
  const int64_t vocab = (*model)->config().vocab_size;
  const int64_t k = std::clamp<int64_t>(o.top_k, 1, vocab);
  nlohmann::ordered_json positions = nlohmann::ordered_json::array();
  for (size_t t = 0; t < ids->size(); ++t) {
    const float* row = &(*logits)[t * vocab];
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      return row[a] > row[b] || (row[a] == row[b] && a < b);
    });
    nlohmann::ordered_json entry{{"ids", nlohmann::ordered_json::array()}, {"logits", nlohmann::ordered_json::array()}};
    for (int64_t j = 0; j < k; ++j) {
      entry["ids"].push_back(order[j]);
      entry["logits"].push_back(row[order[j]]);
    }
    if (!o.json) fmt::print("position {} (token {}): top id {} logit {:.6g}\n", t, (*ids)[t], order[0], row[order[0]]);
    positions.push_back(std::move(entry));
  }
  if (o.json) fmt::print("{}\n", nlohmann::ordered_json{{"positions", positions}}.dump());
  return 0;
}

}  // namespace

void register_score_command(CLI::App& app) {
  auto o = std::make_shared<ScoreOptions>();
  CLI::App* cmd = app.add_subcommand("score", "Teacher-forced logits of a prompt (top-K per position)");
  add_model_options(*cmd, o->model);
  cmd->add_option("--prompt-ids", o->prompt_ids, "Comma-separated token ids")->required();
  cmd->add_option("--top-k", o->top_k, "How many of the highest logits to print per position");
  cmd->add_flag("--json", o->json, "Print {\"positions\": [{\"ids\": [...], \"logits\": [...]}, ...]}");
  cmd->callback([o] { throw CLI::RuntimeError(run_score(*o)); });
}

}  // namespace tern
