// `tern bench`: offline throughput of a model on this machine (usually --load-format dummy on a bench/configs
// shape): prefill of given prompt lengths, and decode steps at given batch sizes and context length, each row next
// to the hardware limit measured in the same run (copy bandwidth for decode, BF16 GEMM rate for prefill).
#pragma once

#include <CLI/CLI.hpp>

namespace tern {

void register_bench_command(CLI::App& app);

}  // namespace tern
