// The library's cutlass_sm90 forward kernel for Hopper (CUTLASS 3, sm_90a), for the one case the
// MLP spends most on: out = gelu_approx(input @ weight^T + bias) with the pre-activation saved.
// The epilogue adds the bias to the fp32 accumulator, stores it rounded as pre_act and applies
// GELU to the fp32 value for out (activation_math.cuh's formula), both stores through TMA, one
// warp group's epilogue running under the other's MMAs (ping-pong). cuBLASLt's GELU_AUX_BIAS
// epilogue takes 1.27x torch.mm's time at 8192 x 1024 -> 4096 on the H200 (docs/performance.md).
//
// Compiled in when the build finds CUTLASS's headers and targets sm_90a
// (FUSED_DENSE_WITH_CUTLASS_SM90A, setup.py); otherwise it offers no variant.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/gemm/gemm.h"
#include "core/common/types.h"

namespace fused_dense::core {

struct CutlassSm90ForwardArgs {
  int device = 0;
  int64_t batch = 0, in_features = 0, out_features = 0;  // B, K, N as in LinearActArgs
  DType dtype = DType::kBFloat16;
  Activation activation = Activation::kGeluTanh;
  const void* input = nullptr;   // [B, K]
  const void* weight = nullptr;  // [N, K]
  const void* bias = nullptr;    // [N]
  void* out = nullptr;           // [B, N]
  void* pre_act = nullptr;       // [B, N]
};

// How many variants the tuner may time (kNumEpilogueTiles epilogue sub-tiles times
// kCutlassOrders tile-scheduler orders, numbered as tuner.h says); 0 unless the kernel is
// compiled in, the device is compute capability 9.0, the activation is gelu_approx with a bias
// and a saved pre-activation, the dtype fp16 / bf16, K and N multiples of 8 and every pointer
// 16-byte aligned.
int cutlass_sm90_forward_variants(const CutlassSm90ForwardArgs& a);

// Enqueues variant `variant` on the stream. False, with nothing launched, when the problem does
// not fit (checked on every call: a tuned shape may come back at another offset), CUTLASS
// refuses it, or the workspace is too small.
bool cutlass_sm90_forward(int variant, const CutlassSm90ForwardArgs& a, const Workspace& ws, cudaStream_t stream);

}  // namespace fused_dense::core
