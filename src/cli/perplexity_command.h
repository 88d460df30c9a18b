#pragma once

#include <CLI/CLI.hpp>

namespace tern {
// tern perplexity: the perplexity of a text file under a model, over strided sliding windows (runtime/perplexity.h),
// and with --kl-reference the KL divergence of its next-token distributions from a reference model's.
void register_perplexity_command(CLI::App& app);
}  // namespace tern
