#include "cli/version_command.h"

#include <fmt/format.h>

#include <memory>

#if TERN_HAVE_CUDA
#include "kernels/cuda/library_versions.h"
#endif

namespace tern {

std::vector<LibraryVersion> linked_library_versions() {
#if TERN_HAVE_CUDA
  return cuda_library_versions();
#else
  return {};
#endif
}

nlohmann::ordered_json build_info_json(const std::vector<LibraryVersion>& libraries) {
  const BuildInfo& b = build_info();
  auto or_null = [](std::string_view s) { return s.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(s); };
  nlohmann::ordered_json j = {{"version", b.version},
                              {"commit", b.commit},
                              {"build_type", b.build_type},
                              {"compiler", b.compiler},
                              {"cuda", b.cuda},
                              {"cuda_toolkit", or_null(b.cuda_toolkit)},
                              {"cuda_architectures", b.cuda_architectures},
                              {"libraries", nlohmann::ordered_json::object()}};
  for (const LibraryVersion& l : libraries) {
    j["libraries"][l.key] = {{"name", l.name}, {"version", or_null(l.version)}, {"compiled", or_null(l.compiled)}};
  }
  return j;
}

void register_version_command(CLI::App& app) {
  app.set_version_flag(
      "--version", [] { return build_info_text(linked_library_versions()); },
      "Print tern's version, commit, build and CUDA libraries, and exit");
  auto json = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand("version", "Print what --version prints; --json for one JSON object");
  cmd->add_flag("--json", *json, "Print one JSON object");
  cmd->callback([json] {
    const std::vector<LibraryVersion> libraries = linked_library_versions();
    fmt::print("{}\n", *json ? build_info_json(libraries).dump(2) : build_info_text(libraries));
  });
}

}  // namespace tern
