// The model on the CPU: the blocks of models/cpu/cpu_ops.h (each host block's fp32 reference forward), each
// sequence's caches in its LayerCache.
#pragma once

#include <memory>

#include "core/error.h"
#include "models/causal_lm.h"
#include "runtime/model_runner.h"

namespace tern {

// `comm`: the tensor-parallel group when `model` is one rank's slice (runtime/tp_runner.h); null for a whole model.
Expected<std::unique_ptr<ModelRunner>> cpu_runner_create(std::unique_ptr<CausalLm> model, Communicator* comm = nullptr);

}  // namespace tern
