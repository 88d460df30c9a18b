#include "models/gpu/gpu_weights.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/formats.h"
#include "kernels/cuda/gemm/gemm_bf16.h"
#include "kernels/cuda/gemm/gemm_fp8_w8a16.h"
#include "kernels/cuda/gemm/gemm_nvfp4_native.h"
#include "kernels/cuda/gemm/gemm_nvfp4_w4a16.h"
#include "kernels/cuda/gemv/gemv_bf16.h"
#include "kernels/cuda/nvfp4/nvfp4_scale_layout.h"

namespace tern {
namespace {

// The rows of a dense host matrix as bf16: in place for BF16, converted (into `scratch`) otherwise.
const uint16_t* host_bf16(const CpuMatrix& m, std::vector<uint16_t>& scratch) {
  if (m.format == CpuWeightFormat::kBf16) return static_cast<const uint16_t*>(m.data);
  scratch.resize(static_cast<size_t>(m.rows * m.cols));
  for (size_t i = 0; i < scratch.size(); ++i) {
    const float v = m.format == CpuWeightFormat::kF32 ? static_cast<const float*>(m.data)[i]
                                                      : fp16_to_float(static_cast<const uint16_t*>(m.data)[i]);
    scratch[i] = float_to_bf16(v);
  }
  return scratch.data();
}

int64_t fp8_scale_cols(int64_t k) { return (k + 127) / 128; }

}  // namespace

Expected<void*> DeviceWeights::allocate(size_t bytes, const std::string& what) {
  DeviceBuffer buffer;
  if (!DeviceBuffer::try_allocate(bytes, buffer)) {
    return make_error("out of device memory uploading {} ({} bytes; {} bytes of weights uploaded before it)", what,
                      bytes, bytes_);
  }
  bytes_ += bytes;
  buffers_.push_back(std::move(buffer));
  return buffers_.back().data();
}

Expected<void*> DeviceWeights::upload(const void* host, size_t bytes, const std::string& what) {
  TERN_ASSIGN_OR_RETURN(void* dst, allocate(bytes, what));
  TERN_CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_));
  TERN_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host data may be a temporary
  return dst;
}

Expected<DeviceMatrix> DeviceWeights::matrix(const CpuMatrix& m, const std::string& name) {
  if (auto it = uploaded_.find(m.data); it != uploaded_.end() && it->second.n == m.rows && it->second.k == m.cols) {
    return it->second;
  }
  DeviceMatrix d{.nvfp4 = m.format == CpuWeightFormat::kNvfp4,
                 .fp8 = m.format == CpuWeightFormat::kFp8Block128,
                 .n = m.rows,
                 .k = m.cols};
  if (d.fp8) {
    if (m.cols % 16 != 0) return make_error("{}: FP8 on CUDA needs in_features a multiple of 16, got {}", name, m.cols);
    TERN_ASSIGN_OR_RETURN(void* codes, allocate(static_cast<size_t>(m.rows * m.cols), name));
    TERN_ASSIGN_OR_RETURN(void* scales, allocate(static_cast<size_t>(m.rows * fp8_scale_cols(m.cols)) * 4, name));
    TERN_TRY(copy_fp8_rows(m, static_cast<uint8_t*>(codes), static_cast<float*>(scales), 0, m.cols));
    d.packed = static_cast<const uint8_t*>(codes);
    d.row_scales = static_cast<const float*>(scales);
  } else if (d.nvfp4) {
    TERN_ASSIGN_OR_RETURN(void* packed, upload(m.data, static_cast<size_t>(m.rows * m.cols / 2), name));
    TERN_ASSIGN_OR_RETURN(void* scales, upload(m.block_scales, static_cast<size_t>(m.rows * m.cols / 16), name));
    d.packed = static_cast<const uint8_t*>(packed);
    d.scales = static_cast<const uint8_t*>(scales);
    d.global_scale = m.global_scale;
  } else {
    std::vector<uint16_t> scratch;
    const uint16_t* rows = host_bf16(m, scratch);
    TERN_ASSIGN_OR_RETURN(void* data, upload(rows, static_cast<size_t>(m.rows * m.cols) * 2, name));
    d.bf16 = static_cast<const uint16_t*>(data);
    d.gemv = bf16_gemv_;
  }
  uploaded_[m.data] = d;
  return d;
}

namespace {

Expected<void> check_supported(const Linear& linear) {
  if (!linear.bias().empty()) return make_error("{}: linear layers with a bias are not supported on CUDA yet", linear.name());
  return {};
}

}  // namespace

Expected<DeviceMatrix> DeviceWeights::matrix(const Linear& linear) {
  TERN_TRY(check_supported(linear));
  if (linear.quantizes_input()) return stack_w4a4(std::span<const Linear* const>(std::array{&linear}));
  return matrix(linear.matrix(), linear.name());
}

Expected<void> DeviceWeights::check_w4a4_verified(const std::string& name) const {
  if (nvfp4_w4a4_) return {};
  return make_error("{}: NVFP4 with quantized activations (W4A4) runs on CUDA only on FP4 tensor cores that the "
                    "self-test verified (gemm_nvfp4_w4a4 \"fp4-native\"), which this device's did not; use "
                    "--nvfp4-activations auto or dequantize (W4A16)", name);
}

Expected<DeviceMatrix> DeviceWeights::stack_w4a4(std::span<const Linear* const> linears) {
  const Linear& first = *linears[0];
  TERN_TRY(check_w4a4_verified(first.name()));
  const int64_t k = first.in_features();
  if (k % 32 != 0) {
    return make_error("{}: W4A4 on CUDA needs in_features a multiple of 32 (cuBLASLt's FP4 rows), got {}; use "
                      "--nvfp4-activations dequantize", first.name(), k);
  }
  if (!share_w4a4_scales(linears)) {
    return make_error("{}: W4A4 parts stacked into one GEMM must share weight_scale_2 and input_scale", first.name());
  }
  int64_t rows = 0;
  for (const Linear* l : linears) rows += l->out_features();
  // Row-major scales of the stack, then re-laid into cuBLASLt's tiles.
  std::vector<uint8_t> scales(static_cast<size_t>(rows * k / 16));
  TERN_ASSIGN_OR_RETURN(void* packed, allocate(static_cast<size_t>(rows * k / 2), first.name()));
  int64_t row = 0;
  for (const Linear* l : linears) {
    const CpuMatrix& m = l->matrix();
    TERN_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(packed) + row * k / 2, m.data,
                                    static_cast<size_t>(m.rows * k / 2), cudaMemcpyHostToDevice, stream_));
    std::memcpy(scales.data() + row * k / 16, m.block_scales, static_cast<size_t>(m.rows * k / 16));
    TERN_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host data may be a temporary
    row += m.rows;
  }
  const std::vector<uint8_t> tiled = nvfp4_scales_to_tiled(scales, rows, k);
  TERN_ASSIGN_OR_RETURN(void* scales_tiled, upload(tiled.data(), tiled.size(), first.name()));
  const float input_scale = first.input_scale();
  if (!std::isfinite(input_scale) || !(input_scale > 0.0f)) {
    return make_error("{}: input_scale must be positive and finite for W4A4, got {}", first.name(), input_scale);
  }
  TERN_ASSIGN_OR_RETURN(void* scale, upload(&input_scale, sizeof(float), first.name()));
  return DeviceMatrix{.nvfp4 = true,
                      .n = rows,
                      .k = k,
                      .packed = static_cast<const uint8_t*>(packed),
                      .global_scale = first.matrix().global_scale,
                      .w4a4 = true,
                      .scales_tiled = static_cast<const uint8_t*>(scales_tiled),
                      .input_scale = input_scale,
                      .input_scale_device = static_cast<const float*>(scale)};
}

Expected<DeviceMatrix> DeviceWeights::concat_bf16(std::span<const Linear* const> linears, int64_t rows_multiple) {
  int64_t rows = 0;
  for (const Linear* l : linears) rows += l->out_features();
  const int64_t padded = (rows + rows_multiple - 1) / rows_multiple * rows_multiple;
  if (linears.size() == 1 && padded == rows) return matrix(*linears[0]);
  const int64_t k = linears[0]->in_features();
  TERN_ASSIGN_OR_RETURN(void* dst, allocate(static_cast<size_t>(padded * k) * 2, linears[0]->name()));
  auto* out = static_cast<uint16_t*>(dst);
  for (const Linear* l : linears) {
    if (!l->bias().empty()) return make_error("{}: linear layers with a bias are not supported on CUDA yet", l->name());
    std::vector<uint16_t> scratch;
    const uint16_t* src = host_bf16(l->matrix(), scratch);
    const size_t bytes = static_cast<size_t>(l->out_features() * k) * 2;
    TERN_CUDA_CHECK(cudaMemcpyAsync(out, src, bytes, cudaMemcpyHostToDevice, stream_));
    TERN_CUDA_CHECK(cudaStreamSynchronize(stream_));
    out += l->out_features() * k;
  }
  TERN_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>((padded - rows) * k) * 2, stream_));
  return DeviceMatrix{
      .nvfp4 = false, .n = padded, .k = k, .bf16 = static_cast<const uint16_t*>(dst), .gemv = bf16_gemv_};
}

static_assert(kNvfp4MaxStackedParts == 1 + kNvfp4MaxExtraParts);

Expected<DeviceMatrix> DeviceWeights::stack_nvfp4(std::span<const Linear* const> linears) {
  if (linears.size() == 1) return matrix(*linears[0]);
  int64_t rows = 0;
  for (const Linear* l : linears) rows += l->out_features();
  const int64_t k = linears[0]->in_features();
  TERN_ASSIGN_OR_RETURN(void* packed, allocate(static_cast<size_t>(rows * k / 2), linears[0]->name()));
  TERN_ASSIGN_OR_RETURN(void* scales, allocate(static_cast<size_t>(rows * k / 16), linears[0]->name()));
  DeviceMatrix d{.nvfp4 = true, .n = rows, .k = k, .packed = static_cast<const uint8_t*>(packed),
                 .scales = static_cast<const uint8_t*>(scales), .global_scale = linears[0]->matrix().global_scale};
  int64_t row = 0;
  for (size_t i = 0; i < linears.size(); ++i) {
    const Linear& l = *linears[i];
    TERN_TRY(check_supported(l));
    const CpuMatrix& m = l.matrix();
    TERN_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(packed) + row * k / 2, m.data,
                                    static_cast<size_t>(m.rows * k / 2), cudaMemcpyHostToDevice, stream_));
    TERN_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(scales) + row * k / 16, m.block_scales,
                                    static_cast<size_t>(m.rows * k / 16), cudaMemcpyHostToDevice, stream_));
    TERN_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host data may be a temporary
    if (i > 0) {
      d.part_begin[i - 1] = row;
      d.part_scale[i - 1] = m.global_scale;
    }
    row += m.rows;
  }
  return d;
}

Expected<void> DeviceWeights::copy_fp8_rows(const CpuMatrix& m, uint8_t* codes, float* scales, int64_t row,
                                           int64_t k) {
  const int64_t cols = fp8_scale_cols(k);
  TERN_CUDA_CHECK(cudaMemcpyAsync(codes + row * k, m.data, static_cast<size_t>(m.rows * k), cudaMemcpyHostToDevice,
                                  stream_));
  TERN_CUDA_CHECK(cudaMemcpyAsync(scales + row * cols, m.row_block_scales, static_cast<size_t>(m.rows * cols) * 4,
                                  cudaMemcpyHostToDevice, stream_));
  TERN_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host data may be a temporary
  return {};
}

// FP8 linears over one input as one matrix: their codes and per-row scales stacked by rows.
Expected<DeviceMatrix> DeviceWeights::stack_fp8(std::span<const Linear* const> linears) {
  if (linears.size() == 1) return matrix(*linears[0]);
  int64_t rows = 0;
  for (const Linear* l : linears) rows += l->out_features();
  const int64_t k = linears[0]->in_features();
  if (k % 16 != 0) {
    return make_error("{}: FP8 on CUDA needs in_features a multiple of 16, got {}", linears[0]->name(), k);
  }
  TERN_ASSIGN_OR_RETURN(void* codes, allocate(static_cast<size_t>(rows * k), linears[0]->name()));
  TERN_ASSIGN_OR_RETURN(void* scales, allocate(static_cast<size_t>(rows * fp8_scale_cols(k)) * 4, linears[0]->name()));
  int64_t row = 0;
  for (const Linear* l : linears) {
    TERN_TRY(check_supported(*l));
    TERN_TRY(copy_fp8_rows(l->matrix(), static_cast<uint8_t*>(codes), static_cast<float*>(scales), row, k));
    row += l->out_features();
  }
  return DeviceMatrix{.fp8 = true,
                      .n = rows,
                      .k = k,
                      .packed = static_cast<const uint8_t*>(codes),
                      .row_scales = static_cast<const float*>(scales)};
}

Expected<DeviceProjection> DeviceWeights::projection(std::span<const Linear* const> linears, int64_t width_multiple) {
  DeviceProjection p;
  p.in_features = linears.front()->in_features();
  for (const Linear* l : linears) {
    if (l->in_features() != p.in_features) {
      return make_error("{}: in_features {} differs from {} of the layers it is fused with", l->name(),
                        l->in_features(), p.in_features);
    }
  }
  for (const ProjectionRun& r : projection_runs({linears.begin(), linears.end()})) {
    const auto run = linears.subspan(r.begin, r.end - r.begin);
    // A BF16 run that ends the projection gets zero rows (layers/linear.h); one inside it does not, so that the
    // parts after it keep the columns their consumers compute.
    const int64_t rows_multiple = r.end == linears.size() ? kFusedProjectionRowMultiple : 1;
    TERN_ASSIGN_OR_RETURN(DeviceMatrix m, r.kind == LinearKind::kNvfp4 ? stack_nvfp4(run)
                                          : r.kind == LinearKind::kW4a4 ? stack_w4a4(run)
                                          : r.kind == LinearKind::kFp8  ? stack_fp8(run)
                                                                        : concat_bf16(run, rows_multiple));
    p.offsets.push_back(p.width);
    p.width += m.n;
    p.parts.push_back(m);
  }
  p.width = (p.width + width_multiple - 1) / width_multiple * width_multiple;
  for (size_t part = 0; part < p.parts.size(); ++part) {  // cuBLASLt's FP4 GEMM writes 16-byte aligned rows
    if (p.parts[part].w4a4 && (p.offsets[part] % 8 != 0 || p.width % 8 != 0)) {
      return make_error("{}: W4A4 on CUDA needs its output at a column and row stride that are multiples of 8 "
                        "(column {} of {}); use --nvfp4-activations dequantize", linears.front()->name(),
                        p.offsets[part], p.width);
    }
  }
  return p;
}

Expected<MoeExpertWeights> DeviceWeights::expert_stack(const std::vector<MlpWeights>& experts, int part,
                                                       const std::string& name) {
  // part 0: gate|up fused (BF16), 1: gate, 2: up, 3: down.
  auto pick = [&](const MlpWeights& w) -> const Linear& {
    return part == 1 || part == 0 ? w.gate_proj : part == 2 ? w.up_proj : w.down_proj;
  };
  const Linear& first = pick(experts[0]);
  const int64_t e_count = static_cast<int64_t>(experts.size()), k = first.in_features();
  const int64_t n = part == 0 ? 2 * first.out_features() : first.out_features();
  MoeExpertWeights w{};
  w.n_experts = e_count;
  w.n = n;
  w.k = k;
  if (is_nvfp4(first)) {
    w.format = MoeWeightFormat::kNvfp4;
    w.packed_expert_stride = n * k / 2;
    w.scales_expert_stride = n * k / 16;
    TERN_ASSIGN_OR_RETURN(void* packed, allocate(static_cast<size_t>(e_count * w.packed_expert_stride), name));
    TERN_ASSIGN_OR_RETURN(void* scales, allocate(static_cast<size_t>(e_count * w.scales_expert_stride), name));
    std::vector<float> globals(static_cast<size_t>(e_count));
    for (int64_t e = 0; e < e_count; ++e) {
      const CpuMatrix& m = pick(experts[e]).matrix();
      if (m.format != CpuWeightFormat::kNvfp4 || m.rows != n || m.cols != k) {
        return make_error("{}: expert {} differs in format or shape from expert 0", name, e);
      }
      TERN_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(packed) + e * w.packed_expert_stride, m.data,
                                      w.packed_expert_stride, cudaMemcpyHostToDevice, stream_));
      TERN_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(scales) + e * w.scales_expert_stride, m.block_scales,
                                      w.scales_expert_stride, cudaMemcpyHostToDevice, stream_));
      globals[e] = m.global_scale;
    }
    TERN_ASSIGN_OR_RETURN(const float* g, vector_f32(globals));
    w.packed = static_cast<const uint8_t*>(packed);
    w.scales = static_cast<const uint8_t*>(scales);
    w.global_scales = g;
    return w;
  }
  if (is_fp8(first)) {
    if (k % 16 != 0) return make_error("{}: FP8 on CUDA needs in_features a multiple of 16, got {}", name, k);
    w.format = MoeWeightFormat::kFp8;
    w.packed_expert_stride = n * k;
    w.row_scales_expert_stride = n * fp8_scale_cols(k);
    TERN_ASSIGN_OR_RETURN(void* codes, allocate(static_cast<size_t>(e_count * w.packed_expert_stride), name));
    TERN_ASSIGN_OR_RETURN(void* scales, allocate(static_cast<size_t>(e_count * w.row_scales_expert_stride) * 4, name));
    for (int64_t e = 0; e < e_count; ++e) {
      const std::vector<const Linear*> parts =
          part == 0 ? std::vector<const Linear*>{&experts[e].gate_proj, &experts[e].up_proj}
                    : std::vector<const Linear*>{&pick(experts[e])};
      int64_t row = e * n;  // the expert's first row in the stack
      for (const Linear* l : parts) {
        if (!is_fp8(*l) || l->in_features() != k) {
          return make_error("{}: expert {} differs in format or shape", name, e);
        }
        TERN_TRY(copy_fp8_rows(l->matrix(), static_cast<uint8_t*>(codes), static_cast<float*>(scales), row, k));
        row += l->out_features();
      }
    }
    w.packed = static_cast<const uint8_t*>(codes);
    w.row_scales = static_cast<const float*>(scales);
    return w;
  }
  w.format = MoeWeightFormat::kBf16;
  w.bf16_expert_stride = n * k;
  TERN_ASSIGN_OR_RETURN(void* data, allocate(static_cast<size_t>(e_count * n * k) * 2, name));
  auto* out = static_cast<uint16_t*>(data);
  for (int64_t e = 0; e < e_count; ++e) {
    const std::vector<const Linear*> parts =
        part == 0 ? std::vector<const Linear*>{&experts[e].gate_proj, &experts[e].up_proj}
                  : std::vector<const Linear*>{&pick(experts[e])};
    for (const Linear* l : parts) {
      if (linear_kind(*l) != LinearKind::kBf16 || l->in_features() != k) {
        return make_error("{}: expert {} differs in format or shape", name, e);
      }
      std::vector<uint16_t> scratch;
      const uint16_t* src = host_bf16(l->matrix(), scratch);
      const size_t bytes = static_cast<size_t>(l->out_features() * k) * 2;
      TERN_CUDA_CHECK(cudaMemcpyAsync(out, src, bytes, cudaMemcpyHostToDevice, stream_));
      TERN_CUDA_CHECK(cudaStreamSynchronize(stream_));
      out += l->out_features() * k;
    }
  }
  w.bf16 = static_cast<const uint16_t*>(data);
  return w;
}

Expected<DeviceExperts> DeviceWeights::experts(const std::vector<MlpWeights>& experts, const std::string& name) {
  if (experts.empty()) return make_error("{}: no experts", name);
  DeviceExperts d;
  d.n_experts = static_cast<int64_t>(experts.size());
  d.inter = experts[0].gate_proj.out_features();
  d.hidden = experts[0].gate_proj.in_features();
  d.nvfp4 = is_nvfp4(experts[0].gate_proj);
  if (experts[0].gate_proj.quantizes_input() || experts[0].down_proj.quantizes_input()) {
    TERN_TRY(check_w4a4_verified(name));  // the device's refusal first: it holds for every layer
    return make_error("{}: the routed experts have no W4A4 kernel on CUDA yet; use --nvfp4-activations auto (W4A4 "
                      "for the dense layers where the GPU verifies it, the experts W4A16) or dequantize", name);
  }
  if (d.nvfp4) {
    TERN_ASSIGN_OR_RETURN(d.gate, expert_stack(experts, 1, name + ".gate_proj"));
    TERN_ASSIGN_OR_RETURN(d.up, expert_stack(experts, 2, name + ".up_proj"));
  } else {
    TERN_ASSIGN_OR_RETURN(d.gate_up, expert_stack(experts, 0, name + ".gate_up_proj"));
  }
  TERN_ASSIGN_OR_RETURN(d.down, expert_stack(experts, 3, name + ".down_proj"));
  TERN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return d;
}

Expected<const uint16_t*> DeviceWeights::vector_bf16(const std::vector<float>& values) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = float_to_bf16(values[i]);
  TERN_ASSIGN_OR_RETURN(void* d, upload(bits.data(), bits.size() * 2, "a norm weight"));
  return static_cast<const uint16_t*>(d);
}

Expected<const float*> DeviceWeights::vector_f32(const std::vector<float>& values) {
  TERN_ASSIGN_OR_RETURN(void* d, upload(values.data(), values.size() * 4, "a parameter vector"));
  return static_cast<const float*>(d);
}

Expected<void> device_matrix_forward(const DeviceContext& ctx, const DeviceMatrix& w, const uint16_t* x, int64_t m,
                                     uint16_t* y, int64_t ldy) {
  if (w.w4a4) {
    const GemmNvfp4NativeArgs args{.x = x,
                                   .w = {.packed = w.packed,
                                         .scales_tiled = w.scales_tiled,
                                         .global_scale = w.global_scale,
                                         .n = w.n,
                                         .k = w.k},
                                   .input_scale = w.input_scale,
                                   .input_scale_device = w.input_scale_device,
                                   .y = y,
                                   .m = m,
                                   .ldy = ldy,
                                   .workspace = ctx.weight_workspace(),
                                   .workspace_bytes = ctx.weight_workspace_bytes()};
    return gemm_nvfp4_native(ctx, args);
  }
  if (w.fp8) {
    const GemmFp8W8a16Args args{
        .x = x, .w = Fp8WeightView{.codes = w.packed, .row_scales = w.row_scales, .n = w.n, .k = w.k}, .y = y, .m = m,
        .ldy = ldy};
    return gemm_fp8_w8a16(ctx, args);
  }
  if (w.nvfp4) {
    GemmNvfp4W4a16Args args{
        .x = x,
        .w = Nvfp4WeightView{.packed = w.packed, .scales = w.scales, .global_scale = w.global_scale, .n = w.n, .k = w.k},
        .y = y,
        .m = m,
        .ldy = ldy};
    std::copy(std::begin(w.part_begin), std::end(w.part_begin), args.w.part_begin);
    std::copy(std::begin(w.part_scale), std::end(w.part_scale), args.w.part_scale);
    return gemm_nvfp4_w4a16(ctx, args);
  }
  const GemmBf16Args args{.x = x, .w = w.bf16, .y = y, .m = m, .n = w.n, .k = w.k, .ldy = ldy};
  return w.gemv && gemv_bf16_preferred(m, w.n, w.k) ? gemv_bf16(ctx, args) : gemm_bf16(ctx, args);
}

}  // namespace tern
