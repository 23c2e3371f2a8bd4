// norm_forward (elementwise.h): one block per row; the row is read three times (mean, variance,
// output), the second and third from L1 / L2 (a row of 8,192 bf16 is 16 KB).
// norm_backward: a fixed number of blocks, each over rows r = block, block + blocks, ...; a row's
// grad_out and x are read twice (the row sums, then grad_x), the second time from L1 / L2; the
// weight and bias gradients' column sums stay in the block's shared memory across its rows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/common/cuda_check.h"
#include "core/elementwise/elementwise.h"
#include "core/elementwise/elementwise_checks.h"
#include "core/elementwise/elementwise_launch.h"
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

// Blocks of norm_backward (fewer where there are fewer rows): a constant, so the order of the
// column sums depends on rows alone. 2 blocks per SM of a 132-SM H200 keep it busy.
constexpr int64_t kNormBackwardBlocks = 264;
// Shared memory a block may take for its column sums (the H200 allows 227 KB per block).
constexpr int64_t kNormBackwardMaxSmem = 192 << 10;

int64_t norm_backward_blocks(int64_t rows) { return std::min(rows, kNormBackwardBlocks); }

// The columns of a row that thread threadIdx.x owns: f(j) for each run of W columns from j (W = kV
// where the row is read in 16-byte vectors, else 1). The same columns in every row, so each
// shared-memory sum has one owner.
template <int W, typename F>
__device__ __forceinline__ void for_each_owned(int64_t cols, F&& f) {
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * W; j < cols; j += static_cast<int64_t>(kNormThreads) * W) f(j);
}

// p[j .. j + W) in fp32
template <typename T, int W>
__device__ __forceinline__ void load_floats(const T* p, int64_t j, float (&v)[W]) {
  if constexpr (W > 1) {
    pack_to_floats(v, load_pack<T, W>(p + j));
  } else {
    v[0] = Cvt<T>::to_float(p[j]);
  }
}

// W: columns per access (16 / sizeof(T) on the vectorized path, else 1).
template <typename T, int W>
__global__ void __launch_bounds__(kNormThreads)
    norm_backward_kernel(NormBackwardArgs a, float* partial_w, float* partial_b) {
  extern __shared__ float sums[];  // [cols] for the weight's gradient, then [cols] for the bias's
  const int64_t C = a.cols;
  float* sum_w = partial_w != nullptr ? sums : nullptr;
  float* sum_b = partial_b != nullptr ? sums + (sum_w != nullptr ? C : 0) : nullptr;
  const T* w = static_cast<const T*>(a.weight);
  const float inv_cols = 1.f / static_cast<float>(C);
  for_each_owned<W>(C, [&](int64_t j) {
#pragma unroll
    for (int k = 0; k < W; ++k) {
      if (sum_w != nullptr) sum_w[j + k] = 0.f;
      if (sum_b != nullptr) sum_b[j + k] = 0.f;
    }
  });
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const T* g = static_cast<const T*>(a.grad_out) + r * C;
    const T* x = static_cast<const T*>(a.x) + r * C;
    const float rstd = a.rstd[r], mean = a.mean != nullptr ? a.mean[r] : 0.f;
    float c1 = 0.f, c2 = 0.f;
    if (a.grad_x != nullptr) {
      float s1 = 0.f, s2 = 0.f;
      for_each_owned<W>(C, [&](int64_t j) {
        float gv[W], xv[W], wv[W];
        load_floats<T, W>(g, j, gv), load_floats<T, W>(x, j, xv), load_floats<T, W>(w, j, wv);
#pragma unroll
        for (int k = 0; k < W; ++k) {
          const float gy = gv[k] * wv[k];
          s1 = fmaf(gy, (xv[k] - mean) * rstd, s1);
          s2 += gy;
        }
      });
      c1 = block_reduce<0>(s1) * inv_cols;
      if (a.mean != nullptr) c2 = block_reduce<0>(s2) * inv_cols;
    }
    T* gx = a.grad_x != nullptr ? static_cast<T*>(a.grad_x) + r * C : nullptr;
    for_each_owned<W>(C, [&](int64_t j) {
      float gv[W], xv[W], wv[W], out[W];
      load_floats<T, W>(g, j, gv), load_floats<T, W>(x, j, xv);
      if (gx != nullptr) load_floats<T, W>(w, j, wv);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float xh = (xv[k] - mean) * rstd;
        if (gx != nullptr) out[k] = rstd * (gv[k] * wv[k] - xh * c1 - c2);
        if (sum_w != nullptr) sum_w[j + k] = fmaf(gv[k], xh, sum_w[j + k]);
        if (sum_b != nullptr) sum_b[j + k] += gv[k];
      }
      if (gx == nullptr) return;
      if constexpr (W > 1) {
        Pack<T, W> o;
        floats_to_pack(o, out);
        store_pack(gx + j, o);
      } else {
        gx[j] = Cvt<T>::from_float(out[0]);
      }
    });
  }
  for_each_owned<W>(C, [&](int64_t j) {
#pragma unroll
    for (int k = 0; k < W; ++k) {
      if (sum_w != nullptr) partial_w[blockIdx.x * C + j + k] = sum_w[j + k];
      if (sum_b != nullptr) partial_b[blockIdx.x * C + j + k] = sum_b[j + k];
    }
  });
}

// Raises norm_backward_kernel<T, W>'s dynamic shared-memory limit on `device` once.
template <typename T, int W>
void raise_norm_backward_smem_once(int device) {
  static std::atomic<std::uint64_t> done{0};  // a bit per device below 64; setting it twice is harmless
  const std::uint64_t bit = device < 64 ? (std::uint64_t{1} << device) : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return;
  FD_CUDA_CHECK(cudaFuncSetAttribute(norm_backward_kernel<T, W>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kNormBackwardMaxSmem)));
  done.fetch_or(bit, std::memory_order_acq_rel);
}

}  // namespace

std::size_t norm_backward_workspace_bytes(int64_t rows, int64_t cols, bool weight, bool bias) {
  check_shape("norm_backward_workspace_bytes", rows, cols);
  const int64_t sums = (weight ? 1 : 0) + (bias ? 1 : 0);
  return static_cast<std::size_t>(norm_backward_blocks(rows) * cols * sums) * sizeof(float);
}

int64_t norm_backward_max_cols(bool weight_and_bias) {
  return kNormBackwardMaxSmem / static_cast<int64_t>(sizeof(float) * (weight_and_bias ? 2 : 1));
}

void norm_backward(const NormBackwardArgs& a, void* workspace, std::size_t workspace_bytes, int device,
                   cudaStream_t stream) {
  constexpr const char* fn = "norm_backward";
  check_codes(fn, a.dtype, Activation::kNone);
  check_shape(fn, a.rows, a.cols);
  const bool want_w = a.grad_weight != nullptr, want_b = a.grad_bias != nullptr;
  if (a.cols > norm_backward_max_cols(want_w && want_b))
    fail(fn, "cols " + std::to_string(a.cols) + " exceed the shared-memory column sums' limit of " +
                 std::to_string(norm_backward_max_cols(want_w && want_b)));
  if (workspace_bytes < norm_backward_workspace_bytes(a.rows, a.cols, want_w, want_b))
    fail(fn, "workspace of " + std::to_string(workspace_bytes) + " bytes is smaller than " +
                 std::to_string(norm_backward_workspace_bytes(a.rows, a.cols, want_w, want_b)));
  if (a.cols == 0 || (a.grad_x == nullptr && !want_w && !want_b)) return;
  if (a.rows == 0) {  // empty sums: zeros
    if (want_w) FD_CUDA_CHECK(cudaMemsetAsync(a.grad_weight, 0, a.cols * dtype_size(a.dtype), stream));
    if (want_b) FD_CUDA_CHECK(cudaMemsetAsync(a.grad_bias, 0, a.cols * dtype_size(a.dtype), stream));
    return;
  }
  const int64_t blocks = norm_backward_blocks(a.rows);
  float* partial_w = want_w ? static_cast<float*>(workspace) : nullptr;
  float* partial_b = want_b ? static_cast<float*>(workspace) + (want_w ? blocks * a.cols : 0) : nullptr;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kV = 16 / sizeof(T);
    const auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    const bool vectorized =
        a.cols % kV == 0 && aligned(a.grad_out) && aligned(a.x) && aligned(a.weight) && aligned(a.grad_x);
    const std::size_t smem = static_cast<std::size_t>(a.cols) * sizeof(float) * ((want_w ? 1 : 0) + (want_b ? 1 : 0));
    const auto launch = [&](auto width) {
      constexpr int W = decltype(width)::value;
      if (smem > (48u << 10)) raise_norm_backward_smem_once<T, W>(device);
      norm_backward_kernel<T, W><<<static_cast<unsigned>(blocks), kNormThreads, smem, stream>>>(a, partial_w,
                                                                                              partial_b);
    };
    if (vectorized) {
      launch(std::integral_constant<int, kV>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
  });
  FD_CHECK_LAUNCH();
  if (want_w) sum_partials(a.dtype, partial_w, a.cols, blocks, a.cols, a.grad_weight, stream);
  if (want_b) sum_partials(a.dtype, partial_b, a.cols, blocks, a.cols, a.grad_bias, stream);
}

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
