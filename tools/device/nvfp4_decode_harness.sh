#!/bin/bash
# Builds and runs tools/device/nvfp4_decode_harness.cu on the GPU machine (nvcc there):
#   tools/device/nvfp4_decode_harness.sh [time | profile]
set -e
cd "$(dirname "$0")/../.."
cublas=$(dirname "$(find /usr/local/cuda*/ /usr/lib /opt -name 'libcublasLt.so*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$cublas${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvcc -std=c++20 -O3 -arch=sm_90a -DTERN_BUILD_HAS_SM90A=1 -lineinfo -I src -o /tmp/nvfp4_decode_harness \
  tools/device/nvfp4_decode_harness.cu src/kernels/cuda/gemm/gemm_nvfp4_w4a16.cu src/kernels/cuda/roofline.cu \
  src/kernels/cuda/launch.cu src/kernels/cuda/device.cc -L"$cublas" -lcublasLt -Xptxas -v > /tmp/harness_build.txt 2>&1 ||
  { grep -v "^ptxas info\|bytes stack" /tmp/harness_build.txt | tail -20; exit 1; }
grep -E "spill stores" /tmp/harness_build.txt | sort | uniq -c
/tmp/nvfp4_decode_harness "$@"
