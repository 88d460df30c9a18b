#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/build_info.h"

namespace tern {

// `tern --version` and `tern version [--json]`: what this binary is (core/build_info.h) and the CUDA libraries it
// runs with. The JSON form is a subcommand with its own --json, as `tern info --json` and `tern doctor --json` are,
// rather than `tern --version --json`: that needs a top-level --json flag that only the version callback would
// read and that `tern --help` would list as if it applied to every subcommand.
void register_version_command(CLI::App& app);

// The libraries found at run time: the CUDA ones in a CUDA build (kernels/cuda/library_versions.h), none otherwise.
std::vector<LibraryVersion> linked_library_versions();

// The build facts and those libraries as one object: `tern version --json`, and "build" in `tern doctor --json`.
nlohmann::ordered_json build_info_json(const std::vector<LibraryVersion>& libraries);

}  // namespace tern
