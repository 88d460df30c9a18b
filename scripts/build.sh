#!/usr/bin/env bash
# Configures and builds tern into build/ (CUDA kernels included when nvcc is found; TERN_CUDA=OFF to skip them).
# Extra arguments go to ninja (targets, -j).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${TERN_BUILD_DIR:-$root/build}"
cmake -S "$root" -B "$build" -G Ninja -DTERN_CUDA="${TERN_CUDA:-AUTO}" ${TERN_CMAKE_ARGS:-} >/dev/null
ninja -C "$build" "$@"
