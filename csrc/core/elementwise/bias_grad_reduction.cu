// The activation backward with the bias gradient: grad_in = grad * act'(pre_act) and its column
// sums, in one pass over grad, reduced deterministically. Each (column tile, row chunk) block
// writes fp32 partial sums in a fixed order into the workspace, then sum_partials.cu's kernel
// adds the chunks in an order fixed by their count. The chunk count depends only on (rows, cols,
// workspace size), never on the GPU, so the same inputs give bit-identical bias gradients on
// every device.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "core/elementwise/act_backward_step.cuh"
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

// Chunking. Fixed constants (an H100/H200 has 132 SMs) instead of a device query keep
// reduction_workspace_bytes and the summation order device-independent.
constexpr int64_t kReduceTargetBlocks = 132 * kBlocksPerSm;
constexpr int64_t kReduceNominalTileCols = 256;
// Keeps the workspace round trip (8 bytes per column per chunk) a few percent of the main
// traffic (>= 4 bytes per element).
constexpr int64_t kMinRowsPerChunk = 64;

// grad_in = grad * act'(pre) (skipped when grad_in is null) plus fp32 column sums of the rounded grad_in
// over one row chunk: partial[chunk * cols + col]. Block = (TX column-vectors) x (TY rows); a
// tile covers TX * V columns. Summation order is fixed: rows ty, ty+TY, ... per thread, then
// the TY partials in order of ty. kAct: also act_out = act(pre).
template <typename T, Activation A, int V, bool kAct>
__global__ void __launch_bounds__(kThreads)
    act_backward_colsum_kernel(const T* grad, const void* pre_act, T* grad_in, T* act_out, float* partial, int64_t rows,
                               int64_t cols, int64_t rb, int64_t rows_per_chunk, int64_t nchunks, int64_t ntiles) {
  // Rows in flight per thread. Bytes in flight are what keep HBM busy; 4 measured best on H200
  // for every activation (docs/performance.md, "Elementwise kernels and host time").
  constexpr int R = 4;
  __shared__ float sh[kThreads * V];
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int TX = blockDim.x;
  const int TY = blockDim.y;
  const int64_t tile_w = static_cast<int64_t>(TX) * V;

  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    for (int64_t chunk = blockIdx.y; chunk < nchunks; chunk += gridDim.y) {
      const int64_t col = tile * tile_w + static_cast<int64_t>(tx) * V;
      const int64_t r_end = min(rows, (chunk + 1) * rows_per_chunk);
      float acc[V];
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = 0.f;

      if (col < cols) {
        int64_t r = chunk * rows_per_chunk + ty;
        // R rows in flight per thread: the compiler cannot hoist the next rows' loads above
        // this row's stores itself because grad_in may alias grad.
        for (; r + static_cast<int64_t>(R - 1) * TY < r_end; r += static_cast<int64_t>(R) * TY) {
          Pack<T, V> g[R];
          PreLoad<T, A, V> pl[R];
#pragma unroll
          for (int k = 0; k < R; ++k) {
            const int64_t rk = r + static_cast<int64_t>(k) * TY;
            g[k] = load_pack<T, V>(grad + rk * cols + col);
            pl[k].load(pre_act, rk * cols + col, rk, col, rb);
          }
#pragma unroll
          for (int k = 0; k < R; ++k) {
            Pack<T, V> o, av;
            float vals[V];
            pl[k].apply(g[k], o, vals, kAct ? &av : nullptr);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += vals[j];
            const int64_t off = (r + static_cast<int64_t>(k) * TY) * cols + col;
            if (grad_in != nullptr) store_pack<T, V>(grad_in + off, o);
            if constexpr (kAct) store_pack<T, V>(act_out + off, av);
          }
        }
        for (; r < r_end; r += TY) {
          const Pack<T, V> g = load_pack<T, V>(grad + r * cols + col);
          PreLoad<T, A, V> pl;
          pl.load(pre_act, r * cols + col, r, col, rb);
          Pack<T, V> o, av;
          float vals[V];
          pl.apply(g, o, vals, kAct ? &av : nullptr);
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] += vals[j];
          if (grad_in != nullptr) store_pack<T, V>(grad_in + r * cols + col, o);
          if constexpr (kAct) store_pack<T, V>(act_out + r * cols + col, av);
        }
      }

#pragma unroll
      for (int j = 0; j < V; ++j) sh[ty * tile_w + tx * V + j] = acc[j];
      __syncthreads();
      for (int64_t cc = static_cast<int64_t>(ty) * TX + tx; cc < tile_w; cc += static_cast<int64_t>(TX) * TY) {
        const int64_t gc = tile * tile_w + cc;
        if (gc < cols) {
          float s = 0.f;
          for (int y = 0; y < TY; ++y) s += sh[y * tile_w + cc];
          partial[chunk * cols + gc] = s;
        }
      }
      __syncthreads();
    }
  }
}

int pow2_ceil(int64_t v) {
  int p = 1;
  while (p < v && p < (1 << 30)) p <<= 1;
  return p;
}

template <typename T, Activation A, int V, bool kAct>
void launch_colsum(DType dtype, const T* grad, const void* pre_act, T* grad_in, T* act_out, T* bias_grad,
                   int64_t rows, int64_t cols, float* partial, int64_t nchunks, cudaStream_t stream) {
  // Column-vector threads per block: up to 256 columns per tile, fewer for narrow matrices so
  // that the remaining threads work on more rows instead of idling.
  const int max_tx = V == 8 ? 32 : 64;  // tiles of 256 columns (vector paths) or 64 (scalar)
  const int tx = std::min(max_tx, pow2_ceil(cols / V));
  const int ty = kThreads / tx;
  const int64_t tile_w = static_cast<int64_t>(tx) * V;
  const int64_t ntiles = ceil_div(cols, tile_w);
  const int64_t rows_per_chunk = ceil_div(rows, nchunks);
  // Recompute so that no chunk is empty (an empty chunk would still be summed, as zeros).
  nchunks = ceil_div(rows, rows_per_chunk);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(ntiles, INT_MAX)),
                  static_cast<unsigned>(std::min<int64_t>(nchunks, 65535)));
  const dim3 block(tx, ty);
  act_backward_colsum_kernel<T, A, V, kAct><<<grid, block, 0, stream>>>(grad, pre_act, grad_in, act_out, partial,
                                                                         rows, cols, relu_mask_row_bytes(cols),
                                                                         rows_per_chunk, nchunks, ntiles);
  FD_CHECK_LAUNCH();
  launch_sum_partials(dtype, partial, cols, nchunks, cols, bias_grad, stream);
}

}  // namespace

std::size_t reduction_workspace_bytes(int64_t rows, int64_t cols) {
  check_shape("reduction_workspace_bytes", rows, cols);
  if (rows == 0 || cols == 0) return 0;
  return static_cast<std::size_t>(preferred_reduction_chunks(rows, cols)) * static_cast<std::size_t>(cols) *
         sizeof(float);
}

namespace elementwise_detail {

int64_t preferred_reduction_chunks(int64_t rows, int64_t cols) {
  const int64_t tiles = ceil_div(cols, kReduceNominalTileCols);
  const int64_t by_occupancy = ceil_div(kReduceTargetBlocks, tiles);
  const int64_t by_rows = ceil_div(rows, kMinRowsPerChunk);
  return std::max<int64_t>(1, std::min(by_occupancy, by_rows));
}

void launch_act_backward_bias_grad(DType dtype, Activation act, const void* grad, const void* pre_act, void* grad_in,
                                   void* act_out, void* bias_grad, int64_t rows, int64_t cols, float* partial,
                                   int64_t nchunks, bool ptrs_aligned, cudaStream_t stream) {
  dispatch_dtype(dtype, [&](auto ttag) {
    using T = typename decltype(ttag)::type;
    constexpr int VW = 16 / static_cast<int>(sizeof(T));
    const T* gt = static_cast<const T*>(grad);
    T* git = static_cast<T*>(grad_in);
    T* bgt = static_cast<T*>(bias_grad);
    T* aot = static_cast<T*>(act_out);
    const bool vec = cols % VW == 0 && ptrs_aligned;
    dispatch_act(act, [&](auto atag) {
      constexpr Activation A = decltype(atag)::value;
      with_act_out_flag<A>(act_out != nullptr, [&](auto act_flag) {
        constexpr bool kAct = decltype(act_flag)::value;
        if (vec)
          launch_colsum<T, A, VW, kAct>(dtype, gt, pre_act, git, aot, bgt, rows, cols, partial, nchunks, stream);
        else
          launch_colsum<T, A, 1, kAct>(dtype, gt, pre_act, git, aot, bgt, rows, cols, partial, nchunks, stream);
      });
    });
  });
}

}  // namespace elementwise_detail
}  // namespace fused_dense::core
