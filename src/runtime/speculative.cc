#include "runtime/speculative.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace tern {
namespace {

// The first sampled row of each sequence of a step: a verified one samples all its rows, the others their last.
std::vector<int64_t> first_sampled_rows(std::span<const SequenceInput> batch) {
  std::vector<int64_t> first;
  int64_t row = 0;
  for (const SequenceInput& in : batch) {
    first.push_back(row);
    row += in.verify ? static_cast<int64_t>(in.tokens.size()) : 1;
  }
  return first;
}

// Acceptance in order from the tokens sampled at each row (`rows`: the sequence's rows from its first). Draft d is
// accepted when the row before it sampled d, and the first row that sampled something else gives the step's last
// token (after every draft accepted, the last row's). With a point-mass proposal q = δ(d) this is the Leviathan /
// Chen rejection rule: the row samples d with probability p(d), the acceptance probability min(1, p(d) / q(d)), and
// a token other than d comes from p without d, renormalised; greedy rows take the arg-max. So the output is
// distributed exactly as plain sampling's (greedy: identical). Without a verification, the one row's token.
Expected<std::vector<SampledToken>> accept_in_order(std::span<const Expected<SampledToken>> rows,
                                                    std::span<const int32_t> drafts, bool verified) {
  std::vector<SampledToken> tokens;
  const size_t n = verified ? drafts.size() + 1 : 1;
  for (size_t j = 0; j < n; ++j) {
    if (!rows[j]) return tl::unexpected<Error>(rows[j].error());
    tokens.push_back(*rows[j]);
    if (j == drafts.size() || !verified || rows[j]->id != drafts[j]) break;
  }
  return tokens;
}

}  // namespace

Expected<std::vector<SpecOutcome>> speculative_step(ModelRunner& runner, std::span<SpecSequence> seqs,
                                                    int num_steps) {
  if (!runner.has_draft()) return make_error("speculative decoding needs the model's draft module loaded");
  if (num_steps < 0 || num_steps > kMaxSpeculativeSteps) {
    return make_error("{} speculative steps asked; 0 to {} are possible", num_steps, kMaxSpeculativeSteps);
  }
  const size_t n = seqs.size();
  // The model's step: each chunk, with a sampling sequence's drafts after its last token.
  std::vector<std::vector<int32_t>> tokens(n);
  std::vector<SequenceInput> batch(n);
  std::vector<int64_t> start(n);
  for (size_t i = 0; i < n; ++i) {
    const SpecSequence& s = seqs[i];
    const bool samples = s.sample.sampler != nullptr;
    const size_t known = s.input.tokens.size();
    if (s.drafts == nullptr || known == 0) return make_error("a speculative sequence without tokens or drafts");
    if (s.following.size() < known - (samples ? 1 : 0)) {
      return make_error("a chunk of {} tokens with {} known after its first", known, s.following.size());
    }
    tokens[i].assign(s.input.tokens.begin(), s.input.tokens.end());
    if (samples) tokens[i].insert(tokens[i].end(), s.drafts->begin(), s.drafts->end());
    batch[i] = s.input;
    batch[i].tokens = tokens[i];
    batch[i].verify = samples && !s.drafts->empty();
    start[i] = s.input.cache->length;
  }
  // Every row samples where its logits are (on a GPU they stay there, only ids come back): a verified sequence's
  // rows each with a draw of their own from the sequence's sampler, row j seeing the output with the drafts before
  // it (its penalties' ids).
  std::vector<std::vector<int32_t>> row_outputs;
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; batch[i].verify && j < batch[i].tokens.size(); ++j) {
      std::vector<int32_t>& output = row_outputs.emplace_back(seqs[i].sample.output_ids.begin(),
                                                              seqs[i].sample.output_ids.end());
      output.insert(output.end(), seqs[i].drafts->begin(), seqs[i].drafts->begin() + static_cast<ptrdiff_t>(j));
    }
  }
  std::vector<SampleRow> rows;  // row_outputs is complete: the spans into it stay valid
  size_t o = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!batch[i].verify) {
      rows.push_back(seqs[i].sample);
      continue;
    }
    for (size_t j = 0; j < batch[i].tokens.size(); ++j) {
      rows.push_back({seqs[i].sample.sampler, seqs[i].sample.prompt_ids, row_outputs[o++]});
    }
  }
  TERN_ASSIGN_OR_RETURN(const SampleResults row_tokens, runner.forward_sample_rows(batch, rows));
  const std::vector<int64_t> first = first_sampled_rows(batch);

  // Acceptance, and the rows each sequence keeps.
  std::vector<SpecOutcome> outcomes(n);
  std::vector<int64_t> kept(n);
  for (size_t i = 0; i < n; ++i) {
    SpecSequence& s = seqs[i];
    SpecOutcome& out = outcomes[i];
    kept[i] = static_cast<int64_t>(s.input.tokens.size());
    if (s.sample.sampler == nullptr) continue;
    Expected<std::vector<SampledToken>> got =
        accept_in_order(std::span(row_tokens).subspan(static_cast<size_t>(first[i])), *s.drafts, batch[i].verify);
    if (!got) {
      out.error = got.error();
      continue;
    }
    out.tokens = std::move(*got);
    if (batch[i].verify) {
      out.drafted = static_cast<int64_t>(s.drafts->size());
      out.accepted = static_cast<int64_t>(out.tokens.size()) - 1;
      kept[i] = static_cast<int64_t>(s.input.tokens.size()) + out.accepted;
      TERN_TRY(runner.keep_rows(*s.input.cache, kept[i]));
    }
  }

  // The draft module over every kept row: row j runs on the token that followed it.
  std::vector<std::vector<int32_t>> next(n);
  std::vector<DraftInput> extend;
  std::vector<size_t> owner;     // the sequence of each input of `extend`
  std::vector<size_t> drafting;  // the inputs of the sampling sequences
  for (size_t i = 0; i < n; ++i) {
    SpecSequence& s = seqs[i];
    s.drafts->clear();
    if (outcomes[i].error) continue;
    const bool samples = s.sample.sampler != nullptr;
    const size_t rows = static_cast<size_t>(kept[i]);
    if (samples) {
      // The chunk's own tokens after its first, then the step's tokens (accepted drafts and the last one).
      next[i].assign(s.following.begin(), s.following.begin() + static_cast<ptrdiff_t>(s.input.tokens.size() - 1));
      for (const SampledToken& t : outcomes[i].tokens) next[i].push_back(t.id);
    } else {
      next[i].assign(s.following.begin(), s.following.begin() + static_cast<ptrdiff_t>(rows));
    }
    next[i].resize(rows);
    SequenceInput in = s.input;
    in.tokens = next[i];
    extend.push_back({in, start[i], DraftHidden::kModel, static_cast<int64_t>(i)});
    owner.push_back(i);
    if (samples) drafting.push_back(extend.size() - 1);
  }
  if (extend.empty()) return outcomes;
  // Proposals are the draft's arg-maxes (the point mass the acceptance rule assumes), one row per step on the
  // draft's own output after the first.
  TERN_ASSIGN_OR_RETURN(std::vector<int32_t> proposal, runner.draft_argmax(extend));
  std::vector<int64_t> position(extend.size());
  for (size_t e = 0; e < extend.size(); ++e) {
    position[e] = extend[e].position + static_cast<int64_t>(extend[e].seq.tokens.size());
  }
  std::vector<int64_t> source(extend.size());
  for (size_t e = 0; e < extend.size(); ++e) source[e] = static_cast<int64_t>(e);
  for (int step = 0; step < num_steps; ++step) {
    for (size_t d : drafting) seqs[owner[d]].drafts->push_back(proposal[d]);
    if (step + 1 == num_steps || drafting.empty()) break;
    std::vector<DraftInput> chain;
    for (size_t d : drafting) {
      SequenceInput in = seqs[owner[d]].input;
      in.tokens = std::span<const int32_t>(&proposal[d], 1);
      chain.push_back({in, position[d], DraftHidden::kDraft, source[d]});
    }
    TERN_ASSIGN_OR_RETURN(const std::vector<int32_t> chained, runner.draft_argmax(chain));
    for (size_t c = 0; c < drafting.size(); ++c) {
      const size_t d = drafting[c];
      proposal[d] = chained[c];
      ++position[d];
      source[d] = static_cast<int64_t>(c);
    }
  }
  return outcomes;
}

int SpeculationGovernor::bucket_of(int batch) { return std::bit_width(static_cast<unsigned>(std::max(batch, 1))) - 1; }

bool SpeculationGovernor::verify(int batch) {
  Bucket& b = buckets_[bucket_of(batch)];
  const int64_t at = b.decisions++;
  if (b.spec_samples < kMinSamples) return true;
  if (b.plain_samples < kMinSamples) return false;
  const bool spec_pays = b.n_spec * b.t_plain >= b.t_spec;
  const bool probing = probe_every_ > 0 && at % probe_every_ >= probe_every_ - kProbeSteps;
  return probing ? !spec_pays : spec_pays;
}

void SpeculationGovernor::record(int batch, bool verified, double seconds, double tokens_per_sequence) {
  if (!(seconds > 0.0) || !std::isfinite(seconds)) return;
  Bucket& b = buckets_[bucket_of(batch)];
  auto blend = [](double& average, int& samples, double value) {
    average = samples == 0 ? value : average + kWeight * (value - average);
    ++samples;
  };
  if (verified) {
    int spec_samples = b.spec_samples;
    blend(b.n_spec, spec_samples, tokens_per_sequence);
    blend(b.t_spec, b.spec_samples, seconds);
  } else {
    blend(b.t_plain, b.plain_samples, seconds);
  }
}

}  // namespace tern
