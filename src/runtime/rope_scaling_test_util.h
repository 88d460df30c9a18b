// A fixture's files with config.json's RoPE replaced (rope_scaling_test.cc, cuda_runner_test.cc).
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>

namespace tern {

// A directory named after `tag` (unique per test) holding the fixture's files, its weights linked, with
// config.json's rope_parameters dropped and rope_scaling set to `rope_scaling`.
inline std::filesystem::path with_rope(const std::string& fixture, const nlohmann::json& rope_scaling,
                                       const std::string& tag) {
  const std::filesystem::path src = std::filesystem::path(TERN_FIXTURES_DIR) / fixture;
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("tern_rope_" + tag);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  for (const auto& entry : std::filesystem::directory_iterator(src)) {
    const auto name = entry.path().filename();
    if (name != "config.json") std::filesystem::create_symlink(entry.path(), dir / name);
  }
  nlohmann::json config = nlohmann::json::parse(std::ifstream(src / "config.json"));
  nlohmann::json& text = config.contains("text_config") ? config["text_config"] : config;
  text.erase("rope_parameters");
  text["rope_scaling"] = rope_scaling;
  std::ofstream(dir / "config.json") << config.dump(1);
  return dir;
}

}  // namespace tern
