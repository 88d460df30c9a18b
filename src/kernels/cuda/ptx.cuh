// Inline-PTX helpers shared by the tensor-core kernels (attention, the NVFP4 GEMMs, the MoE GEMM): shared-memory
// addresses, cp.async copies with zero fill, ldmatrix, the bf16 and TF32 mma.sync. All exist on sm_80 and later, so on
// sm_90a, sm_100a and sm_120a alike. Include from .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tern::ptx {

// Programmatic dependent launch (sm_90 and later). A kernel launched with programmatic stream serialization
// (launch.cuh) may start while the previous kernel of its stream is still running: it lets the next kernel launch
// as soon as all of its own blocks have started (grid_dependents_launch), and waits for the previous kernel to
// complete and its writes to be visible (grid_dependency_wait) before reading or writing memory that kernel (or an
// earlier one) uses. Without that launch attribute both are no-ops. Every kernel launched through launch_kernel
// begins with grid_dependency_begin(), so it waits before any access to memory and in all its blocks: the wait also
// chains, and a kernel cannot complete before its predecessor has. The exceptions are the BF16 GEMV and the dense
// NVFP4 decode GEMM, which load their first weights (memory no kernel writes) between the two. Before the wait, a
// kernel may read nothing that any kernel writes: its predecessor's predecessor may still be running. (No L2
// prefetch of the GEMV's weights before the wait either: the extra L2 requests made it slower; see
// docs/perf/gpu.md §gemv-l2-prefetch.)
__device__ __forceinline__ void grid_dependents_launch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
__device__ __forceinline__ void grid_dependency_begin() {
  grid_dependents_launch();
  grid_dependency_wait();
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from global to shared memory, asynchronously; zeros instead when !valid (src is then not read).
__device__ __forceinline__ void cp_async_16_zfill(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
// 4 bytes the same way (through L1: cp.async.cg takes only 16).
__device__ __forceinline__ void cp_async_4_zfill(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}
// 16 and 4 bytes from global to the shared-memory address `dst` (smem_addr), always read.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most kPending committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// 16 bytes of a weight read once: not allocated in L1 (left to the activations every warp reads), with the
// surrounding 256 bytes asked of L2 (the neighbouring lanes' or warps' next reads).
__device__ __forceinline__ uint4 ld_stream_16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// D = A B + D on the tensor cores: one m16n8k16 tile, bf16 A (row-major fragment, 4 registers) and B (col-major
// fragment, 2 registers), fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D = A B + D on the tensor cores: one m16n8k8 tile of TF32 operands (A row-major, 4 registers; B col-major, 2),
// fp32 accumulators. The hardware reads an operand's top 19 bits.
__device__ __forceinline__ void mma_tf32_1688(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// x = big + small with both TF32 (round to nearest): the split of "3xTF32", where a b ~ a_big b_big + a_big b_small
// + a_small b_big keeps about fp32's accuracy (the dropped a_small b_small is ~2^-22 of a b).
__device__ __forceinline__ void tf32_split(float x, uint32_t& big, uint32_t& small) {
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(big) : "f"(x));
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(small) : "f"(x - __uint_as_float(big)));
}

}  // namespace tern::ptx
