// How one tensor splits across the ranks of tensor parallelism: a declaration per tensor, as data (the weight
// schema fills one in for every linear, parameter, expert group and cached state), and the arithmetic that turns it
// into the index ranges one rank holds. At world 1 every declaration yields the whole tensor.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tern {

enum class ShardDim {
  kReplicated,  // every rank holds the whole tensor
  kOutput,      // rows of W [out, in] (column-parallel), or dim 0 of a parameter or state
  kInput,       // columns of W [out, in] (row-parallel)
  kVocab,       // embedding / lm_head rows: the vocabulary padded to a multiple of kVocabShardAlign * world rows,
                // divided into equal contiguous ranges (vocab_shard_rows), each clipped to the real rows (so the
                // last ranks may hold fewer, or none)
};

// `count` consecutive units of `size` elements along the split dimension (a head's rows, a channel; size 1 for a
// plain split). Each rank takes count / world consecutive units. With `replicate`, count < world is also allowed
// when world % count == 0: rank r then holds unit r * count / world (KV heads, as vLLM and SGLang replicate them).
struct ShardSegment {
  int64_t count = 0;
  int64_t size = 1;
  bool replicate = false;
};

// The split dimension is the concatenation of `segments`, each divided among the ranks on its own; a rank's slice is
// its part of every segment, in segment order. kReplicated and kVocab take no segments.
struct Shard {
  ShardDim dim = ShardDim::kReplicated;
  std::vector<ShardSegment> segments;

  static Shard replicated() { return {}; }
  static Shard vocab() { return {ShardDim::kVocab, {}}; }
  static Shard output(std::vector<ShardSegment> segments) { return {ShardDim::kOutput, std::move(segments)}; }
  static Shard input(std::vector<ShardSegment> segments) { return {ShardDim::kInput, std::move(segments)}; }
};

struct ShardRank {
  int rank = 0;
  int world = 1;
  // Expert parallelism (--enable-expert-parallel): each rank holds whole routed experts, world of them splitting the
  // experts between them (ExpertGroupSpec::experts_shard), instead of a slice of every expert.
  bool expert_parallel = false;
};

// Every rank's range of the vocabulary is a multiple of this many rows (vLLM's DEFAULT_VOCAB_PADDING_SIZE). vLLM
// pads the vocabulary to it and then requires the world size to divide the result; padding to a multiple of
// kVocabShardAlign * world instead splits any vocabulary over any world size.
inline constexpr int64_t kVocabShardAlign = 64;

// The rows of each rank's (padded) range of a vocabulary of `vocab` rows split `world` ways: rank r's rows are
// [r * range, (r + 1) * range) clipped to [0, vocab).
inline int64_t vocab_shard_rows(int64_t vocab, int64_t world) {
  const int64_t unit = kVocabShardAlign * world;
  return (vocab + unit - 1) / unit * kVocabShardAlign;
}

// [offset, offset + length) along the split dimension.
struct ShardPiece {
  int64_t offset = 0;
  int64_t length = 0;
};

// The pieces rank `r` holds of a split dimension of `extent` elements, in order, adjacent pieces merged (so world 1
// gives one piece, the whole extent). Errors name `tensor`, the dimension, the world size and why: rank outside
// [0, world), world < 1, segments not covering the extent, units that do not divide among the ranks.
Expected<std::vector<ShardPiece>> shard_pieces(const Shard& shard, int64_t extent, ShardRank r,
                                               std::string_view tensor);

int64_t shard_pieces_length(const std::vector<ShardPiece>& pieces);

}  // namespace tern
