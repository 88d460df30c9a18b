#!/usr/bin/env bash
# compute-sanitizer over the small cases of every CUDA kernel's test, on a GPU machine, from a directory holding
# the test binaries (and the shared libraries a bare CUDA image lacks, as gemm_check.sh bundles them). memcheck and
# racecheck for every kernel file, synccheck where warps synchronise partially; one line per run with the tool's
# summary. Exit status: the number of runs with findings or failures. Logs go to $OUT (or ./sanitize-out).
#
# usage: tools/device/sanitize.sh BIN_DIR [TOOL...]      (default tools: memcheck racecheck)
#        ONLY=REGEX tools/device/sanitize.sh ...           only the cases whose "binary:filter" matches REGEX
#        CASE_TIMEOUT=SECONDS (default 300) per case and tool
set -uo pipefail
bin=$(cd "${1:?usage: sanitize.sh BIN_DIR [TOOL...]}" && pwd)
shift
tools=("$@")
[[ ${#tools[@]} -eq 0 ]] && tools=(memcheck racecheck)
cublas=$(find /usr/local/cuda*/ /usr/lib /opt -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$bin${cublas:+:$(dirname "$cublas")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out=${OUT:-./sanitize-out}
mkdir -p "$out"

# binary : gtest filter (small shapes, so a run stays within a minute or two under the sanitizer). Not here:
# ops_race_cuda_test, whose injected race is meant to trip racecheck.
cases=(
  "cuda_gemm_nvfp4_test:GemmNvfp4W4a16.SmallShapes:GemmNvfp4W4a16.RejectsBadArguments:GemmNvfp4W4a16.DecodeModelShapes"
  "cuda_gemm_fp8_test:GemmFp8W8a16.SmallShapes:GemmFp8W8a16.RejectsBadArguments"
  "cuda_gemm_bf16_test:*"
  "cuda_gemv_bf16_test:GemvBf16.MatchesReferenceOnSmallOddShapes:GemvBf16.WritesOnlyItsColumnsOfAWiderOutput:GemvBf16.EveryGroupSizeMatchesReference:GemvBf16.RmsNormPrologueMatchesReference:GemvBf16.SiluMulPrologueMatchesReference:GemvBf16.SiluMulEveryGroupSizeMatches"
  "ops_elementwise_cuda_test:*RmsNorm*:*Rope*:*SiluMul*:*Embedding*"
  "cuda_attention_test:CudaAttention.DecodeMatchesCpuOnRaggedBatches:CudaAttention.PrefillMatchesCpuOnRaggedBatches:CudaAttention.PrepareMatchesCpuLayers:CudaAttention.WgmmaPrefillAcrossTiles"
  "cuda_gdn_test:GdnKernels.DeltaRuleMatchesCpuOnRaggedBatches:GdnKernels.ConvMatchesCpuOnRaggedBatchesAndContinues"
  "cuda_moe_test:MoeRoute.*:MoeAlign.*:MoeBlock.*:MoeGemm.Nvfp4DecodeModelShapes"
  "cuda_moe_test:MoeRouteAlign.*:MoeGemm.SecondProjectionInTheSameLaunch:MoeGemm.SiluMulFoldedIntoTheDecodeKernel"
  "cuda_sampling_test:CudaSampling.GreedyMatchesCpuIncludingTies:CudaSampling.PenaltiesMatchCpu:CudaSampling.NonFiniteLogitsFailOnlyTheirRow:CudaSampling.NonFiniteLogitsInOneOrTwoRows"
  "cuda_nvfp4_quantize_test:*"
  "cuda_mla_test:CudaMla.PrepareMatchesReference:CudaMla.SelectedAttentionMatchesReference:CudaMla.BadArgumentsAreErrors:CudaMla.RowsFindTheirSequenceAmongMany"
  "cuda_mla_indexer_test:CudaIndexer.FixtureShapesAfterPrepare:CudaIndexer.ExactTiesTakeTheEarlierKeys:CudaIndexer.TopkOverSeveralBlocksPerRow"
  "gpu_model_test:GpuModel.GlmDecodeGraphsCoverAContextBetweenPowersOfTwo"
)
failed=0
for tool in "${tools[@]}"; do
  for c in "${cases[@]}"; do
    [[ -n "${ONLY:-}" && ! "$c" =~ $ONLY ]] && continue
    test=${c%%:*} filter=${c#*:}
    [[ -x "$bin/$test" ]] || { echo "$tool $test: not in $bin"; failed=$((failed + 1)); continue; }
    log="$out/${tool}_$test.log"
    timeout "${CASE_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 99 "$bin/$test" --gtest_filter="$filter" > "$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY" "$log" | tail -1)
    echo "$tool $test: exit $rc ${summary:-(no summary: see $log)}"
    [[ $rc -eq 0 ]] || failed=$((failed + 1))
  done
done
exit "$failed"
