// The MLA kernels against fp64 host references computed here from the same bf16 inputs (label gpu): mla_prepare's
// latent norm, RoPE (both layouts) and cache writes, and mla_attention over a paged latent cache with scattered
// blocks, causal and with DSA selections, for GLM-5's shapes (576-value latent) and the tiny fixture's. Outputs are
// poisoned first; a padding row's slot -1 must write nothing.
#include "kernels/cuda/mla/mla.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/formats.h"
#include "core/latent_fp8.h"
#include "kernels/cuda/cuda_check.h"

namespace tern {
namespace {

constexpr uint16_t kPoison = 0xFFFF;  // a bf16 NaN

std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<uint16_t> out(n);
  for (auto& v : out) {
    do {
      v = float_to_bf16(dist(rng) * scale);
    } while ((v & 0x7FFF) == 0);
  }
  return out;
}

template <class T>
DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer b(std::max<size_t>(host.size() * sizeof(T), 16));
  if (!host.empty()) b.upload(host.data(), host.size() * sizeof(T));
  return b;
}

template <class T>
std::vector<T> download(const DeviceBuffer& b, size_t count) {
  std::vector<T> out(count);
  TERN_CUDA_CHECK(cudaMemcpy(out.data(), b.data(), count * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

double bf(uint16_t v) { return static_cast<double>(bf16_to_float(v)); }

// The rotation of pair slot j as mla_launch.h defines it, in double, cos and sin times `factor`.
void rope_ref(const std::vector<double>& x, std::vector<double>& y, int64_t dim, double position,
              const std::vector<float>& inv_freq, bool interleaved, double factor) {
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    const int64_t lo = interleaved ? 2 * j : j, hi = interleaved ? 2 * j + 1 : j + half;
    const double angle = static_cast<double>(static_cast<float>(position) * inv_freq[j]);
    const double c = factor * std::cos(angle), s = factor * std::sin(angle);
    y[lo] = x[lo] * c - x[hi] * s;
    y[hi] = x[hi] * c + x[lo] * s;
  }
}

std::vector<float> inv_freq_table(int64_t rope_dim) {
  std::vector<float> f(static_cast<size_t>(rope_dim / 2));
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / rope_dim));
  return f;
}

// |got - want| within bf16 rounding of the value plus `abs` (fp32 accumulation over long sums); NaN never passes.
void expect_close(float got, double want, double abs, const std::string& what) {
  ASSERT_TRUE(std::isfinite(got)) << what;
  ASSERT_LE(std::abs(got - want), abs + std::abs(want) * (1.0 / 128)) << what << ": got " << got << " want " << want;
}

struct PrepareShape {
  int64_t tokens, heads, lora, rope, nope;
  bool interleaved;
  std::optional<LatentFp8Scales> fp8 = {};  // the cache in FP8 entries with these scales
  float attention_factor = 1.0f;            // YaRN's: cos and sin times it
};

// One token's FP8 entry against the fp64 latent c and roped k_pe it was made from (the definition in
// core/latent_fp8.h): each tile's scale from the tile's amax (within the fp32 computation's error of c, or the next
// power of two up), each value read back within half an e4m3 step of c, k_pe as bf16.
void expect_fp8_entry(const uint8_t* entry, const std::vector<double>& c, const std::vector<double>& k_pe,
                      LatentFp8Scales scales, const std::string& what) {
  const auto lora = static_cast<int64_t>(c.size()), rope = static_cast<int64_t>(k_pe.size());
  for (int64_t t = 0; t < lora / kLatentFp8Tile; ++t) {
    double amax = 0;
    for (int64_t i = 0; i < kLatentFp8Tile; ++i) amax = std::max(amax, std::abs(c[t * kLatentFp8Tile + i]));
    const double want = std::max(amax / 448, double{FLT_MIN});
    float s;
    std::memcpy(&s, entry + lora + 4 * t, 4);
    ASSERT_TRUE(std::isfinite(s) && s > 0) << what << " tile " << t;
    if (scales == LatentFp8Scales::kFp32) {
      ASSERT_NEAR(s, want, 1e-5 * want) << what << " tile " << t;
    } else {
      int exp = 0;
      ASSERT_EQ(std::frexp(s, &exp), 0.5f) << what << " tile " << t << ": scale " << s << " is not a power of two";
      ASSERT_TRUE(s >= want * (1 - 1e-5) && s / 2 < want * (1 + 1e-5)) << what << " tile " << t << ": " << s;
    }
    for (int64_t i = t * kLatentFp8Tile; i < (t + 1) * kLatentFp8Tile; ++i) {
      const double got = static_cast<double>(e4m3_to_float(entry[i])) * s;
      const double bound = std::max(0x1p-4 * std::abs(c[i]), 0x1p-10 * s) * (1 + 1e-4) + 1e-5 * amax;
      ASSERT_LE(std::abs(got - c[i]), bound) << what << " c " << i << ": code " << int{entry[i]};
    }
  }
  for (int64_t i = 0; i < rope; ++i) {
    uint16_t bits;
    std::memcpy(&bits, entry + lora + 4 * (lora / kLatentFp8Tile) + 2 * i, 2);
    expect_close(bf16_to_float(bits), k_pe[i], 1e-3, what + " k_pe");
  }
}

void check_prepare(const PrepareShape& s, uint64_t seed) {
  DeviceContext ctx;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int64_t width = s.lora + s.rope, kv_stride = width + 24, q_stride = s.heads * (s.nope + s.rope) + 8;
  const int64_t block_size = 16, n_blocks = (s.tokens + block_size - 1) / block_size + 2;
  const int64_t entry = s.fp8 ? latent_fp8_bytes(s.lora, s.rope) : 2 * width;
  const auto kv_a = random_bf16(static_cast<size_t>(s.tokens * kv_stride), rng, 3.0f);
  const auto q = random_bf16(static_cast<size_t>(s.tokens * q_stride), rng, 2.0f);
  const auto weight = random_bf16(static_cast<size_t>(s.lora), rng, 2.0f);
  const auto inv_freq = inv_freq_table(s.rope);
  std::vector<int32_t> positions(s.tokens), slots(s.tokens);
  std::uniform_int_distribution<int32_t> pos_dist(0, 200000);
  for (int64_t t = 0; t < s.tokens; ++t) {
    positions[t] = pos_dist(rng);
    slots[t] = static_cast<int32_t>((t * 7 + 3) % ((n_blocks - 1) * block_size));  // distinct for tokens < pool
  }
  slots[s.tokens / 2] = -1;  // a padding row
  DeviceBuffer d_kv = upload(kv_a), d_q = upload(q), d_w = upload(weight), d_f = upload(inv_freq),
               d_pos = upload(positions), d_slot = upload(slots);
  DeviceBuffer cache(static_cast<size_t>(n_blocks * block_size * entry)),
      q_lat(static_cast<size_t>(s.tokens * s.heads * width) * 2);
  cache.fill(0xFF);
  q_lat.fill(0xFF);
  const PagedLatentCache pc{.data = cache.as<uint16_t>(),
                            .n_blocks = n_blocks,
                            .block_size = block_size,
                            .kv_lora_rank = s.lora,
                            .rope_dim = s.rope,
                            .dtype = s.fp8 ? LatentCacheDtype::kFp8 : LatentCacheDtype::kBf16,
                            .pow2_scales = s.fp8 == LatentFp8Scales::kPow2};
  const auto status = mla_prepare(ctx, MlaPrepareArgs{.kv_a = d_kv.as<uint16_t>(),
                                                      .kv_a_stride = kv_stride,
                                                      .kv_norm_weight = d_w.as<uint16_t>(),
                                                      .eps = 1e-5f,
                                                      .q = d_q.as<uint16_t>(),
                                                      .q_stride = q_stride,
                                                      .q_latent = q_lat.as<uint16_t>(),
                                                      .positions = d_pos.as<int32_t>(),
                                                      .inv_freq = d_f.as<float>(),
                                                      .attention_factor = s.attention_factor,
                                                      .interleaved = s.interleaved,
                                                      .slot_mapping = d_slot.as<int32_t>(),
                                                      .cache = pc,
                                                      .tokens = s.tokens,
                                                      .n_heads = s.heads,
                                                      .nope_dim = s.nope});
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();
  const auto got_cache = download<uint8_t>(cache, static_cast<size_t>(n_blocks * block_size * entry));
  const auto got_q = download<uint16_t>(q_lat, static_cast<size_t>(s.tokens * s.heads * width));
  std::vector<bool> written(static_cast<size_t>(n_blocks * block_size), false);
  for (int64_t t = 0; t < s.tokens; ++t) {
    const std::string what = "token " + std::to_string(t);
    std::vector<double> x(static_cast<size_t>(s.rope)), y(static_cast<size_t>(s.rope));
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < s.rope; ++i) x[i] = bf(q[t * q_stride + h * (s.nope + s.rope) + s.nope + i]);
      rope_ref(x, y, s.rope, positions[t], inv_freq, s.interleaved, s.attention_factor);
      const int64_t base = (t * s.heads + h) * width;
      for (int64_t i = 0; i < s.lora; ++i) ASSERT_EQ(got_q[base + i], kPoison) << what << ": q_lat written";
      for (int64_t i = 0; i < s.rope; ++i) {
        expect_close(bf16_to_float(got_q[base + s.lora + i]), y[i], 1e-3, what + " q_pe head " + std::to_string(h));
      }
    }
    if (slots[t] < 0) continue;
    written[slots[t]] = true;
    double sq = 0;
    for (int64_t i = 0; i < s.lora; ++i) sq += bf(kv_a[t * kv_stride + i]) * bf(kv_a[t * kv_stride + i]);
    const double inv = 1.0 / std::sqrt(sq / s.lora + 1e-5);
    std::vector<double> c(static_cast<size_t>(s.lora));
    for (int64_t i = 0; i < s.lora; ++i) c[i] = bf(kv_a[t * kv_stride + i]) * inv * bf(weight[i]);
    for (int64_t i = 0; i < s.rope; ++i) x[i] = bf(kv_a[t * kv_stride + s.lora + i]);
    rope_ref(x, y, s.rope, positions[t], inv_freq, s.interleaved, s.attention_factor);
    const uint8_t* bytes = &got_cache[slots[t] * entry];
    if (s.fp8) {
      expect_fp8_entry(bytes, c, y, *s.fp8, what);
      continue;
    }
    std::vector<uint16_t> row(static_cast<size_t>(width));
    std::memcpy(row.data(), bytes, static_cast<size_t>(entry));
    for (int64_t i = 0; i < s.lora; ++i) expect_close(bf16_to_float(row[i]), c[i], 1e-3, what + " c");
    for (int64_t i = 0; i < s.rope; ++i) expect_close(bf16_to_float(row[s.lora + i]), y[i], 1e-3, what + " k_pe");
  }
  for (size_t slot = 0; slot < written.size(); ++slot) {
    if (written[slot]) continue;
    for (int64_t i = 0; i < entry; ++i) ASSERT_EQ(got_cache[slot * entry + i], 0xFF) << "slot " << slot;
  }
}

TEST(CudaMla, PrepareMatchesReference) {
  check_prepare({.tokens = 37, .heads = 16, .lora = 512, .rope = 64, .nope = 192, .interleaved = true}, 1);
  check_prepare({.tokens = 5, .heads = 16, .lora = 512, .rope = 64, .nope = 192, .interleaved = false}, 2);
  check_prepare({.tokens = 9, .heads = 4, .lora = 32, .rope = 16, .nope = 32, .interleaved = true}, 3);
  // DeepSeek's yarn with mscale != mscale_all_dim: cos and sin times their ratio.
  check_prepare({.tokens = 13, .heads = 16, .lora = 512, .rope = 64, .nope = 192, .interleaved = true,
                 .attention_factor = 1.24f}, 6);
}

TEST(CudaMla, PrepareWritesFp8Entries) {
  check_prepare({.tokens = 37, .heads = 16, .lora = 512, .rope = 64, .nope = 192, .interleaved = true,
                 .fp8 = LatentFp8Scales::kFp32}, 4);
  check_prepare({.tokens = 21, .heads = 8, .lora = 512, .rope = 64, .nope = 192, .interleaved = false,
                 .fp8 = LatentFp8Scales::kPow2}, 5);
}

// A batch of sequences over one paged latent cache: seq_lens[s] cached tokens (new ones included), n_q[s] query rows.
struct AttnCase {
  int64_t heads, lora, rope;
  std::vector<int64_t> seq_lens, n_q;
  int64_t topk;  // 0: causal
  int64_t splits = 0;  // MlaAttentionArgs::splits: 0 the launcher's rule, else forced
  bool fp8 = false;     // the cache in FP8 entries (core/latent_fp8.h, fp32 scales)
};

// A pool of random latent rows, in bf16 or as FP8 entries, and the values each holds (the reference's keys). FP8
// rows get tiles of magnitudes 1, 1/64 and 40 and one of zeros, so the scales differ across tiles and rows.
struct LatentPool {
  DeviceBuffer device;
  std::vector<double> values;  // [slots, width]
};

LatentPool random_pool(int64_t slots, int64_t lora, int64_t rope, bool fp8, std::mt19937& rng) {
  const int64_t width = lora + rope;
  LatentPool p{DeviceBuffer(), std::vector<double>(static_cast<size_t>(slots * width))};
  if (!fp8) {
    const auto pool = random_bf16(static_cast<size_t>(slots * width), rng, 1.0f);
    for (size_t i = 0; i < pool.size(); ++i) p.values[i] = bf(pool[i]);
    p.device = upload(pool);
    return p;
  }
  const int64_t entry = latent_fp8_bytes(lora, rope);
  std::vector<uint8_t> bytes(static_cast<size_t>(slots * entry));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const float tile_scale[] = {1.0f, 1.0f / 64, 40.0f, 0.0f};
  std::vector<float> c(static_cast<size_t>(lora)), pe(static_cast<size_t>(rope)), c_read(c.size()),
      pe_read(pe.size());
  for (int64_t slot = 0; slot < slots; ++slot) {
    const int64_t shift = slot % 4;
    for (int64_t i = 0; i < lora; ++i) c[i] = dist(rng) * tile_scale[(i / kLatentFp8Tile + shift) % 4];
    for (float& v : pe) v = dist(rng);
    latent_fp8_pack(c.data(), pe.data(), lora, rope, LatentFp8Scales::kFp32, &bytes[slot * entry]);
    latent_fp8_unpack(&bytes[slot * entry], lora, rope, c_read.data(), pe_read.data());
    std::copy(c_read.begin(), c_read.end(), p.values.begin() + slot * width);
    std::copy(pe_read.begin(), pe_read.end(), p.values.begin() + slot * width + lora);
  }
  p.device = upload(bytes);
  return p;
}

void check_attention(const AttnCase& c, uint64_t seed) {
  DeviceContext ctx;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int64_t width = c.lora + c.rope, block_size = 16, n_seqs = static_cast<int64_t>(c.seq_lens.size());
  int64_t max_blocks = 0, total_blocks = 0, tokens = 0;
  for (int64_t s = 0; s < n_seqs; ++s) {
    max_blocks = std::max(max_blocks, (c.seq_lens[s] + block_size - 1) / block_size);
    total_blocks += (c.seq_lens[s] + block_size - 1) / block_size;
    tokens += c.n_q[s];
  }
  // Blocks handed out in a shuffled order, so a sequence's blocks are scattered over the pool.
  const int64_t n_blocks = total_blocks + 3;
  std::vector<int32_t> order(n_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int32_t> tables(static_cast<size_t>(n_seqs * max_blocks), -1), query_start(n_seqs + 1, 0),
      seq_lens(n_seqs);
  int64_t next = 0;
  for (int64_t s = 0; s < n_seqs; ++s) {
    for (int64_t b = 0; b < (c.seq_lens[s] + block_size - 1) / block_size; ++b) tables[s * max_blocks + b] = order[next++];
    query_start[s + 1] = static_cast<int32_t>(query_start[s] + c.n_q[s]);
    seq_lens[s] = static_cast<int32_t>(c.seq_lens[s]);
  }
  const LatentPool pool = random_pool(n_blocks * block_size, c.lora, c.rope, c.fp8, rng);
  // Queries large enough for a peaked softmax (scores of several units).
  const auto q = random_bf16(static_cast<size_t>(tokens * c.heads * width), rng, 1.5f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(width));
  // Selections: per row a random ascending subset of its causal keys (all of them when they are at most topk), the
  // tail -1.
  std::vector<int32_t> selected;
  std::vector<int64_t> row_pos(tokens);
  for (int64_t s = 0; s < n_seqs; ++s) {
    for (int64_t i = 0; i < c.n_q[s]; ++i) row_pos[query_start[s] + i] = c.seq_lens[s] - c.n_q[s] + i;
  }
  if (c.topk > 0) {
    selected.assign(static_cast<size_t>(tokens * c.topk), -1);
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int32_t> keys(row_pos[t] + 1);
      std::iota(keys.begin(), keys.end(), 0);
      if (static_cast<int64_t>(keys.size()) > c.topk) {
        std::shuffle(keys.begin(), keys.end(), rng);
        keys.resize(c.topk);
        std::sort(keys.begin(), keys.end());
      }
      std::copy(keys.begin(), keys.end(), selected.begin() + t * c.topk);
    }
  }
  DeviceBuffer d_q = upload(q), d_tables = upload(tables), d_qs = upload(query_start),
               d_lens = upload(seq_lens), d_sel = upload(selected);
  DeviceBuffer out(static_cast<size_t>(tokens * c.heads * c.lora) * 2);
  out.fill(0xFF);
  const int64_t max_seq_len = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
  DeviceBuffer workspace(mla_attention_workspace_bytes(ctx.props(), c.lora));
  workspace.fill(0xFF);
  const auto status = mla_attention(ctx, MlaAttentionArgs{.q_latent = d_q.as<uint16_t>(),
                                                          .out_latent = out.as<uint16_t>(),
                                                          .cache = {.data = pool.device.data(),
                                                                    .n_blocks = n_blocks,
                                                                    .block_size = block_size,
                                                                    .kv_lora_rank = c.lora,
                                                                    .rope_dim = c.rope,
                                                                    .dtype = c.fp8 ? LatentCacheDtype::kFp8
                                                                                   : LatentCacheDtype::kBf16},
                                                          .block_tables = d_tables.as<int32_t>(),
                                                          .max_blocks_per_seq = max_blocks,
                                                          .query_start = d_qs.as<int32_t>(),
                                                          .seq_lens = d_lens.as<int32_t>(),
                                                          .n_seqs = n_seqs,
                                                          .tokens = tokens,
                                                          .n_heads = c.heads,
                                                          .selected = c.topk > 0 ? d_sel.as<int32_t>() : nullptr,
                                                          .topk = c.topk,
                                                          .scale = scale,
                                                          .max_seq_len = max_seq_len,
                                                          .workspace = workspace.data(),
                                                          .workspace_bytes = workspace.size_bytes(),
                                                          .splits = c.splits});
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();
  const auto got = download<uint16_t>(out, static_cast<size_t>(tokens * c.heads * c.lora));
  for (int64_t s = 0; s < n_seqs; ++s) {
    for (int64_t i = 0; i < c.n_q[s]; ++i) {
      const int64_t t = query_start[s] + i;
      std::vector<int64_t> keys;
      if (c.topk > 0) {
        for (int64_t j = 0; j < c.topk && selected[t * c.topk + j] >= 0; ++j) keys.push_back(selected[t * c.topk + j]);
      } else {
        for (int64_t p = 0; p <= row_pos[t]; ++p) keys.push_back(p);
      }
      for (int64_t h = 0; h < c.heads; ++h) {
        const uint16_t* qh = &q[(t * c.heads + h) * width];
        std::vector<double> score(keys.size()), o(static_cast<size_t>(c.lora), 0.0);
        double mx = -INFINITY, sum = 0;
        for (size_t j = 0; j < keys.size(); ++j) {
          const int64_t slot = tables[s * max_blocks + keys[j] / block_size] * block_size + keys[j] % block_size;
          double dot = 0;
          for (int64_t d = 0; d < width; ++d) dot += bf(qh[d]) * pool.values[slot * width + d];
          score[j] = dot * scale;
          mx = std::max(mx, score[j]);
        }
        double cmax = 0;
        for (size_t j = 0; j < keys.size(); ++j) {
          const double p = std::exp(score[j] - mx);
          sum += p;
          const int64_t slot = tables[s * max_blocks + keys[j] / block_size] * block_size + keys[j] % block_size;
          for (int64_t d = 0; d < c.lora; ++d) {
            o[d] += p * pool.values[slot * width + d];
            cmax = std::max(cmax, std::abs(pool.values[slot * width + d]));
          }
        }
        for (int64_t d = 0; d < c.lora; ++d) {
          // fp32 scores of 576-term sums: an absolute error of ~1e-5 relative to the score magnitude moves the
          // weights by as much; 2e-3 of the values' range covers it with room.
          expect_close(bf16_to_float(got[(t * c.heads + h) * c.lora + d]), o[d] / sum, 2e-3 * cmax,
                       "seq " + std::to_string(s) + " row " + std::to_string(i) + " head " + std::to_string(h) +
                           " dim " + std::to_string(d));
        }
      }
    }
  }
}

TEST(CudaMla, CausalAttentionMatchesReference) {
  // GLM-5's latent at 16 heads (two blocks of heads) and at 12 (a partial group); decode rows, a prefill chunk
  // continuing a cached prefix, a one-token sequence, a sequence of 300.
  check_attention({.heads = 16, .lora = 512, .rope = 64, .seq_lens = {1, 300, 45, 77}, .n_q = {1, 1, 45, 20}}, 11);
  check_attention({.heads = 12, .lora = 512, .rope = 64, .seq_lens = {130, 3}, .n_q = {1, 3}}, 12);
  check_attention({.heads = 4, .lora = 32, .rope = 16, .seq_lens = {33, 5, 17}, .n_q = {33, 1, 4}}, 13);
  // One long decode row (split over many key ranges) and a 200-row prefill (enough blocks for one range).
  check_attention({.heads = 8, .lora = 512, .rope = 64, .seq_lens = {5000}, .n_q = {1}}, 14);
  check_attention({.heads = 16, .lora = 512, .rope = 64, .seq_lens = {260}, .n_q = {200}}, 15);
  // GLM-5's 64 heads on one GPU (four head groups) over a long decode row, and 20 heads (a partial second group).
  check_attention({.heads = 64, .lora = 512, .rope = 64, .seq_lens = {2100, 7}, .n_q = {1, 1}}, 16);
  check_attention({.heads = 20, .lora = 512, .rope = 64, .seq_lens = {700, 64}, .n_q = {1, 2}}, 17);
  // Split counts forced past the rule's: 128 ranges of a 5000-key row (two 32-key tiles each, the last 49 ranges
  // empty), one range, and 64 ranges of a DSA selection; the combine must give the same attention.
  check_attention({.heads = 8, .lora = 512, .rope = 64, .seq_lens = {5000}, .n_q = {1}, .topk = 0, .splits = 128}, 18);
  check_attention({.heads = 8, .lora = 512, .rope = 64, .seq_lens = {5000}, .n_q = {1}, .topk = 0, .splits = 1}, 19);
  check_attention({.heads = 16, .lora = 512, .rope = 64, .seq_lens = {3000}, .n_q = {1}, .topk = 2048, .splits = 64},
                  20);
  // A latent narrower than a combine block's 128 columns, split 8 ways (three 32-key tiles a range).
  check_attention({.heads = 4, .lora = 32, .rope = 16, .seq_lens = {700}, .n_q = {1}, .topk = 0, .splits = 8}, 21);
}

// The FP8 cache (GLM-5's 656-byte entries): decode rows, a prefill continuing a cached prefix, partial head groups,
// split and unsplit key ranges, a DSA selection; the keys are the entries' values, the output as with bf16 keys.
TEST(CudaMla, Fp8CacheAttentionMatchesReference) {
  check_attention({.heads = 16, .lora = 512, .rope = 64, .seq_lens = {1, 300, 45, 77}, .n_q = {1, 1, 45, 20},
                   .topk = 0, .splits = 0, .fp8 = true}, 31);
  check_attention({.heads = 20, .lora = 512, .rope = 64, .seq_lens = {700, 64}, .n_q = {1, 2}, .topk = 0, .splits = 0,
                   .fp8 = true}, 32);
  check_attention({.heads = 8, .lora = 512, .rope = 64, .seq_lens = {5000}, .n_q = {1}, .topk = 0, .splits = 1,
                   .fp8 = true}, 33);
  check_attention({.heads = 16, .lora = 512, .rope = 64, .seq_lens = {3000, 40}, .n_q = {1, 40}, .topk = 2048,
                   .splits = 0, .fp8 = true}, 34);
  check_attention({.heads = 64, .lora = 512, .rope = 32, .seq_lens = {2100, 7}, .n_q = {1, 1}, .topk = 0, .splits = 0,
                   .fp8 = true}, 35);
}

// Sequences of one token: the softmax weight is exactly 1, so each head's output is the key's c as the FP8 entry
// holds it, bit for bit (core/latent_fp8.h's values, bf16-exact). Tiles of ordinary values, of values spanning 2^-19
// to 1 (subnormal codes), of 1e5 (scales past 2^7) and of 1/64; a NaN value makes its row's output NaN.
TEST(CudaMla, Fp8CacheReadsBackItsEntries) {
  DeviceContext ctx;
  constexpr int64_t kSeqs = 40, kHeads = 16, kLora = 512, kRope = 64, kWidth = kLora + kRope, kNanRow = 5;
  const int64_t entry = latent_fp8_bytes(kLora, kRope);
  std::mt19937 rng(41);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint8_t> bytes(static_cast<size_t>(kSeqs * entry));
  std::vector<float> values(static_cast<size_t>(kSeqs * kWidth));
  for (int64_t r = 0; r < kSeqs; ++r) {
    std::vector<float> c(kLora), pe(kRope);
    for (int64_t i = 0; i < kLora; ++i) {
      const float x = normal(rng);
      const int64_t tile = (i / kLatentFp8Tile + r) % 4;
      c[i] = tile == 0 ? x : tile == 1 ? std::ldexp(x < 0 ? -1.0f : 1.0f, -static_cast<int>(i % 20))
                       : tile == 2 ? 1e5f * x : x / 64;
    }
    for (float& v : pe) v = normal(rng);
    if (r == kNanRow) c[7] = std::nanf("");
    latent_fp8_pack(c.data(), pe.data(), kLora, kRope, LatentFp8Scales::kFp32, &bytes[r * entry]);
    latent_fp8_unpack(&bytes[r * entry], kLora, kRope, &values[r * kWidth], &values[r * kWidth + kLora]);
  }
  std::vector<int32_t> tables(kSeqs), query_start(kSeqs + 1), seq_lens(kSeqs, 1);
  std::iota(query_start.begin(), query_start.end(), 0);
  for (int64_t r = 0; r < kSeqs; ++r) tables[r] = static_cast<int32_t>(r);  // block r of 16 slots holds token r
  std::vector<uint8_t> pool(static_cast<size_t>(kSeqs * 16 * entry), 0xFF);
  for (int64_t r = 0; r < kSeqs; ++r) std::copy_n(&bytes[r * entry], entry, &pool[r * 16 * entry]);
  const auto q = random_bf16(static_cast<size_t>(kSeqs * kHeads * kWidth), rng, 0.01f);
  DeviceBuffer d_pool = upload(pool), d_q = upload(q), d_tables = upload(tables), d_qs = upload(query_start),
               d_lens = upload(seq_lens), out(static_cast<size_t>(kSeqs * kHeads * kLora) * 2),
               workspace(mla_attention_workspace_bytes(ctx.props(), kLora));
  out.fill(0xFF);
  const auto status = mla_attention(ctx, MlaAttentionArgs{.q_latent = d_q.as<uint16_t>(),
                                                          .out_latent = out.as<uint16_t>(),
                                                          .cache = {.data = d_pool.data(),
                                                                    .n_blocks = kSeqs,
                                                                    .block_size = 16,
                                                                    .kv_lora_rank = kLora,
                                                                    .rope_dim = kRope,
                                                                    .dtype = LatentCacheDtype::kFp8},
                                                          .block_tables = d_tables.as<int32_t>(),
                                                          .max_blocks_per_seq = 1,
                                                          .query_start = d_qs.as<int32_t>(),
                                                          .seq_lens = d_lens.as<int32_t>(),
                                                          .n_seqs = kSeqs,
                                                          .tokens = kSeqs,
                                                          .n_heads = kHeads,
                                                          .scale = 0.05f,
                                                          .max_seq_len = 1,
                                                          .workspace = workspace.data(),
                                                          .workspace_bytes = workspace.size_bytes()});
  ASSERT_TRUE(status.has_value()) << status.error().message;
  ctx.synchronize();
  const auto got = download<uint16_t>(out, static_cast<size_t>(kSeqs * kHeads * kLora));
  for (int64_t r = 0; r < kSeqs; ++r) {
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t i = 0; i < kLora; ++i) {
        const float v = bf16_to_float(got[(r * kHeads + h) * kLora + i]);
        if (r == kNanRow) {
          ASSERT_TRUE(std::isnan(v)) << "head " << h << " value " << i;
        } else {
          ASSERT_EQ(v, values[r * kWidth + i]) << "row " << r << " head " << h << " value " << i;
        }
      }
    }
  }
}

TEST(CudaMla, RowsFindTheirSequenceAmongMany) {
  // 300 decode sequences (a block finds its row's sequence 256 entries of query_start at a time), of lengths 1-40,
  // and a prefill of 5 rows among them; causal and over selections of at most 9 keys.
  AttnCase c{.heads = 4, .lora = 32, .rope = 16, .seq_lens = {}, .n_q = {}, .topk = 0};
  for (int64_t s = 0; s < 300; ++s) {
    c.seq_lens.push_back(1 + (s * 7) % 40);
    c.n_q.push_back(s == 270 ? std::min<int64_t>(5, c.seq_lens.back()) : 1);
  }
  check_attention(c, 22);
  c.topk = 9;
  check_attention(c, 23);
}

TEST(CudaMla, SplitCountsCoverTheShapes) {
  DeviceContext ctx;
  const DeviceProps& p = ctx.props();
  constexpr int64_t kWidth = 576;  // GLM-5's latent
  EXPECT_GT(mla_attention_splits(p, 1, 8, 5000, kWidth), 1);  // one block alone would leave the GPU idle
  EXPECT_EQ(mla_attention_splits(p, 1, 8, kMlaMinKeysPerSplit, kWidth), 1);  // too few keys to split
  EXPECT_EQ(mla_attention_splits(p, 200, 16, 260, kWidth), 1);               // rows x groups fill the SMs
  for (int64_t tokens : {1, 3, 17, 64}) {
    for (int64_t heads : {4, 8, 64}) {
      const int64_t groups = (heads + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock;
      const int64_t splits = mla_attention_splits(p, tokens, heads, 131072, kWidth);
      if (splits > 1) {
        EXPECT_LT(tokens * groups * splits, 3 * p.num_sms) << tokens << " rows, " << heads << " heads";
        // One wave: every block resident at once (at most two per SM).
        EXPECT_LE(tokens * groups * splits, 2 * p.num_sms) << tokens << " rows, " << heads << " heads";
      }
    }
  }
  // An SM that holds one block of this latent (sm_120's 100 KiB of shared memory per SM) gets half the ranges.
  DeviceProps one = p;
  one.shared_mem_per_sm = 100 * 1024;
  EXPECT_LE(64 * mla_attention_splits(one, 64, 8, 4096, kWidth), one.num_sms);
  EXPECT_GE(64 * mla_attention_splits(p, 64, 8, 4096, kWidth), 64 * mla_attention_splits(one, 64, 8, 4096, kWidth));
}

TEST(CudaMla, SelectedAttentionMatchesReference) {
  // DSA: rows with more causal keys than topk attend a subset; rows with fewer attend all, with a -1 tail.
  check_attention({.heads = 16, .lora = 512, .rope = 64, .seq_lens = {600, 40, 90}, .n_q = {1, 40, 30}, .topk = 64},
                  21);
  check_attention({.heads = 4, .lora = 32, .rope = 16, .seq_lens = {33, 20}, .n_q = {33, 2}, .topk = 16}, 22);
}

TEST(CudaMla, BadArgumentsAreErrors) {
  DeviceContext ctx;
  DeviceBuffer buf(1 << 20);
  MlaAttentionArgs a{.q_latent = buf.as<uint16_t>(),
                     .out_latent = buf.as<uint16_t>(),
                     .cache = {.data = buf.as<uint16_t>(), .n_blocks = 4, .block_size = 16, .kv_lora_rank = 512,
                               .rope_dim = 64},
                     .block_tables = buf.as<int32_t>(),
                     .max_blocks_per_seq = 1,
                     .query_start = buf.as<int32_t>(),
                     .seq_lens = buf.as<int32_t>(),
                     .n_seqs = 1,
                     .tokens = 1,
                     .n_heads = 8,
                     .scale = 0.1f,
                     .max_seq_len = 16};
  auto bad = a;
  bad.cache.block_size = 24;
  auto r = mla_attention(ctx, bad);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("block_size=24 must be a power of two"), std::string::npos) << r.error().message;
  bad = a;
  bad.cache.kv_lora_rank = 1024;
  r = mla_attention(ctx, bad);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("kv_lora_rank=1024"), std::string::npos) << r.error().message;
  bad = a;
  bad.cache.rope_dim = 40;  // even, but not whole k16 steps of the tensor-core tiles
  r = mla_attention(ctx, bad);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("rope_dim=40 must be a multiple of 16"), std::string::npos) << r.error().message;
  bad = a;
  bad.cache.kv_lora_rank = 256;
  bad.cache.dtype = LatentCacheDtype::kFp8;
  r = mla_attention(ctx, bad);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("an FP8 latent cache needs kv_lora_rank 512 and rope_dim at most 64"),
            std::string::npos)
      << r.error().message;
  MlaPrepareArgs p{.kv_a = buf.as<uint16_t>(),
                   .kv_a_stride = 500,
                   .kv_norm_weight = buf.as<uint16_t>(),
                   .q = buf.as<uint16_t>(),
                   .q_stride = 4096,
                   .q_latent = buf.as<uint16_t>(),
                   .positions = buf.as<int32_t>(),
                   .inv_freq = buf.as<float>(),
                   .slot_mapping = buf.as<int32_t>(),
                   .cache = a.cache,
                   .tokens = 1,
                   .n_heads = 8,
                   .nope_dim = 192};
  r = mla_prepare(ctx, p);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("kv_a_stride=500 is less than"), std::string::npos) << r.error().message;
}

}  // namespace
}  // namespace tern
