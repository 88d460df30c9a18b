// The device collectives against a CPU sum: every rank's fresh random bf16 values all-reduced (and all-gathered) on
// its GPU, each result within the bf16 roundings of a sum over the ranks of the exact fp64 sum, and the same bits on
// every rank (the router and top-k of the model read replicated activations: ranks that disagree by one bit can
// route a token differently). NCCL with one GPU per rank (2, 4, 8 ranks where that many GPUs are present; skipped
// otherwise), also captured into a CUDA graph and replayed after the inputs changed in place; the host-staged
// communicator with several ranks on one GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "core/formats.h"
#include "dist/cuda/staged_communicator.h"
#if TERN_HAVE_NCCL
#include "dist/cuda/nccl_communicator.h"
#endif
#include "dist/loopback.h"

namespace tern {
namespace {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

// Rank r's fresh inputs: bf16 values of both signs and several magnitudes, none zero.
std::vector<uint16_t> random_bf16(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> value(0.0f, 1.0f);
  std::uniform_int_distribution<int> scale(-6, 6);
  std::vector<uint16_t> out(n);
  for (uint16_t& v : out) {
    float x = 0.0f;
    while (x == 0.0f) x = std::ldexp(value(rng), scale(rng));
    v = float_to_bf16(x);
  }
  return out;
}

// What every rank of a collective test does on its thread: makes its communicator, then runs `body` with it.
using MakeComm = std::function<Expected<std::unique_ptr<DeviceCommunicator>>(Communicator& host, int rank)>;

struct RankResult {
  std::vector<uint16_t> reduced, reduced_again, gathered;
  std::string error;
};

// Each rank: fill its buffer with inputs[rank], all-reduce in place, then (graph) capture the all-reduce into a CUDA
// graph, overwrite the buffer with inputs2[rank] and replay it; all-gather inputs[rank].
std::vector<RankResult> run_ranks(int world, const std::vector<int>& devices, const MakeComm& make,
                                  const std::vector<std::vector<uint16_t>>& inputs,
                                  const std::vector<std::vector<uint16_t>>& inputs2, bool graph) {
  LoopbackGroup group(world, std::chrono::seconds(120));
  std::vector<RankResult> results(static_cast<size_t>(world));
  auto rank_body = [&](int r) {
    RankResult& out = results[static_cast<size_t>(r)];
    auto fail = [&](const std::string& why) {
      out.error = why;
      group.abort(why);
    };
    if (cudaSetDevice(devices[static_cast<size_t>(r)]) != cudaSuccess) return fail("cudaSetDevice");
    auto comm = make(group.rank(r), devices[static_cast<size_t>(r)]);
    if (!comm) return fail(comm.error().message);
    const size_t n = inputs[0].size();
    cudaStream_t stream = nullptr;
    uint16_t *data = nullptr, *all = nullptr;
    if (cudaStreamCreate(&stream) != cudaSuccess || cudaMalloc(&data, n * 2) != cudaSuccess ||
        cudaMalloc(&all, n * 2 * static_cast<size_t>(world)) != cudaSuccess) {
      return fail("allocation");
    }
    cudaMemcpy(data, inputs[static_cast<size_t>(r)].data(), n * 2, cudaMemcpyHostToDevice);
    cudaMemset(all, 0xFF, n * 2 * static_cast<size_t>(world));  // poisoned
    if (auto s = (*comm)->all_reduce_sum_bf16(data, n, stream); !s) return fail(s.error().message);
    if (cudaStreamSynchronize(stream) != cudaSuccess) return fail("all-reduce did not finish");
    out.reduced.resize(n);
    cudaMemcpy(out.reduced.data(), data, n * 2, cudaMemcpyDeviceToHost);
    if (graph) {
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return fail("capture");
      auto captured = (*comm)->all_reduce_sum_bf16(data, n, stream);
      if (cudaStreamEndCapture(stream, &g) != cudaSuccess || !captured) return fail("capture of the all-reduce");
      if (cudaGraphInstantiate(&exec, g, 0) != cudaSuccess) return fail("graph instantiation");
      cudaMemcpy(data, inputs2[static_cast<size_t>(r)].data(), n * 2, cudaMemcpyHostToDevice);  // in place
      if (cudaGraphLaunch(exec, stream) != cudaSuccess || cudaStreamSynchronize(stream) != cudaSuccess) {
        return fail("graph replay");
      }
      out.reduced_again.resize(n);
      cudaMemcpy(out.reduced_again.data(), data, n * 2, cudaMemcpyDeviceToHost);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(g);
    }
    cudaMemcpy(data, inputs[static_cast<size_t>(r)].data(), n * 2, cudaMemcpyHostToDevice);
    if (auto s = (*comm)->all_gather_bf16(data, all, n, stream); !s) return fail(s.error().message);
    if (cudaStreamSynchronize(stream) != cudaSuccess) return fail("all-gather did not finish");
    out.gathered.resize(n * static_cast<size_t>(world));
    cudaMemcpy(out.gathered.data(), all, out.gathered.size() * 2, cudaMemcpyDeviceToHost);
    cudaFree(data);
    cudaFree(all);
    cudaStreamDestroy(stream);
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < world; ++r) threads.emplace_back(rank_body, r);
  rank_body(0);
  for (std::thread& t : threads) t.join();
  return results;
}

// Every element within world roundings of bf16 (2^-8 relative each) of the exact sum, scaled by the sum of the
// magnitudes (cancellation leaves the absolute error of the larger partial sums), and finite.
void expect_sum(const std::vector<uint16_t>& got, const std::vector<std::vector<uint16_t>>& inputs,
                const std::string& what) {
  const int world = static_cast<int>(inputs.size());
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 5; ++i) {
    double exact = 0.0, magnitude = 0.0;
    for (const auto& in : inputs) {
      exact += bf16_to_float(in[i]);
      magnitude += std::abs(double{bf16_to_float(in[i])});
    }
    const double g = bf16_to_float(got[i]);
    const bool ok = std::isfinite(g) && std::abs(g - exact) <= world * std::ldexp(magnitude, -8);
    if (!ok) {
      ++bad;
      ADD_FAILURE() << what << " element " << i << ": " << g << ", exact sum " << exact;
    }
  }
}

void check_group(int world, const std::vector<int>& devices, const MakeComm& make, bool graph,
                 const std::string& what) {
  std::random_device seed_source;
  const uint64_t seed = (uint64_t{seed_source()} << 32) | seed_source();
  SCOPED_TRACE(what + ", seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const size_t n : {size_t{1}, size_t{7}, size_t{4096}, (size_t{1} << 20) + 3}) {
    std::vector<std::vector<uint16_t>> inputs, inputs2;
    for (int r = 0; r < world; ++r) {
      inputs.push_back(random_bf16(n, rng));
      inputs2.push_back(random_bf16(n, rng));
    }
    const std::vector<RankResult> results = run_ranks(world, devices, make, inputs, inputs2, graph);
    const std::string size = " n=" + std::to_string(n);
    for (int r = 0; r < world; ++r) {
      const RankResult& got = results[static_cast<size_t>(r)];
      ASSERT_TRUE(got.error.empty()) << "rank " << r << size << ": " << got.error;
      expect_sum(got.reduced, inputs, "rank " + std::to_string(r) + size);
      EXPECT_EQ(got.reduced, results[0].reduced) << "rank " << r << " disagrees with rank 0 bit for bit" << size;
      if (graph) {
        expect_sum(got.reduced_again, inputs2, "replayed, rank " + std::to_string(r) + size);
        EXPECT_EQ(got.reduced_again, results[0].reduced_again) << "replayed, rank " << r << size;
      }
      for (int from = 0; from < world; ++from) {
        const auto begin = got.gathered.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(from) * n);
        EXPECT_TRUE(std::equal(begin, begin + static_cast<ptrdiff_t>(n), inputs[static_cast<size_t>(from)].begin()))
            << "rank " << r << " gathered rank " << from << "'s values wrongly" << size;
      }
    }
  }
}

#if TERN_HAVE_NCCL
TEST(NcclCommunicator, AllReduceAndGatherMatchTheCpuOnEveryRank) {
  const int gpus = device_count();
  if (gpus < 2) GTEST_SKIP() << "NCCL needs one GPU per rank; " << gpus << " present";
  if (auto v = nccl_version(); !v) GTEST_SKIP() << v.error().message;
  for (const int world : {2, 4, 8}) {
    if (world > gpus) break;
    std::vector<int> devices;
    for (int r = 0; r < world; ++r) devices.push_back(r);
    check_group(world, devices, nccl_communicator_create, true, "NCCL over " + std::to_string(world) + " GPUs");
  }
}
#endif

TEST(StagedCommunicator, RanksSharingOneGpuMatchTheCpu) {
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  const MakeComm staged = [](Communicator& host, int) -> Expected<std::unique_ptr<DeviceCommunicator>> {
    return staged_device_communicator(host);
  };
  for (const int world : {2, 3}) {
    check_group(world, std::vector<int>(static_cast<size_t>(world), 0), staged, false,
                "staged, " + std::to_string(world) + " ranks on GPU 0");
  }
}

}  // namespace
}  // namespace tern
