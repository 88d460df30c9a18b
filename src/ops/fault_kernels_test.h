// Deliberately racy CUDA kernels for the registry's race tests (fault_kernels_test.cu, compiled into
// ops_race_cuda_test only, never into tern). Both implement the plain rms_norm (no residual, no gate: y = w * x̂)
// over rows of `dim` bf16 values with the contract of RmsNormArgs (kernels/cuda/elementwise/elementwise_launch.h); the
// launchers are unchecked and ignore the residual, gate and zero_centred fields. compute-sanitizer's racecheck reports
// the shared-memory race of the first one: that is the point, so keep this binary out of tools/device/sanitize.sh.
#pragma once

#include "kernels/cuda/elementwise/elementwise_launch.h"

namespace tern {

// Every thread adds its squares into the row's one shared float with a plain load-add-store (no atomics, no
// reduction): most updates are lost, so the norm is far too large, by an amount that varies from run to run.
void rms_norm_lost_updates_launch(const DeviceContext& ctx, const RmsNormArgs& args);

// Deterministic sums, but each row's scale is multiplied by 1 + (c mod 256) * 2^-18, where c is what is left of a
// count that every thread of a second grid increments on the row's counter in global memory with a plain
// load-add-store: tens of thousands of colliding writers on every SM, so c differs from run to run. The change
// stays below 2^-10 of each output, inside the bf16 tolerance: only the repeatability check can see this race.
// `counters`: `rows` floats of device scratch.
void rms_norm_racy_scale_launch(const DeviceContext& ctx, const RmsNormArgs& args, float* counters);

}  // namespace tern
