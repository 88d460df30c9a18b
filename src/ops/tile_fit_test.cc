// The tile choices of the attention and Gated DeltaNet kernels on simulated GPUs (no GPU needed): every head dim the
// supported models use gets a tile that fits the device's shared memory per block, computed from the device's
// numbers and not from its compute capability (an RTX PRO 6000 has 99 KiB per block where an H200 has 227 KiB).
#include <gtest/gtest.h>

#include <cstdio>

#include "kernels/cuda/attention_launch.h"
#include "kernels/cuda/gated_delta_launch.h"
#include "ops/device.h"

namespace tern {
namespace {

DeviceProps props_of(const DeviceDescription& d) {
  DeviceProps p;
  p.name = d.name;
  p.cc_major = d.cc_major;
  p.cc_minor = d.cc_minor;
  p.num_sms = d.sm_count;
  p.shared_mem_per_block_optin = static_cast<size_t>(d.smem_per_block_optin);
  p.shared_mem_per_sm = static_cast<size_t>(d.smem_per_sm);
  p.regs_per_block = d.regs_per_block;
  p.regs_per_sm = d.regs_per_sm;
  return p;
}

TEST(TileFit, AttentionPrefillTilesFitEverySimulatedDevice) {
  for (const std::string& name : simulated_device_names()) {
    auto d = simulated_device(name);
    ASSERT_TRUE(d.has_value()) << name;
    const DeviceProps p = props_of(*d);
    for (int64_t hd : {32, 64, 128, 256}) {
      const AttentionPrefillTiles t = attention_prefill_tiles(p, hd);
      std::printf("%-13s hd %3lld: kv tile %d, %d stage(s), %zu of %lld bytes\n", name.c_str(),
                  static_cast<long long>(hd), t.kv_tile, t.stages, t.smem_bytes,
                  static_cast<long long>(d->smem_per_block_optin));
      EXPECT_GE(t.stages, 1) << name << " hd " << hd << ": no prefill tile fits";
      EXPECT_LE(static_cast<int64_t>(t.smem_bytes), d->smem_per_block_optin) << name << " hd " << hd;
      EXPECT_GT(t.kv_tile, 0);
    }
  }
}

TEST(TileFit, AttentionTilesShrinkWithSharedMemoryNotWithArchitecture) {
  auto h200 = simulated_device("h200");
  ASSERT_TRUE(h200.has_value());
  DeviceProps p = props_of(*h200);
  const AttentionPrefillTiles roomy = attention_prefill_tiles(p, 256);
  p.shared_mem_per_block_optin = roomy.smem_bytes - 1;  // the same sm_90, one byte short of the two-stage tile
  const AttentionPrefillTiles tight = attention_prefill_tiles(p, 256);
  EXPECT_EQ(roomy.stages, 2);
  EXPECT_EQ(tight.stages, 1);
  EXPECT_LT(tight.smem_bytes, roomy.smem_bytes);
  p.shared_mem_per_block_optin = 1024;
  EXPECT_EQ(attention_prefill_tiles(p, 256).stages, 0) << "a tile that does not fit must be refused";
}

TEST(TileFit, GdnChunksFitEverySimulatedDevice) {
  for (const std::string& name : simulated_device_names()) {
    auto d = simulated_device(name);
    ASSERT_TRUE(d.has_value()) << name;
    const DeviceProps p = props_of(*d);
    for (int64_t dk : {32, 64, 128}) {
      const int64_t chunk = gdn_chunked_chunk_len(p, dk);
      std::printf("%-13s dk %3lld: chunk %lld, %lld of %lld bytes\n", name.c_str(), static_cast<long long>(dk),
                  static_cast<long long>(chunk), static_cast<long long>(gdn_chunked_smem_bytes(dk, chunk)),
                  static_cast<long long>(d->smem_per_block_optin));
      ASSERT_GT(chunk, 0) << name << " dk " << dk;
      EXPECT_LE(gdn_chunked_smem_bytes(dk, chunk), d->smem_per_block_optin) << name << " dk " << dk;
    }
  }
  // dk 128 takes the long chunk only where ~109 KB fit: H200 yes, RTX PRO 6000 no.
  EXPECT_EQ(gdn_chunked_chunk_len(props_of(*simulated_device("h200")), 128), 64);
  EXPECT_EQ(gdn_chunked_chunk_len(props_of(*simulated_device("rtx-pro-6000")), 128), 32);
}

}  // namespace
}  // namespace tern
