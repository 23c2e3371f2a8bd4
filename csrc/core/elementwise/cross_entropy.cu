// cross_entropy_rows (elementwise.h): one block per row of logits, two passes over the row; and
// scale_unless_one, the backward's scaling of the gradients by the incoming gradient.
//
// Pass 1 reads the row once and keeps, per thread, an online log-sum-exp (running maximum m and
// sum s of exp(z - m)) and the sum of z (label smoothing's mean term); the block merges them.
// Pass 2 (write_grad) reads the row again and overwrites it with the scaled gradient. The row of
// a 128k vocabulary is 256 KB in bf16, so the second read comes from L2 for the rows in flight.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/common/cuda_check.h"
#include "core/elementwise/elementwise.h"
#include "core/elementwise/flat_grid.cuh"
#include "core/elementwise/type_dispatch.cuh"
#include "core/elementwise/vector_pack.cuh"

namespace fused_dense::core {

using namespace elementwise_detail;

namespace {

constexpr int kRowThreads = 256;
constexpr int kWarps = kRowThreads / 32;

struct RowState {
  float m;     // running maximum
  float s;     // sum of exp(z - m)
  float sumz;  // sum of z
};

__device__ __forceinline__ RowState merge(RowState a, RowState b) {
  if (b.m == -INFINITY) return {a.m, a.s, a.sumz + b.sumz};
  if (a.m == -INFINITY) return {b.m, b.s, a.sumz + b.sumz};
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m), a.sumz + b.sumz};
}

// The capped logit: softcap * tanh(y / softcap), or y when softcap is 0.
__device__ __forceinline__ float capped(float y, float softcap) {
  return softcap > 0.f ? softcap * tanhf(y / softcap) : y;
}

// Adds the n values f[0..n) to the thread's state (one rescale per group).
template <int N>
__device__ __forceinline__ void absorb(RowState& st, const float (&f)[N]) {
  float gm = f[0];
#pragma unroll
  for (int k = 1; k < N; ++k) gm = fmaxf(gm, f[k]);
  if (gm > st.m) {
    st.s = st.m == -INFINITY ? 0.f : st.s * expf(st.m - gm);
    st.m = gm;
  }
#pragma unroll
  for (int k = 0; k < N; ++k) {
    st.s += expf(f[k] - st.m);
    st.sumz += f[k];
  }
}

// The block's merged state, returned to every thread.
__device__ RowState block_merge(RowState st) {
  __shared__ RowState warp_states[kWarps];
  __shared__ RowState total;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    RowState o;
    o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
    o.s = __shfl_xor_sync(0xffffffffu, st.s, off);
    o.sumz = __shfl_xor_sync(0xffffffffu, st.sumz, off);
    st = merge(st, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_states[warp] = st;
  __syncthreads();
  if (threadIdx.x == 0) {
    RowState t = warp_states[0];
    for (int w = 1; w < kWarps; ++w) t = merge(t, warp_states[w]);
    total = t;
  }
  __syncthreads();
  return total;
}

// The gradient of one element: d loss / d y for the raw logit y (its capped value z).
struct GradRule {
  float lse, a, smooth, hit, softcap, scale;  // a = 1 + 2 z_loss lse; smooth = eps / V; hit = 1 - eps
  __device__ __forceinline__ float operator()(float y, bool is_target) const {
    const float z = capped(y, softcap);
    float g = expf(z - lse) * a - smooth - (is_target ? hit : 0.f);
    if (softcap > 0.f) {
      const float t = z / softcap;
      g *= 1.f - t * t;
    }
    return g * scale;
  }
};

template <typename T>
__global__ void __launch_bounds__(kRowThreads) cross_entropy_rows_kernel(CrossEntropyRowsArgs a, bool vectorized) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t row = blockIdx.x;
  const int64_t V = a.vocab;
  T* logits = static_cast<T*>(a.logits) + row * V;
  const int64_t t = a.target[row];
  const bool ignored = t == a.ignore_index;
  const bool in_range = t >= 0 && t < V;
  if (ignored || !in_range) {
    // an ignored row adds nothing; a target out of range poisons the row (the binding refuses
    // such targets before the launch where it can check them)
    const float fill = ignored ? 0.f : NAN;
    if (threadIdx.x == 0) {
      if (a.loss != nullptr) a.loss[row] = fill;
      if (!a.lse_known) a.lse[row] = fill;
    }
    if (a.write_grad)
      for (int64_t j = threadIdx.x; j < V; j += kRowThreads) logits[j] = Cvt<T>::from_float(fill);
    return;
  }
  const float softcap = a.softcap;
  float lse;
  if (a.lse_known) {
    lse = a.lse[row];
  } else {
    RowState st{-INFINITY, 0.f, 0.f};
    if (vectorized) {
      for (int64_t j = static_cast<int64_t>(threadIdx.x) * kVec; j < V; j += static_cast<int64_t>(kRowThreads) * kVec) {
        float f[kVec];
        pack_to_floats(f, load_pack<T, kVec>(logits + j));
#pragma unroll
        for (int k = 0; k < kVec; ++k) f[k] = capped(f[k], softcap);
        absorb(st, f);
      }
    } else {
      for (int64_t j = threadIdx.x; j < V; j += kRowThreads) {
        const float f[1] = {capped(Cvt<T>::to_float(logits[j]), softcap)};
        absorb(st, f);
      }
    }
    const RowState row_state = block_merge(st);
    lse = row_state.m + logf(row_state.s);
    if (threadIdx.x == 0) {
      a.lse[row] = lse;
      if (a.loss != nullptr) {
        const float zt = capped(Cvt<T>::to_float(logits[t]), softcap);
        const float eps = a.label_smoothing;
        float loss = (1.f - eps) * (lse - zt);
        if (eps > 0.f) loss += eps * (lse - row_state.sumz / static_cast<float>(V));
        if (a.z_loss > 0.f) loss += a.z_loss * lse * lse;
        a.loss[row] = loss;
      }
    }
    // every thread has read its part of the row (and thread 0 the target) before pass 2 writes
    __syncthreads();
  }
  if (!a.write_grad) return;
  const GradRule rule{lse, 1.f + 2.f * a.z_loss * lse, a.label_smoothing / static_cast<float>(V),
                      1.f - a.label_smoothing, softcap, a.scale[row * a.scale_stride]};
  if (vectorized) {
    for (int64_t j = static_cast<int64_t>(threadIdx.x) * kVec; j < V; j += static_cast<int64_t>(kRowThreads) * kVec) {
      float f[kVec];
      pack_to_floats(f, load_pack<T, kVec>(logits + j));
#pragma unroll
      for (int k = 0; k < kVec; ++k) f[k] = rule(f[k], j + k == t);
      Pack<T, kVec> out;
      floats_to_pack(out, f);
      store_pack(logits + j, out);
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += kRowThreads)
      logits[j] = Cvt<T>::from_float(rule(Cvt<T>::to_float(logits[j]), j == t));
  }
}

// Grid-stride, N elements a step (16-byte vectors, or N = 1 for the scalar path).
template <typename T, int N>
__global__ void scale_unless_one_kernel(T* __restrict__ data, int64_t steps, const float* __restrict__ scale) {
  const float s = *scale;
  if (s == 1.f) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < steps; i += stride) {
    Pack<T, N> p = load_pack<T, N>(data + i * N);
    float f[N];
    pack_to_floats(f, p);
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] *= s;
    floats_to_pack(p, f);
    store_pack(data + i * N, p);
  }
}

}  // namespace

void scale_unless_one(const ScaleUnlessOneArgs& a, cudaStream_t stream) {
  if (a.n == 0) return;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorized = reinterpret_cast<uintptr_t>(a.data) % 16 == 0 && a.n % kVec == 0;
    const int64_t steps = vectorized ? a.n / kVec : a.n;
    const int64_t resident = int64_t{device_info(a.device).sm_count()} * kBlocksPerSm;
    const auto blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min(ceil_div(steps, kThreads), resident)));
    if (vectorized) {
      scale_unless_one_kernel<T, kVec><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(a.data), steps, a.scale);
    } else {
      scale_unless_one_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(a.data), steps, a.scale);
    }
  });
  FD_CHECK_LAUNCH();
}

void cross_entropy_rows(const CrossEntropyRowsArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    // 16-byte loads need every row to start on a 16-byte boundary: an aligned base and a row
    // length of whole vectors
    const bool vectorized = reinterpret_cast<uintptr_t>(a.logits) % 16 == 0 && a.vocab % kVec == 0;
    cross_entropy_rows_kernel<T><<<static_cast<unsigned>(a.rows), kRowThreads, 0, stream>>>(a, vectorized);
  });
  FD_CHECK_LAUNCH();
}

}  // namespace fused_dense::core
