#!/usr/bin/env bash
# The runs that need several GPUs, from a bundle (bundle.sh) holding tern, device_communicator_test and
# gpu_model_test, one phase per device call (each must end within the call's limit):
#   t  the tests that need several GPUs: NCCL against a CPU sum (2, 4, 8 ranks as present; graph replay after the
#      inputs changed in place), the model at TP 2 / 4 over NCCL against transformers (experts sliced and, with
#      expert parallelism, whole); then greedy tokens of a fixture from one GPU, from rank processes (mp), from rank
#      processes behind a front end and with expert parallelism, side by side;
#   d  tern doctor --tp N: peer access, NVLink or PCIe, the NCCL version, the timed all-reduce;
#   b  tern bench --tp N --load-format dummy on Qwen3.5-397B-A17B NVFP4 (TP 4 and 8) and GLM-5 NVFP4 (TP 8), as many
#      as the GPUs present allow: decode batch 1, 16, 64 at 4k context, prefill 4096, the all-reduce share, start-up;
#   e  the same benches with --enable-expert-parallel (whole experts per rank), to set beside b's;
#   s  tern serve --tp N --distributed-executor-backend mp on the 397B dummy under tern loadgen at concurrency 1, 16
#      and 64, then one rank process killed mid-stream: the stream must fail, /health answer 503 and the server stay
#      up, and SIGTERM must leave no rank process behind.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0; the rank processes tern starts inherit it). Logs and JSON go to
# $OUT, the summary lines to stdout.
#
#   BUNDLE/multi_gpu.sh PHASE [N]     N: the ranks for d, b's largest, s (default: every GPU present, at most 8)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/out}
mkdir -p "$out"
cd "$here/.." || exit 2
export NCCL_NVLS_ENABLE=0
cublas=$(find /usr/local/cuda*/ /usr/lib /opt -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
nccl=$(find /usr/local/cuda*/ /usr/lib /opt /usr/local/lib/python3* -name 'libnccl.so.2' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$here${cublas:+:$(dirname "$cublas")}${nccl:+:$(dirname "$nccl")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
phase=${1:?usage: multi_gpu.sh t|d|b|e|s [N]}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
n=${2:-$((gpus < 8 ? gpus : 8))}
tern="$here/tern"
echo "== $(nvidia-smi -L | head -1) x $gpus; NCCL $(basename "${nccl:-none}"); phase $phase, $n ranks"

bench() {  # bench CONFIG TP EXTRA...
  local cfg=$1 tp=$2
  shift 2
  local log="$out/bench_${cfg}_tp$tp"
  timeout 560 "$tern" bench --model "bench/configs/$cfg" --load-format dummy --tp "$tp" \
    --distributed-executor-backend mp --cuda-devices "$(seq -s, 0 $((tp - 1)))" --json "$@" > "$log.json" 2> "$log.err"
  echo "== bench $cfg TP $tp $* exit $?"
  python3 - "$log.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"   no report: {e}")
print(f"   load {r['load_s']:.1f} s; {r['device']}")
for row in r["rows"]:
    print("   " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
for row in r.get("all_reduce_ms_per_step_measured", []):
    print(f"   all-reduce at batch {row['batch']}: {row['ms_per_step']:.3f} ms per step "
          f"({100 * row['share_of_step']:.1f}% of it)")
EOF
}

case $phase in
  t)
    LINES_PER=20 "$here/run.sh" -t 400 device_communicator_test "gpu_model_test:*nccl*:GpuModel.TheTensorParallel*"
    for mode in "" "--tp 2 --distributed-executor-backend mp" "--tp 2 --distributed-executor-backend mp --front-end" \
                "--tp 2 --distributed-executor-backend mp --enable-expert-parallel"; do
      # shellcheck disable=SC2086  # $mode is a list of flags
      tokens=$(timeout 120 "$tern" generate --model tests/fixtures/qwen3_moe --device cuda --prompt-ids 1,2,3,4,5 \
        --max-tokens 16 --temperature 0 --json $mode 2> "$out/generate.err" | python3 -c \
        'import json, sys; print(json.load(sys.stdin).get("ids"))' 2>&1)
      echo "== generate ${mode:-(one GPU)}: $tokens"
    done
    ;;
  d)
    timeout 300 "$tern" doctor --tp "$n" --selftest fast --model bench/configs/qwen3.5-397b-a17b-nvfp4 \
      > "$out/doctor_tp$n.txt" 2>&1
    echo "== doctor --tp $n exit $?"
    sed -n '/^tensor parallelism/,$p' "$out/doctor_tp$n.txt"
    ;;
  b)
    # The largest model the ranks hold first; each call one configuration (a dummy 397B takes minutes to make).
    if [[ $n -ge 8 ]]; then
      bench glm-5-nvfp4 8 --batch 1,16,64 --context 4096 --prefill 4096 --steps 8
      bench qwen3.5-397b-a17b-nvfp4 8 --batch 1,16,64 --context 4096 --prefill 4096 --steps 8
    fi
    [[ $n -ge 4 ]] && bench qwen3.5-397b-a17b-nvfp4 4 --batch 1,16,64 --context 4096 --prefill 4096 --steps 8
    [[ $n -ge 2 && $n -lt 4 ]] && bench qwen3.5-35b-a3b-nvfp4 2 --batch 1,16,64 --context 4096 --prefill 4096 --steps 8
    ;;
  e)
    if [[ $n -ge 8 ]]; then
      bench glm-5-nvfp4 8 --batch 1,16,64 --context 4096 --prefill 4096 --steps 8 --enable-expert-parallel
      bench qwen3.5-397b-a17b-nvfp4 8 --batch 1,16,64 --context 4096 --prefill 4096 --steps 8 --enable-expert-parallel
    fi
    [[ $n -ge 4 ]] && bench qwen3.5-397b-a17b-nvfp4 4 --batch 1,16,64 --context 4096 --prefill 4096 --steps 8 \
      --enable-expert-parallel
    [[ $n -ge 2 && $n -lt 4 ]] && bench qwen3.5-35b-a3b-nvfp4 2 --batch 1,16,64 --context 4096 --prefill 4096 \
      --steps 8 --enable-expert-parallel
    ;;
  s)
    port=30177
    model=bench/configs/qwen3.5-397b-a17b-nvfp4
    [[ $n -lt 4 ]] && model=bench/configs/qwen3.5-35b-a3b-nvfp4
    "$tern" serve --model "$model" --load-format dummy --tp "$n" --distributed-executor-backend mp \
      --port "$port" --max-running-requests 64 > "$out/serve_tp$n.log" 2>&1 &
    serve=$!
    for _ in $(seq 1 400); do
      curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
      kill -0 "$serve" 2> /dev/null || break
      sleep 1
    done
    echo "== serve --tp $n: $(curl -s "http://127.0.0.1:$port/health" || echo 'not up')"
    for c in 1 16 64; do
      timeout 200 "$tern" loadgen --url "http://127.0.0.1:$port" --num-requests $((c * 4)) --concurrency "$c" \
        --input-len 1024 --output-len 128 --ignore-eos --prompt-token-ids 200000 --warmup 2 \
        > "$out/loadgen_c$c.txt" 2>&1
      echo "== loadgen concurrency $c exit $?"
      head -20 "$out/loadgen_c$c.txt"
    done
    # A rank process killed mid-stream.
    curl -sN "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
      -d '{"prompt": [1, 2, 3, 4], "max_tokens": 2000, "ignore_eos": true, "stream": true}' \
      > "$out/killed_stream.txt" 2>&1 &
    stream=$!
    sleep 3
    victim=$(pgrep -P "$serve" | head -1)
    kill -9 "$victim" 2> /dev/null
    wait "$stream"
    echo "== killed rank process $victim; the stream ended with: $(tail -c 300 "$out/killed_stream.txt")"
    echo "== /health now: $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health") (want 503)"
    echo "== /v1/models now: $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/v1/models")"
    kill -TERM "$serve"
    wait "$serve"
    echo "== serve exit $?; rank processes left: $(pgrep -f "node-rank" | wc -l) (want 0)"
    tail -5 "$out/serve_tp$n.log"
    ;;
  *)
    echo "unknown phase '$phase' (t, d, b or s)" >&2
    exit 2
    ;;
esac
