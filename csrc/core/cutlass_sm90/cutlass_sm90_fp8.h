// The library's cutlass_sm90 FP8 forward kernels of an MLP's fc1 for Hopper (CUTLASS 3, sm_90a).
// With delayed scaling (scale set), where the scale of fc1's FP8 output is known before the GEMM:
//   pre    = round(input_q . weight_q^T * input_scale_inv * weight_scale_inv + bias)  (model dtype)
//   v      = act(pre)                      (fp32, from the rounded pre: activation_math.cuh's fast form)
//   data   = saturate(v * scale)           e4m3, [B, N] row-major
//   data_t = the same bytes transposed     [N, B], when set
//   amax   = max |v|                       (NaN if any v is NaN; atomically maxed into *amax)
//   pre_amax = max |pre|                   where set (the same rule), for pre's own e4m3 copy
// With current scaling (scale null), where the scale follows from this amax: pre and amax only
// (data and data_t are not written); fp8_quantize then casts act(pre) with the amax given.
// All from the epilogue of the one GEMM (input_q [B, K], weight_q [N, K], both e4m3, K-major;
// Hopper's fast FP8 accumulation, as the library's other forward FP8 GEMMs). This is fp8.h's
// fp8_linear followed by fp8_quantize (v = act(pre)) with fewer passes: the same values, and the
// bytes of data / data_t and the amax are those fp8_quantize gives for this pre (the same math in
// the same order); pre itself is this GEMM's rounding of the accumulator, which can differ from
// cuBLASLt's in the last bit, and is the same bits in both forms (the same mainloop and Z).
//
// The epilogue is a CUTLASS visitor tree over TMA stores: in CUTLASS's column-major terms the GEMM
// is D[N, B] = W[N, K] * x^T[K, B] as the library's bf16 forward (cutlass_sm90_forward.h). With
// delayed scaling D is data, and pre and data_t (a row-major store of the same tile) are auxiliary
// stores; with current scaling pre is the one auxiliary store and there is no D. 128 x 128 x 128 tiles, 1 x 2 clusters, ping-pong, 64 x 32 epilogue
// sub-tiles (cutlass_sm90_fp8_common.cuh has the measurements). The amax is reduced across each
// warp before its atomic.
//
// Compiled in when the build finds CUTLASS's headers and targets sm_90a
// (FUSED_DENSE_WITH_CUTLASS_SM90A, setup.py); otherwise cutlass_sm90_fp8_forward_fits is false.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/gemm/gemm.h"
#include "core/common/types.h"

namespace fused_dense::core {

struct CutlassSm90Fp8ForwardArgs {
  int device = 0;
  int64_t batch = 0, in_features = 0, out_features = 0;  // B, K, N
  DType dtype = DType::kBFloat16;                         // of pre and bias
  Activation activation = Activation::kGeluTanh;
  const void* input = nullptr;               // e4m3 [B, K]
  const void* weight = nullptr;              // e4m3 [N, K]
  const float* input_scale_inv = nullptr;    // one float each
  const float* weight_scale_inv = nullptr;
  const void* bias = nullptr;                // [N] or null
  const float* scale = nullptr;              // the scale of data / data_t; null: current scaling
  void* pre = nullptr;                       // [B, N]
  uint8_t* data = nullptr;                   // [B, N] (delayed scaling)
  uint8_t* data_t = nullptr;                 // [N, B] or null (delayed scaling)
  float* amax = nullptr;                     // one float, reset to 0 by the call
  float* pre_amax = nullptr;                 // one float or null, reset to 0 by the call
};

// Whether the kernel takes the problem: compiled in, compute capability 9.0, activation
// gelu_approx (the MLP's default; the others run as fp8_linear + fp8_quantize), dtype bf16 (the
// FP8 recipes' model dtype; fp16 runs as the two kernels), B, K and N multiples of 16 (B for the
// transposed store's rows, unpadded), the input pointers 16-byte aligned. The outputs are not
// looked at, so a caller can ask before it allocates them. A pure function of these, so a
// recomputation of the same problem takes the same path.
bool cutlass_sm90_fp8_forward_fits(const CutlassSm90Fp8ForwardArgs& a);

// Enqueues the kernel. False, with no GEMM launched, when it does not fit, an output pointer is
// null or misaligned, CUTLASS refuses the problem or the workspace is too small.
bool cutlass_sm90_fp8_forward(const CutlassSm90Fp8ForwardArgs& a, const Workspace& ws, cudaStream_t stream);

}  // namespace fused_dense::core
