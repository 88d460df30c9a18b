#!/usr/bin/env bash
# Copies built binaries and the shared libraries a bare CUDA image lacks into one directory, for running them on a
# GPU machine that has no compiler or -dev packages. Libraries the machine has (libc, libm, the CUDA driver,
# cuBLASLt, OpenSSL, zlib) are left out to keep the bundle small; run.sh next to the binaries finds cuBLASLt.
#
#   tools/device/bundle.sh BUILD_DIR BUNDLE_DIR BINARY...     e.g. build-gpu .device tern gpu_model_test
#   BUNDLE_DIR/run.sh [-t SECONDS] BINARY[:gtest_filter]...    on the GPU machine: each with a timeout, logs to $OUT
#   BUNDLE_DIR/check_all.sh [-s REGEX] [-b CONFIGS] [-x FLAGS]   every test in the bundle, sanitizers, bench, ncu
#   BUNDLE_DIR/multi_gpu.sh PHASE [N]                           the runs that need several GPUs (one phase a call)
set -euo pipefail
build=${1:?usage: bundle.sh BUILD_DIR BUNDLE_DIR BINARY...}
bundle=${2:?usage: bundle.sh BUILD_DIR BUNDLE_DIR BINARY...}
shift 2
mkdir -p "$bundle"
skip='^(linux-vdso|libc\.|libm\.|libdl\.|librt\.|libpthread\.|ld-linux|libcuda\.|libcublas|libssl\.|libcrypto\.|libz\.)'
for name in "$@"; do
  path=$(find "$build/src" -name "$name" -type f -perm -u+x | head -1)
  [[ -n "$path" ]] || { echo "bundle.sh: no binary '$name' under $build/src" >&2; exit 2; }
  cp "$path" "$bundle/"
  ldd "$path" | awk '$3 ~ /^\// {print $1, $3}' | while read -r lib file; do
    [[ "$lib" =~ $skip ]] || [[ -e "$bundle/$lib" ]] || cp -L "$file" "$bundle/$lib"
  done
done
cp "$(dirname "$0")/bundle_run.sh" "$bundle/run.sh"
cp "$(dirname "$0")/check_all.sh" "$(dirname "$0")/sanitize.sh" "$(dirname "$0")/ncu_summary.py" \
   "$(dirname "$0")/multi_gpu.sh" "$bundle/"
du -sh "$bundle"
