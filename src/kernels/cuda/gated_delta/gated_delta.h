// Checked launchers of the Gated DeltaNet kernels (argument structs and semantics in gated_delta_launch.h). Each
// validates shapes, strides and pointers and queues the kernels on ctx.stream(); errors name the kernel and the bad
// argument. n_seqs == 0 is a no-op. The per-sequence metadata live on the device and are trusted (see
// GdnSequences).
#pragma once

#include "core/error.h"
#include "kernels/cuda/gated_delta/gated_delta_launch.h"

namespace tern {

Expected<void> gdn_conv1d(const DeviceContext& ctx, const GdnConvArgs& args);
// With args.norm (GdnGatedNorm) the recurrent kernel runs whatever the rows per sequence (kAuto), and kChunked is an
// error; a norm without weight, a short gate stride or a bad eps are errors too.
Expected<void> gdn_delta_rule(const DeviceContext& ctx, const GdnDeltaRuleArgs& args,
                              GdnVariant variant = GdnVariant::kAuto);

}  // namespace tern
