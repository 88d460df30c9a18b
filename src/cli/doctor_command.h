#pragma once

#include <CLI/CLI.hpp>

namespace tern {

// `tern doctor [--model DIR] [--json] [--selftest fast|full]`: devices, what the binary holds, and for each op the
// model needs, every candidate's self-test on this machine and the chosen implementation. Exits 1 when an op has
// no verified implementation.
void register_doctor_command(CLI::App& app);

}  // namespace tern
