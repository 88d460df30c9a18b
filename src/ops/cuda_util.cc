#include "ops/cuda_util.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <sstream>
#include <string>

#include "core/formats.h"
#include "ops/verify.h"

namespace tern {
namespace {

DeviceDescription describe(const DeviceProps& p) {
  return DeviceDescription{.backend = Backend::kCuda,
                           .name = p.name,
                           .cc_major = p.cc_major,
                           .cc_minor = p.cc_minor,
                           .sm_count = p.num_sms,
                           .smem_per_block_optin = static_cast<int64_t>(p.shared_mem_per_block_optin),
                           .smem_per_sm = static_cast<int64_t>(p.shared_mem_per_sm),
                           .regs_per_block = p.regs_per_block,
                           .regs_per_sm = p.regs_per_sm,
                           .l2_bytes = p.l2_bytes,
                           .memory_bytes = static_cast<int64_t>(p.global_mem_bytes)};
}

}  // namespace

std::string cuda_unsupported_reason(const DeviceDescription& d, const SelfTestCase&) {
  if (d.backend != Backend::kCuda) return "runs on CUDA devices only";
  return binary_can_run(cuda_binary_image(), d);
}

Expected<double> cuda_time_best(const DeviceContext& ctx, const std::function<void()>& prepare,
                                const std::function<Expected<void>()>& launch) {
  constexpr int kTimedRuns = 5;
  // Every run starts from a cold L2, as a model's decode step does (its weights, KV cache and states are many times
  // the L2); back to back, a case whose weights fit the L2 would be timed at L2 speed. The context keeps the buffer
  // (allocating and freeing it per call cost each self-test case a device-wide synchronisation).
  const DeviceBuffer& flush = ctx.l2_flush_buffer();
  cudaEvent_t start, stop;
  TERN_CUDA_CHECK(cudaEventCreate(&start));
  TERN_CUDA_CHECK(cudaEventCreate(&stop));
  float best_ms = 1e30f;
  Expected<void> status;
  for (int run = 0; run <= kTimedRuns && status; ++run) {
    prepare();
    TERN_CUDA_CHECK(cudaMemsetAsync(flush.data(), run, flush.size_bytes(), ctx.stream()));
    TERN_CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
    status = launch();
    TERN_CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
    if (cudaError_t e = cudaStreamSynchronize(ctx.stream()); e != cudaSuccess) {
      status = make_error("kernel failed: {} ({})", cudaGetErrorName(e), cudaGetErrorString(e));
    }
    float ms = 0.0f;
    if (status && run > 0 && cudaEventElapsedTime(&ms, start, stop) == cudaSuccess) best_ms = std::min(best_ms, ms);
  }
  TERN_CUDA_CHECK(cudaEventDestroy(start));
  TERN_CUDA_CHECK(cudaEventDestroy(stop));
  if (!status) return tl::unexpected(status.error());
  return best_ms * 1e-3;
}

Expected<RunOutput> cuda_run_timed(const DeviceContext& ctx, int64_t m, int64_t n,
                                   const std::function<Expected<void>(uint16_t* y)>& launch) {
  const size_t count = static_cast<size_t>(m * n);
  DeviceBuffer y(std::max<size_t>(count * 2, 16));
  const std::vector<uint16_t> poison(count, kPoisonBf16Bits);
  TERN_ASSIGN_OR_RETURN(
      const double seconds,
      cuda_time_best(
          ctx,
          [&] {
            TERN_CUDA_CHECK(cudaMemcpyAsync(y.data(), poison.data(), count * 2, cudaMemcpyHostToDevice, ctx.stream()));
          },
          [&] { return launch(y.as<uint16_t>()); }));
  std::vector<uint16_t> host(count);
  TERN_CUDA_CHECK(cudaMemcpy(host.data(), y.data(), count * 2, cudaMemcpyDeviceToHost));
  RunOutput out{.values = std::vector<float>(count), .seconds = seconds};
  for (size_t i = 0; i < count; ++i) {
    out.values[i] = host[i] == kPoisonBf16Bits ? std::bit_cast<float>(kPoisonF32Bits) : bf16_to_float(host[i]);
  }
  return out;
}

std::vector<DeviceDescription> cuda_devices_describe() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: clear the sticky error
    return {};
  }
  std::vector<DeviceDescription> out;
  for (int i = 0; i < count; ++i) out.push_back(describe(device_query_props(i)));
  return out;
}

BinaryImage cuda_binary_image() {
  BinaryImage image;
  std::stringstream archs(TERN_OPS_CUDA_ARCHS);  // CMAKE_CUDA_ARCHITECTURES with commas, e.g. "90a,100a,120a"
  for (std::string arch; std::getline(archs, arch, ',');) {
    if (arch.empty()) continue;
    const bool virtual_only = arch.ends_with("-virtual"), real_only = arch.ends_with("-real");
    const std::string base = arch.substr(0, arch.find('-'));
    if (!virtual_only) image.sass.push_back("sm_" + base);
    if (!real_only) image.ptx.push_back("compute_" + base);
  }
  return image;
}

}  // namespace tern
