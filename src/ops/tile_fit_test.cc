// The tile choices of the attention and Gated DeltaNet kernels on simulated GPUs (no GPU needed): every head dim the
// supported models use gets a tile that fits the device's shared memory per block, computed from the device's
// numbers and not from its compute capability (an RTX PRO 6000 has 99 KiB per block where an H200 has 227 KiB).
// The decode split count, which follows the device's resident blocks, stays within the workspace sized for it.
#include <gtest/gtest.h>

#include <cstdio>

#include <fmt/format.h>

#include "kernels/cuda/attention/attention.h"
#include "kernels/cuda/gated_delta/gated_delta_launch.h"
#include "kernels/cuda/mla/indexer_launch.h"
#include "kernels/cuda/mla/mla.h"
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

TEST(TileFit, AttentionDecodeTilesFitEverySimulatedDevice) {
  for (const std::string& name : simulated_device_names()) {
    auto d = simulated_device(name);
    ASSERT_TRUE(d.has_value()) << name;
    const DeviceProps p = props_of(*d);
    for (int64_t hd : {32, 64, 128, 256}) {
      const AttentionDecodeTiles t = attention_decode_tiles(p, hd);
      std::printf("%-13s hd %3lld: decode %d stage(s), %zu of %lld bytes, %d blocks per SM\n", name.c_str(),
                  static_cast<long long>(hd), t.stages, t.smem_bytes, static_cast<long long>(d->smem_per_block_optin),
                  t.blocks_per_sm);
      EXPECT_GE(t.stages, 1) << name << " hd " << hd << ": no decode tile fits";
      EXPECT_LE(static_cast<int64_t>(t.smem_bytes), d->smem_per_block_optin) << name << " hd " << hd;
      EXPECT_GE(t.blocks_per_sm, 1) << name << " hd " << hd;
      EXPECT_LE(static_cast<int64_t>(t.blocks_per_sm) * static_cast<int64_t>(t.smem_bytes + 1024), d->smem_per_sm)
          << name << " hd " << hd << ": more resident blocks planned than the SM's shared memory holds";
    }
  }
  // Two K/V stages per warp up to head_dim 256 on an H200; the RTX PRO 6000 keeps two up to 128 and one at 256.
  for (int64_t hd : {32, 64, 128, 256})
    EXPECT_EQ(attention_decode_tiles(props_of(*simulated_device("h200")), hd).stages, 2);
  const DeviceProps rtx = props_of(*simulated_device("rtx-pro-6000"));
  EXPECT_EQ(attention_decode_tiles(rtx, 128).stages, 2);
  EXPECT_EQ(attention_decode_tiles(rtx, 256).stages, 1);
  DeviceProps tiny = rtx;
  tiny.shared_mem_per_block_optin = 1024;
  EXPECT_EQ(attention_decode_tiles(tiny, 64).stages, 0) << "a tile that does not fit must be refused";
}

// Every launch within the bounds a workspace was sized for (token count, max_seq_len, any n_kv_heads) needs at
// most that workspace; large batches get one split, a lone long sequence enough splits to reach 90% of the SMs.
TEST(TileFit, AttentionDecodeSplitsStayWithinTheWorkspace) {
  constexpr int64_t kHeads = 32, kMaxTokens = 160, kMaxSeqLen = 40000;
  for (const std::string& name : simulated_device_names()) {
    const DeviceProps p = props_of(*simulated_device(name));
    for (int64_t hd : {64, 128, 256}) {
      const size_t ws = paged_attention_workspace_bytes(p, kMaxTokens, kHeads, hd, kMaxSeqLen);
      for (int64_t t = 1; t <= kMaxTokens; t += t < 16 ? 1 : 7) {
        for (int64_t n_kv : {2, 8, 32}) {
          for (int64_t len : {int64_t{1}, int64_t{63}, int64_t{1042}, int64_t{32768}, kMaxSeqLen}) {
            const int64_t n = attention_decode_splits(p, hd, t, kHeads, n_kv, len);
            SCOPED_TRACE(
                fmt::format("{} hd {} tokens {} kv heads {} max_seq_len {}: {} splits", name, hd, t, n_kv, len, n));
            ASSERT_GE(n, 1);
            ASSERT_LE(n, attention_decode_max_splits(p, hd, t, n_kv, len));
            ASSERT_LE(attention_decode_workspace_bytes(n, t, kHeads, hd), ws);
          }
        }
      }
    }
    EXPECT_EQ(attention_decode_splits(p, 128, 1024, kHeads, 8, 1042), 1) << name;
    const int64_t lone = attention_decode_splits(p, 128, 1, kHeads, 8, 32768);
    EXPECT_GE(lone * 8 * 10, p.num_sms * 9) << name << ": " << lone << " splits leave SMs idle";
    std::printf(
        "%-13s hd 128, 32/8 heads: splits %lld (64 x 1042), %lld (128 x 1042), %lld (64 x 32k), %lld (1 x 32k)\n",
        name.c_str(), static_cast<long long>(attention_decode_splits(p, 128, 64, kHeads, 8, 1042)),
        static_cast<long long>(attention_decode_splits(p, 128, 128, kHeads, 8, 1042)),
        static_cast<long long>(attention_decode_splits(p, 128, 64, kHeads, 8, 32768)), static_cast<long long>(lone));
  }
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

// The DSA indexer's score tiles (GLM-5's 32 heads of 128, the fixture's 16 of 32, the largest supported shape, the
// smallest) fit every device, two K stages where they fit; the planned resident blocks fit the SM's shared memory.
TEST(TileFit, IndexerSelectTilesFitEverySimulatedDevice) {
  const int64_t shapes[][2] = {{128, 32}, {32, 16}, {256, 64}, {16, 1}};  // head_dim, n_heads
  for (const std::string& name : simulated_device_names()) {
    auto d = simulated_device(name);
    ASSERT_TRUE(d.has_value()) << name;
    const DeviceProps p = props_of(*d);
    for (const auto& [hd, heads] : shapes) {
      const IndexerSelectTiles t = indexer_select_tiles(p, hd, heads);
      std::printf("%-13s indexer hd %3lld heads %2lld: %d stage(s), %zu of %lld bytes, %d blocks per SM\n",
                  name.c_str(), static_cast<long long>(hd), static_cast<long long>(heads), t.stages, t.smem_bytes,
                  static_cast<long long>(d->smem_per_block_optin), t.blocks_per_sm);
      EXPECT_GE(t.stages, 1) << name << " hd " << hd << " heads " << heads << ": no score tile fits";
      EXPECT_LE(static_cast<int64_t>(t.smem_bytes), d->smem_per_block_optin) << name << " hd " << hd;
      EXPECT_EQ(t.m_tiles, (heads + 15) / 16);
      EXPECT_GE(t.blocks_per_sm, 1);
      EXPECT_LE(static_cast<int64_t>(t.blocks_per_sm) * static_cast<int64_t>(t.smem_bytes + 1024), d->smem_per_sm)
          << name << " hd " << hd << ": more resident blocks planned than the SM's shared memory holds";
    }
    EXPECT_EQ(indexer_select_tiles(p, 128, 32).stages, 2) << name << ": GLM-5's shape keeps two stages";
  }
  EXPECT_EQ(indexer_select_tiles(props_of(*simulated_device("h200")), 256, 64).stages, 2);
  EXPECT_EQ(indexer_select_tiles(props_of(*simulated_device("rtx-pro-6000")), 256, 64).stages, 1);
  DeviceProps tiny = props_of(*simulated_device("rtx-pro-6000"));
  tiny.shared_mem_per_block_optin = 1024;
  EXPECT_EQ(indexer_select_tiles(tiny, 128, 32).stages, 0) << "a tile that does not fit must be refused";
}

// GLM-5 / DeepSeek-V3's 576-value latent (two key tiles and the warps' partial scores) fits every simulated device,
// sm_120's 101,376 bytes included; a latent past the kernel's limits would not.
TEST(TileFit, MlaAttentionTilesFitEverySimulatedDevice) {
  for (const std::string& name : simulated_device_names()) {
    auto d = simulated_device(name);
    ASSERT_TRUE(d.has_value()) << name;
    const DeviceProps p = props_of(*d);
    std::printf("%-13s mla latent 576: %zu of %lld bytes\n", name.c_str(), mla_attention_smem_bytes(576),
                static_cast<long long>(d->smem_per_block_optin));
    EXPECT_TRUE(mla_attention_fits(p, 576)) << name;
    EXPECT_TRUE(mla_attention_fits(p, 48)) << name;
  }
  DeviceProps tiny = props_of(*simulated_device("rtx-pro-6000"));
  tiny.shared_mem_per_block_optin = 64 * 1024;
  EXPECT_FALSE(mla_attention_fits(tiny, 576)) << "a tile that does not fit must be refused";
}

}  // namespace
}  // namespace tern
