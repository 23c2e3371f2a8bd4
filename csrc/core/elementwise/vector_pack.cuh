// Element conversions and 16-byte vectors for the elementwise kernels (internal to them).
//
// Everything elementwise is memory-bound, so the fast paths move 16 bytes per load/store (8 halfs
// or 4 floats). They are taken only when cols is a multiple of the vector width and every matrix
// and vector pointer is 16-byte aligned; a scalar path handles all other shapes.
// No implicit __half / __nv_bfloat16 conversions or operators are used: PyTorch's extension build
// defines __CUDA_NO_HALF_OPERATORS__ and friends.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fused_dense::core::elementwise_detail {

template <typename T>
struct Cvt;

template <>
struct Cvt<float> {
  __device__ __forceinline__ static float to_float(float v) { return v; }
  __device__ __forceinline__ static float from_float(float f) { return f; }
  __device__ __forceinline__ static float zero() { return 0.f; }
};

// The 16-bit types also convert in pairs: one cvt.rn.{f16,bf16}x2.f32 instead of two, which
// matters because the conversions, not the memory system, bound the 16-bit GELU kernels.
template <>
struct Cvt<__half> {
  using T2 = __half2;
  __device__ __forceinline__ static float to_float(__half v) { return __half2float(v); }
  __device__ __forceinline__ static __half from_float(float f) { return __float2half_rn(f); }
  __device__ __forceinline__ static __half zero() { return __ushort_as_half(0); }
  __device__ __forceinline__ static float2 to_float2(__half2 v) { return __half22float2(v); }
  __device__ __forceinline__ static __half2 from_float2(float a, float b) { return __floats2half2_rn(a, b); }
};

template <>
struct Cvt<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  __device__ __forceinline__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float f) { return __float2bfloat16_rn(f); }
  __device__ __forceinline__ static __nv_bfloat16 zero() { return __ushort_as_bfloat16(0); }
  __device__ __forceinline__ static float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
  __device__ __forceinline__ static __nv_bfloat162 from_float2(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};

// N consecutive elements moved as one (or, for 32 bytes, two) 16-byte transactions.
template <typename T, int N>
struct alignas(N * sizeof(T) >= 16 ? 16 : N * sizeof(T)) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

template <typename T>
constexpr bool kPaired = sizeof(T) == 2;

// f[0..N) -> out, round to nearest even.
template <typename T, int N>
__device__ __forceinline__ void floats_to_pack(Pack<T, N>& out, const float (&f)[N]) {
  if constexpr (kPaired<T> && N % 2 == 0) {
    using T2 = typename Cvt<T>::T2;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) reinterpret_cast<T2*>(out.v)[i] = Cvt<T>::from_float2(f[2 * i], f[2 * i + 1]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out.v[j] = Cvt<T>::from_float(f[j]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void pack_to_floats(float (&f)[N], const Pack<T, N>& in) {
  if constexpr (kPaired<T> && N % 2 == 0) {
    using T2 = typename Cvt<T>::T2;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 t = Cvt<T>::to_float2(reinterpret_cast<const T2*>(in.v)[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) f[j] = Cvt<T>::to_float(in.v[j]);
  }
}

}  // namespace fused_dense::core::elementwise_detail
