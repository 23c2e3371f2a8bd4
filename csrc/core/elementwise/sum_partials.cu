// out[j] = the sum of fp32 partial sums partial[p * stride + j] over p, in an order fixed by
// their count: the last step of the bias-gradient reduction (bias_grad_reduction.cu) and of the
// cutlass_sm90 data gradient's bias gradient (its epilogue writes per-tile partial sums).
#include <algorithm>
#include <cstdint>
#include <sstream>

#include "core/common/cuda_check.h"
#include "core/elementwise/elementwise.h"
#include "core/elementwise/elementwise_checks.h"
#include "core/elementwise/elementwise_launch.h"
#include "core/elementwise/flat_grid.cuh"
#include "core/elementwise/type_dispatch.cuh"
#include "core/elementwise/vector_pack.cuh"

namespace fused_dense::core {

using namespace elementwise_detail;

namespace {


// out[j] = sum over c < nparts of partial[c * stride + j], in a fixed order: part lane ty of the
// block adds parts ty, ty + kPartLanes, ... in turn, then the kPartLanes sums are added in order
// of ty. Several part lanes and an unrolled loop keep many loads in flight: one thread adding 64
// parts one after the other waits out 64 L2 latencies, a large share of the pass
// (docs/performance.md, "Elementwise kernels and host time").
constexpr int kFinalizeCols = 32;
constexpr int kPartLanes = kThreads / kFinalizeCols;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    partial_sums_finalize_kernel(const float* partial, int64_t stride, int64_t nparts, int64_t cols, T* out) {
  __shared__ float lane_sums[kPartLanes][kFinalizeCols];
  const int tx = threadIdx.x % kFinalizeCols, ty = threadIdx.x / kFinalizeCols;
  for (int64_t j0 = static_cast<int64_t>(blockIdx.x) * kFinalizeCols; j0 < cols;
       j0 += static_cast<int64_t>(gridDim.x) * kFinalizeCols) {
    const int64_t j = j0 + tx;
    float s = 0.f;
    if (j < cols) {
#pragma unroll 4
      for (int64_t c = ty; c < nparts; c += kPartLanes) s += partial[c * stride + j];
    }
    lane_sums[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && j < cols) {
      float total = lane_sums[0][tx];
#pragma unroll
      for (int l = 1; l < kPartLanes; ++l) total += lane_sums[l][tx];
      out[j] = Cvt<T>::from_float(total);
    }
    __syncthreads();  // lane_sums is rewritten by the next column block
  }
}

}  // namespace

namespace elementwise_detail {

void launch_sum_partials(DType dtype, const float* partial, int64_t stride, int64_t nparts, int64_t cols, void* out,
                         cudaStream_t stream) {
  dispatch_dtype(dtype, [&](auto ttag) {
    using T = typename decltype(ttag)::type;
    const int64_t blocks = std::min<int64_t>(ceil_div(cols, int64_t{kFinalizeCols}), 65535);
    partial_sums_finalize_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        partial, stride, nparts, cols, static_cast<T*>(out));
    FD_CHECK_LAUNCH();
  });
}

}  // namespace elementwise_detail

void sum_partials(DType dtype, const float* partial, int64_t stride, int64_t nparts, int64_t cols, void* out,
                  cudaStream_t stream) {
  constexpr const char* fn = "sum_partials";
  check_codes(fn, dtype, Activation::kNone);
  check_shape(fn, nparts, cols);
  if (cols == 0) return;
  if (out == nullptr || (nparts > 0 && partial == nullptr)) fail(fn, "partial and out must be non-null");
  if (stride < cols) {
    std::ostringstream m;
    m << "stride must be >= cols (" << cols << "), got " << stride;
    fail(fn, m.str());
  }
  launch_sum_partials(dtype, partial, stride, nparts, cols, out, stream);
}

}  // namespace fused_dense::core
