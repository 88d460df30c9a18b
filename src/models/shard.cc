#include "models/shard.h"

namespace tern {
namespace {

std::string_view dim_name(ShardDim dim) {
  switch (dim) {
    case ShardDim::kReplicated:
      return "replicated";
    case ShardDim::kOutput:
      return "output rows";
    case ShardDim::kInput:
      return "input columns";
    case ShardDim::kVocab:
      return "vocabulary rows";
  }
  return "?";
}

void append(std::vector<ShardPiece>& pieces, ShardPiece p) {
  if (p.length == 0) return;
  if (!pieces.empty() && pieces.back().offset + pieces.back().length == p.offset) {
    pieces.back().length += p.length;
  } else {
    pieces.push_back(p);
  }
}

}  // namespace

int64_t shard_pieces_length(const std::vector<ShardPiece>& pieces) {
  int64_t n = 0;
  for (const ShardPiece& p : pieces) n += p.length;
  return n;
}

Expected<std::vector<ShardPiece>> shard_pieces(const Shard& shard, int64_t extent, ShardRank r,
                                               std::string_view tensor) {
  if (r.world < 1) return make_error("tensor '{}': world size must be at least 1, got {}", tensor, r.world);
  if (r.rank < 0 || r.rank >= r.world) {
    return make_error("tensor '{}': rank {} is outside world size {}", tensor, r.rank, r.world);
  }
  const int64_t world = r.world, rank = r.rank;
  std::vector<ShardPiece> pieces;
  if (shard.dim == ShardDim::kReplicated) {
    append(pieces, {0, extent});
    return pieces;
  }
  if (shard.dim == ShardDim::kVocab) {
    const int64_t range = vocab_shard_rows(extent, world);
    const int64_t begin = std::min(extent, rank * range);
    append(pieces, {begin, std::min(extent, begin + range) - begin});
    return pieces;
  }
  int64_t covered = 0;
  for (const ShardSegment& s : shard.segments) covered += s.count * s.size;
  if (covered != extent) {
    return make_error("tensor '{}': its shard segments cover {} of its {} {}", tensor, covered, extent,
                      dim_name(shard.dim));
  }
  int64_t offset = 0;
  for (const ShardSegment& s : shard.segments) {
    if (s.count % world == 0) {
      const int64_t n = s.count / world;
      append(pieces, {offset + rank * n * s.size, n * s.size});
    } else if (s.replicate && s.count < world && world % s.count == 0) {
      append(pieces, {offset + rank * s.count / world * s.size, s.size});
    } else {
      return make_error(
          "tensor '{}': cannot split its {} over world size {}: {} units of {} at offset {} do not divide by {}{}",
          tensor, dim_name(shard.dim), world, s.count, s.size, offset, world,
          s.replicate ? " (nor does the world size divide by them, for replication)" : "");
    }
    offset += s.count * s.size;
  }
  return pieces;
}

}  // namespace tern
