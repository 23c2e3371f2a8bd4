// The library's cutlass_sm90 data-gradient kernel for Hopper, built on CUTLASS 3's
// warp-specialized sm_90a kernels: d_input = (d_output @ weight) * act'(pre_act) in one kernel,
// the activation backward applied in the epilogue to the fp32 accumulator (activation_math.cuh's
// derivative); with activation none, the plain product (CUTLASS's GEMM beats torch.mm's at these
// layouts). cuBLASLt's DGELU epilogues are slower than its plain GEMM + fused_dense's elementwise
// pass on the H200; this kernel takes 0.72-0.79x that pair's time at d <= 4096
// (docs/performance.md). With gelu_approx the epilogue also writes
// fp32 partial sums of each output tile's columns, and a small kernel adds them into the bias
// gradient; CUTLASS's stock in-epilogue reduction, which finishes the sums inside the GEMM, makes
// the kernel slower than the pair. Activation none sums the finished d_input instead.
//
// Compiled in when the build finds CUTLASS's headers and targets sm_90a
// (FUSED_DENSE_WITH_CUTLASS_SM90A, setup.py); otherwise it offers no variant.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/gemm/gemm.h"
#include "core/common/types.h"

namespace fused_dense::core {

struct CutlassSm90DgradArgs {
  int device = 0;
  int64_t batch = 0, in_features = 0, out_features = 0;  // B, K, N as in ActLinearDgradArgs
  DType dtype = DType::kBFloat16;
  Activation activation = Activation::kGeluTanh;
  const void* weight = nullptr;    // [N, K]
  const void* d_output = nullptr;  // [B, N]
  const void* pre_act = nullptr;   // [B, K]
  void* d_input = nullptr;         // [B, K]
  void* d_bias = nullptr;          // [K], the column sums of d_input; null: not computed
};

// How many variants the tuner may time for this problem (tile configurations times
// kCutlassOrders tile-scheduler orders, numbered as tuner.h says: two epilogue sub-tiles with
// gelu_approx, one configuration without activation);
// 0 when the kernel is not compiled in, the device is not compute capability 9.0, or the dtype
// (fp16 / bf16), activation (gelu_approx or none), widths (multiples of 8) or pointer alignment
// (16 bytes) do not fit.
int cutlass_sm90_dgrad_variants(const CutlassSm90DgradArgs& a);

// Enqueues variant `variant` on the stream, and the bias gradient when d_bias is set. The
// workspace holds CUTLASS's scratch and then the epilogue's partial sums (B * K / 32 bytes
// with gelu_approx); when these do not fit, the bias gradient comes from the column-sum kernel,
// which needs K * 4 bytes. False, with nothing launched, when the problem does not fit (checked
// on every call: a tuned shape may come back at another offset), CUTLASS refuses it, or the
// workspace is too small for CUTLASS.
bool cutlass_sm90_dgrad(int variant, const CutlassSm90DgradArgs& a, const Workspace& ws, cudaStream_t stream);

}  // namespace fused_dense::core
