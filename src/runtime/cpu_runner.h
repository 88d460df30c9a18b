// The model on the CPU: the blocks of models/cpu/cpu_ops.h (each host block's fp32 reference forward), each
// sequence's caches in its LayerCache.
#pragma once

#include <memory>

#include "core/error.h"
#include "models/causal_lm.h"
#include "runtime/model_runner.h"

namespace tern {

Expected<std::unique_ptr<ModelRunner>> cpu_runner_create(std::unique_ptr<CausalLm> model);

}  // namespace tern
