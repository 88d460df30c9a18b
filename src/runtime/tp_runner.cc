#include "runtime/tp_runner.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "dist/loopback.h"
#include "runtime/cpu_runner.h"

#if TERN_RUNTIME_CUDA
#include "dist/cuda/nccl_communicator.h"
#include "dist/cuda/staged_communicator.h"
#include "runtime/cuda_runner.h"
#endif

namespace tern {
namespace {

// One thread per rank above 0; run() hands every rank the same job (rank 0 on the calling thread) and returns when
// all have finished.
class RankThreads {
 public:
  using Job = std::function<Expected<void>(int rank)>;

  explicit RankThreads(int world) : results_(static_cast<size_t>(world)) {
    for (int r = 1; r < world; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~RankThreads() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  std::vector<Expected<void>> run(const Job& job) {
    {
      std::lock_guard lock(mu_);
      job_ = &job;
      remaining_ = static_cast<int>(threads_.size());
      ++generation_;
    }
    cv_.notify_all();
    results_[0] = job(0);
    std::unique_lock lock(mu_);
    done_.wait(lock, [&] { return remaining_ == 0; });
    job_ = nullptr;
    return results_;
  }

 private:
  void loop(int rank) {
    uint64_t seen = 0;
    while (true) {
      const Job* job = nullptr;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      Expected<void> result = (*job)(rank);
      std::lock_guard lock(mu_);
      results_[static_cast<size_t>(rank)] = std::move(result);
      if (--remaining_ == 0) done_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_, done_;
  const Job* job_ = nullptr;
  uint64_t generation_ = 0;
  int remaining_ = 0;
  bool stop_ = false;
  std::vector<Expected<void>> results_;
  std::vector<std::thread> threads_;
};

// A sequence's slice on every rank.
struct TpSequence final : DeviceSequenceState {
  std::vector<SequenceCache> ranks;
};

class TpRunner final : public ModelRunner {
 public:
  // `devices`: each rank's GPU (empty on the CPU).
  TpRunner(int world, std::vector<int> devices)
      : group_(world), threads_(world), devices_(std::move(devices)), device_comms_(static_cast<size_t>(world)),
        runners_(static_cast<size_t>(world)) {}

  // The group's start-up check, before any weight is read: the device collectives joined (NCCL's group made) and
  // one timed all-reduce on every rank that must finish within `deadline` with the exact sum.
  Expected<TpGroupCheck> connect(std::chrono::milliseconds deadline) {
    TpGroupCheck check;
    check.world = static_cast<int>(runners_.size());
    check.transport = group_.rank(0).describe();
    std::vector<double> ms(runners_.size(), 0.0);
#if TERN_RUNTIME_CUDA
    if (!devices_.empty()) {
      check.peers = cuda_peer_report(devices_);
#if TERN_HAVE_NCCL
      if (!shares_a_device()) {
        TERN_ASSIGN_OR_RETURN(const std::string version, nccl_version());
        check.transport = "NCCL " + version;
      }
#endif
    }
#endif
    const auto probe = [&](int r) -> Expected<void> {
      if (devices_.empty()) {
        std::vector<float> probe(kProbeElements, static_cast<float>(r + 1));
        const auto start = std::chrono::steady_clock::now();
        TERN_TRY(group_.rank(r).all_reduce_sum(probe));
        ms[static_cast<size_t>(r)] =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        const float want = static_cast<float>(check.world * (check.world + 1) / 2);
        for (size_t i = 0; i < probe.size(); ++i) {
          if (probe[i] != want) {
            return make_error("rank {}: the all-reduce probe summed to {} at element {}, not {}", r, probe[i], i, want);
          }
        }
        return {};
      }
#if TERN_RUNTIME_CUDA
      const int device = devices_[static_cast<size_t>(r)];
      TERN_TRY(cuda_use_device(device));
      auto& comm = device_comms_[static_cast<size_t>(r)];
      if (shares_a_device()) {
        comm = staged_device_communicator(group_.rank(r));
        if (r == 0) check.transport = comm->describe();
      } else {
#if TERN_HAVE_NCCL
        TERN_ASSIGN_OR_RETURN(comm, nccl_communicator_create(group_.rank(r), device));
#else
        return make_error("this tern was built without NCCL: ranks on several GPUs are not available");
#endif
      }
      TERN_ASSIGN_OR_RETURN(ms[static_cast<size_t>(r)], cuda_all_reduce_probe(*comm, kProbeElements, deadline));
      return {};
#else
      (void)deadline;
      return make_error("this tern was built without CUDA");
#endif
    };
    TERN_TRY(run_ranks("the start-up check", probe));
    check.probe_bytes = static_cast<int64_t>(kProbeElements) * (devices_.empty() ? 4 : 2);
    check.all_reduce_ms = *std::max_element(ms.begin(), ms.end());
    return check;
  }

  Expected<void> load(const std::filesystem::path& dir, const ModelLoadOptions& options) {
    return run_ranks("loading", [&](int r) -> Expected<void> {
      ModelLoadOptions rank_options = options;
      rank_options.tensor_parallel_size = 1;
      rank_options.communicator = &group_.rank(r);
      rank_options.shard = {r, static_cast<int>(runners_.size())};
      auto& runner = runners_[static_cast<size_t>(r)];
      if (devices_.empty()) {
        TERN_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> model, model_build_host(dir, rank_options));
        TERN_ASSIGN_OR_RETURN(runner, cpu_runner_create(std::move(model), &group_.rank(r)));
        return {};
      }
#if TERN_RUNTIME_CUDA
      const int device = devices_[static_cast<size_t>(r)];
      TERN_TRY(cuda_use_device(device));
      auto& comm = device_comms_[static_cast<size_t>(r)];
      rank_options.device_options.device = device;
      TERN_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> model, model_build_host(dir, rank_options));
      TERN_ASSIGN_OR_RETURN(runner, cuda_runner_create(std::move(model), rank_options.device_options, comm.get()));
      return {};
#else
      return make_error("this tern was built without CUDA");
#endif
    });
  }

  const CausalLm& model() const override { return runners_.front()->model(); }
  SequenceCache new_sequence() override {
    auto state = std::make_shared<TpSequence>();
    for (const auto& runner : runners_) state->ranks.push_back(runner->new_sequence());
    SequenceCache cache;
    cache.device = std::move(state);
    return cache;
  }
  ModelDevice device() const override { return runners_.front()->device(); }
  std::optional<std::string> failure() const override {
    if (failed_.empty()) return std::nullopt;
    return failed_;
  }
  std::string describe() const override {
    return fmt::format("{} tensor-parallel ranks ({}): {}", runners_.size(), group_.rank(0).describe(),
                       runners_.front()->describe());
  }
  int64_t kv_cache_tokens() const override {
    int64_t tokens = runners_.front()->kv_cache_tokens();
    for (const auto& runner : runners_) tokens = std::min(tokens, runner->kv_cache_tokens());
    return tokens;
  }

 private:
  Expected<std::vector<float>> step(std::span<const SequenceInput> batch, LogitsFor which,
                                    const Tracer* tracer) override {
    TERN_ASSIGN_OR_RETURN(const auto inputs, rank_inputs(batch));
    std::vector<float> logits;
    TERN_TRY(run_ranks("a step", [&](int r) -> Expected<void> {
      TERN_TRY(bind(r));
      TERN_ASSIGN_OR_RETURN(std::vector<float> l, runners_[static_cast<size_t>(r)]->forward(
                                                      inputs[static_cast<size_t>(r)], which, r == 0 ? tracer : nullptr));
      if (r == 0) logits = std::move(l);
      return {};
    }));
    return logits;
  }

  // Rank 0 samples (the rows' Samplers and their random streams are used once); the others run the same step.
  Expected<SampleResults> sample_step(std::span<const SequenceInput> batch, std::span<const SampleRow> rows) override {
    TERN_ASSIGN_OR_RETURN(const auto inputs, rank_inputs(batch));
    SampleResults results;
    TERN_TRY(run_ranks("a step", [&](int r) -> Expected<void> {
      TERN_TRY(bind(r));
      ModelRunner& runner = *runners_[static_cast<size_t>(r)];
      if (r == 0) {
        TERN_ASSIGN_OR_RETURN(results, runner.forward_sample(inputs[0], rows));
      } else {
        TERN_TRY(runner.forward(inputs[static_cast<size_t>(r)], LogitsFor::kLastToken));
      }
      return {};
    }));
    return results;
  }

  // Rank r's GPU current on the thread running it (rank 0 runs on the caller's thread, which may use others).
  Expected<void> bind(int r) const {
#if TERN_RUNTIME_CUDA
    if (!devices_.empty()) return cuda_use_device(devices_[static_cast<size_t>(r)]);
#endif
    (void)r;
    return {};
  }

  // Each rank's view of the step: the same tokens and ids over its slice of each sequence, checked by every rank
  // here (check_inputs), so that a refused batch fails every rank alike instead of breaking the group.
  Expected<std::vector<std::vector<SequenceInput>>> rank_inputs(std::span<const SequenceInput> batch) const {
    std::vector<std::vector<SequenceInput>> inputs(runners_.size());
    for (const SequenceInput& in : batch) {
      auto* seq = dynamic_cast<TpSequence*>(in.cache->device.get());
      if (seq == nullptr || seq->ranks.size() != runners_.size()) {
        return make_error("a sequence not made by this tensor-parallel runner was passed to it");
      }
      for (size_t r = 0; r < runners_.size(); ++r) {
        if (seq->ranks[r].length != in.cache->length) {
          return make_error("rank {} holds {} tokens of a sequence of {}", r, seq->ranks[r].length, in.cache->length);
        }
        inputs[r].push_back({&seq->ranks[r], in.tokens, in.kv_blocks, in.state_slot});
      }
    }
    TERN_TRY(check_inputs(batch));
    for (size_t r = 0; r < runners_.size(); ++r) {
      if (auto checked = runners_[r]->check_inputs(inputs[r]); !checked) {
        return tl::unexpected<Error>(checked.error());
      }
    }
    return inputs;
  }

  // Runs `job` on every rank; the first rank to fail aborts the group (so no rank waits for it in a collective) and
  // its reason is the error. A failed group stays failed.
  Expected<void> run_ranks(std::string_view what, const std::function<Expected<void>(int)>& job) {
    if (!failed_.empty()) return make_error("the tensor-parallel group failed earlier: {}", failed_);
    std::mutex mu;
    std::string first;
    const auto results = threads_.run([&](int r) -> Expected<void> {
      Expected<void> result = job(r);
      if (!result) {
        std::lock_guard lock(mu);
        if (first.empty()) {
          first = fmt::format("rank {}: {}", r, result.error().message);
          group_.abort(first);
        }
      }
      return result;
    });
    if (first.empty()) return {};
    failed_ = first;
    return make_error("{} failed on {} of {} tensor-parallel ranks; {}", what,
                      std::count_if(results.begin(), results.end(), [](const auto& e) { return !e.has_value(); }),
                      results.size(), first);
  }

  bool shares_a_device() const {
    std::vector<int> sorted = devices_;
    std::sort(sorted.begin(), sorted.end());
    return std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end();
  }

  static constexpr size_t kProbeElements = size_t{1} << 20;

  mutable LoopbackGroup group_;
  RankThreads threads_;
  const std::vector<int> devices_;
  // Declared before the runners, which use them, so that they outlive the runners.
  std::vector<std::unique_ptr<DeviceCommunicator>> device_comms_;
  std::vector<std::unique_ptr<ModelRunner>> runners_;
  std::string failed_;
};

Expected<std::vector<int>> rank_devices(const ModelLoadOptions& options) {
  const int world = options.tensor_parallel_size;
  if (world < 1) return make_error("--tensor-parallel-size must be at least 1, got {}", world);
  std::vector<int> devices;
  if (options.device == ModelDevice::kCuda) {
    const int present = runner_cuda_device_count();
    if (options.cuda_devices.empty()) {
      if (present < world) {
        return make_error("--tensor-parallel-size {} needs {} GPUs, {} present (--cuda-devices lists the GPU of each "
                          "rank; ranks may share one GPU, slowly, for testing)", world, world, present);
      }
      for (int r = 0; r < world; ++r) devices.push_back(r);
    } else {
      devices = options.cuda_devices;
      if (static_cast<int>(devices.size()) != world) {
        return make_error("--cuda-devices lists {} GPUs for --tensor-parallel-size {}", devices.size(), world);
      }
      for (const int d : devices) {
        if (d < 0 || d >= present) return make_error("--cuda-devices: GPU {} does not exist ({} present)", d, present);
      }
    }
  }
  return devices;
}

constexpr std::string_view kTpHint =
    "; check the group with `tern doctor --tensor-parallel-size N`: on PCIe machines a hang in NCCL's peer-to-peer "
    "path is usually fixed by NCCL_P2P_DISABLE=1 or by disabling ACS / the IOMMU in the BIOS; NCCL_DEBUG=INFO says "
    "what NCCL chose";

}  // namespace

Expected<TpGroupCheck> tp_group_check(const ModelLoadOptions& options, std::chrono::milliseconds deadline) {
  TERN_ASSIGN_OR_RETURN(std::vector<int> devices, rank_devices(options));
  TpRunner group(options.tensor_parallel_size, devices);
  auto check = group.connect(deadline);
  if (!check) return make_error("{}{}", check.error().message, devices.size() > 1 ? kTpHint : "");
  check->devices = std::move(devices);
  return check;
}

Expected<std::unique_ptr<ModelRunner>> tp_runner_load(const std::filesystem::path& dir,
                                                      const ModelLoadOptions& options) {
  TERN_ASSIGN_OR_RETURN(std::vector<int> devices, rank_devices(options));
  const bool gpus = devices.size() > 1;
  auto runner = std::make_unique<TpRunner>(options.tensor_parallel_size, std::move(devices));
  auto check = runner->connect(options.tp_check_deadline);
  if (!check) return make_error("tensor-parallel start-up check failed: {}{}", check.error().message, gpus ? kTpHint : "");
  TERN_TRY(runner->load(dir, options));
  return std::unique_ptr<ModelRunner>(std::move(runner));
}

}  // namespace tern
