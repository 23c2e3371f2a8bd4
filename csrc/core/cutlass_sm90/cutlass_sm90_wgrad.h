// The library's cutlass_sm90 weight-gradient accumulation for Hopper (CUTLASS 3, sm_90a):
//   weight_grad [N, D] += grad^T [N, R] * input [R, D]
// with grad [R, N] and input [R, D] row-major (grad the rows' output gradient, input the rows'
// input), weight_grad row-major, 16-bit throughout, fp32 accumulation, weight_grad read and
// written once (beta = 1). The LM head's chunk loop (csrc/torch/lm_head.cpp) adds each chunk's
// share of the weight gradient this way: R is a chunk's rows (up to a few thousand), N the
// vocabulary, D the model width.
//
// In CUTLASS's terms D[M = N, N = D] row-major = A[M, K = R] * B[K, N] + C (C = D): A is grad^T,
// M-major, B is input, N-major; the source C is loaded by TMA in the epilogue. Variants
// (cutlass_sm90_wgrad_variants) are tile configurations x the tile scheduler's orders
// (cutlass_sm90_common.cuh): ping-pong 128 x 128 with 1 x 1 and 2 x 1 clusters (one warp group's
// epilogue, which reads and writes the weight gradient, runs under the other's MMAs) and
// cooperative 256 x 128, 2 x 1. Variant 0 is the one the LM head takes (docs/performance.md,
// "The LM head and its loss", has the measurement).
//
// Compiled in when the build finds CUTLASS's headers and targets sm_90a
// (FUSED_DENSE_WITH_CUTLASS_SM90A, setup.py); otherwise the kernel offers no variant.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/gemm/gemm.h"
#include "core/common/types.h"

namespace fused_dense::core {

struct CutlassSm90WgradArgs {
  int device = 0;
  DType dtype = DType::kBFloat16;  // bf16 or fp16
  int64_t rows = 0;                // R
  int64_t out_rows = 0;            // N, weight_grad's rows
  int64_t out_cols = 0;            // D, weight_grad's columns
  const void* grad = nullptr;      // [R, N] row-major
  const void* input = nullptr;     // [R, D] row-major
  void* weight_grad = nullptr;     // [N, D] row-major, accumulated into
};

// How many variants take the problem: 0 unless compiled in, on compute capability 9.0, a 16-bit
// dtype, N and D multiples of 8 (TMA's 16-byte rows), every size in int32 and the pointers
// 16-byte aligned.
int cutlass_sm90_wgrad_variants(const CutlassSm90WgradArgs& a);

// Enqueues variant `variant`. False, with nothing launched, when it does not take the problem,
// CUTLASS refuses it or the workspace is too small.
bool cutlass_sm90_wgrad(int variant, const CutlassSm90WgradArgs& a, const Workspace& ws, cudaStream_t stream);

}  // namespace fused_dense::core
