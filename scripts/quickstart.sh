#!/usr/bin/env bash
# From a fresh machine: installs the dependencies, builds tern and runs its main job: `tern serve` on the bundled
# demo model (demo/, chosen when no --model is given), one chat completion through the OpenAI API, the answer
# printed, the server stopped. On a machine with a GPU the server runs there; TERN_DEVICE=cpu forces the CPU.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" tern
tern="${TERN_BUILD_DIR:-$root/build}/src/cli/tern"
log="$(mktemp)"
"$tern" serve --host 127.0.0.1 --port "${TERN_PORT:-8000}" --device "${TERN_DEVICE:-auto}" >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 120); do
  grep -q "listening on" "$log" && break
  kill -0 "$server" 2>/dev/null || { cat "$log"; echo "quickstart: tern serve exited" >&2; exit 1; }
  sleep 0.5
done
grep -E "demo model|listening on" "$log"
python3 - "$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -1)" <<'PY'
import json, sys, urllib.request
base = sys.argv[1]
model = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
body = {"model": model, "temperature": 0, "max_tokens": 64,
        "messages": [{"role": "user", "content": "Write a sentence about the city."}],
        "chat_template_kwargs": {"enable_thinking": False}}
req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(req))
print("user:      Write a sentence about the city.")
print("tern-demo:", reply["choices"][0]["message"]["content"])
PY
