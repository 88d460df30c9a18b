#!/usr/bin/env bash
# Fuzzes tern's parsers of untrusted input: the safetensors header, OpenAI requests (parser and validator),
# config.json, tokenizer.json and chat templates (lexer, parser, renderer). Builds the fuzz/ targets with clang,
# libFuzzer, ASan and UBSan in build-fuzz/, seeds each corpus from the tests' own inputs, and runs each target for
# an equal share of the given seconds (default 60 in all; CI's budget). A longer local run: scripts/fuzz.sh 1500
# (five minutes per target). Usage: scripts/fuzz.sh [seconds] [target...]. Exits non-zero if a target finds a
# crash, a leak, a timeout (10 s) or an input that needs more than 2 GB; the input is kept in
# build-fuzz/fuzz-artifacts/ (replay it with build-fuzz/fuzz/TARGET FILE).
set -euo pipefail

seconds="${1:-60}"
shift || true
all=(safetensors_header_fuzz openai_request_fuzz model_config_fuzz tokenizer_load_fuzz template_fuzz)
if [ $# -gt 0 ]; then targets=("$@"); else targets=("${all[@]}"); fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build-fuzz"
artifacts="$build/fuzz-artifacts"
seeds="$build/fuzz-seeds"

CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DTERN_CUDA=OFF -DTERN_BUILD_FUZZERS=ON \
  -DTERN_BUILD_TESTS=OFF -DTERN_BUILD_BENCHMARKS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C "$build" -j2 "${targets[@]}"

mkdir -p "$artifacts"
rm -rf "$seeds"
# Seeds (fresh each run, from the repository) and a dictionary per target; each corpus directory keeps what the
# fuzzer found interesting across runs.
python3 "$root/fuzz/seeds.py" "$root" "$seeds"

share=$(( seconds / ${#targets[@]} ))
[ "$share" -ge 1 ] || share=1
failed=0
for target in "${targets[@]}"; do
  name="${target%_fuzz}"
  corpus="$build/fuzz-corpus/$name"
  mkdir -p "$corpus"
  dict=()
  [ -f "$seeds/$name.dict" ] && dict=(-dict="$seeds/$name.dict")
  max_len=4096
  [ "$name" = tokenizer_load ] && max_len=16384
  echo "fuzzing $target for ${share}s (corpus: $corpus)"
  log="$build/fuzz-$name.log"
  # The fuzzer's progress lines go to a log; on failure its tail (with the crash report) is printed.
  if ! "$build/fuzz/$target" "$corpus" "$seeds/$name" "${dict[@]}" -max_total_time="$share" -max_len="$max_len" \
    -timeout=10 -rss_limit_mb=2048 -artifact_prefix="$artifacts/$name-" -print_final_stats=1 >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz: $target FAILED (inputs that broke it are in $artifacts/)"
    failed=1
    continue
  fi
  grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|Done [0-9]+ runs" "$log" || true
done
[ "$failed" -eq 0 ] || exit 1
echo "fuzz: no crash, no broken invariant in ${share}s for each of ${targets[*]}"
