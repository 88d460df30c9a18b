// projection_runs: how a block's fused input projections split into the GEMMs a device computes (and the self-test
// plans). Each expectation follows from the rules in layers/linear.h, written out by hand for each case.
#include "layers/linear.h"

#include <gtest/gtest.h>

#include <vector>

namespace tern {
namespace {

// A linear of `rows` outputs in `format` (no data: projection_runs reads formats, shapes and scales only).
Linear part(CpuWeightFormat format, int64_t rows, float global_scale = 1.0f) {
  return Linear("p", CpuMatrix{.format = format, .rows = rows, .cols = 64, .global_scale = global_scale});
}

struct Want {
  LinearKind kind;
  size_t begin, end;
  int64_t rows;
};

void expect_runs(const std::vector<Linear>& linears, const std::vector<Want>& want) {
  std::vector<const Linear*> parts;
  for (const Linear& l : linears) parts.push_back(&l);
  const std::vector<ProjectionRun> got = projection_runs(parts);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].kind, want[i].kind) << "run " << i;
    EXPECT_EQ(got[i].begin, want[i].begin) << "run " << i;
    EXPECT_EQ(got[i].end, want[i].end) << "run " << i;
    EXPECT_EQ(got[i].rows, want[i].rows) << "run " << i;
  }
}

constexpr auto kB = CpuWeightFormat::kBf16, kN = CpuWeightFormat::kNvfp4, kF = CpuWeightFormat::kFp8Block128;

TEST(ProjectionRuns, AdjacentPartsOfOneKindStackAndOnlyTheLastBf16RunIsPadded) {
  // BF16 and fp32 alike (both BF16 on a device), the last run padded to a multiple of 8 rows.
  expect_runs({part(kB, 1024), part(CpuWeightFormat::kF32, 256), part(kB, 1)}, {{LinearKind::kBf16, 0, 3, 1288}});
  // A BF16 run inside the projection keeps its rows, so the parts after it keep their columns.
  expect_runs({part(kB, 3), part(kB, 2), part(kN, 16), part(kB, 5)},
              {{LinearKind::kBf16, 0, 2, 5}, {LinearKind::kNvfp4, 2, 3, 16}, {LinearKind::kBf16, 3, 4, 8}});
  expect_runs({part(kF, 128), part(kF, 128), part(kB, 8)},
              {{LinearKind::kFp8, 0, 2, 256}, {LinearKind::kBf16, 2, 3, 8}});
}

TEST(ProjectionRuns, Nvfp4RunsTakeAtMostFourParts) {
  std::vector<Linear> six;
  for (int i = 0; i < 6; ++i) six.push_back(part(kN, 16 * (i + 1), 0.5f * static_cast<float>(i + 1)));
  expect_runs(six, {{LinearKind::kNvfp4, 0, 4, 16 + 32 + 48 + 64}, {LinearKind::kNvfp4, 4, 6, 80 + 96}});
}

TEST(ProjectionRuns, W4a4PartsStackOnlyWithOneAlpha) {
  auto w4a4 = [](int64_t rows, float global_scale, float input_scale) {
    Linear l = part(kN, rows, global_scale);
    l.set_input_quantization(input_scale);
    return l;
  };
  expect_runs({w4a4(32, 1.0f, 2.0f), w4a4(16, 1.0f, 2.0f), part(kN, 16)},
              {{LinearKind::kW4a4, 0, 2, 48}, {LinearKind::kNvfp4, 2, 3, 16}});
  // Scales that differ anywhere in the run: a GEMM a part until the rest agree.
  expect_runs({w4a4(32, 1.0f, 2.0f), w4a4(16, 1.0f, 3.0f), w4a4(8, 1.0f, 3.0f)},
              {{LinearKind::kW4a4, 0, 1, 32}, {LinearKind::kW4a4, 1, 3, 24}});
  expect_runs({w4a4(32, 1.0f, 2.0f), w4a4(16, 4.0f, 2.0f)},
              {{LinearKind::kW4a4, 0, 1, 32}, {LinearKind::kW4a4, 1, 2, 16}});
}

}  // namespace
}  // namespace tern
