// `tern loadgen`: an online load generator for OpenAI-compatible servers (tern serve, vLLM, SGLang), reporting
// throughput and TTFT / TPOT / ITL / end-to-end latency as the serving benchmarks of those projects do.
#pragma once

#include <CLI/CLI.hpp>

namespace tern {

void register_loadgen_command(CLI::App& app);

}  // namespace tern
