// tern: one binary, one subcommand per job.
#include <CLI/CLI.hpp>

#include "cli/bench_command.h"
#include "cli/doctor_command.h"
#include "cli/generate_command.h"
#include "cli/info_command.h"
#include "cli/loadgen_command.h"
#include "cli/perplexity_command.h"
#include "cli/rank_processes.h"
#include "cli/score_command.h"
#include "cli/serve_command.h"
#include "cli/template_command.h"
#include "cli/tokenize_command.h"
#include "cli/version_command.h"

int main(int argc, char** argv) {
  tern::adopt_parent_lifetime();  // a rank process of --distributed-executor-backend mp dies with its node 0
  tern::set_command_line(argc, argv);
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {  // a command's own exit status (0 clean, 1 problems found, 2 bad input)
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every malformed or out-of-range flag is bad input, exit 2 like any other.
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  return 0;
}
