// Where a model's weights come from: a checkpoint (mmapped safetensors, used in place; NVFP4 stays packed) or
// random dummy tensors generated from the weight schema alone (`--load-format dummy`), laid out as a checkpoint
// would store them (BF16, or ModelOpt NVFP4 for the linears a quantization config does not exclude).
//
// Tensor parallelism: a store serves one rank for its whole life. set_sharding (once, before the first read) gives
// it the schema's shard declarations and the rank; linear(), vector(), dense_matrix() and experts() then return
// this rank's slice of each tensor as its declaration says (models/shard.h). A slice of whole rows is a view into
// the checkpoint, like an unsharded tensor; a column split or rows from several segments is a copy the store owns.
// A store never given a sharding, or given world 1, reads every tensor whole, exactly as before. A shapes-only store's
// slices, copies included, are views of its one zero buffer (nothing is copied).
#pragma once

#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "io/linear_weight.h"
#include "io/model_config.h"
#include "io/quant_config.h"
#include "io/safetensors.h"
#include "layers/linear.h"
#include "layers/moe.h"
#include "models/weight_schema.h"

namespace tern {

// How make_dummy generates a tensor: BF16 elements (N(0, 0.02); 1; 0; Gated DeltaNet's A_log and conv1d
// initialisations), NVFP4 codes or block scales, or FP8 e4m3 codes.
enum class DummyKind { kNormal, kOne, kZero, kALog, kConv, kCodes, kScales, kFp8Codes };
// A dummy linear's weight format.
enum class DummyFormat { kBf16, kNvfp4, kFp8 };

// Which NVFP4 linears quantize their input (W4A4: the activations quantized per 16-element block with the layer's
// input_scale, as ModelOpt defines; docs/model-specs.md §1.5) instead of multiplying the dequantized weight by
// unquantized activations (W4A16).
enum class Nvfp4Activations {
  kDequantize,     // none: W4A16 everywhere
  kQuantize,       // every NVFP4 linear
  kQuantizeDense,  // every NVFP4 linear but the routed experts' (a GPU with a W4A4 GEMM but no W4A4 expert kernel)
};

class WeightStore {
 public:
  static Expected<std::unique_ptr<WeightStore>> open_checkpoint(const std::filesystem::path& dir);
  // Deterministic in `seed`; activation input_scale of dummy NVFP4 linears is set for inputs of amax ~8. Each
  // tensor is generated when read, and of a sharded store only the rank's slice (its values those of the whole
  // tensor's at the same positions), so that a rank's host memory is its slice, not the whole model.
  static std::unique_ptr<WeightStore> make_dummy(const ModelConfig& config, const WeightSchema& schema,
                                                 const std::optional<QuantConfig>& quant, uint64_t seed);
  // The dummy store's tensors (names, shapes, formats) with all-zero contents, every large one a view of one shared
  // zero buffer that is never written: what a model's blocks are, without the memory or the time of their weights
  // (the self-test plans its cases from them, models/selftest_plan.h).
  static std::unique_ptr<WeightStore> make_shapes_only(const WeightSchema& schema,
                                                       const std::optional<QuantConfig>& quant);

  // The rank is checked at each read (the error names the tensor). At world > 1 a tensor without a declaration in
  // the schema is an error.
  void set_sharding(const WeightSchema& schema, ShardRank rank);
  ShardRank shard_rank() const { return rank_; }

  // Prefix of the text model in this store's names ("model." or "model.language_model.").
  const std::string& text_prefix() const { return text_prefix_; }
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  // The tensor as stored, whole: a view into the mapped checkpoint, or a dummy tensor; nullptr if absent.
  const TensorView* find(const std::string& name) const;

  // Sizes are the full logical ones; the results have this rank's.
  // Which NVFP4 linears quantize their input (W4A4 with their input_scale) from here on; kDequantize by default.
  void set_nvfp4_activations(Nvfp4Activations a) { nvfp4_activations_ = a; }

  // `<module>.weight` (+ NVFP4 scales, + bias) as a Linear; an NVFP4 one quantizes its input where
  // set_nvfp4_activations says so.
  Expected<Linear> linear(const std::string& module, int64_t out, int64_t in);
  // A float parameter of the given shape, copied to fp32 (this rank's part of dim 0).
  Expected<std::vector<float>> vector(const std::string& name, const std::vector<int64_t>& shape);
  // A dense [rows, cols] matrix used in place (embeddings).
  Expected<CpuMatrix> dense_matrix(const std::string& name, int64_t rows, int64_t cols);
  // The routed experts of one MoE layer this rank holds (expert_group_rank), fused in the checkpoint (gate_up_proj /
  // down_proj) or one module per expert.
  struct Experts {
    int64_t first = 0;  // the router's index of experts[0]
    std::vector<MlpWeights> experts;
  };
  Expected<Experts> experts(const ExpertGroupSpec& group);

 private:
  WeightStore() = default;
  // The tensor's data if aligned for its element type, else an aligned copy owned by the store.
  const void* aligned_data(const TensorView& t);
  Expected<Shard> shard_of(const std::string& name) const;
  // This rank's part of a row-major [rows, row_bytes] block at byte `offset` of `t`: `pieces` of rows (by_rows) or
  // of each row's bytes. One piece of rows, or all of every row, is a view of `t`; anything else is copied; a dummy
  // tensor's part is generated (generate).
  const std::byte* gather(const TensorView& t, int64_t offset, int64_t rows, int64_t row_bytes, bool by_rows,
                          const std::vector<ShardPiece>& pieces);
  struct DummyTensor {
    DummyKind kind;
    uint64_t stream;
    int64_t bytes = 0;
  };
  const std::byte* generate(const DummyTensor& d, int64_t offset, int64_t rows, int64_t row_bytes, bool by_rows,
                            const std::vector<ShardPiece>& pieces);
  void add_dummy(std::string name, DType dtype, std::vector<int64_t> shape, DummyTensor d);
  // This rank's part of the dense [rows, cols] matrix in `t` that starts at row `row_offset`.
  Expected<CpuMatrix> dense_slice(const TensorView& t, int64_t rows, int64_t cols, int64_t row_offset,
                                  const Shard& shard, const std::string& what);
  // That a split of the input columns of a weight scaled per `block` columns keeps its blocks whole (an error naming
  // the tensor, its format and its pieces otherwise).
  Expected<void> check_input_blocks(const std::vector<ShardPiece>& pieces, int64_t block, int64_t in,
                                    std::string_view format, std::string_view block_name,
                                    const std::string& what) const;
  // This rank's part of a block-wise FP8 linear [out, in] (its e4m3 codes gathered, each kept row's block scales
  // expanded from the 128 x 128 grid).
  Expected<CpuMatrix> fp8_block_slice(const LinearWeight& lw, int64_t out, int64_t in, const Shard& shard,
                                      const std::string& what);
  // This rank's part of dim 0 (of `dim0` entries) of `t`, as fp32.
  Expected<std::vector<float>> float_rows(const TensorView& t, int64_t dim0, const Shard& shard);
  Expected<Linear> sharded_linear(const std::string& module, int64_t out, int64_t in, bool quantize_input,
                                  const Shard& shard);
  Nvfp4Activations nvfp4_activations_ = Nvfp4Activations::kDequantize;
  void add_owned(std::string name, DType dtype, std::vector<int64_t> shape, std::vector<std::byte> bytes);
  void add_dummy_linear(const std::string& module, int64_t out, int64_t in, DummyFormat format, uint64_t seed);
  // Tensors of make_shapes_only: a view of zeros_ (at least `bytes` long).
  void add_zeros(std::string name, DType dtype, std::vector<int64_t> shape, size_t bytes);
  std::shared_ptr<std::byte> zeros_;
  size_t zeros_bytes_ = 0;

  std::optional<SafetensorsSet> checkpoint_;
  std::map<std::string, TensorView> owned_views_;
  std::map<std::string, DummyTensor> dummies_;  // make_dummy's tensors, each a view without data in owned_views_
  std::deque<std::vector<std::byte>> owned_bytes_;
  std::deque<std::unique_ptr<std::byte[]>> generated_;  // generate's buffers
  std::string text_prefix_;
  ShardRank rank_;
  std::map<std::string, Shard> shards_;  // linear modules and parameter names; empty: every tensor whole
};

}  // namespace tern
