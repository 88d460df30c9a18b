// `tern serve`: the OpenAI-compatible HTTP server.
#pragma once

#include <CLI/CLI.hpp>

namespace tern {

void register_serve_command(CLI::App& app);

}  // namespace tern
