#pragma once

#include <CLI/CLI.hpp>

namespace tern {
// tern score: one teacher-forced forward over a prompt; the top-K raw logits at every position.
void register_score_command(CLI::App& app);
}  // namespace tern
