#!/usr/bin/env bash
# GEMM checks on a GPU machine from a prebuilt bundle: the gpu-labelled GEMM tests, the same tests (small shapes)
# under compute-sanitizer, then gemm_bench. Logs go to $OUT (or ./gemm-out).
#
# Make the bundle on a build machine (the GPU machine needs no compiler or -dev packages):
#   tools/device/gemm_check.sh --bundle BUILD_DIR BUNDLE_DIR
# Run it there:
#   BUNDLE_DIR/gemm_check.sh [--quick] [--no-sanitizer] [--no-bench]
# The bundle holds the binaries and the shared libraries a CUDA image may lack (fmt, libstdc++, libgcc_s,
# cudart). cuBLASLt (over 500 MB) is not copied: the script finds the machine's own libcublasLt.so.13.
set -uo pipefail

if [[ "${1:-}" == "--bundle" ]]; then
  build=$2 bundle=$3
  mkdir -p "$bundle"
  for b in cuda_gemm_nvfp4_test cuda_gemm_bf16_test gemm_bench; do cp "$build/src/kernels/cuda/$b" "$bundle/"; done
  for lib in libfmt.so.9 libstdc++.so.6 libgcc_s.so.1 libcudart.so.13; do
    path=$(ldd "$bundle/gemm_bench" | awk -v l="$lib" '$1 == l {print $3}')
    [[ -n "$path" ]] && cp -L "$path" "$bundle/"
  done
  cp "$0" "$bundle/gemm_check.sh"
  exit 0
fi

here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$PWD/gemm-out}
mkdir -p "$out"
quick="" sanitize=1 bench=1
for arg in "$@"; do
  case $arg in
    --quick) quick=--quick ;;
    --no-sanitizer) sanitize=0 ;;
    --no-bench) bench=0 ;;
  esac
done

cublas=$(find /usr/local/cuda*/ /usr/lib /opt -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$here${cublas:+:$(dirname "$cublas")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "cuBLASLt: ${cublas:-not found}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$out/gpu.txt"

status=0
run() {  # run NAME CMD...: log to $out/NAME.log, keep the first failure's status
  local name=$1
  shift
  echo "=== $name: $*"
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "=== $name: exit $rc"
  [[ $rc -ne 0 && $status -eq 0 ]] && status=$rc
}

run test_nvfp4 "$here/cuda_gemm_nvfp4_test"
run test_bf16 "$here/cuda_gemm_bf16_test"
[[ $bench -eq 1 ]] && run bench "$here/gemm_bench" $quick
if [[ $sanitize -eq 1 ]]; then
  small='GemmNvfp4W4a16.SmallShapes:GemmNvfp4W4a16.RejectsBadArguments'
  for tool in memcheck racecheck initcheck synccheck; do
    run "sanitizer_$tool" timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 99 \
      "$here/cuda_gemm_nvfp4_test" --gtest_filter="$small"
  done
  run sanitizer_memcheck_bf16 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 \
    "$here/cuda_gemm_bf16_test"
fi
echo "gemm_check: exit $status"
exit $status
