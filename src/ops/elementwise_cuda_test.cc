// The elementwise ops on the GPU through the registry (label gpu): the CUDA implementations pass their self-test
// on ragged shapes, deliberately broken launches (each one fault class, all-zero outputs for every op included) are
// rejected, bad arguments and bad ids are errors, in-place calls match out-of-place ones, and a timing table reports
// achieved bandwidth.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>

#include "core/formats.h"
#include "kernels/cuda/elementwise/elementwise.h"
#include "ops/cuda_fault_test_util.h"
#include "ops/cuda_op_test.h"
#include "ops/cuda_util.h"
#include "ops/elementwise_cuda.h"

namespace tern {
namespace {

constexpr int64_t kTokens[] = {1, 7, 33, 1000};

class CudaElementwiseOps : public CudaOpTest<elementwise_register_cpu, elementwise_register_cuda> {
 protected:
  void expect_chosen(const std::string& op, const std::vector<SelfTestCase>& cases) {
    auto s = registry_select(registry_, op, devices_[0], cases, {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(s->chosen, "cuda") << op << ": " << s->candidates.front().reason;
    for (const auto& c : s->candidates) {
      if (c.name == "cuda") std::printf("%-12s cuda: %zu cases, max error %.3g (bound %.3g)\n", op.c_str(),
                                        cases.size(), c.max_error, c.bound);
    }
  }
  template <class Inputs>
  std::unique_ptr<Inputs> inputs(const std::string& op, const SelfTestCase& c, uint64_t seed = 7) {
    auto in = registry_.harness(op)->make_inputs(c, seed);
    EXPECT_TRUE(in.has_value());
    return std::unique_ptr<Inputs>(static_cast<Inputs*>(in->release()));
  }
};

TEST_F(CudaElementwiseOps, RmsNormPassesOnRaggedShapes) {
  std::vector<SelfTestCase> cases;
  for (int64_t t : kTokens) {
    cases.push_back(rms_norm_case(t, 1, 64, RmsNormForm::kPlain, false));
    cases.push_back(rms_norm_case(t, 1, 2048, RmsNormForm::kZeroCentred, true));
    cases.push_back(rms_norm_case(t, 1, 4096, RmsNormForm::kPlain, true));
    cases.push_back(rms_norm_case(t, 1, 4096, RmsNormForm::kZeroCentred, false));
    for (int64_t hd : {64, 128, 256}) cases.push_back(rms_norm_case(t, 16, hd, RmsNormForm::kZeroCentred, false));
    cases.push_back(rms_norm_case(t, 8, 128, RmsNormForm::kGated, false));
  }
  cases.push_back(rms_norm_case(7, 1, 16384, RmsNormForm::kZeroCentred, true));  // 8 chunks per thread
  cases.push_back(rms_norm_case(3, 1, 5120, RmsNormForm::kPlain, false));        // a partly filled last pass
  expect_chosen("rms_norm", cases);
}

TEST_F(CudaElementwiseOps, RopePassesOnRaggedShapes) {
  std::vector<SelfTestCase> cases;
  for (int64_t t : kTokens) {
    cases.push_back(rope_case(t, 8, 64, 64, false, 10000));
    cases.push_back(rope_case(t, 8, 128, 128, false, 1000000));
    cases.push_back(rope_case(t, 4, 256, 64, false, 10000000));  // Qwen3.5 partial rotary
    cases.push_back(rope_case(t, 8, 64, 64, true, 10000));       // interleaved (GLM, DeepSeek)
    cases.push_back(rope_case(t, 3, 192, 64, true, 10000));      // interleaved, partial
  }
  expect_chosen("rope", cases);
}

TEST_F(CudaElementwiseOps, SiluMulEmbeddingAndAddPassOnRaggedShapes) {
  std::vector<SelfTestCase> silu, embed, add;
  for (int64_t t : kTokens) {
    for (int64_t h : {64, 2048, 4096}) {
      silu.push_back(silu_mul_case(t, h));
      add.push_back(residual_add_case(t, h));
    }
    embed.push_back(embedding_case(t, 1000, 64));
    embed.push_back(embedding_case(t, 3000, 2048));
  }
  expect_chosen("silu_mul", silu);
  expect_chosen("embedding", embed);
  expect_chosen("residual_add", add);
}

struct Fault {
  std::string op, name, expected_reason;
  std::function<Expected<RunOutput>(const DeviceContext&, const OpInputs&)> run;
};

template <class Inputs, class Args>
std::function<Expected<RunOutput>(const DeviceContext&, const OpInputs&)> tweaked(
    Expected<RunOutput> (*runner)(const DeviceContext&, const Inputs&, const ArgsTweak<Args>&), ArgsTweak<Args> t) {
  return [runner, t](const DeviceContext& ctx, const OpInputs& in) { return runner(ctx, static_cast<const Inputs&>(in), t); };
}

// The all-zeros class: the kernel runs on scratch copies of its outputs while the real ones are cleared.
template <class Inputs, class Args>
std::function<Expected<RunOutput>(const DeviceContext&, const OpInputs&)> zeroed(
    Expected<RunOutput> (*runner)(const DeviceContext&, const Inputs&, const ArgsTweak<Args>&),
    std::function<void(ZeroedOutputs&, Args&)> redirect) {
  return [runner, redirect](const DeviceContext& ctx, const OpInputs& in) {
    ZeroedOutputs zero(ctx.stream());
    return runner(ctx, static_cast<const Inputs&>(in), [&](Args& a) { redirect(zero, a); });
  };
}

std::vector<Fault> gpu_faults() {
  return {
      {"rms_norm", "all-zeros", "all zeros",
       zeroed<RmsNormInputs, RmsNormArgs>(rms_norm_cuda_run,
                                          [](ZeroedOutputs& z, RmsNormArgs& a) {
                                            z.redirect(a.y, static_cast<size_t>(a.rows * a.dim));
                                            if (a.h_out != nullptr)
                                              z.redirect(a.h_out, static_cast<size_t>(a.rows * a.dim));
                                          })},
      {"rope", "all-zeros", "all zeros",
       zeroed<RopeInputs, RopeArgs>(rope_cuda_run,
                                    [](ZeroedOutputs& z, RopeArgs& a) {
                                      z.redirect(a.y, static_cast<size_t>(a.tokens * a.n_heads * a.head_dim));
                                    })},
      {"silu_mul", "all-zeros", "all zeros",
       zeroed<SiluMulInputs, SiluMulArgs>(
           silu_mul_cuda_run,
           [](ZeroedOutputs& z, SiluMulArgs& a) { z.redirect(a.y, static_cast<size_t>(a.rows * a.inter)); })},
      {"embedding", "all-zeros", "all zeros",
       zeroed<EmbeddingInputs, EmbeddingArgs>(
           embedding_cuda_run,
           [](ZeroedOutputs& z, EmbeddingArgs& a) { z.redirect(a.y, static_cast<size_t>(a.tokens * a.hidden)); })},
      {"residual_add", "all-zeros", "all zeros",
       zeroed<ResidualAddInputs, ResidualAddArgs>(
           residual_add_cuda_run,
           [](ZeroedOutputs& z, ResidualAddArgs& a) { z.redirect(a.y, static_cast<size_t>(a.n)); })},
      {"rms_norm", "no-1+w", "exceeds the tolerance",
       tweaked<RmsNormInputs, RmsNormArgs>(rms_norm_cuda_run, [](RmsNormArgs& a) { a.zero_centred = false; })},
      {"rms_norm", "last-row-skipped", "never written",
       tweaked<RmsNormInputs, RmsNormArgs>(rms_norm_cuda_run, [](RmsNormArgs& a) { a.rows -= 1; })},
      {"rms_norm", "wrong-eps", "exceeds the tolerance",
       tweaked<RmsNormInputs, RmsNormArgs>(rms_norm_cuda_run, [](RmsNormArgs& a) { a.eps = 0.3f; })},
      {"rope", "wrong-half", "exceeds the tolerance",
       tweaked<RopeInputs, RopeArgs>(rope_cuda_run, [](RopeArgs& a) { a.interleaved = !a.interleaved; })},
      {"rope", "rotary-dim-halved", "exceeds the tolerance",
       tweaked<RopeInputs, RopeArgs>(rope_cuda_run, [](RopeArgs& a) { a.rotary_dim /= 2; })},
      // The reference has no attention factor: a kernel that applies one is off (one that ignored it would pass).
      {"rope", "attention-factor", "exceeds the tolerance",
       tweaked<RopeInputs, RopeArgs>(rope_cuda_run, [](RopeArgs& a) { a.attention_factor = 1.25f; })},
      {"rope", "last-token-skipped", "never written",
       tweaked<RopeInputs, RopeArgs>(rope_cuda_run, [](RopeArgs& a) { a.tokens -= 1; })},
      {"silu_mul", "last-row-skipped", "never written",
       tweaked<SiluMulInputs, SiluMulArgs>(silu_mul_cuda_run, [](SiluMulArgs& a) { a.rows -= 1; })},
      {"silu_mul", "wrong-split", "exceeds the tolerance",
       tweaked<SiluMulInputs, SiluMulArgs>(silu_mul_cuda_run,
                                           [](SiluMulArgs& a) {
                                             a.inter /= 2;
                                             a.rows *= 2;
                                           })},
      {"embedding", "vocab-one-short", "outside the vocabulary",
       tweaked<EmbeddingInputs, EmbeddingArgs>(embedding_cuda_run, [](EmbeddingArgs& a) { a.vocab -= 1; })},
  };
}

TEST_F(CudaElementwiseOps, InjectedFaultsAreRejectedOnTheGpu) {
  for (const Fault& f : gpu_faults()) {
    ASSERT_TRUE(registry_
                    .add(Implementation{.op = f.op, .name = f.name, .backend = Backend::kCuda, .priority = 100,
                                        .tolerance = kBf16ElementwiseTolerance,
                                        .run = [this, run = f.run](const OpInputs& in) { return run(*context_, in); }})
                    .has_value());
  }
  const std::vector<std::pair<std::string, SelfTestCase>> cases = {
      {"rms_norm", rms_norm_case(33, 1, 2048, RmsNormForm::kZeroCentred, true)},
      {"rope", rope_case(33, 4, 256, 64, false, 10000000)},
      {"silu_mul", silu_mul_case(33, 2048)},
      {"embedding", embedding_case(33, 1000, 64)},
      {"residual_add", residual_add_case(33, 2048)},
  };
  for (const auto& [op, c] : cases) {
    auto s = registry_select(registry_, op, devices_[0], std::span(&c, 1), {});
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(s->chosen, "cuda") << op;
    for (const Fault& f : gpu_faults()) {
      if (f.op != op) continue;
      const CandidateReport* it = s->candidate(f.name);
      ASSERT_NE(it, nullptr) << f.name;
      EXPECT_EQ(it->status, CandidateStatus::kFailed) << f.name;
      EXPECT_NE(it->reason.find(f.expected_reason), std::string::npos) << f.name << ": " << it->reason;
    }
  }
}

TEST_F(CudaElementwiseOps, BadIdsAndBadArgumentsAreErrors) {
  auto in = inputs<EmbeddingInputs>("embedding", embedding_case(9, 100, 64));
  in->ids[5] = -3;
  in->ids[7] = 100;
  auto out = embedding_cuda_run(*context_, *in);
  ASSERT_FALSE(out.has_value());
  EXPECT_NE(out.error().message.find("token 5 has id -3 outside the vocabulary [0, 100)"), std::string::npos)
      << out.error().message;

  DeviceBuffer buf(4096);
  const uint16_t* p = buf.as<uint16_t>();
  auto norm = rms_norm(*context_, {.x = p + 1, .weight = p, .y = buf.as<uint16_t>(), .rows = 1, .dim = 64});
  ASSERT_FALSE(norm.has_value());
  EXPECT_NE(norm.error().message.find("x is not 16-byte aligned"), std::string::npos) << norm.error().message;
  norm = rms_norm(*context_, {.x = p, .weight = p, .y = buf.as<uint16_t>(), .rows = 1, .dim = 60});
  ASSERT_FALSE(norm.has_value());
  EXPECT_NE(norm.error().message.find("dim=60 must be a positive multiple of 8"), std::string::npos);
  auto r = rope(*context_, {.x = p, .y = buf.as<uint16_t>(), .positions = buf.as<int32_t>(), .inv_freq = buf.as<float>(),
                            .tokens = 1, .n_heads = 1, .head_dim = 64, .rotary_dim = 128});
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("rotary_dim=128 must be positive, even and at most head_dim=64"), std::string::npos);
}

// In place (y == x, h_out == residual) must give the bits of the out-of-place call.
TEST_F(CudaElementwiseOps, InPlaceMatchesOutOfPlace) {
  auto in = inputs<RmsNormInputs>("rms_norm", rms_norm_case(33, 1, 2048, RmsNormForm::kZeroCentred, true));
  auto expected = rms_norm_cuda_run(*context_, *in);
  ASSERT_TRUE(expected.has_value());
  const size_t n = in->x.size();
  DeviceBuffer x(n * 2), res(n * 2), w(in->weight.size() * 2);
  // The context's stream does not order with the legacy default stream: copy and wait on it explicitly.
  const cudaStream_t stream = context_->stream();
  TERN_CUDA_CHECK(cudaMemcpyAsync(x.data(), in->x.data(), n * 2, cudaMemcpyHostToDevice, stream));
  TERN_CUDA_CHECK(cudaMemcpyAsync(res.data(), in->residual_in.data(), n * 2, cudaMemcpyHostToDevice, stream));
  TERN_CUDA_CHECK(cudaMemcpyAsync(w.data(), in->weight.data(), in->weight.size() * 2, cudaMemcpyHostToDevice, stream));
  ASSERT_TRUE(rms_norm(*context_, {.x = x.as<uint16_t>(), .residual = res.as<uint16_t>(), .h_out = res.as<uint16_t>(),
                                   .weight = w.as<uint16_t>(), .y = x.as<uint16_t>(), .rows = in->rows,
                                   .dim = in->dim, .eps = in->eps, .zero_centred = true})
                  .has_value());
  context_->synchronize();
  std::vector<uint16_t> h(n), y(n);
  TERN_CUDA_CHECK(cudaMemcpy(h.data(), res.data(), n * 2, cudaMemcpyDeviceToHost));
  TERN_CUDA_CHECK(cudaMemcpy(y.data(), x.data(), n * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(bf16_to_float(h[i]), expected->values[i]) << "h " << i;
    ASSERT_EQ(bf16_to_float(y[i]), expected->values[n + i]) << "y " << i;
  }
}

// Gates read from inside a wider projection output (GDN's [qkv | z | b | a] rows: gate_stride, gate_heads) must
// give the bits of the dense-gate call, which RmsNormPassesOnRaggedShapes checks against the CPU; the columns
// around the gates hold NaN, so reading any of them shows.
TEST_F(CudaElementwiseOps, StridedGatesMatchDenseGates) {
  constexpr int64_t kHeads = 8, kDim = 128, kLead = 24, kStride = kLead + kHeads * kDim + 40;
  auto in = inputs<RmsNormInputs>("rms_norm", rms_norm_case(5, kHeads, kDim, RmsNormForm::kGated, false));
  ASSERT_EQ(in->rows % kHeads, 0);
  auto dense = rms_norm_cuda_run(*context_, *in);
  ASSERT_TRUE(dense.has_value()) << dense.error().message;
  const int64_t tokens = in->rows / kHeads;
  std::vector<uint16_t> wide(static_cast<size_t>(tokens * kStride), 0x7FC0);  // bf16 NaN
  for (int64_t t = 0; t < tokens; ++t) {
    std::copy_n(in->gate.begin() + t * kHeads * kDim, kHeads * kDim, wide.begin() + t * kStride + kLead);
  }
  DeviceBuffer gates(wide.size() * 2);
  gates.upload(wide.data(), wide.size() * 2);
  auto strided = rms_norm_cuda_run(*context_, *in, [&](RmsNormArgs& a) {
    a.gate = gates.as<uint16_t>() + kLead;
    a.gate_stride = kStride;
    a.gate_heads = kHeads;
  });
  ASSERT_TRUE(strided.has_value()) << strided.error().message;
  ASSERT_EQ(strided->values.size(), dense->values.size());
  for (size_t i = 0; i < dense->values.size(); ++i) {
    ASSERT_TRUE(std::isfinite(dense->values[i])) << i;
    ASSERT_EQ(strided->values[i], dense->values[i]) << i;
  }
  auto bad = rms_norm_cuda_run(*context_, *in, [&](RmsNormArgs& a) {
    a.gate_stride = kHeads * kDim + 4;
    a.gate_heads = kHeads;
  });
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("gate_stride=1028 must be a multiple of 8"), std::string::npos)
      << bad.error().message;
}

// x rows inside a wider projection output (MLA's q_a columns of [q_a | kv_a | ...]) must give the bits of the dense
// call; the columns around them hold NaN. Then y rows written inside a wider buffer (y_stride, from strided x too):
// the same bits in each row, and the poisoned columns between the rows unchanged.
TEST_F(CudaElementwiseOps, StridedRowsMatchDenseRows) {
  constexpr int64_t kDim = 512, kLead = 16, kStride = kLead + kDim + 72;
  auto in = inputs<RmsNormInputs>("rms_norm", rms_norm_case(9, 1, kDim, RmsNormForm::kPlain, false));
  auto dense = rms_norm_cuda_run(*context_, *in);
  ASSERT_TRUE(dense.has_value()) << dense.error().message;
  std::vector<uint16_t> wide(static_cast<size_t>(in->rows * kStride), 0x7FC0);  // bf16 NaN
  for (int64_t r = 0; r < in->rows; ++r) std::copy_n(in->x.begin() + r * kDim, kDim, wide.begin() + r * kStride + kLead);
  DeviceBuffer xs(wide.size() * 2);
  xs.upload(wide.data(), wide.size() * 2);
  auto strided = rms_norm_cuda_run(*context_, *in, [&](RmsNormArgs& a) {
    a.x = xs.as<uint16_t>() + kLead;
    a.x_stride = kStride;
  });
  ASSERT_TRUE(strided.has_value()) << strided.error().message;
  ASSERT_EQ(strided->values.size(), dense->values.size());
  for (size_t i = 0; i < dense->values.size(); ++i) {
    ASSERT_TRUE(std::isfinite(dense->values[i])) << i;
    ASSERT_EQ(strided->values[i], dense->values[i]) << i;
  }
  auto bad = rms_norm_cuda_run(*context_, *in, [&](RmsNormArgs& a) { a.x_stride = kDim + 4; });
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("x_stride=516 must be a multiple of 8"), std::string::npos) << bad.error().message;

  constexpr int64_t kYLead = 8, kYStride = kYLead + kDim + 40;
  constexpr uint16_t kGap = 0x7FBA;  // a NaN pattern no bf16 result rounds to
  const std::vector<uint16_t> poisoned(static_cast<size_t>(in->rows * kYStride), kGap);
  DeviceBuffer ys(poisoned.size() * 2);
  ys.upload(poisoned.data(), poisoned.size() * 2);
  auto y_strided = rms_norm_cuda_run(*context_, *in, [&](RmsNormArgs& a) {
    a.x = xs.as<uint16_t>() + kLead;
    a.x_stride = kStride;
    a.y = ys.as<uint16_t>() + kYLead;
    a.y_stride = kYStride;
  });
  ASSERT_TRUE(y_strided.has_value()) << y_strided.error().message;
  std::vector<uint16_t> wide_y(poisoned.size());
  TERN_CUDA_CHECK(cudaMemcpy(wide_y.data(), ys.data(), wide_y.size() * 2, cudaMemcpyDeviceToHost));
  for (int64_t r = 0; r < in->rows; ++r) {
    for (int64_t c = 0; c < kYStride; ++c) {
      const uint16_t got = wide_y[r * kYStride + c];
      if (c < kYLead || c >= kYLead + kDim) {
        ASSERT_EQ(got, kGap) << "row " << r << " column " << c << " outside the row was written";
      } else {
        ASSERT_EQ(bf16_to_float(got), dense->values[r * kDim + c - kYLead]) << "row " << r << " column " << c;
      }
    }
  }
  bad = rms_norm_cuda_run(*context_, *in, [&](RmsNormArgs& a) { a.y_stride = kDim + 4; });
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("y_stride=516 must be a multiple of 8"), std::string::npos) << bad.error().message;
  bad = rms_norm_cuda_run(*context_, *in, [&](RmsNormArgs& a) { a.y_stride = kDim - 8; });
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("y_stride=504 must be a multiple of 8"), std::string::npos) << bad.error().message;
  bad = rms_norm_cuda_run(*context_, *in, [&](RmsNormArgs& a) {
    a.residual = a.x;
    a.h_out = a.y;
    a.y_stride = kYStride;
  });
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("y_stride with a residual is not supported"), std::string::npos)
      << bad.error().message;
}

// silu_mul over the gate|up columns inside a wider projection output (the MoE block's [shared gate | shared up |
// router | ...] rows) must give the bits of the dense call; the columns around them hold NaN.
TEST_F(CudaElementwiseOps, StridedSiluMulMatchesDense) {
  constexpr int64_t kInter = 512, kStride = 2 * kInter + 264;
  auto in = inputs<SiluMulInputs>("silu_mul", silu_mul_case(7, kInter));
  auto dense = silu_mul_cuda_run(*context_, *in);
  ASSERT_TRUE(dense.has_value()) << dense.error().message;
  std::vector<uint16_t> wide(static_cast<size_t>(in->rows * kStride), 0x7FC0);  // bf16 NaN
  for (int64_t r = 0; r < in->rows; ++r) {
    std::copy_n(in->gate_up.begin() + r * 2 * kInter, 2 * kInter, wide.begin() + r * kStride);
  }
  DeviceBuffer gate_up(wide.size() * 2);
  gate_up.upload(wide.data(), wide.size() * 2);
  auto strided = silu_mul_cuda_run(*context_, *in, [&](SiluMulArgs& a) {
    a.gate_up = gate_up.as<uint16_t>();
    a.gate_up_stride = kStride;
  });
  ASSERT_TRUE(strided.has_value()) << strided.error().message;
  for (size_t i = 0; i < dense->values.size(); ++i) {
    ASSERT_TRUE(std::isfinite(dense->values[i])) << i;
    ASSERT_EQ(strided->values[i], dense->values[i]) << i;
  }
  auto bad = silu_mul_cuda_run(*context_, *in, [&](SiluMulArgs& a) { a.gate_up_stride = 2 * kInter - 8; });
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("gate_up_stride=1016 must be a multiple of 8"), std::string::npos)
      << bad.error().message;
}

// Achieved bandwidth at a decode-like and a prefill-like size, next to a device-to-device copy.
TEST_F(CudaElementwiseOps, Bandwidth) {
  const size_t copy_bytes = size_t{512} << 20;
  DeviceBuffer src(copy_bytes), dst(copy_bytes);
  cudaEvent_t e0, e1;
  TERN_CUDA_CHECK(cudaEventCreate(&e0));
  TERN_CUDA_CHECK(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int i = 0; i < 5; ++i) {
    TERN_CUDA_CHECK(cudaEventRecord(e0, context_->stream()));
    TERN_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), copy_bytes, cudaMemcpyDeviceToDevice, context_->stream()));
    TERN_CUDA_CHECK(cudaEventRecord(e1, context_->stream()));
    TERN_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    TERN_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  std::printf("%-34s %9.1f us %8.1f GB/s\n", "device copy 512 MiB", best * 1e3, 2.0 * copy_bytes / (best * 1e-3) / 1e9);
  auto report = [](const std::string& what, double bytes, const Expected<RunOutput>& out) {
    ASSERT_TRUE(out.has_value()) << out.error().message;
    std::printf("%-34s %9.1f us %8.1f GB/s\n", what.c_str(), out->seconds * 1e6, bytes / out->seconds / 1e9);
  };
  for (int64_t t : {int64_t{32}, int64_t{4096}}) {
    const int64_t h = 4096, inter = 8192, heads = 32, hd = 128;
    auto norm = inputs<RmsNormInputs>("rms_norm", rms_norm_case(t, 1, h, RmsNormForm::kZeroCentred, true));
    report(fmt::format("rms_norm+residual T={} H={}", t, h), 8.0 * t * h, rms_norm_cuda_run(*context_, *norm));
    auto qk = inputs<RmsNormInputs>("rms_norm", rms_norm_case(t, heads, hd, RmsNormForm::kZeroCentred, false));
    report(fmt::format("q_norm T={} 32x128", t), 4.0 * t * heads * hd, rms_norm_cuda_run(*context_, *qk));
    auto ro = inputs<RopeInputs>("rope", rope_case(t, heads, hd, hd, false, 1000000));
    report(fmt::format("rope T={} 32x128", t), 4.0 * t * heads * hd, rope_cuda_run(*context_, *ro));
    auto sm = inputs<SiluMulInputs>("silu_mul", silu_mul_case(t, inter));
    report(fmt::format("silu_mul T={} I={}", t, inter), 6.0 * t * inter, silu_mul_cuda_run(*context_, *sm));
    auto em = inputs<EmbeddingInputs>("embedding", embedding_case(t, 32000, h));
    report(fmt::format("embedding T={} H={}", t, h), 4.0 * t * h, embedding_cuda_run(*context_, *em));
    auto ad = inputs<ResidualAddInputs>("residual_add", residual_add_case(t, h));
    report(fmt::format("residual_add T={} H={}", t, h), 6.0 * t * h, residual_add_cuda_run(*context_, *ad));
  }
  TERN_CUDA_CHECK(cudaEventDestroy(e0));
  TERN_CUDA_CHECK(cudaEventDestroy(e1));
}

}  // namespace
}  // namespace tern
