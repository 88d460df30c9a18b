// The model on the CPU: fp32 activations, each sequence's caches in its LayerCache, every block computed by its
// host object's reference forward (layers/).
#pragma once

#include <memory>

#include "io/model_config.h"
#include "models/model_runner.h"

namespace tern {

std::unique_ptr<ModelRunner> cpu_runner_create(const ModelConfig& config);

}  // namespace tern
