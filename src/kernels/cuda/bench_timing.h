// Timing for the kernel benchmarks: calls captured in one CUDA graph and replayed, so launch overheads stay out of
// the measurement (as they stay out of a serving step that replays a graph).
#pragma once

#include <algorithm>
#include <functional>
#include <vector>

#include "kernels/cuda/device.h"

namespace tern {

// Median milliseconds per call of launch(i % n_slots) over n_calls calls (one graph), from 7 replays after a
// warm-up replay. n_slots rotates over inputs (e.g. weights larger than L2 in total, so reads come from memory).
inline double bench_time_ms(const DeviceContext& ctx, int n_slots, int n_calls,
                            const std::function<void(int)>& launch) {
  constexpr int kReplays = 7;
  cudaGraph_t graph;
  TERN_CUDA_CHECK(cudaStreamBeginCapture(ctx.stream(), cudaStreamCaptureModeRelaxed));
  for (int i = 0; i < n_calls; ++i) launch(i % n_slots);
  TERN_CUDA_CHECK(cudaStreamEndCapture(ctx.stream(), &graph));
  cudaGraphExec_t exec;
  TERN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  TERN_CUDA_CHECK(cudaEventCreate(&start));
  TERN_CUDA_CHECK(cudaEventCreate(&stop));
  TERN_CUDA_CHECK(cudaGraphLaunch(exec, ctx.stream()));  // warm-up
  std::vector<float> ms(kReplays);
  for (auto& t : ms) {
    TERN_CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
    TERN_CUDA_CHECK(cudaGraphLaunch(exec, ctx.stream()));
    TERN_CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
    TERN_CUDA_CHECK(cudaEventSynchronize(stop));
    TERN_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
  }
  TERN_CUDA_CHECK(cudaEventDestroy(start));
  TERN_CUDA_CHECK(cudaEventDestroy(stop));
  TERN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TERN_CUDA_CHECK(cudaGraphDestroy(graph));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] / n_calls;
}

}  // namespace tern
