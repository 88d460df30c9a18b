#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/format_probe.h"

namespace tern {
namespace {

struct EncodeParams {
  const float* in;
  int64_t n;
  uint16_t* bf16;
  uint16_t* fp16;
  uint8_t* e4m3_satfinite;
  uint8_t* e4m3_nonfinite;
  uint8_t* e5m2_satfinite;
  uint8_t* e5m2_nonfinite;
  uint8_t* e2m1;
  uint8_t* ue8m0_up;
  uint8_t* ue8m0_toward_zero;
};

__global__ void __launch_bounds__(256) encode_kernel(EncodeParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  const float x = p.in[i];
  p.bf16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
  p.fp16[i] = __half_as_ushort(__float2half_rn(x));
  p.e4m3_satfinite[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  p.e4m3_nonfinite[i] = __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E4M3);
  p.e5m2_satfinite[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
  p.e5m2_nonfinite[i] = __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E5M2);
  p.e2m1[i] = __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
  p.ue8m0_up[i] = __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf);
  p.ue8m0_toward_zero[i] = __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundZero);
}

__global__ void __launch_bounds__(256) decode_kernel(float* e4m3, float* e5m2, float* e2m1, float* ue8m0) {
  const int code = threadIdx.x;  // one block of 256 threads
  e4m3[code] = __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3)));
  e5m2[code] = __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E5M2)));
  if (code < 16) {
    e2m1[code] = __half2float(__half(__nv_cvt_fp4_to_halfraw(static_cast<__nv_fp4_storage_t>(code), __NV_E2M1)));
  }
  ue8m0[code] = __bfloat162float(__nv_bfloat16(__nv_cvt_e8m0_to_bf16raw(static_cast<__nv_fp8_storage_t>(code))));
}

template <class T>
T* device_alloc(int64_t n) {
  T* ptr = nullptr;
  TERN_CUDA_CHECK(cudaMalloc(&ptr, static_cast<size_t>(n) * sizeof(T)));
  TERN_CUDA_CHECK(cudaMemset(ptr, 0xA5, static_cast<size_t>(n) * sizeof(T)));  // poison
  return ptr;
}

template <class T>
std::vector<T> download_and_free(T* ptr, int64_t n) {
  std::vector<T> out(static_cast<size_t>(n));
  TERN_CUDA_CHECK(cudaMemcpy(out.data(), ptr, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
  TERN_CUDA_CHECK(cudaFree(ptr));
  return out;
}

}  // namespace

DeviceEncodings cuda_probe_encode(std::span<const float> in) {
  const int64_t n = static_cast<int64_t>(in.size());
  EncodeParams p{.in = device_alloc<float>(n),
                 .n = n,
                 .bf16 = device_alloc<uint16_t>(n),
                 .fp16 = device_alloc<uint16_t>(n),
                 .e4m3_satfinite = device_alloc<uint8_t>(n),
                 .e4m3_nonfinite = device_alloc<uint8_t>(n),
                 .e5m2_satfinite = device_alloc<uint8_t>(n),
                 .e5m2_nonfinite = device_alloc<uint8_t>(n),
                 .e2m1 = device_alloc<uint8_t>(n),
                 .ue8m0_up = device_alloc<uint8_t>(n),
                 .ue8m0_toward_zero = device_alloc<uint8_t>(n)};
  TERN_CUDA_CHECK(cudaMemcpy(const_cast<float*>(p.in), in.data(), in.size_bytes(), cudaMemcpyHostToDevice));
  if (n > 0) {
    encode_kernel<<<static_cast<unsigned>((n + 255) / 256), 256>>>(p);
    TERN_CUDA_CHECK_LAUNCH();
  }
  TERN_CUDA_CHECK(cudaDeviceSynchronize());
  TERN_CUDA_CHECK(cudaFree(const_cast<float*>(p.in)));
  DeviceEncodings out;
  out.bf16 = download_and_free(p.bf16, n);
  out.fp16 = download_and_free(p.fp16, n);
  out.e4m3_satfinite = download_and_free(p.e4m3_satfinite, n);
  out.e4m3_nonfinite = download_and_free(p.e4m3_nonfinite, n);
  out.e5m2_satfinite = download_and_free(p.e5m2_satfinite, n);
  out.e5m2_nonfinite = download_and_free(p.e5m2_nonfinite, n);
  out.e2m1 = download_and_free(p.e2m1, n);
  out.ue8m0_up = download_and_free(p.ue8m0_up, n);
  out.ue8m0_toward_zero = download_and_free(p.ue8m0_toward_zero, n);
  return out;
}

DeviceDecodings cuda_probe_decode() {
  float* e4m3 = device_alloc<float>(256);
  float* e5m2 = device_alloc<float>(256);
  float* e2m1 = device_alloc<float>(16);
  float* ue8m0 = device_alloc<float>(256);
  decode_kernel<<<1, 256>>>(e4m3, e5m2, e2m1, ue8m0);
  TERN_CUDA_CHECK_LAUNCH();
  TERN_CUDA_CHECK(cudaDeviceSynchronize());
  return DeviceDecodings{.e4m3 = download_and_free(e4m3, 256),
                         .e5m2 = download_and_free(e5m2, 256),
                         .e2m1 = download_and_free(e2m1, 16),
                         .ue8m0 = download_and_free(ue8m0, 256)};
}

}  // namespace tern
