// The mainloop search (bench/native/mainloop_search.cu): one CUTLASS sm90 GEMM configuration per
// translation unit (mainloop_config.cu, compiled once per MAINLOOP_CONFIG), bf16 in, fp32
// accumulation, a plain bf16 epilogue (D = accumulator, TMA store), row-major D[M, N] =
// A[M, K] * B[K, N] with M the batch: the layout of the library's own cutlass_sm90 kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace mainloop {

struct Config {
  const char* name;
  int tile_m, tile_n, tile_k;
  int cluster_m, cluster_n;
  bool cooperative;  // else ping-pong
  bool stream_k;     // else the persistent data-parallel scheduler
  int smem_bytes;    // the kernel's shared storage
  int stages;        // the mainloop's pipeline stages
  int epi_m, epi_n;  // the epilogue's sub-tile
};

// raster: 0 CUTLASS's heuristic, 1 along M, 2 along N; swizzle: 1, 2, 4 or 8.
struct Order {
  int raster, swizzle;
};

// b_k_major: B stored as [N, K] (the gated fc1's weight, K-major) or as [K, N] (the data
// gradient's weight, N-major). False, with nothing launched, when CUTLASS refuses the problem or
// the workspace is too small.
using RunFn = bool (*)(bool b_k_major, Order order, int sm_count, int m, int n, int k, const void* a, const void* b,
                       void* d, void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

struct Entry {
  Config config;
  RunFn run;
};

}  // namespace mainloop
