#include "models/weights.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "core/fnv.h"
#include "core/formats.h"
#include "core/nvfp4.h"
#include "io/linear_weight.h"

namespace tern {
namespace {

constexpr float kDummyStd = 0.02f;
constexpr float kDummyActivationAmax = 8.0f;

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Approximately N(0, 1) (Irwin-Hall of four uniforms), a pure function of (stream, index).
float dummy_normal(uint64_t stream, int64_t index) {
  const uint64_t r = splitmix64(stream + static_cast<uint64_t>(index) * 0xD1B54A32D192ED03ull);
  // The four 16-bit uniforms summed as integers: the same value as summing them as floats (every partial sum is
  // exact in fp32), one conversion instead of four.
  const uint64_t sum = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
  const float s = static_cast<float>(sum) / 65536.0f;
  return (s - 2.0f) * 1.7320508f;
}

float dummy_uniform(uint64_t stream, int64_t index) {
  return static_cast<float>(splitmix64(stream ^ static_cast<uint64_t>(index)) >> 40) / 16777216.0f;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_string(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

Expected<float> scalar_of(const TensorView& t) {
  if (t.numel() != 1) return make_error("tensor '{}' must be a scalar", t.name);
  if (t.dtype == DType::kF32) {
    float v;
    std::memcpy(&v, t.data.data(), sizeof(v));
    return v;
  }
  uint16_t bits;
  std::memcpy(&bits, t.data.data(), sizeof(bits));
  if (t.dtype == DType::kBF16) return bf16_to_float(bits);
  if (t.dtype == DType::kF16) return fp16_to_float(bits);
  return make_error("tensor '{}' must be F32, BF16 or F16, found {}", t.name, dtype_name(t.dtype));
}

// Every linear a dummy store holds, with its format: as the exporter would have written them. NVFP4 follows
// ModelOpt's exclude list (QuantConfig::producer_excludes); block-wise FP8 quantizes every linear but the router,
// the shared-expert gate and lm_head, as the DeepSeek-V3, GLM-5-FP8 and Qwen3-FP8 releases ship them, less the
// config's modules_to_not_convert. lm_head is absent when tied to the embedding.
template <class F>
void for_each_dummy_linear(const WeightSchema& schema, const std::optional<QuantConfig>& quant, F&& f) {
  const bool nvfp4_config = quant && quant->quant_algo.find("NVFP4") != std::string::npos;
  const bool fp8_config = quant && quant->quant_algo == "FP8_BLOCK128";
  auto format = [&](const std::string& module, LinearRole role) {
    if (!quant || quant->producer_excludes(module)) return DummyFormat::kBf16;
    if (nvfp4_config) return DummyFormat::kNvfp4;
    const bool fp8 = fp8_config && role != LinearRole::kRouter && role != LinearRole::kSharedExpertGate &&
                     role != LinearRole::kLmHead;
    return fp8 ? DummyFormat::kFp8 : DummyFormat::kBf16;
  };
  for (const LinearSpec& l : schema.linears) {
    if (l.role == LinearRole::kLmHead && schema.tied_embeddings) continue;
    f(l.module, l.out_features, l.in_features, format(l.module, l.role));
  }
  for (const ExpertGroupSpec& g : schema.expert_groups) {
    for (int64_t x = 0; x < g.num_experts; ++x) {
      for (auto [name, out, in] : {std::tuple{"gate_proj", g.intermediate, g.hidden},
                                   {"up_proj", g.intermediate, g.hidden}, {"down_proj", g.hidden, g.intermediate}}) {
        const std::string module = fmt::format("{}.{}.{}", g.prefix, x, name);
        f(module, out, in, format(module, LinearRole::kMlp));
      }
    }
  }
}

}  // namespace

Expected<std::unique_ptr<WeightStore>> WeightStore::open_checkpoint(const std::filesystem::path& dir) {
  auto set = SafetensorsSet::open_dir(dir);
  if (!set) return tl::unexpected(set.error());
  std::unique_ptr<WeightStore> store(new WeightStore());
  store->checkpoint_.emplace(std::move(*set));
  store->text_prefix_ = weight_schema_text_prefix(*store->checkpoint_);
  return store;
}

const TensorView* WeightStore::find(const std::string& name) const {
  if (checkpoint_) return checkpoint_->find(name);
  auto it = owned_views_.find(name);
  return it == owned_views_.end() ? nullptr : &it->second;
}

const void* WeightStore::aligned_data(const TensorView& t) {
  const size_t align = dtype_size(t.dtype);
  if (reinterpret_cast<uintptr_t>(t.data.data()) % align == 0) return t.data.data();
  owned_bytes_.emplace_back(t.data.begin(), t.data.end());
  return owned_bytes_.back().data();
}

void WeightStore::set_sharding(const WeightSchema& schema, ShardRank rank) {
  rank_ = rank;
  shards_.clear();
  for (const LinearSpec& l : schema.linears) shards_[l.module] = l.shard;
  for (const ParamSpec& p : schema.params) shards_[p.name] = p.shard;
}

Expected<Shard> WeightStore::shard_of(const std::string& name) const {
  if (auto it = shards_.find(name); it != shards_.end()) return it->second;
  if (rank_.world == 1) return Shard::replicated();
  return make_error("tensor '{}' has no shard declaration in the weight schema (world size {})", name, rank_.world);
}

const std::byte* WeightStore::gather(const TensorView& t, int64_t offset, int64_t rows, int64_t row_bytes,
                                     bool by_rows, const std::vector<ShardPiece>& pieces) {
  // A shapes-only store's tensors are all views of one zero buffer as long as the largest of them: so is any slice.
  if (zeros_) return zeros_.get();
  if (auto it = dummies_.find(t.name); it != dummies_.end()) {
    return generate(it->second, offset, rows, row_bytes, by_rows, pieces);
  }
  const std::byte* base = static_cast<const std::byte*>(aligned_data(t)) + offset;
  if (by_rows && pieces.size() == 1) return base + pieces[0].offset * row_bytes;
  if (!by_rows && pieces.size() == 1 && pieces[0].offset == 0 && pieces[0].length == row_bytes) return base;
  std::vector<std::byte> out;
  auto take = [&](int64_t begin, int64_t length) { out.insert(out.end(), base + begin, base + begin + length); };
  for (int64_t r = 0; r < (by_rows ? 1 : rows); ++r) {
    for (const ShardPiece& p : pieces) {
      if (by_rows) {
        take(p.offset * row_bytes, p.length * row_bytes);
      } else {
        take(r * row_bytes + p.offset, p.length);
      }
    }
  }
  owned_bytes_.push_back(std::move(out));
  return owned_bytes_.back().data();
}

namespace {

// Pieces of elements as pieces of bytes, `num / den` bytes an element (NVFP4: 1/2 for codes, 1/16 for scales).
std::vector<ShardPiece> in_bytes(std::vector<ShardPiece> pieces, int64_t num, int64_t den) {
  for (ShardPiece& p : pieces) p = {p.offset * num / den, p.length * num / den};
  return pieces;
}

}  // namespace

Expected<CpuMatrix> WeightStore::dense_slice(const TensorView& t, int64_t rows, int64_t cols, int64_t row_offset,
                                             const Shard& shard, const std::string& what) {
  CpuMatrix m;
  switch (t.dtype) {
    case DType::kBF16: m.format = CpuWeightFormat::kBf16; break;
    case DType::kF16: m.format = CpuWeightFormat::kF16; break;
    case DType::kF32: m.format = CpuWeightFormat::kF32; break;
    default: return make_error("tensor '{}': {} is not a dense float matrix", t.name, dtype_name(t.dtype));
  }
  const bool by_rows = shard.dim != ShardDim::kInput;
  TERN_ASSIGN_OR_RETURN(const std::vector<ShardPiece> pieces, shard_pieces(shard, by_rows ? rows : cols, rank_, what));
  const auto es = static_cast<int64_t>(dtype_size(t.dtype));
  m.rows = by_rows ? shard_pieces_length(pieces) : rows;
  m.cols = by_rows ? cols : shard_pieces_length(pieces);
  m.data = gather(t, row_offset * cols * es, rows, cols * es, by_rows, by_rows ? pieces : in_bytes(pieces, es, 1));
  return m;
}

// A split of a block-scaled weight's input columns keeps each rank's pieces whole blocks (a piece may end at the
// last, partial block): the scales are per block of `block` columns.
Expected<void> WeightStore::check_input_blocks(const std::vector<ShardPiece>& pieces, int64_t block, int64_t in,
                                               std::string_view format, std::string_view block_name,
                                               const std::string& what) const {
  for (const ShardPiece& p : pieces) {
    if (p.offset % block != 0 || (p.length % block != 0 && p.offset + p.length != in)) {
      return make_error("tensor '{}': {} input columns [{}, {}) of rank {} (world size {}) straddle its {} scale "
                        "blocks",
                        what, format, p.offset, p.offset + p.length, rank_.rank, rank_.world, block_name);
    }
  }
  return {};
}

Expected<CpuMatrix> WeightStore::fp8_block_slice(const LinearWeight& lw, int64_t out, int64_t in, const Shard& shard,
                                                 const std::string& what) {
  constexpr int64_t kBlock = 128;
  const bool by_rows = shard.dim != ShardDim::kInput;
  TERN_ASSIGN_OR_RETURN(const std::vector<ShardPiece> pieces, shard_pieces(shard, by_rows ? out : in, rank_, what));
  if (!by_rows) TERN_TRY(check_input_blocks(pieces, kBlock, in, "FP8", "128-column", what));
  const int64_t length = shard_pieces_length(pieces);
  CpuMatrix m{.format = CpuWeightFormat::kFp8Block128, .rows = by_rows ? length : out, .cols = by_rows ? in : length};
  m.data = gather(*lw.weight, 0, out, in, by_rows, pieces);
  if (zeros_) {  // a shapes-only store: zeros throughout (the expanded scales take fewer bytes than the codes)
    m.row_block_scales = reinterpret_cast<const float*>(zeros_.get());
    return m;
  }
  // Each kept row's scales over its kept column blocks, from the [ceil(out/128), ceil(in/128)] block grid.
  const TensorView& st = *lw.weight_scale;
  const int64_t grid_cols = (in + kBlock - 1) / kBlock;
  auto scale_at = [&](int64_t row, int64_t col) {  // by bytes: a file may leave the scales unaligned
    const int64_t i = (row / kBlock) * grid_cols + col / kBlock;
    if (st.dtype == DType::kF32) {
      float v;
      std::memcpy(&v, st.data.data() + i * 4, 4);
      return v;
    }
    uint16_t b;
    std::memcpy(&b, st.data.data() + i * 2, 2);
    return bf16_to_float(b);
  };
  std::vector<int64_t> rows, cols;  // the global row of each kept row, the global first column of each kept block
  if (by_rows) {
    for (const ShardPiece& p : pieces) {
      for (int64_t r = p.offset; r < p.offset + p.length; ++r) rows.push_back(r);
    }
    for (int64_t c = 0; c < in; c += kBlock) cols.push_back(c);
  } else {
    for (int64_t r = 0; r < out; ++r) rows.push_back(r);
    for (const ShardPiece& p : pieces) {
      for (int64_t c = p.offset; c < p.offset + p.length; c += kBlock) cols.push_back(c);
    }
  }
  std::vector<std::byte> bytes(rows.size() * cols.size() * sizeof(float));
  auto* scales = reinterpret_cast<float*>(bytes.data());
  for (size_t r = 0; r < rows.size(); ++r) {
    for (size_t c = 0; c < cols.size(); ++c) scales[r * cols.size() + c] = scale_at(rows[r], cols[c]);
  }
  owned_bytes_.push_back(std::move(bytes));
  m.row_block_scales = reinterpret_cast<const float*>(owned_bytes_.back().data());
  return m;
}

Expected<std::vector<float>> WeightStore::float_rows(const TensorView& t, int64_t dim0, const Shard& shard) {
  TERN_ASSIGN_OR_RETURN(const std::vector<ShardPiece> pieces,
                        shard_pieces(shard.dim == ShardDim::kInput ? Shard::replicated() : shard, dim0, rank_, t.name));
  TERN_ASSIGN_OR_RETURN(CpuMatrix m, dense_slice(t, 1, t.numel(), 0, Shard::replicated(), t.name));
  std::vector<float> all(static_cast<size_t>(t.numel()));
  cpu_matrix_row(m, 0, all.data());
  if (pieces.size() == 1 && pieces[0].length == dim0) return all;
  const int64_t row = dim0 > 0 ? t.numel() / dim0 : 0;
  std::vector<float> v;
  for (const ShardPiece& p : pieces) {
    v.insert(v.end(), all.begin() + p.offset * row, all.begin() + (p.offset + p.length) * row);
  }
  return v;
}

Expected<Linear> WeightStore::linear(const std::string& module, int64_t out, int64_t in) {
  TERN_ASSIGN_OR_RETURN(const Shard shard, shard_of(module));
  return sharded_linear(module, out, in, nvfp4_activations_ != Nvfp4Activations::kDequantize, shard);
}

Expected<Linear> WeightStore::sharded_linear(const std::string& module, int64_t out, int64_t in, bool quantize_input,
                                             const Shard& shard) {
  LinearWeight lw;
  if (checkpoint_) {
    auto resolved = linear_weight_resolve(*checkpoint_, module, out, in);
    if (!resolved) return tl::unexpected(resolved.error());
    lw = *resolved;
  } else {
    lw.weight = find(module + ".weight");
    if (lw.weight == nullptr) return make_error("tensor '{}.weight' is missing", module);
    lw.format = lw.weight->dtype == DType::kU8       ? WeightFormat::kNvfp4
                : lw.weight->dtype == DType::kF8E4M3 ? WeightFormat::kFp8Block128
                                                     : WeightFormat::kBf16;
    lw.weight_scale = find(module + (lw.format == WeightFormat::kFp8Block128 ? ".weight_scale_inv" : ".weight_scale"));
    lw.weight_scale_2 = find(module + ".weight_scale_2");
    lw.input_scale = find(module + ".input_scale");
  }
  const std::string weight_name = module + ".weight";
  Linear linear;
  if (lw.format == WeightFormat::kNvfp4) {
    TERN_ASSIGN_OR_RETURN(const float global_scale, scalar_of(*lw.weight_scale_2));
    const bool by_rows = shard.dim != ShardDim::kInput;
    TERN_ASSIGN_OR_RETURN(const std::vector<ShardPiece> pieces,
                          shard_pieces(shard, by_rows ? out : in, rank_, weight_name));
    if (!by_rows) TERN_TRY(check_input_blocks(pieces, 16, in, "NVFP4", "16-element", weight_name));
    const auto* codes = gather(*lw.weight, 0, out, in / 2, by_rows, by_rows ? pieces : in_bytes(pieces, 1, 2));
    const auto* scales =
        gather(*lw.weight_scale, 0, out, in / 16, by_rows, by_rows ? pieces : in_bytes(pieces, 1, 16));
    const int64_t length = shard_pieces_length(pieces);
    CpuMatrix m{.format = CpuWeightFormat::kNvfp4,
                .rows = by_rows ? length : out,
                .cols = by_rows ? in : length,
                .data = codes,
                .block_scales = reinterpret_cast<const uint8_t*>(scales),
                .global_scale = global_scale};
    linear = Linear(module, m);
    if (quantize_input) {
      if (lw.input_scale == nullptr) return make_error("'{}': W4A4 needs '{}.input_scale'", module, module);
      TERN_ASSIGN_OR_RETURN(const float input_scale, scalar_of(*lw.input_scale));
      linear.set_input_quantization(input_scale);
    }
  } else if (lw.format == WeightFormat::kFp8Block128) {
    TERN_ASSIGN_OR_RETURN(CpuMatrix m, fp8_block_slice(lw, out, in, shard, weight_name));
    linear = Linear(module, m);
  } else {
    TERN_ASSIGN_OR_RETURN(CpuMatrix m, dense_slice(*lw.weight, out, in, 0, shard, weight_name));
    linear = Linear(module, m);
  }
  // A row-parallel layer's bias is added once, after the reduction: rank 0 holds it.
  if (lw.bias != nullptr && (shard.dim != ShardDim::kInput || rank_.rank == 0)) {
    TERN_ASSIGN_OR_RETURN(std::vector<float> bias, float_rows(*lw.bias, out, shard));
    linear.set_bias(std::move(bias));
  }
  return linear;
}

Expected<std::vector<float>> WeightStore::vector(const std::string& name, const std::vector<int64_t>& shape) {
  const TensorView* t = find(name);
  if (t == nullptr) return make_error("tensor '{}' {} is missing", name, shape_string(shape));
  if (t->shape != shape && !(shape.size() == 1 && t->numel() == shape[0])) {
    return make_error("tensor '{}' must have shape {}, found {}", name, shape_string(shape), shape_string(t->shape));
  }
  TERN_ASSIGN_OR_RETURN(const Shard shard, shard_of(name));
  return float_rows(*t, shape.empty() ? 1 : shape[0], shard);
}

Expected<CpuMatrix> WeightStore::dense_matrix(const std::string& name, int64_t rows, int64_t cols) {
  const TensorView* t = find(name);
  if (t == nullptr) return make_error("tensor '{}' [{}, {}] is missing", name, rows, cols);
  if (t->shape != std::vector<int64_t>{rows, cols}) {
    return make_error("tensor '{}' must have shape [{}, {}], found {}", name, rows, cols, shape_string(t->shape));
  }
  TERN_ASSIGN_OR_RETURN(const Shard shard, shard_of(name));
  return dense_slice(*t, rows, cols, 0, shard, name);
}

Expected<WeightStore::Experts> WeightStore::experts(const ExpertGroupSpec& g) {
  const int64_t e = g.num_experts, h = g.hidden, i = g.intermediate;
  const bool quantize_input = nvfp4_activations_ == Nvfp4Activations::kQuantize;
  TERN_ASSIGN_OR_RETURN(const ExpertGroupRank mine, expert_group_rank(g, rank_));
  Experts out{mine.first, {}};
  const TensorView* gate_up = find(g.prefix + ".gate_up_proj");
  if (gate_up != nullptr) {  // fused: gate_up [E, 2I, H] (rows [0, I) gate), down [E, H, I]
    const TensorView* down = find(g.prefix + ".down_proj");
    if (gate_up->shape != std::vector<int64_t>{e, 2 * i, h}) {
      return make_error("tensor '{}' must have shape [{}, {}, {}], found {}", gate_up->name, e, 2 * i, h,
                        shape_string(gate_up->shape));
    }
    if (down == nullptr || down->shape != std::vector<int64_t>{e, h, i}) {
      return make_error("tensor '{}.down_proj' must exist with shape [{}, {}, {}]", g.prefix, e, h, i);
    }
    for (int64_t x = mine.first; x < mine.first + mine.count; ++x) {
      const std::string name = fmt::format("{}.{}", g.prefix, x);
      TERN_ASSIGN_OR_RETURN(CpuMatrix gm, dense_slice(*gate_up, i, h, x * 2 * i, mine.gate_up,
                                                      fmt::format("{} (expert {}, gate)", gate_up->name, x)));
      TERN_ASSIGN_OR_RETURN(CpuMatrix um, dense_slice(*gate_up, i, h, x * 2 * i + i, mine.gate_up,
                                                      fmt::format("{} (expert {}, up)", gate_up->name, x)));
      TERN_ASSIGN_OR_RETURN(
          CpuMatrix dm, dense_slice(*down, h, i, x * h, mine.down, fmt::format("{} (expert {})", down->name, x)));
      out.experts.push_back(
          {Linear(name + ".gate_proj", gm), Linear(name + ".up_proj", um), Linear(name + ".down_proj", dm)});
    }
    return out;
  }
  for (int64_t x = mine.first; x < mine.first + mine.count; ++x) {
    const std::string name = fmt::format("{}.{}", g.prefix, x);
    TERN_ASSIGN_OR_RETURN(Linear gate, sharded_linear(name + ".gate_proj", i, h, quantize_input, mine.gate_up));
    TERN_ASSIGN_OR_RETURN(Linear up, sharded_linear(name + ".up_proj", i, h, quantize_input, mine.gate_up));
    TERN_ASSIGN_OR_RETURN(Linear down, sharded_linear(name + ".down_proj", h, i, quantize_input, mine.down));
    out.experts.push_back({std::move(gate), std::move(up), std::move(down)});
  }
  return out;
}

void WeightStore::add_owned(std::string name, DType dtype, std::vector<int64_t> shape, std::vector<std::byte> bytes) {
  owned_bytes_.push_back(std::move(bytes));
  const auto& b = owned_bytes_.back();
  owned_views_[name] = TensorView{name, dtype, std::move(shape), {b.data(), b.size()}, nullptr};
}

void WeightStore::add_dummy(std::string name, DType dtype, std::vector<int64_t> shape, DummyTensor d) {
  d.bytes = numel_of(shape) * static_cast<int64_t>(dtype_size(dtype));
  owned_views_[name] = TensorView{name, dtype, std::move(shape), {}, nullptr};
  dummies_.emplace(std::move(name), d);
}

void WeightStore::add_dummy_linear(const std::string& module, int64_t out, int64_t in, DummyFormat format,
                                   uint64_t seed) {
  const uint64_t stream = fnv1a64(module, seed);
  if (format == DummyFormat::kBf16) {
    add_dummy(module + ".weight", DType::kBF16, {out, in}, {DummyKind::kNormal, stream});
    return;
  }
  if (format == DummyFormat::kFp8) {
    // e4m3 codes of magnitude 2^e (1 + m / 8) for e in -3 .. 0 and m in 0 .. 7, equally likely (root mean square
    // sqrt(mean(4^e) mean((1 + m/8)^2)) = sqrt(0.332 * 2.148) = 0.845), and every block's scale chosen so the
    // weights' spread is about kDummyStd.
    constexpr float kFp8CodeRms = 0.845f;
    const int64_t grid = ((out + 127) / 128) * ((in + 127) / 128);
    std::vector<std::byte> scales(static_cast<size_t>(grid) * 4);
    const float scale = kDummyStd / kFp8CodeRms;
    for (int64_t i = 0; i < grid; ++i) std::memcpy(scales.data() + i * 4, &scale, 4);
    add_dummy(module + ".weight", DType::kF8E4M3, {out, in}, {DummyKind::kFp8Codes, stream});
    add_owned(module + ".weight_scale_inv", DType::kF32, {(out + 127) / 128, (in + 127) / 128}, std::move(scales));
    return;
  }
  // Random codes drawn directly (quantizing random floats took minutes for a 35B model): every e2m1 code equally
  // likely (root mean square 2.93 in magnitude), block scales e4m3 in [0.5, 1.875], and the global scale chosen so
  // the weights' spread is about kDummyStd, as for the BF16 dummies.
  constexpr float kCodeRms = 2.93f, kScaleMean = 1.08f;
  const float global = kDummyStd / (kCodeRms * kScaleMean);
  auto scalar = [](float v) {
    std::vector<std::byte> b(4);
    std::memcpy(b.data(), &v, 4);
    return b;
  };
  add_dummy(module + ".weight", DType::kU8, {out, in / 2}, {DummyKind::kCodes, stream});
  add_dummy(module + ".weight_scale", DType::kF8E4M3, {out, in / 16}, {DummyKind::kScales, stream});
  add_owned(module + ".weight_scale_2", DType::kF32, {}, scalar(global));
  add_owned(module + ".input_scale", DType::kF32, {}, scalar(nvfp4_global_scale_from_amax(kDummyActivationAmax)));
}

namespace {

// float_to_bf16 (round to nearest even) of a finite value, inline.
inline uint16_t bf16_of_finite(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// Element k of a dummy BF16 tensor.
uint16_t dummy_bf16(DummyKind kind, uint64_t stream, int64_t k) {
  float v = kDummyStd * dummy_normal(stream, k);
  switch (kind) {
    case DummyKind::kOne: v = 1.0f; break;
    case DummyKind::kZero: v = 0.0f; break;
    case DummyKind::kALog: v = std::log(0.1f + 1.9f * dummy_uniform(stream, k)); break;
    case DummyKind::kConv: v = 0.2f * dummy_normal(stream, k); break;
    default: break;
  }
  return float_to_bf16(v);
}

// Bytes [begin, begin + length) of a dummy tensor of `total` bytes into `out`.
void dummy_fill(DummyKind kind, uint64_t stream, int64_t total, int64_t begin, int64_t length, std::byte* out) {
  if (length <= 0) return;
  const int64_t end = begin + length;
  if (kind == DummyKind::kCodes || kind == DummyKind::kScales || kind == DummyKind::kFp8Codes) {
    // 8-byte words; the bytes past the last whole word are fixed (0x21: NVFP4 codes +0.5, +1, e4m3 0.140625; 0x38:
    // scale 1.0).
    const int64_t words = total / 8;
    for (int64_t b = begin; b < end;) {
      const int64_t w = b / 8;
      if (w >= words) {
        out[b++ - begin] = std::byte{kind == DummyKind::kScales ? uint8_t{0x38} : uint8_t{0x21}};
        continue;
      }
      const uint64_t random = splitmix64(stream + static_cast<uint64_t>(w) * 0xD1B54A32D192ED03ull);
      const uint64_t bits =
          kind == DummyKind::kCodes ? random
          // sign | 0x20 | five random bits: e4m3 exponent field 4..7, magnitudes 0.125 .. 1.875.
          : kind == DummyKind::kFp8Codes ? (random & 0x9F9F9F9F9F9F9F9Full) | 0x2020202020202020ull
                                         // 0x30 | a random low nibble: e4m3 0.5 .. 0.9375 or 1 .. 1.875 (mean 1.08).
                                         : (splitmix64(~stream + static_cast<uint64_t>(w)) & 0x0F0F0F0F0F0F0F0Full) |
                                               0x3030303030303030ull;
      const int64_t from = b - w * 8, upto = std::min<int64_t>(8, end - w * 8);
      std::memcpy(out + (b - begin), reinterpret_cast<const std::byte*>(&bits) + from,
                  static_cast<size_t>(upto - from));
      b = w * 8 + upto;
    }
    return;
  }
  // BF16 elements, little-endian: the whole ones in one loop, a part of one at either end byte by byte.
  auto part = [&](int64_t b, int64_t upto) {  // bytes [b, upto) of one element
    const uint16_t v = dummy_bf16(kind, stream, b / 2);
    std::memcpy(out + (b - begin), reinterpret_cast<const std::byte*>(&v) + b % 2, static_cast<size_t>(upto - b));
  };
  int64_t b = begin;
  if (b % 2 == 1 && b < end) part(b, b + 1), ++b;
  const int64_t first = b / 2, last = end / 2;  // whole elements [first, last); b is even and at most end
  std::byte* at = out + (b - begin);
  if (kind == DummyKind::kNormal || kind == DummyKind::kConv) {
    // The normal kinds (all but a few small tensors), with dummy_bf16's arithmetic and rounding inlined.
    const float scale = kind == DummyKind::kNormal ? kDummyStd : 0.2f;
    for (int64_t k = first; k < last; ++k) {
      const uint16_t v = bf16_of_finite(scale * dummy_normal(stream, k));
      std::memcpy(at + 2 * (k - first), &v, 2);
    }
  } else {
    for (int64_t k = first; k < last; ++k) {
      const uint16_t v = dummy_bf16(kind, stream, k);
      std::memcpy(at + 2 * (k - first), &v, 2);
    }
  }
  if (2 * last < end) part(2 * last, end);
}

}  // namespace

const std::byte* WeightStore::generate(const DummyTensor& d, int64_t offset, int64_t rows, int64_t row_bytes,
                                       bool by_rows, const std::vector<ShardPiece>& pieces) {
  int64_t per_row = 0;
  for (const ShardPiece& p : pieces) per_row += p.length;
  const int64_t size = by_rows ? per_row * row_bytes : per_row * rows;
  // Not zeroed first: each page is first touched by the thread that fills it.
  std::unique_ptr<std::byte[]> buffer = std::make_unique_for_overwrite<std::byte[]>(static_cast<size_t>(size));
  std::byte* const out = buffer.get();
  if (by_rows) {
    // Chunks of at most 1 MiB, generated in parallel.
    struct Chunk {
      int64_t source, length, at;
    };
    std::vector<Chunk> chunks;
    constexpr int64_t kChunk = int64_t{1} << 20;
    int64_t at = 0;
    for (const ShardPiece& p : pieces) {
      const int64_t length = p.length * row_bytes;
      for (int64_t b = 0; b < length; b += kChunk) {
        chunks.push_back({offset + p.offset * row_bytes + b, std::min(kChunk, length - b), at + b});
      }
      at += length;
    }
#pragma omp parallel for schedule(dynamic)
    for (size_t c = 0; c < chunks.size(); ++c) {
      dummy_fill(d.kind, d.stream, d.bytes, chunks[c].source, chunks[c].length, out + chunks[c].at);
    }
  } else {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      int64_t at = r * per_row;
      for (const ShardPiece& p : pieces) {
        dummy_fill(d.kind, d.stream, d.bytes, offset + r * row_bytes + p.offset, p.length, out + at);
        at += p.length;
      }
    }
  }
  generated_.push_back(std::move(buffer));
  return out;
}

std::unique_ptr<WeightStore> WeightStore::make_dummy(const ModelConfig& config, const WeightSchema& schema,
                                                     const std::optional<QuantConfig>& quant, uint64_t seed) {
  std::unique_ptr<WeightStore> store(new WeightStore());
  store->text_prefix_ = schema.text_prefix;
  const bool zero_centred = config.architecture == Architecture::kQwen35Moe ||
                            config.architecture == Architecture::kQwen3Next;
  for (const ParamSpec& p : schema.params) {
    DummyKind kind = DummyKind::kNormal;
    if (p.name.ends_with("norm.weight")) {
      kind = zero_centred && !p.name.ends_with("linear_attn.norm.weight") ? DummyKind::kZero : DummyKind::kOne;
    }
    if (p.name.ends_with("A_log")) kind = DummyKind::kALog;
    if (p.name.ends_with("dt_bias")) kind = DummyKind::kOne;
    if (p.name.ends_with("conv1d.weight")) kind = DummyKind::kConv;
    store->add_dummy(p.name, DType::kBF16, p.shape, {kind, fnv1a64(p.name, seed)});
  }
  for_each_dummy_linear(schema, quant, [&](const std::string& module, int64_t out, int64_t in, DummyFormat format) {
    store->add_dummy_linear(module, out, in, format, seed);
  });
  return store;
}

void WeightStore::add_zeros(std::string name, DType dtype, std::vector<int64_t> shape, size_t bytes) {
  TERN_CHECK(bytes <= zeros_bytes_);
  owned_views_[name] = TensorView{name, dtype, std::move(shape), {zeros_.get(), bytes}, nullptr};
}

std::unique_ptr<WeightStore> WeightStore::make_shapes_only(const WeightSchema& schema,
                                                           const std::optional<QuantConfig>& quant) {
  std::unique_ptr<WeightStore> store(new WeightStore());
  store->text_prefix_ = schema.text_prefix;
  // One buffer of zeros as large as the largest tensor; calloc maps it lazily, and nothing writes it.
  size_t largest = 16;
  for (const ParamSpec& p : schema.params) largest = std::max(largest, static_cast<size_t>(numel_of(p.shape)) * 2);
  for_each_dummy_linear(schema, quant, [&](const std::string&, int64_t out, int64_t in, DummyFormat) {
    largest = std::max(largest, static_cast<size_t>(out * in) * 2);
  });
  store->zeros_ = std::shared_ptr<std::byte>(static_cast<std::byte*>(std::calloc(largest, 1)), std::free);
  TERN_CHECK(store->zeros_ != nullptr);
  store->zeros_bytes_ = largest;
  for (const ParamSpec& p : schema.params) {
    store->add_zeros(p.name, DType::kBF16, p.shape, static_cast<size_t>(numel_of(p.shape)) * 2);
  }
  for_each_dummy_linear(schema, quant, [&](const std::string& module, int64_t out, int64_t in, DummyFormat format) {
    if (format == DummyFormat::kBf16) {
      store->add_zeros(module + ".weight", DType::kBF16, {out, in}, static_cast<size_t>(out * in) * 2);
      return;
    }
    if (format == DummyFormat::kFp8) {
      const int64_t grid_r = (out + 127) / 128, grid_c = (in + 127) / 128;
      store->add_zeros(module + ".weight", DType::kF8E4M3, {out, in}, static_cast<size_t>(out * in));
      store->add_zeros(module + ".weight_scale_inv", DType::kF32, {grid_r, grid_c},
                       static_cast<size_t>(grid_r * grid_c) * 4);
      return;
    }
    store->add_zeros(module + ".weight", DType::kU8, {out, in / 2}, static_cast<size_t>(out * in / 2));
    store->add_zeros(module + ".weight_scale", DType::kF8E4M3, {out, in / 16}, static_cast<size_t>(out * in / 16));
    store->add_zeros(module + ".weight_scale_2", DType::kF32, {}, 4);
    store->add_zeros(module + ".input_scale", DType::kF32, {}, 4);
  });
  return store;
}

}  // namespace tern
