// Launch shape and flat grid-stride iteration of the elementwise kernels (internal to them).
//
// Flat grid-stride loops track (row, col) incrementally instead of dividing per element: a 64-bit
// division costs more issue slots than the memory system leaves per vector. Each thread issues
// kUnroll independent loads before any store; the compiler cannot do this reordering itself
// because the input and output matrices may alias.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "core/common/device_info.h"

namespace fused_dense::core::elementwise_detail {

// Threads per block of every elementwise kernel.
constexpr int kThreads = 256;
constexpr int kUnroll = 2;
// 2048 resident threads per SM on sm_80 / sm_90.
constexpr int kBlocksPerSm = 2048 / kThreads;
// Flat kernels get at most this many full-occupancy waves; beyond that the grid-stride loop
// does the work and the per-thread setup (one 64-bit division) is amortised.
constexpr int64_t kMaxWaves = 4;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct FlatPlan {
  int64_t total;   // rows * width items
  int64_t width;   // items per row
  int64_t stride1; // grid size in threads (G)
  int64_t srow1, scol1;  // G split into whole rows and remaining columns
  int64_t strideU;       // kUnroll * G
  int64_t srowU, scolU;
};

struct Cursor {
  int64_t idx, row, col;
};

__device__ __forceinline__ void advance(Cursor& c, int64_t stride, int64_t srow, int64_t scol, int64_t width) {
  c.idx += stride;
  c.row += srow;
  c.col += scol;
  if (c.col >= width) {
    c.col -= width;
    ++c.row;
  }
}

__device__ __forceinline__ void init_cursors(Cursor (&c)[kUnroll], const FlatPlan& plan) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  c[0].idx = tid;
  c[0].row = tid / plan.width;
  c[0].col = tid - c[0].row * plan.width;
#pragma unroll
  for (int k = 1; k < kUnroll; ++k) {
    c[k] = c[k - 1];
    advance(c[k], plan.stride1, plan.srow1, plan.scol1, plan.width);
  }
}

__device__ __forceinline__ void advance_all(Cursor (&c)[kUnroll], const FlatPlan& plan) {
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) advance(c[k], plan.strideU, plan.srowU, plan.scolU, plan.width);
}

// The plan and grid of a flat kernel over total items, width items per row, on `device` (whose
// multiprocessor count caps the grid); total > 0, width > 0.
inline FlatPlan make_flat_plan(int device, int64_t total, int64_t width, unsigned& grid) {
  const int64_t cap = static_cast<int64_t>(device_info(device).sm_count()) * kBlocksPerSm * kMaxWaves;
  const int64_t blocks = std::max<int64_t>(1, std::min(ceil_div(total, int64_t{kThreads} * kUnroll), cap));
  grid = static_cast<unsigned>(std::min<int64_t>(blocks, INT_MAX));
  FlatPlan p;
  p.total = total;
  p.width = width;
  p.stride1 = static_cast<int64_t>(grid) * kThreads;
  p.srow1 = p.stride1 / width;
  p.scol1 = p.stride1 % width;
  p.strideU = p.stride1 * kUnroll;
  p.srowU = p.strideU / width;
  p.scolU = p.strideU % width;
  return p;
}

}  // namespace fused_dense::core::elementwise_detail
