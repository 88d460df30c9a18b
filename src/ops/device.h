// What a device can do, as measured from the device itself (or, for CPU-only tests, as a simulated description of
// a real GPU), and what this binary holds for it. Kernel requirements are written against these facts: shared
// memory per block, registers, SM count, the instructions the exact architecture has, and whether the binary has
// machine code (or compilable PTX) for it. Nothing here says "compute capability >= N therefore feature X".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tern {

enum class Backend { kCpu, kCuda };

struct DeviceDescription {
  Backend backend = Backend::kCpu;
  std::string name;
  int cc_major = 0;                   // CUDA compute capability (0 on the CPU)
  int cc_minor = 0;
  int sm_count = 0;                   // CPU: hardware threads
  int64_t smem_per_block_optin = 0;   // bytes a block may use after cudaFuncSetAttribute (sharedMemPerBlockOptin)
  int64_t smem_per_sm = 0;            // bytes per multiprocessor
  int regs_per_block = 0;
  int regs_per_sm = 0;
  int64_t l2_bytes = 0;
  int64_t memory_bytes = 0;
  bool simulated = false;             // a description for tests, not a device that can run anything

  std::string arch() const;           // "sm_90", "sm_120", "cpu"
};

// Instructions the exact architecture provides, from the PTX ISA's per-target tables. Unknown architectures get
// none of the special paths: a new GPU runs the portable kernels until someone verifies the others on it.
struct ArchFeatures {
  bool mma_bf16 = false;               // mma.sync with bf16 operands (sm_80 and later targets)
  bool fp8_mma = false;                // mma.sync / wgmma with e4m3/e5m2 operands (sm_89, sm_90a, ...)
  bool wgmma = false;                  // warpgroup MMA: sm_90a only
  bool tma = false;                    // cp.async.bulk.tensor: sm_90 and later targets
  bool tcgen05 = false;                // 5th-generation tensor core instructions: sm_100a / sm_101a / sm_103a
  bool fp4_block_scaled_mma = false;   // block-scaled e2m1 MMA: sm_100a family (tcgen05) and sm_120a (mma.sync)
};
ArchFeatures arch_features(int cc_major, int cc_minor);

// The code a binary (or one kernel of it) carries, as cudaFuncGetAttributes / cuobjdump report it: machine code
// per target ("sm_90a", "sm_100a", "sm_120a", "sm_80") and PTX per virtual target ("compute_90a", "compute_80").
struct BinaryImage {
  std::vector<std::string> sass;
  std::vector<std::string> ptx;
};

// Whether the image can run on the device: SASS for "sm_XY" runs on X.Y' with Y' >= Y (same major); an
// arch-specific "sm_XYa" runs on X.Y only; PTX "compute_XY" is compiled by the driver for any X.Y' >= X.Y, and
// "compute_XYa" only for X.Y. Returns "" when it can run, otherwise the reason.
std::string binary_can_run(const BinaryImage& image, const DeviceDescription& device);

// Descriptions of real GPUs for CPU-only tests of selection: "h200", "b200", "rtx-pro-6000", "rtx-4090".
Expected<DeviceDescription> simulated_device(std::string_view name);
std::vector<std::string> simulated_device_names();

// The machine tern runs on, as the CPU backend sees it.
DeviceDescription cpu_device_describe();

}  // namespace tern
