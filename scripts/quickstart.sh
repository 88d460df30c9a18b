#!/usr/bin/env bash
# From a fresh machine: installs the dependencies, builds tern and runs its main job on a bundled checkpoint.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" tern
"${TERN_BUILD_DIR:-$root/build}/src/cli/tern" info --model "$root/tests/fixtures/qwen3_5_moe_nvfp4"
