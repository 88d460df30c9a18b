#!/bin/bash
# Builds and runs tools/device/moe_prefill_harness.cu on the GPU machine (nvcc there):
#   tools/device/moe_prefill_harness.sh [timing|tiles [CASE_SUBSTRING]]   (pass a case filter, e.g. 35B)
set -e
cd "$(dirname "$0")/../.."
nvcc -std=c++20 -O3 -arch=sm_90a -DTERN_BUILD_HAS_SM90A=1 -lineinfo -I src -o /tmp/moe_prefill_harness tools/device/moe_prefill_harness.cu \
  src/kernels/cuda/moe/moe_gemm_prefill.cu \
  src/kernels/cuda/launch.cu src/kernels/cuda/device.cc -lcublasLt -Xptxas -v 2>&1 | grep -E "error|Used|spill" | head -20
/tmp/moe_prefill_harness "$@"
