// The model's steps on a CUDA device: the KV blocks and Gated DeltaNet state slots of each sequence, the step's
// metadata (planned on the host, uploaded in one copy), decode steps replayed as CUDA graphs per batch size and
// context bucket, and sampling on the device (cuda_sampler.h). The blocks themselves are models/gpu/cuda_ops.h's.
// The same contract as the CPU runner: one forward per batch of sequences, prefill and decode rows mixed.
//
// Every buffer is allocated at load for DeviceModelOptions::max_batch_tokens rows, so a step allocates nothing
// (except the logits of a prefill asking for more rows than any step before).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/device_communicator.h"
#include "models/causal_lm.h"
#include "runtime/model_runner.h"

namespace tern {

// CUDA devices present (0 without a driver or a GPU).
int cuda_device_count();
// Makes `device` the calling thread's current CUDA device (a tensor-parallel rank's thread, before its work).
Expected<void> cuda_use_device(int device);

// One rank's part of the tensor-parallel start-up check, on its thread with its GPU current: an all-reduce of
// `n` bf16 values (rank r contributes r + 1 everywhere) that must finish within `deadline` (else the collective is
// aborted) and give world * (world + 1) / 2 exactly. Returns its time in milliseconds.
Expected<double> cuda_all_reduce_probe(DeviceCommunicator& comm, size_t n, std::chrono::milliseconds deadline);
// The time of one all-reduce of `n` bf16 values on `comm` (this rank's GPU current): `calls` of them back to back on
// one stream between two events (after one untimed call), the elapsed time divided by `calls`. A batch that does not
// finish within `deadline` aborts the collective and is an error.
Expected<double> cuda_all_reduce_ms(DeviceCommunicator& comm, size_t n, int calls, std::chrono::milliseconds deadline);
// Peer access between every ordered pair of `devices`, one line each ("GPU 0 -> GPU 1: peer access").
std::vector<std::string> cuda_peer_report(const std::vector<int>& devices);

// The model placed on options.device: its blocks made by models/gpu/cuda_ops.h, its activations and caches
// allocated. Errors name what does not fit or what the CUDA path does not support yet (a layer kind, a bias, W4A4).
// `comm`: the tensor-parallel group when `model` is one rank's slice (runtime/tp_runner.h); null for a whole model.
Expected<std::unique_ptr<ModelRunner>> cuda_runner_create(std::unique_ptr<CausalLm> model,
                                                          const DeviceModelOptions& options,
                                                          DeviceCommunicator* comm = nullptr);

}  // namespace tern
