// A DeviceCommunicator staged through the host: each collective waits for the rank's stream, copies the device
// buffer to the host, runs the host Communicator's collective (in fp32: a bf16 sum of N values rounded once) and
// copies the result back. Slow and not capturable into CUDA graphs; for N ranks sharing one GPU, where NCCL refuses
// to run (the tensor-parallel tests on one device).
#pragma once

#include <memory>

#include "dist/communicator.h"
#include "dist/device_communicator.h"

namespace tern {

// `host` (not owned) is the rank's host communicator; it outlives the result.
std::unique_ptr<DeviceCommunicator> staged_device_communicator(Communicator& host);

}  // namespace tern
