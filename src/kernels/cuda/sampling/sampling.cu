// Token sampling on the GPU; contract in sampling_launch.h. One 512-thread block owns a row and walks it several
// times: the first walk reads it from memory (status, max, log-sum-exp, penalised argmax), later walks mostly hit
// the L2. With few rows, one block per row would leave most SMs idle for the first walk (a single warp per SM is
// bound by the latency of each thread's long serial walk), so a first kernel (sampling_partials.cu) spreads it over
// kSampleSplitBlocks one-warp blocks per row: kSampleSlotsPerThread slots per thread of the row's block, slot s taking
// the 16-byte groups s, s + 4096, ...; each thread of the row's block merges its slots (together exactly the ids of
// its own walk) before the block combines the threads. The double sums then add in another order than the unsplit walk
// (both are compared with the CPU Sampler's fp64 sum within the same tolerance). Nothing is sorted: thresholds come
// from three-digit radix selects (11 + 11 + 10 bits) over an order-preserving integer key, counted or weighted by the
// fixed-point mass, and searches in id order (the top_p boundary among equal weights, the draw itself, the lowest ids
// of a logprob tie) from per-chunk sums.
#include <cuda_runtime.h>
#include "kernels/cuda/module_attributes.h"

#include <cmath>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/sampling/sampling_launch.h"
#include "kernels/cuda/sampling/sampling_walk.cuh"

namespace tern {
namespace {

using u64 = unsigned long long;  // the type atomicAdd and the shuffles take
using cuda_common::warp_sum;

constexpr int kLoadBatch = 4;  // 16-byte loads a thread has in flight in a walk
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr float kGreedyTemperature = 1e-5f;  // kernels/cpu/sampler.h kSamplingGreedyTemperature

struct Crossing {
  int64_t index;  // first item whose inclusive prefix exceeds the target, -1 if none
  u64 rest;       // target minus the items before it: 0 <= rest < weight of the item
};

struct Scratch {
  u64 u64s[kWarps];
  double f64s[kWarps];
  float f32s[kWarps];
  int32_t i32s[kWarps];
  Crossing cross;
  int32_t result;
  int32_t top_count;
  int32_t top_ids[kSampleMaxTopLogprobs];
  float top_values[kSampleMaxTopLogprobs];
};
static_assert(sizeof(Scratch) <= kSampleStaticSharedBytes);

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & 31; }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x) >> 5; }

// ---------------------------------------------------------------------------------------------------------------
// Keys and penalties.

// Order-preserving map of a finite float to uint32; -0 is made +0 first so that key equality is float equality
// (the CPU compares floats, where -0 == +0).
__device__ __forceinline__ uint32_t float_key(float x) {
  uint32_t bits = __float_as_uint(x);
  if ((bits << 1) == 0) bits = 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float key_float(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// The CPU's float operations one by one (no contraction into FMAs): x / p for positive logits, x * p otherwise.
__device__ __forceinline__ float penalise_repetition(float x, float penalty) {
  return x > 0.0f ? __fdiv_rn(x, penalty) : __fmul_rn(x, penalty);
}

// `logit -= frequency * count`, then `logit -= presence`, as two roundings each like the CPU.
__device__ __forceinline__ float penalise_counts(float x, int32_t count, float frequency, float presence) {
  return __fsub_rn(__fsub_rn(x, __fmul_rn(frequency, static_cast<float>(count))), presence);
}

// One row: the raw bf16 values and, when a penalty is active, the bitmap of penalised ids (shared memory) with
// their output counts (workspace) from which a penalised logit is recomputed wherever it is needed.
struct RowView {
  const uint16_t* raw;
  int64_t vocab;
  bool vectorised;         // raw is 16-byte aligned
  const uint32_t* listed;  // null when no penalty is active
  const int32_t* counts;
  float repetition, frequency, presence;

  __device__ float raw_at(int64_t id) const { return cuda_common::bf16_to_f32(raw[id]); }

  __device__ float value(int64_t id, float x) const {
    if (listed == nullptr || ((listed[id >> 5] >> (id & 31)) & 1u) == 0) return x;
    if (repetition != 1.0f) x = penalise_repetition(x, repetition);
    const int32_t count = __ldcg(counts + id);
    return count > 0 ? penalise_counts(x, count, frequency, presence) : x;
  }
};

// f(id, raw value) for every id of the row, spread over the block; 16-byte loads where the row is aligned. Thread
// t sees, in this order, the 16-byte groups t, t + kThreads, t + 2 kThreads, ... (kLoadBatch of them loaded at a
// time), then the ids t, t + kThreads, ... of the tail past the last whole group; unaligned rows, the ids t,
// t + kThreads, ... The first walk's sums depend on this order: sample_partials_kernel repeats it exactly.
template <class F>
__device__ __forceinline__ void row_for_each(const RowView& v, F&& f) {
  int64_t start = 0;
  if (v.vectorised) {
    const int64_t n_vec = v.vocab / 8;
    const uint4* p = reinterpret_cast<const uint4*>(v.raw);
    for (int64_t c0 = threadIdx.x; c0 < n_vec; c0 += kThreads * kLoadBatch) {
      uint4 q[kLoadBatch];
#pragma unroll
      for (int b = 0; b < kLoadBatch; ++b) {
        const int64_t c = c0 + b * kThreads;
        q[b] = c < n_vec ? p[c] : uint4{0, 0, 0, 0};
      }
#pragma unroll
      for (int b = 0; b < kLoadBatch; ++b) {
        const int64_t c = c0 + b * kThreads;
        if (c < n_vec) group_for_each(c, q[b], f);
      }
    }
    start = n_vec * 8;
  }
  for (int64_t id = start + threadIdx.x; id < v.vocab; id += kThreads) f(id, v.raw_at(id));
}

// ---------------------------------------------------------------------------------------------------------------
// Block reductions and scans. Each starts with a barrier so that the scratch it writes is no longer being read by
// a previous call, and returns the block-wide result to every thread.

__device__ u64 warp_inclusive_scan(u64 v) {
  for (int o = 1; o < 32; o <<= 1) {
    const u64 t = __shfl_up_sync(kFullMask, v, o);
    if (lane_id() >= o) v += t;
  }
  return v;
}

__device__ u64 block_sum(u64 v, Scratch& s) {
  v = warp_sum(v);
  __syncthreads();
  if (lane_id() == 0) s.u64s[warp_id()] = v;
  __syncthreads();
  u64 total = 0;
  for (int w = 0; w < kWarps; ++w) total += s.u64s[w];
  return total;
}

__device__ double block_sum(double v, Scratch& s) {
  v = warp_sum(v);
  __syncthreads();
  if (lane_id() == 0) s.f64s[warp_id()] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kWarps; ++w) total += s.f64s[w];
  return total;
}

__device__ float block_max(float v, Scratch& s) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  __syncthreads();
  if (lane_id() == 0) s.f32s[warp_id()] = v;
  __syncthreads();
  float m = s.f32s[0];
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, s.f32s[w]);
  return m;
}

__device__ int32_t block_min(int32_t v, Scratch& s) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kFullMask, v, o));
  __syncthreads();
  if (lane_id() == 0) s.i32s[warp_id()] = v;
  __syncthreads();
  int32_t m = s.i32s[0];
  for (int w = 1; w < kWarps; ++w) m = min(m, s.i32s[w]);
  return m;
}

__device__ Best block_best(Best b, Scratch& s) {
  for (int o = 16; o > 0; o >>= 1) {
    const Best other{__shfl_xor_sync(kFullMask, b.value, o), __shfl_xor_sync(kFullMask, b.id, o)};
    if (better(other, b)) b = other;
  }
  __syncthreads();
  if (lane_id() == 0) {
    s.f32s[warp_id()] = b.value;
    s.i32s[warp_id()] = b.id;
  }
  __syncthreads();
  Best best{s.f32s[0], s.i32s[0]};
  for (int w = 1; w < kWarps; ++w) {
    const Best other{s.f32s[w], s.i32s[w]};
    if (better(other, best)) best = other;
  }
  return best;
}

// Sum of v over the threads before this one.
__device__ u64 block_exclusive_scan(u64 v, Scratch& s) {
  const u64 inclusive = warp_inclusive_scan(v);
  __syncthreads();
  if (lane_id() == 31) s.u64s[warp_id()] = inclusive;
  __syncthreads();
  u64 before = 0;
  for (int w = 0; w < warp_id(); ++w) before += s.u64s[w];
  return before + inclusive - v;
}

// Over n items in a fixed order with weights get(q), the first item whose inclusive prefix exceeds `target`. Each
// thread sums a contiguous range of items, a block scan places the ranges, and the thread whose range holds the
// crossing walks it.
template <class Get>
__device__ Crossing block_find_crossing(int64_t n, u64 target, Get&& get, Scratch& s) {
  const int64_t per = (n + kThreads - 1) / kThreads;
  const int64_t lo = min(n, static_cast<int64_t>(threadIdx.x) * per), hi = min(n, lo + per);
  u64 local = 0;
  for (int64_t q = lo; q < hi; ++q) local += get(q);
  if (threadIdx.x == 0) s.cross = Crossing{-1, 0};  // ordered before the write below by the scan's barriers
  const u64 before = block_exclusive_scan(local, s);
  if (before <= target && target - before < local) {
    u64 rest = target - before;
    for (int64_t q = lo; q < hi; ++q) {
      const u64 w = get(q);
      if (rest < w) {
        s.cross = Crossing{q, rest};
        break;
      }
      rest -= w;
    }
  }
  __syncthreads();
  const Crossing c = s.cross;
  __syncthreads();  // the caller may reuse what get() read once every thread has the answer
  return c;
}

// ---------------------------------------------------------------------------------------------------------------
// Selections.

struct RadixResult {
  uint32_t key;
  u64 rest;  // the target's offset among the items whose key equals `key`
  bool found;
};

// Descending weighted radix select: with items ordered by key from the largest, the key of the item whose inclusive
// weight prefix first exceeds `target`. key_mass(id, raw, key&) returns the item's weight (0 = not an item).
template <class KeyMass>
__device__ RadixResult radix_select_desc(const RowView& v, u64 target, KeyMass&& key_mass, u64* hist, Scratch& s) {
  uint32_t prefix = 0, mask = 0;
  bool found = true;
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
    const uint32_t bins = pass == 2 ? 1024u : 2048u;
    for (uint32_t b = threadIdx.x; b < bins; b += kThreads) hist[b] = 0;
    __syncthreads();
    row_for_each(v, [&](int64_t id, float x) {
      uint32_t key;
      const u64 m = key_mass(id, x, key);
      if (m != 0 && (key & mask) == prefix) atomicAdd(&hist[(key >> shift) & (bins - 1)], m);
    });
    __syncthreads();
    Crossing c = block_find_crossing(bins, target, [&](int64_t q) { return hist[bins - 1 - q]; }, s);
    if (c.index < 0) {
      found = false;
      c = Crossing{0, 0};
    }
    prefix |= (bins - 1 - static_cast<uint32_t>(c.index)) << shift;
    mask |= (bins - 1) << shift;
    target = c.rest;
  }
  return {prefix, target, found};
}

template <class Mass>
__device__ u64 lane_masses(const RowView& v, int64_t chunk, Mass& mass, u64 (&m)[4]) {
  const int64_t base = chunk * kSampleChunkIds + lane_id() * 4;
  u64 sum = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    m[j] = base + j < v.vocab ? mass(base + j, v.raw_at(base + j)) : 0;
    sum += m[j];
  }
  return sum;
}

// The first id whose inclusive prefix of mass(id, raw) in id order exceeds `target`, or -1: chunk sums of 128 ids
// (one warp each), a block-wide search over the chunks, then one warp inside the chunk.
template <class Mass>
__device__ int32_t ordered_select(const RowView& v, u64 target, Mass&& mass, u64* chunk_sums, Scratch& s) {
  const int64_t n_chunks = (v.vocab + kSampleChunkIds - 1) / kSampleChunkIds;
  for (int64_t c = warp_id(); c < n_chunks; c += kWarps) {
    u64 m[4];
    const u64 sum = warp_sum(lane_masses(v, c, mass, m));
    if (lane_id() == 0) __stcg(chunk_sums + c, sum);
  }
  if (threadIdx.x == 0) s.result = -1;
  __syncthreads();
  const Crossing c = block_find_crossing(n_chunks, target, [&](int64_t q) { return __ldcg(chunk_sums + q); }, s);
  if (c.index >= 0 && warp_id() == 0) {
    u64 m[4];
    const u64 own = lane_masses(v, c.index, mass, m);
    const u64 inclusive = warp_inclusive_scan(own);
    const u64 before = inclusive - own;
    if (before <= c.rest && c.rest - before < own) {
      u64 rest = c.rest - before;
      for (int j = 0; j < 4; ++j) {
        if (rest < m[j]) {
          s.result = static_cast<int32_t>(c.index * kSampleChunkIds + lane_id() * 4 + j);
          break;
        }
        rest -= m[j];
      }
    }
  }
  __syncthreads();
  const int32_t id = s.result;
  __syncthreads();
  return id;
}

// ---------------------------------------------------------------------------------------------------------------
// The random path: which tokens are kept and with what mass.

struct KeepRule {
  float max;          // of the penalised row
  float temperature;
  float min_p;
  float mass_scale;   // 2^(62 - bit_width(vocab))
  float threshold;    // top_k: the k-th largest penalised logit, or -inf
  bool top_p;
  uint32_t boundary_bits;  // top_p: the boundary token's weight (as bits) and id
  int32_t boundary_id;

  // The CPU's candidate test: logit >= threshold, weight >= min_p, mass > 0. `w` is the weight.
  __device__ u64 candidate(float x, float& w) const {
    w = 0.0f;
    if (x < threshold) return 0;
    w = expf(__fdiv_rn(__fsub_rn(x, max), temperature));
    if (!(w >= min_p)) return 0;
    return __float2ull_rz(__fmul_rn(w, mass_scale));
  }

  // Mass after top_p: candidates at least as probable as the boundary (weight, then lower id).
  __device__ u64 kept(int64_t id, float x) const {
    float w;
    const u64 m = candidate(x, w);
    if (m == 0 || !top_p) return m;
    const uint32_t bits = __float_as_uint(w);
    return bits > boundary_bits || (bits == boundary_bits && id <= boundary_id) ? m : 0;
  }
};

struct RowContext {
  const RowView& v;
  const SamplingRow& params;
  u64* hist;
  u64* chunk_sums;
  Scratch& s;
};

// top_k's threshold: the k-th largest penalised logit counting repeats (ties with it stay, as on the CPU).
__device__ float top_k_threshold(const RowContext& r) {
  const RowView& v = r.v;
  const auto count = [&](int64_t id, float x, uint32_t& key) -> u64 {
    key = float_key(v.value(id, x));
    return 1;
  };
  const RadixResult k = radix_select_desc(v, static_cast<u64>(r.params.top_k - 1), count, r.hist, r.s);
  return key_float(k.key);
}

// top_p: the smallest set of most probable candidates (weight descending, then id ascending) whose mass reaches
// ceil(top_p * total). Sets the boundary in `keep` and returns the kept mass, or 0 if a search failed.
__device__ u64 top_p_apply(const RowContext& r, KeepRule& keep, u64 total) {
  const RowView& v = r.v;
  const double wanted = ceil(static_cast<double>(r.params.top_p) * static_cast<double>(total));
  const u64 need = min(max(static_cast<u64>(wanted), u64{1}), total);
  const auto by_weight = [&](int64_t id, float x, uint32_t& key) -> u64 {
    float w;
    const u64 m = keep.candidate(v.value(id, x), w);
    key = __float_as_uint(w);
    return m;
  };
  const RadixResult b = radix_select_desc(v, need - 1, by_weight, r.hist, r.s);
  const u64 mass_each = __float2ull_rz(__fmul_rn(__uint_as_float(b.key), keep.mass_scale));
  if (!b.found || mass_each == 0) return 0;
  // Tokens of equal weight have equal mass and are taken in id order: the boundary is the (j + 1)-th of them.
  const u64 j = b.rest / mass_each;
  const auto same_weight = [&](int64_t id, float x) -> u64 {
    float w;
    return keep.candidate(v.value(id, x), w) != 0 && __float_as_uint(w) == b.key ? 1 : 0;
  };
  const int32_t boundary = ordered_select(v, j, same_weight, r.chunk_sums, r.s);
  if (boundary < 0) return 0;
  keep.top_p = true;
  keep.boundary_bits = b.key;
  keep.boundary_id = boundary;
  return (need - 1 - b.rest) + (j + 1) * mass_each;  // heavier tokens plus j + 1 of the boundary weight
}

// The sampled id, or -1 if a search failed.
__device__ int32_t sample_random(const RowContext& r, float row_max, float mass_scale) {
  const RowView& v = r.v;
  const SamplingRow& p = r.params;
  KeepRule keep{row_max, p.temperature, p.min_p, mass_scale, -INFINITY, false, 0, 0};
  if (p.top_k > 0 && p.top_k < v.vocab) keep.threshold = top_k_threshold(r);
  u64 local = 0;
  row_for_each(v, [&](int64_t id, float x) {
    float w;
    local += keep.candidate(v.value(id, x), w);
  });
  u64 total = block_sum(local, r.s);  // >= the best token's mass, which is > 0
  if (p.top_p < 1.0f) total = top_p_apply(r, keep, total);
  if (total == 0) return -1;
  // Inverse CDF over the kept tokens in id order, with the CPU's integer target.
  const u64 target = min(total - 1, static_cast<u64>(p.uniform * static_cast<double>(total)));
  return ordered_select(v, target, [&](int64_t id, float x) { return keep.kept(id, v.value(id, x)); }, r.chunk_sums,
                        r.s);
}

// ---------------------------------------------------------------------------------------------------------------
// Outputs.

__device__ float raw_logprob(float x, float max, double log_sum) {
  return static_cast<float>(static_cast<double>(x) - static_cast<double>(max) - log_sum);
}

__device__ void write_failed_row(const SampleArgs& a, int64_t row, int32_t status) {
  const float nan = __int_as_float(0x7FC00000);
  if (threadIdx.x == 0) {
    a.out_status[row] = status;
    a.out_id[row] = -1;
    a.out_logprob[row] = nan;
  }
  if (threadIdx.x < kSampleMaxTopLogprobs) {
    a.out_top_ids[row * kSampleMaxTopLogprobs + threadIdx.x] = -1;
    a.out_top_logprobs[row * kSampleMaxTopLogprobs + threadIdx.x] = nan;
  }
}

// The n highest raw logits (ties to the lower id), highest first: the n-th largest key by a counting radix select,
// the lowest ids among its ties by an ordered search, then at most 20 tokens sorted by one thread.
__device__ void write_top_logprobs(const RowContext& r, const SampleArgs& a, int64_t row, float row_max,
                                   double log_sum) {
  const RowView& v = r.v;
  const int32_t wanted = max(0, min(r.params.n_logprobs, kSampleMaxTopLogprobs));
  const int32_t n = v.vocab < wanted ? static_cast<int32_t>(v.vocab) : wanted;
  if (n > 0) {
    const auto count = [&](int64_t, float x, uint32_t& key) -> u64 {
      key = float_key(x);
      return 1;
    };
    const RadixResult nth = radix_select_desc(v, static_cast<u64>(n - 1), count, r.hist, r.s);
    const int32_t last_tie = ordered_select(
        v, nth.rest, [&](int64_t, float x) -> u64 { return float_key(x) == nth.key ? 1 : 0; }, r.chunk_sums, r.s);
    if (threadIdx.x == 0) r.s.top_count = 0;
    __syncthreads();
    row_for_each(v, [&](int64_t id, float x) {
      const uint32_t key = float_key(x);
      if (key > nth.key || (key == nth.key && id <= last_tie)) {
        const int slot = atomicAdd(&r.s.top_count, 1);
        if (slot < kSampleMaxTopLogprobs) {
          r.s.top_ids[slot] = static_cast<int32_t>(id);
          r.s.top_values[slot] = x;
        }
      }
    });
    __syncthreads();
    if (threadIdx.x == 0) {
      const int m = min(r.s.top_count, kSampleMaxTopLogprobs);
      for (int i = 1; i < m; ++i) {  // insertion sort, highest first, ties to the lower id
        const Best item{r.s.top_values[i], r.s.top_ids[i]};
        int j = i;
        for (; j > 0 && better(item, Best{r.s.top_values[j - 1], r.s.top_ids[j - 1]}); --j) {
          r.s.top_values[j] = r.s.top_values[j - 1];
          r.s.top_ids[j] = r.s.top_ids[j - 1];
        }
        r.s.top_values[j] = item.value;
        r.s.top_ids[j] = item.id;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x < kSampleMaxTopLogprobs) {
    const int i = static_cast<int>(threadIdx.x);
    const bool used = i < n;
    a.out_top_ids[row * kSampleMaxTopLogprobs + i] = used ? r.s.top_ids[i] : -1;
    a.out_top_logprobs[row * kSampleMaxTopLogprobs + i] = used ? raw_logprob(r.s.top_values[i], row_max, log_sum) : -INFINITY;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The kernel.

// The row's active slice of penalty_ids: prompt ids only when the repetition penalty is active (as on the CPU),
// with prompt_end clamped into [penalty_begin, penalty_end].
struct PenaltyRange {
  int64_t begin, prompt_end, end;
};

__device__ PenaltyRange penalty_range(const SampleArgs& a, const SamplingRow& p) {
  const int32_t end = a.penalty_ids == nullptr ? p.penalty_begin : max(p.penalty_begin, p.penalty_end);
  const int32_t prompt_end = min(end, max(p.penalty_begin, p.prompt_end));
  return {p.repetition_penalty != 1.0f ? p.penalty_begin : prompt_end, prompt_end, end};
}

// Marks the row's listed ids in the shared bitmap and counts its output ids in the workspace. Returns false (and
// touches nothing) if an id lies outside the vocabulary.
__device__ bool penalties_prepare(const SampleArgs& a, const SamplingRow& p, uint32_t* listed, int32_t* counts,
                                  Scratch& s) {
  const PenaltyRange range = penalty_range(a, p);
  const int64_t begin = range.begin, prompt_end = range.prompt_end, end = range.end;
  int32_t bad = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const int32_t id = a.penalty_ids[i];
    bad |= id < 0 || id >= a.vocab;
  }
  if (block_min(-bad, s) != 0) return false;
  for (int64_t w = threadIdx.x; w < (a.vocab + 31) / 32; w += kThreads) listed[w] = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) atomicExch(counts + a.penalty_ids[i], 0);
  __syncthreads();
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const int32_t id = a.penalty_ids[i];
    atomicOr(listed + (id >> 5), 1u << (id & 31));
    if (i >= prompt_end) atomicAdd(counts + id, 1);
  }
  __syncthreads();
  return true;
}

// The lowest id whose penalised logit is not finite, as status -(1 + id) (0 if none): after the repetition
// penalty first, then after frequency/presence, the order in which the CPU checks.
__device__ int32_t penalties_check(const SampleArgs& a, const SamplingRow& p, const RowView& v, Scratch& s) {
  const PenaltyRange range = penalty_range(a, p);
  const int64_t begin = range.begin, end = range.end;
  int32_t after_repetition = kNoId, after_counts = kNoId;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const int32_t id = a.penalty_ids[i];
    float x = v.raw_at(id);
    if (p.repetition_penalty != 1.0f) {
      x = penalise_repetition(x, p.repetition_penalty);
      if (!isfinite(x)) {
        after_repetition = min(after_repetition, id);
        continue;
      }
    }
    const int32_t count = __ldcg(v.counts + id);
    if (count > 0 && !isfinite(penalise_counts(x, count, p.frequency_penalty, p.presence_penalty))) {
      after_counts = min(after_counts, id);
    }
  }
  after_repetition = block_min(after_repetition, s);
  after_counts = block_min(after_counts, s);
  if (after_repetition != kNoId) return -(1 + after_repetition);
  return after_counts != kNoId ? -(1 + after_counts) : 0;
}

// This thread's share of the first walk.
__device__ RawStats raw_thread_stats(const RowView& v) {
  RawStats t;
  const auto penalised = [&](int64_t id, float x) { return v.value(id, x); };
  row_for_each(v, [&](int64_t id, float x) { raw_stats_push(t, id, x, penalised); });
  return t;
}

// This thread's best penalised logit alone (the split first walk ranks raw logits): the best is the first of a
// total order on (value, id), so it does not depend on how the ids were grouped. Non-finite raw logits are left
// out as in raw_stats_push.
__device__ Best penalised_thread_best(const RowView& v) {
  Best best{-INFINITY, kNoId};
  row_for_each(v, [&](int64_t id, float x) {
    if (!isfinite(x)) return;
    const Best b{v.value(id, x), static_cast<int32_t>(id)};
    if (better(b, best)) best = b;
  });
  return best;
}

// Two shares of a row's first walk as one: the sums rescaled to the larger max (a share that saw no finite logit
// has max -inf and adds nothing); first bad id and best are order-free (a min and a total order).
__device__ RawStats raw_merge(const RawStats& a, const RawStats& b) {
  RawStats r;
  r.first_bad = min(a.first_bad, b.first_bad);
  r.max = fmaxf(a.max, b.max);
  const auto scaled = [&](const RawStats& t) {
    return t.max == -INFINITY ? 0.0 : t.sum * exp(static_cast<double>(t.max) - static_cast<double>(r.max));
  };
  r.sum = scaled(a) + scaled(b);
  r.best = better(b.best, a.best) ? b.best : a.best;
  return r;
}

// The row's statistics from every thread's share, and log(sum of exp(x - max)).
__device__ RawStats raw_combine(const RawStats& t, Scratch& s, double& log_sum) {
  RawStats row;
  row.first_bad = block_min(t.first_bad, s);
  row.max = block_max(t.max, s);
  const double scaled = t.max == -INFINITY ? 0.0 : t.sum * exp(static_cast<double>(t.max) - static_cast<double>(row.max));
  row.sum = block_sum(scaled, s);
  row.best = block_best(t.best, s);
  log_sum = log(row.sum);
  return row;
}

__global__ void __launch_bounds__(kThreads) sample_rows_kernel(const SampleParams p) {
  ptx::grid_dependency_begin();
  extern __shared__ u64 dynamic_shared[];
  __shared__ Scratch s;
  const SampleArgs& a = p.a;
  const int64_t row = blockIdx.x;
  const SamplingRow params = a.rows_params[row];
  char* workspace = row_workspace(p, row);
  int32_t* counts = reinterpret_cast<int32_t*>(workspace);
  u64* chunk_sums = reinterpret_cast<u64*>(workspace + p.counts_bytes);
  u64* hist = dynamic_shared;
  uint32_t* listed = reinterpret_cast<uint32_t*>(dynamic_shared + kSampleHistBins);

  const uint16_t* raw = a.logits + row * a.logits_stride;
  RowView v{raw,    a.vocab, reinterpret_cast<uintptr_t>(raw) % 16 == 0, nullptr, counts, params.repetition_penalty,
            params.frequency_penalty, params.presence_penalty};
  const bool penalties = params.repetition_penalty != 1.0f || params.presence_penalty != 0.0f ||
                         params.frequency_penalty != 0.0f;
  int32_t status = kSampleStatusOk;
  if (penalties) {
    if (penalties_prepare(a, params, listed, counts, s)) {
      v.listed = listed;
    } else {
      status = kSampleStatusBadPenaltyId;
    }
  }
  // Stage 1: the one read from memory, here or in sample_partials_kernel. A non-finite raw logit outranks every
  // other failure, as on the CPU.
  RawStats mine;
  if (p.from_partials) {
    const PartialSlots slots = PartialSlots::at(workspace + p.partials_offset);
    mine = slots.load(static_cast<int>(threadIdx.x));
#pragma unroll
    for (int j = 1; j < kSampleSlotsPerThread; ++j)
      mine = raw_merge(mine, slots.load(static_cast<int>(threadIdx.x) + j * kThreads));
    if (v.listed != nullptr) mine.best = penalised_thread_best(v);
  } else {
    mine = raw_thread_stats(v);
  }
  double log_sum = 0.0;
  const RawStats stats = raw_combine(mine, s, log_sum);
  if (stats.first_bad != kNoId) status = 1 + stats.first_bad;
  if (status == kSampleStatusOk && v.listed != nullptr) status = penalties_check(a, params, v, s);
  if (status != kSampleStatusOk) {
    write_failed_row(a, row, status);
    return;
  }
  // Stage 2: the token.
  const RowContext ctx{v, params, hist, chunk_sums, s};
  const int32_t token = params.temperature < kGreedyTemperature ? stats.best.id
                                                                : sample_random(ctx, stats.best.value, p.mass_scale);
  if (token < 0) {
    write_failed_row(a, row, kSampleStatusInternal);
    return;
  }
  // Stage 3: logprobs of the raw row.
  write_top_logprobs(ctx, a, row, stats.max, log_sum);
  if (threadIdx.x == 0) {
    a.out_status[row] = kSampleStatusOk;
    a.out_id[row] = token;
    a.out_logprob[row] = raw_logprob(v.raw_at(token), stats.max, log_sum);
  }
}

}  // namespace

void sample_rows_launch(const DeviceContext& ctx, const SampleArgs& args) {
  // Split the first walk while one block per row would leave SMs idle; past that the row blocks fill the device.
  const bool split = args.rows < ctx.props().num_sms;
  const SampleParams p = sample_params(args, split);
  if (split) sample_partials_launch(ctx, args);
  const size_t shared = sampling_dynamic_shared_bytes(args.vocab);
  TERN_CUDA_CHECK(
      cudaFuncSetAttribute(sample_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  launch_kernel(ctx, sample_rows_kernel, dim3(static_cast<unsigned>(args.rows)), dim3(kThreads), shared, p);
  TERN_CUDA_CHECK_LAUNCH();
}

// What the driver loaded of this module for the current device (module_attributes.h).
cudaError_t sampling_module_attributes(cudaFuncAttributes* out) {
  return cudaFuncGetAttributes(out, sample_rows_kernel);
}

}  // namespace tern
