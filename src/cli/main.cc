// tern: one binary, one subcommand per job.
#include <CLI/CLI.hpp>

#include "cli/bench_command.h"
#include "cli/doctor_command.h"
#include "cli/generate_command.h"
#include "cli/info_command.h"
#include "cli/loadgen_command.h"
#include "cli/perplexity_command.h"
#include "cli/score_command.h"
#include "cli/serve_command.h"
#include "cli/template_command.h"
#include "cli/tokenize_command.h"
#include "cli/version_command.h"

int main(int argc, char** argv) {
  CLI::App app{"tern: serves large language models from their Hugging Face checkpoints"};
  app.require_subcommand(1);  // --version answers before this is checked
  tern::register_info_command(app);
  tern::register_doctor_command(app);
  tern::register_tokenize_commands(app);
  tern::register_template_command(app);
  tern::register_generate_command(app);
  tern::register_score_command(app);
  tern::register_perplexity_command(app);
  tern::register_serve_command(app);
  tern::register_bench_command(app);
  tern::register_loadgen_command(app);
  tern::register_version_command(app);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
