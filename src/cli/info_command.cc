#include "cli/info_command.h"

#include <fmt/format.h>

#include <memory>

#include "models/model_info.h"

namespace tern {
namespace {

struct InfoOptions {
  std::string model_dir;
  bool json = false;
};

int run_info(const InfoOptions& options) {
  auto info = model_info_inspect(options.model_dir);
  if (!info) {
    fmt::print(stderr, "tern info: {}\n", info.error().message);
    return 2;
  }
  if (options.json) {
    fmt::print("{}\n", model_info_to_json(*info).dump(2));
  } else {
    fmt::print("{}", model_info_to_text(*info));
  }
  return info->problems.empty() ? 0 : 1;
}

}  // namespace

void register_info_command(CLI::App& app) {
  auto options = std::make_shared<InfoOptions>();
  CLI::App* cmd = app.add_subcommand("info", "Show what a checkpoint holds and check it against its architecture");
  cmd->add_option("--model", options->model_dir, "Checkpoint directory (config.json + safetensors)")->required();
  cmd->add_flag("--json", options->json, "Print one JSON object");
  cmd->callback([options] { throw CLI::RuntimeError(run_info(*options)); });
}

}  // namespace tern
