#!/usr/bin/env bash
# One device call's worth of checks from a bundle (bundle.sh): every GPU test binary in it, optionally the
# sanitizers on a subset, then `tern bench` on the given configs and an ncu per-kernel breakdown of one batch-1
# decode step of each. Logs and JSON go to $OUT; the summary lines to stdout.
#
#   BUNDLE/check_all.sh [-s SANITIZE_REGEX] [-b "cfg1 cfg2"] [-x "extra tern bench flags"] [-n]
#     -s  run memcheck + racecheck on the sanitize.sh cases matching the regex (needs sanitize.sh in the bundle)
#     -b  bench/configs names (default: qwen3-8b-bf16 qwen3.5-35b-a3b-nvfp4)
#     -x  flags added to every tern bench call (e.g. --no-pdl)
#     -n  skip the ncu breakdown
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/out}
mkdir -p "$out"
cd "$here/.."
sanitize="" configs="qwen3-8b-bf16 qwen3.5-35b-a3b-nvfp4" extra="" ncu=1
while getopts "s:b:x:n" opt; do
  case $opt in
    s) sanitize=$OPTARG ;;
    b) configs=$OPTARG ;;
    x) extra=$OPTARG ;;
    n) ncu=0 ;;
    *) exit 2 ;;
  esac
done
tests=()
for bin in "$here"/*_test; do [[ -x "$bin" ]] && tests+=("$(basename "$bin")"); done
failed=0
if [[ ${#tests[@]} -gt 0 ]]; then
  LINES_PER=${LINES_PER:-4} "$here/run.sh" -t 300 "${tests[@]}" || failed=$((failed + $?))
fi
if [[ -n "$sanitize" && -x "$here/sanitize.sh" ]]; then
  ONLY=$sanitize CASE_TIMEOUT=${CASE_TIMEOUT:-120} "$here/sanitize.sh" "$here" memcheck racecheck || failed=$((failed + $?))
fi
cublas=$(find /usr/local/cuda*/ /usr/lib /opt -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$here${cublas:+:$(dirname "$cublas")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ -x "$here/tern" ]]; then
  for cfg in $configs; do
    # shellcheck disable=SC2086  # $extra is a list of flags
    timeout 150 "$here/tern" bench --model "bench/configs/$cfg" --load-format dummy --batch 1,8,64 --context 1024 \
      --steps 32 --json $extra > "$out/bench_$cfg.json" 2> "$out/bench_$cfg.err"
    echo "== bench $cfg exit $?"
    python3 - "$out/bench_$cfg.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
print(" ", d.get("device", ""))
for r in d.get("rows", []):
    if r["kind"] == "decode":
        print(f"  decode b{r['batch']}: {r['ms_per_step']:.3f} ms, {r['tokens_per_s']:.1f} tok/s, {r['pct_of_copy']:.1f}% of copy")
    else:
        print(f"  prefill {r['tokens']}: {r['ms']:.2f} ms, {r['pct_of_gemm']:.1f}% of GEMM")
PY
    if [[ $ncu -eq 1 ]] && command -v ncu > /dev/null; then
      # --clock-control none: kernels at the clocks the GPU runs at in service (ncu locks them to base by default).
      # shellcheck disable=SC2086
      timeout 200 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
        --log-file "$out/ncu_$cfg.csv" \
        "$here/tern" bench --model "bench/configs/$cfg" --load-format dummy --prefill 16 --batch 1 --context 1024 \
        --steps 2 --enforce-eager --profile-step $extra > "$out/ncu_$cfg.out" 2>&1
      python3 "$here/ncu_summary.py" "$out/ncu_$cfg.csv" --width 60 2> /dev/null | head -14
    fi
  done
fi
exit "$failed"
