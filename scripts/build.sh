#!/usr/bin/env bash
# Configures and builds tern into build/ (CUDA kernels included when nvcc is found; TERN_CUDA=OFF to skip them).
# Extra arguments go to ninja (targets, -j). Fails when ptxas reports that it serialized a kernel's wgmma
# instructions (each then waits for the one before: docs/perf/gpu.md §moe-prefill-wgmma); it says so only for the
# objects it compiles, so a clean build (CI) sees every kernel.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${TERN_BUILD_DIR:-$root/build}"
cmake -S "$root" -B "$build" -G Ninja -DTERN_CUDA="${TERN_CUDA:-AUTO}" ${TERN_CMAKE_ARGS:-} >/dev/null
log="$build/build_output.txt"
ninja -C "$build" "$@" 2>&1 | tee "$log"
if grep -q "wgmma.mma_async instructions are serialized" "$log"; then
  grep "wgmma.mma_async instructions are serialized" "$log" >&2
  echo "build.sh: ptxas serialized the wgmma instructions of the kernels above (docs/perf/gpu.md §moe-prefill-wgmma)" >&2
  exit 1
fi
