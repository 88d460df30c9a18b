// Options shared by the commands that run a model (generate, score): where the model is, how to load it, and the
// prompt given as token ids.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cli/model_selftest.h"
#include "core/error.h"
#include "models/causal_lm.h"
#include "runtime/model_runner.h"

namespace tern {

struct ModelCliOptions {
  std::string model_dir;
  std::string load_format = "auto";           // auto | dummy
  std::string nvfp4_activations = "auto";  // auto | dequantize (W4A16) | quantize (W4A4); nvfp4_activations_of
  std::string device = "auto";  // auto | cpu | cuda
  int cuda_device = 0;
  uint64_t dummy_seed = 0;
  std::string selftest = "auto";  // auto (fast on a GPU, off on the CPU) | off | fast | full
  std::string kv_cache_dtype = "auto";  // auto | bf16 | fp8_e4m3 (kv_cache_dtype_of)
  bool enforce_eager = false;     // no CUDA graphs for decode steps
  bool no_pdl = false;            // no programmatic dependent launch
  int tensor_parallel_size = 1;   // ranks the model is split over (runtime/tp_runner.h)
  bool enable_expert_parallel = false;  // whole routed experts per rank (ModelLoadOptions::expert_parallel)
  int expert_parallel_size = 0;         // SGLang's --ep-size: 0 (unset), 1 or tensor_parallel_size
  std::vector<int> cuda_devices;  // each rank's GPU (empty: rank r on GPU r)
  int nnodes = 1;                 // processes the ranks spread over (--nnodes; SGLang's names)
  int node_rank = 0;              // this one (--node-rank; > 0: runs node 0's steps, then exits)
  std::string dist_init_addr;     // node 0's rendezvous store, HOST:PORT
  bool front_end = false;         // node 0 runs no rank (ModelLoadOptions::front_end)
  int dist_timeout_s = 120;       // joining the nodes, and each wait on another node
  // How this machine's ranks run: "threads" of this process, or "mp": one process per rank, started by tern
  // (cli/rank_processes.h; vLLM's name for it).
  std::string distributed_executor_backend = "threads";
  BackendFlags backends;
  // Speculative decoding (runtime/speculative.h): "" (off) or "mtp" (alias "nextn": the model's MTP layers draft),
  // with this many draft tokens per step.
  std::string speculative_algorithm;
  int speculative_num_steps = 3;
};

void add_model_options(CLI::App& cmd, ModelCliOptions& options);
// --tensor-parallel-size / --tp (part of add_model_options; serve adds it on its own).
void add_parallel_options(CLI::App& cmd, ModelCliOptions& options);
// --enable-expert-parallel (vLLM's name), with SGLang's --expert-parallel-size / --ep-size N, which must equal
// --tensor-parallel-size (tern's expert parallelism spreads the experts over the tensor-parallel ranks) or be 1.
void add_expert_parallel_options(CLI::App& cmd, bool& enable, int& size);
// Whether those flags ask for expert parallelism; an error for an --ep-size other than 1 or the tensor-parallel size.
Expected<bool> expert_parallel_of(bool enable, int size, int tensor_parallel_size);
Expected<bool> expert_parallel_of(const ModelCliOptions& options);
void add_backend_options(CLI::App& cmd, BackendFlags& backends);
// --speculative-algorithm and --speculative-num-steps (serve, generate, bench; doctor into its own fields).
void add_speculative_options(CLI::App& cmd, ModelCliOptions& options);
void add_speculative_options(CLI::App& cmd, std::string& algorithm, int& num_steps);
// The draft tokens per step that the options ask for: 0 without --speculative-algorithm.
int speculative_steps_of(const ModelCliOptions& options);
// The rows one verification holds (num_steps + 1) for the self-test's plan; 0 without an algorithm.
int64_t speculative_verify_rows(const std::string& algorithm, int num_steps);
// Runs the start-up self-test (--selftest) of the device that will run the model, then loads it there. Refuses to
// load when an op the model needs has no verified implementation, or a forced backend fails its self-test.
// `sizes`: what a device runner allocates (rows per step, sequences, KV tokens); the CPU ignores them.
Expected<std::unique_ptr<ModelRunner>> load_model_from_options(const ModelCliOptions& options,
                                                               const DeviceModelOptions& sizes);

// --kv-cache-dtype: auto, bf16 / bfloat16, fp8 / fp8_e4m3 / fp8_ds_mla (vLLM's and SGLang's names); an error lists
// them.
Expected<KvCacheDtype> kv_cache_dtype_of(const std::string& name);
// Adds --kv-cache-dtype (part of add_model_options; doctor adds it on its own).
void add_kv_cache_option(CLI::App& cmd, std::string& kv_cache_dtype);

// "1,2,3" -> {1, 2, 3}; an error names the bad item.
Expected<std::vector<int32_t>> parse_id_list(const std::string& text);

}  // namespace tern
