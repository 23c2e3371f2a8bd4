// The FP8 GEMM of a linear layer (compute capability 8.9 and up), on operands quantized by the
// pass of elementwise/fp8_quantize.h (per-tensor scaling, described there), and an MLP's fc1
// forward: that GEMM and the quantize pass of its activation, with the choice of path between
// the cutlass_sm90 FP8 kernel and the two ops.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/common/types.h"
#include "core/ops/linear.h"

namespace fused_dense::core {

// out[B, N] = (input[B, K] . weight[N, K]^T) * input_scale_inv * weight_scale_inv (+ bias[N]),
// input and weight FP8 (not both e5m2), K-major, out and bias ctx.dtype. K and N multiples of 16
// (K 0: the empty sum, out = bias or zeros),
// pointers 16-byte aligned. heuristic >= 0 picks that entry of cuBLASLt's list; kHeuristicAuto the
// tuner's choice among them (tuner.h; the rule: its first); kHeuristicUnfused its first.
// fast_accum: Hopper's fast FP8 accumulation (fewer promotions to full fp32), the forward's choice.
struct Fp8LinearArgs {
  int64_t batch = 0, in_features = 0, out_features = 0;
  const void* input = nullptr;
  Fp8Format input_format = Fp8Format::kE4M3;
  const void* weight = nullptr;
  Fp8Format weight_format = Fp8Format::kE4M3;
  const float* input_scale_inv = nullptr;
  const float* weight_scale_inv = nullptr;
  const void* bias = nullptr;
  void* out = nullptr;
  bool fast_accum = false;
  int heuristic = kHeuristicAuto;
};

void fp8_linear(const LinearContext& ctx, const Fp8LinearArgs& args);

// An MLP's fc1 forward: pre = fp8_linear(input, weight, bias, fast_accum) in ctx.dtype, then
// fp8_quantize of v = act(pre) into e4m3 (rowwise, and data_t where set) with `scale` (delayed
// scaling) or with the scale of its amax (scale null: current scaling). Where the cutlass_sm90 FP8
// kernel fits (cutlass_sm90_fp8_forward_fits) it runs both in one GEMM (delayed scaling) or one
// GEMM that records the amax of act(pre) and one cast pass (current scaling); else fp8_linear's
// GEMM and fp8_quantize's passes. The bytes of data / data_t and the amax are fp8_quantize's of
// pre either way. The path is a function of the device, the shapes, ctx.dtype and the activation
// only, and fp8_linear's GEMM keys its tuned choice by the same (tuner.h), so a recomputation
// (checkpoint level 2, with the forward's scale) takes the forward's GEMM and gives its bits.
// pre_scale_inv_out set: pre's own e4m3 copy as well (into pre_data; null only when B is 0) and
// its scale_inv, at pre's own amax (current scaling whatever `scale`), the bytes fp8_quantize gives
// pre alone; its amax is recorded by the cutlass_sm90 GEMM or joins the amax pass, its cast joins
// the activation's cast pass (delayed scaling on the cutlass_sm90 kernel: one cast pass of its
// own).
struct Fp8LinearActArgs {
  int64_t batch = 0, in_features = 0, out_features = 0;  // B, K, N: K and N multiples of 16
  const void* input = nullptr;                           // e4m3 [B, K]
  const void* weight = nullptr;                          // e4m3 [N, K]
  const float* input_scale_inv = nullptr;                // one float each
  const float* weight_scale_inv = nullptr;
  const void* bias = nullptr;                            // [N] in ctx.dtype, or null
  Activation activation = Activation::kGeluTanh;         // gelu_approx, relu or sqrelu
  const float* scale = nullptr;                          // delayed scaling's scale; null: current scaling
  void* pre = nullptr;                                   // [B, N] in ctx.dtype
  uint8_t* data = nullptr;                               // e4m3 [B, N]
  uint8_t* data_t = nullptr;                             // e4m3 [N, fp8_padded_rows(B)], or null
  float* scale_out = nullptr;                            // one float each
  float* scale_inv_out = nullptr;
  float* amax = nullptr;
  uint8_t* pre_data = nullptr;                           // e4m3 [B, N], with pre_scale_inv_out
  float* pre_scale_inv_out = nullptr;                    // set: pre's copy is made
};

// Bytes of workspace fp8_linear_act needs (the GEMM's, then the quantize pass's, in turn, and
// pre's amax between them).
std::size_t fp8_linear_act_workspace_bytes(int device, DType dtype, const Fp8LinearActArgs& args);
void fp8_linear_act(const LinearContext& ctx, const Fp8LinearActArgs& args);

}  // namespace fused_dense::core
