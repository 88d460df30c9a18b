// A DeviceCommunicator over NCCL, one GPU per rank (the ranks may be threads of one process or processes):
// capturable into CUDA graphs. libnccl.so.2 (the CUDA toolkit's, or any on the library path) is loaded at run time,
// so that a tern without it still runs a model on one GPU; asking for a group without it is an error saying so.
//
//   // on each rank's thread, with its host communicator (dist/communicator.h) and its GPU:
//   TERN_ASSIGN_OR_RETURN(auto nccl, nccl_communicator_create(host, /*device=*/rank));
//   TERN_TRY(nccl->all_reduce_sum_bf16(out, n, stream));
#pragma once

#include <memory>
#include <string>

#include "dist/communicator.h"
#include "dist/device_communicator.h"

namespace tern {

// Every rank calls it together: rank 0 makes NCCL's unique id and broadcasts it over `host` (not owned; it
// outlives the result), then every rank joins the NCCL group on `device` (made current on the calling thread).
Expected<std::unique_ptr<DeviceCommunicator>> nccl_communicator_create(Communicator& host, int device);

// The version of the NCCL that would be loaded ("2.28.9"), or why none can be.
Expected<std::string> nccl_version();

}  // namespace tern
