#include "dist/cuda/nccl_communicator.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <nccl.h>

#include <cstring>
#include <mutex>

namespace tern {
namespace {

// The few NCCL entry points tern calls, resolved from libnccl.so.2 once.
struct NcclApi {
  ncclResult_t (*get_version)(int*) = nullptr;
  ncclResult_t (*get_unique_id)(ncclUniqueId*) = nullptr;
  ncclResult_t (*comm_init_rank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_abort)(ncclComm_t) = nullptr;
  ncclResult_t (*all_reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                             cudaStream_t) = nullptr;
  ncclResult_t (*all_gather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) = nullptr;
  const char* (*error_string)(ncclResult_t) = nullptr;
  std::string load_error;
};

const NcclApi& nccl() {
  static NcclApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      api.load_error = fmt::format("NCCL (libnccl.so.2) could not be loaded: {}; install NCCL (it comes with the "
                                   "CUDA toolkit, or as the nvidia-nccl package) or put it on LD_LIBRARY_PATH",
                                   why ? why : "not found");
      return;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr && api.load_error.empty()) api.load_error = fmt::format("NCCL has no symbol {}", name);
    };
    sym(api.get_version, "ncclGetVersion");
    sym(api.get_unique_id, "ncclGetUniqueId");
    sym(api.comm_init_rank, "ncclCommInitRank");
    sym(api.comm_destroy, "ncclCommDestroy");
    sym(api.comm_abort, "ncclCommAbort");
    sym(api.all_reduce, "ncclAllReduce");
    sym(api.all_gather, "ncclAllGather");
    sym(api.error_string, "ncclGetErrorString");
  });
  return api;
}

Expected<void> check(ncclResult_t r, const char* what, int rank) {
  if (r == ncclSuccess) return {};
  return make_error("NCCL {} on rank {}: {}", what, rank, nccl().error_string ? nccl().error_string(r) : "error");
}

class NcclCommunicator final : public DeviceCommunicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int world, int device)
      : comm_(comm), rank_(rank), world_(world), device_(device) {}
  ~NcclCommunicator() override {
    if (comm_ != nullptr) nccl().comm_destroy(comm_);
  }
  void abort() override {
    if (comm_ != nullptr) nccl().comm_abort(comm_);
    comm_ = nullptr;
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  std::string describe() const override { return fmt::format("NCCL, GPU {}", device_); }
  bool graph_capturable() const override { return true; }

  Expected<void> all_reduce_sum_bf16(uint16_t* data, size_t n, void* stream) override {
    if (comm_ == nullptr) return make_error("NCCL all_reduce on rank {}: the communicator was aborted", rank_);
    return check(nccl().all_reduce(data, data, n, ncclBfloat16, ncclSum, comm_, static_cast<cudaStream_t>(stream)),
                 "all_reduce", rank_);
  }
  Expected<void> all_gather_bf16(const uint16_t* mine, uint16_t* all, size_t n, void* stream) override {
    if (comm_ == nullptr) return make_error("NCCL all_gather on rank {}: the communicator was aborted", rank_);
    return check(nccl().all_gather(mine, all, n, ncclBfloat16, comm_, static_cast<cudaStream_t>(stream)),
                 "all_gather", rank_);
  }

 private:
  ncclComm_t comm_;
  const int rank_, world_, device_;
};

}  // namespace

Expected<std::string> nccl_version() {
  const NcclApi& api = nccl();
  if (!api.load_error.empty()) return make_error("{}", api.load_error);
  int v = 0;
  TERN_TRY(check(api.get_version(&v), "ncclGetVersion", 0));
  // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9.
  return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

Expected<std::unique_ptr<DeviceCommunicator>> nccl_communicator_create(Communicator& host, int device) {
  const NcclApi& api = nccl();
  // Every rank takes part in the id's broadcast even when NCCL is missing here, so that no peer waits for it.
  ncclUniqueId id{};
  if (host.rank() == 0 && api.load_error.empty()) TERN_TRY(check(api.get_unique_id(&id), "ncclGetUniqueId", 0));
  TERN_TRY(host.broadcast(std::span<std::byte>(reinterpret_cast<std::byte*>(&id), sizeof(id)), 0));
  if (!api.load_error.empty()) return make_error("{}", api.load_error);
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return make_error("rank {}: CUDA device {}: {}", host.rank(), device, cudaGetErrorString(e));
  }
  ncclComm_t comm = nullptr;
  TERN_TRY(check(api.comm_init_rank(&comm, host.world(), id, host.rank()), "ncclCommInitRank", host.rank()));
  return std::unique_ptr<DeviceCommunicator>(
      std::make_unique<NcclCommunicator>(comm, host.rank(), host.world(), device));
}

}  // namespace tern
