#!/usr/bin/env bash
# From a fresh machine: installs the dependencies and test assets, builds everything and runs the tests.
# Tests labelled `gpu` need an NVIDIA GPU and run only with --gpu (or TERN_TEST_GPU=1).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${TERN_BUILD_DIR:-$root/build}"
gpu="${TERN_TEST_GPU:-0}"
[ "${1:-}" = "--gpu" ] && gpu=1
"$root/scripts/setup.sh"
"$root/scripts/fetch_test_assets.sh"
"$root/scripts/build.sh"
label_args=(-LE gpu)
[ "$gpu" = "1" ] && label_args=()
cd "$build"
ctest --output-on-failure -j "$(nproc)" "${label_args[@]}"
