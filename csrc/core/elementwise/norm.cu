// norm_forward (elementwise.h): one block per row; the row is read three times (mean, variance,
// output), the second and third from L1 / L2 (a row of 8,192 bf16 is 16 KB).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/common/cuda_check.h"
#include "core/elementwise/elementwise.h"
#include "core/elementwise/type_dispatch.cuh"
#include "core/elementwise/vector_pack.cuh"

namespace fused_dense::core {

using namespace elementwise_detail;

namespace {

constexpr int kNormThreads = 256;
constexpr int kNormWarps = kNormThreads / 32;

// The block's sum (op 0) or maximum (op 1) of v, returned to every thread.
template <int kOp>
__device__ float block_reduce(float v) {
  __shared__ float parts[kNormWarps];
  __shared__ float total;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = kOp == 0 ? v + o : fmaxf(v, o);
  }
  if (threadIdx.x % 32 == 0) parts[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = parts[0];
    for (int w = 1; w < kNormWarps; ++w) t = kOp == 0 ? t + parts[w] : fmaxf(t, parts[w]);
    total = t;
  }
  __syncthreads();
  const float r = total;
  __syncthreads();  // total and parts are reused by the next reduction
  return r;
}

// Visits the row's elements in fp32, 8-element vectors where the row allows it.
template <typename T, typename F>
__device__ __forceinline__ void for_each(const T* row, int64_t cols, bool vectorized, F&& f) {
  constexpr int kV = 16 / sizeof(T);
  if (vectorized) {
    for (int64_t j = static_cast<int64_t>(threadIdx.x) * kV; j < cols; j += static_cast<int64_t>(kNormThreads) * kV) {
      float v[kV];
      pack_to_floats(v, load_pack<T, kV>(row + j));
#pragma unroll
      for (int k = 0; k < kV; ++k) f(j + k, v[k]);
    }
  } else {
    for (int64_t j = threadIdx.x; j < cols; j += kNormThreads) f(j, Cvt<T>::to_float(row[j]));
  }
}

template <typename T>
__global__ void __launch_bounds__(kNormThreads) norm_forward_kernel(NormForwardArgs a, bool vectorized) {
  const int64_t r = blockIdx.x, C = a.cols;
  const T* x = static_cast<const T*>(a.x) + r * C;
  const T* w = static_cast<const T*>(a.weight);
  const T* b = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out) + r * C;
  const float inv_cols = 1.f / static_cast<float>(C);
  float mean = 0.f;
  if (a.layer_norm) {
    float s = 0.f;
    for_each(x, C, vectorized, [&](int64_t, float v) { s += v; });
    mean = block_reduce<0>(s) * inv_cols;
  }
  float ss = 0.f;
  for_each(x, C, vectorized, [&](int64_t, float v) {
    const float c = v - mean;
    ss = fmaf(c, c, ss);
  });
  const float rstd = rsqrtf(block_reduce<0>(ss) * inv_cols + a.eps);
  if (threadIdx.x == 0) {
    a.rstd[r] = rstd;
    if (a.mean != nullptr) a.mean[r] = mean;
  }
  float row_max = 0.f;
  bool nan = false;
  // y = (x - mean) * rstd * w + b, rounded once to T; explicit roundings, no contraction, so the
  // bits do not depend on how the compiler schedules the loop
  const auto y_of = [&](int64_t j, float v) {
    float y = __fmul_rn(__fmul_rn(__fsub_rn(v, mean), rstd), Cvt<T>::to_float(w[j]));
    if (b != nullptr) y = __fadd_rn(y, Cvt<T>::to_float(b[j]));
    const T t = Cvt<T>::from_float(y);
    const float back = Cvt<T>::to_float(t);
    nan = nan || back != back;
    row_max = fmaxf(row_max, fabsf(back));
    return t;
  };
  constexpr int kV = 16 / sizeof(T);
  if (vectorized) {
    for (int64_t j = static_cast<int64_t>(threadIdx.x) * kV; j < C; j += static_cast<int64_t>(kNormThreads) * kV) {
      float v[kV];
      pack_to_floats(v, load_pack<T, kV>(x + j));
      Pack<T, kV> y;
#pragma unroll
      for (int k = 0; k < kV; ++k) y.v[k] = y_of(j + k, v[k]);
      store_pack(out + j, y);
    }
  } else {
    for (int64_t j = threadIdx.x; j < C; j += kNormThreads) out[j] = y_of(j, Cvt<T>::to_float(x[j]));
  }
  if (nan) row_max = NAN;
  if (a.amax == nullptr) return;
  // the row's maximum, NaN kept (a NaN's bits exceed every finite value's and infinity's)
  unsigned bits = __float_as_uint(row_max);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, off));
  if (threadIdx.x % 32 == 0) atomicMax(reinterpret_cast<unsigned*>(a.amax), bits);
}

}  // namespace

void norm_forward(const NormForwardArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kV = 16 / sizeof(T);
    const auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    const bool vectorized = a.cols % kV == 0 && aligned(a.x) && aligned(a.out);
    norm_forward_kernel<T><<<static_cast<unsigned>(a.rows), kNormThreads, 0, stream>>>(a, vectorized);
  });
  FD_CHECK_LAUNCH();
}

}  // namespace fused_dense::core
