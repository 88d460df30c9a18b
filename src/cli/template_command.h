// `tern template`: renders chat requests with a model's chat template (for checking prompts by hand or in bulk).
#pragma once

#include <CLI/CLI.hpp>

namespace tern {

void register_template_command(CLI::App& app);

}  // namespace tern
