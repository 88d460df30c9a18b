#pragma once

#include <CLI/CLI.hpp>

namespace tern {
// tern generate: prefill a prompt, then decode token by token from the KV cache / GDN states.
void register_generate_command(CLI::App& app);
}  // namespace tern
