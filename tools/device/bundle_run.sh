#!/usr/bin/env bash
# Runs binaries of a bundle made by bundle.sh, each with a timeout, from the repository root (the tests read
# tests/fixtures); prints the exit status, the time and the lines that say what passed or failed; full logs go to
# $OUT (or /tmp/out).
#
#   BUNDLE_DIR/run.sh [-t SECONDS] BINARY[:gtest_filter]...
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cublas=$(find /usr/local/cuda*/ /usr/lib /opt -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
# NCCL is loaded at run time (dist/cuda/nccl_communicator.h): the toolkit's, the system's or the nvidia-nccl wheel's.
nccl=$(find /usr/local/cuda*/ /usr/lib /opt /usr/local/lib/python3* -name 'libnccl.so.2' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$here${cublas:+:$(dirname "$cublas")}${nccl:+:$(dirname "$nccl")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out=${OUT:-/tmp/out}
mkdir -p "$out"
cd "$here/.."
limit=240
if [[ "${1:-}" == "-t" ]]; then limit=$2; shift 2; fi
failed=0
for spec in "$@"; do
  bin=${spec%%:*} filter=()
  [[ "$spec" != "$bin" ]] && filter=(--gtest_filter="${spec#*:}")
  start=$SECONDS
  # -k: a test stuck in a GPU wait may ignore SIGTERM; SIGKILL 10 s later keeps the call within its limit.
  timeout -k 10 "$limit" "$here/$bin" "${filter[@]}" > "$out/$bin.log" 2>&1
  rc=$?
  echo "== $bin ${filter[*]} exit $rc ($((SECONDS - start)) s)"
  grep -E "^\[  (PASSED|FAILED)|Failure|max error" "$out/$bin.log" | head -"${LINES_PER:-12}"
  [[ $rc -eq 0 ]] || failed=$((failed + 1))
done
exit "$failed"
