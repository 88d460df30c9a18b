// Hopper warpgroup matrix multiply (wgmma, sm_90a only): shared-memory matrix descriptors for the 128-byte swizzled
// K-major layout, the fences and the bf16 m64nNk16 instructions with fp32 accumulators. A K-major operand tile is
// rows of 64 bf16 (128 bytes); the 16-byte chunk c of row r sits at chunk c ^ (r % 8) of that row, and a tile starts
// on a 1024-byte boundary (the swizzle XORs address bits 4..6 with bits 7..9). The k16 slice j of a tile is the same
// descriptor with its start 32 j bytes further. Include from .cu files only, and call only from code compiled for
// sm_90a (guard with TERN_WGMMA_AVAILABLE).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TERN_WGMMA_AVAILABLE 1
#else
#define TERN_WGMMA_AVAILABLE 0
#endif

namespace tern::wgmma {

// Byte offset of chunk c (16 bytes) of row r in a 128-byte-swizzled tile.
__host__ __device__ constexpr uint32_t sw128_offset(int r, int c) {
  return static_cast<uint32_t>(r * 128 + ((c ^ (r % 8)) * 16));
}

// Descriptor of a K-major, 128-byte-swizzled bf16 tile at shared address `addr` (1024-byte aligned, plus 32 j for
// k16 slice j): the leading-dimension offset is unused in this layout (1 by convention), the stride between groups
// of 8 rows is 1024 bytes, layout type 1 = 128-byte swizzle.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// Descriptor of an N-major (MN-major), 128-byte-swizzled bf16 B tile at shared address `addr` (1024-byte aligned):
// rows of 64 n-elements, one per k, 1024 bytes between groups of 8 k (the stride offset) and `n_block_bytes` between
// blocks of 64 n (the leading offset; for transposed operands these two swap the roles they have in K-major).
__device__ __forceinline__ uint64_t sw128_mn_desc(uint32_t addr, uint32_t n_block_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{(n_block_bytes & 0x3FFFF) >> 4} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

#if TERN_WGMMA_AVAILABLE
// Orders this thread's register accesses before the wgmma instructions that follow (their accumulators).
__device__ __forceinline__ void fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending committed groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Makes this thread's generic-proxy writes to shared memory (st.shared, completed cp.async) visible to the async
// proxy that wgmma reads through; then a barrier publishes them to the other threads.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The accumulator operands of an m64nNk16 tile: N / 2 fp32 registers a thread, as "+f" constraints on d[] and as the
// instruction's "%0, %1, ..." list (the accumulators come first in every form below).
#define TERN_WGMMA_D8(i)                                                                                      \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define TERN_WGMMA_D32 TERN_WGMMA_D8(0), TERN_WGMMA_D8(8), TERN_WGMMA_D8(16), TERN_WGMMA_D8(24)
#define TERN_WGMMA_D64 TERN_WGMMA_D32, TERN_WGMMA_D8(32), TERN_WGMMA_D8(40), TERN_WGMMA_D8(48), TERN_WGMMA_D8(56)
#define TERN_WGMMA_D128                                                                                          \
  TERN_WGMMA_D64, TERN_WGMMA_D8(64), TERN_WGMMA_D8(72), TERN_WGMMA_D8(80), TERN_WGMMA_D8(88), TERN_WGMMA_D8(96), \
      TERN_WGMMA_D8(104), TERN_WGMMA_D8(112), TERN_WGMMA_D8(120)
#define TERN_WGMMA_R32                                                     \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define TERN_WGMMA_R64                                                                 \
  TERN_WGMMA_R32                                                                       \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define TERN_WGMMA_R128                                                                          \
  TERN_WGMMA_R64                                                                                 \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "           \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "             \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// D (+)= A B for one m64nNk16 bf16 tile of the warpgroup (N = 64, 128, 256): A and B from shared memory
// (descriptors), fp32 accumulators in d; scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" TERN_WGMMA_R32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : TERN_WGMMA_D32
      : "l"(desc_a), "l"(desc_b), "r"(scale_d)
      : "memory");
}
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" TERN_WGMMA_R64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : TERN_WGMMA_D64
      : "l"(desc_a), "l"(desc_b), "r"(scale_d)
      : "memory");
}
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" TERN_WGMMA_R128 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : TERN_WGMMA_D128
      : "l"(desc_a), "l"(desc_b), "r"(scale_d)
      : "memory");
}

// The instruction for a warpgroup tile of kN columns.
template <int kN>
__device__ __forceinline__ void mma_m64k16(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  if constexpr (kN == 64) {
    wgmma_m64n64k16(d, desc_a, desc_b, scale_d);
  } else if constexpr (kN == 128) {
    wgmma_m64n128k16(d, desc_a, desc_b, scale_d);
  } else {
    static_assert(kN == 256);
    wgmma_m64n256k16(d, desc_a, desc_b, scale_d);
  }
}

// Keeps the compiler from moving accumulator registers across the asynchronous wgmma that owns them (call on the
// accumulators after wait_group and before the next issue).
template <int kN>
__device__ __forceinline__ void fence_operands(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// D (+)= A B with A from registers (RS form): a[] is the warp's 16 x 16 slice of the warpgroup's 64 x 16 A, in
// mma.m16n8k16's A fragment layout (a[0]: row g, k 2t..2t+1; a[1]: row g + 8, same k; a[2]: row g, k 2t+8..2t+9;
// a[3]: row g + 8, same k; g = lane / 4, t = lane % 4, warp w of the warpgroup holding rows 16 w ..). B from shared
// memory: K-major (kTransB = 0, sw128_desc) or N-major (kTransB = 1, sw128_mn_desc: B is K x N with N contiguous,
// as a [k][n] row-major tile such as attention's V [key][dim]; its k16 slice j starts 2048 j bytes further). The
// registers of a[] must not change until a wait_group retires this wgmma.
template <int kTransB>
__device__ __forceinline__ void wgmma_rs_m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                   int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" TERN_WGMMA_R32
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : TERN_WGMMA_D32
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB)
      : "memory");
}
template <int kTransB>
__device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                    int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" TERN_WGMMA_R64
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
      : TERN_WGMMA_D64
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB)
      : "memory");
}
template <int kTransB>
__device__ __forceinline__ void wgmma_rs_m64n256k16(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b,
                                                    int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" TERN_WGMMA_R128
      "}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n"
      : TERN_WGMMA_D128
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB)
      : "memory");
}

template <int kN, int kTransB = 0>
__device__ __forceinline__ void mma_rs_m64k16(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t desc_b,
                                              int scale_d) {
  if constexpr (kN == 64) {
    wgmma_rs_m64n64k16<kTransB>(d, a, desc_b, scale_d);
  } else if constexpr (kN == 128) {
    wgmma_rs_m64n128k16<kTransB>(d, a, desc_b, scale_d);
  } else {
    static_assert(kN == 256);
    wgmma_rs_m64n256k16<kTransB>(d, a, desc_b, scale_d);
  }
}

// fence_operands for registers that an asynchronous wgmma reads (its A fragments): kept live and unchanged up to here.
template <int kN>
__device__ __forceinline__ void fence_operands(uint32_t (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

#undef TERN_WGMMA_D8
#undef TERN_WGMMA_D32
#undef TERN_WGMMA_D64
#undef TERN_WGMMA_D128
#undef TERN_WGMMA_R32
#undef TERN_WGMMA_R64
#undef TERN_WGMMA_R128

#endif  // TERN_WGMMA_AVAILABLE

}  // namespace tern::wgmma
