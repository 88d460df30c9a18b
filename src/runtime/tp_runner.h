// A model split over N tensor-parallel ranks in this process: each rank is a runner of its own (runtime/
// cpu_runner.h) holding its slice of every weight (models/shard.h), driven by its own thread, and the ranks sum
// their partial outputs over a LoopbackGroup (dist/loopback.h). One step here is the same step on every rank: the
// same sequences and tokens, each rank extending its own slice of every sequence's caches; rank 0's logits (every
// rank holds the whole logits after lm_head's gather) are the step's, and rank 0 alone samples.
//
//   ModelLoadOptions options;
//   options.tensor_parallel_size = 2;
//   TERN_ASSIGN_OR_RETURN(auto runner, runner_load("/models/qwen3", options));  // a TpRunner of 2 CPU ranks
//
// A rank that fails (or a collective past its deadline) aborts the group, so that no rank waits for it; the step
// fails with the first rank's reason, and so does every later step: the runner is broken.
#pragma once

#include <filesystem>
#include <memory>

#include "core/error.h"
#include "models/causal_lm.h"
#include "runtime/model_runner.h"

namespace tern {

// options.tensor_parallel_size ranks, each loaded from `dir` with its slice (in parallel). Errors name the rank and
// what could not be split (a tensor, its sizes and the world size) or loaded.
Expected<std::unique_ptr<ModelRunner>> tp_runner_load(const std::filesystem::path& dir, const ModelLoadOptions& options);

}  // namespace tern
