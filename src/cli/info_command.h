#pragma once

#include <CLI/CLI.hpp>

namespace tern {

// `tern info --model DIR [--json]`: what a checkpoint holds; exits 1 when problems are found, 2 when unreadable.
void register_info_command(CLI::App& app);

}  // namespace tern
