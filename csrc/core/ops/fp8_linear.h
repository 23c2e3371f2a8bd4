// The FP8 GEMM of a linear layer (compute capability 8.9 and up), on operands quantized by the
// pass of elementwise/fp8_quantize.h (per-tensor scaling, described there).
#pragma once

#include <cstdint>

#include "core/common/types.h"
#include "core/ops/linear.h"

namespace fused_dense::core {

// out[B, N] = (input[B, K] . weight[N, K]^T) * input_scale_inv * weight_scale_inv (+ bias[N]),
// input and weight FP8 (not both e5m2), K-major, out and bias ctx.dtype. K and N multiples of 16,
// pointers 16-byte aligned. heuristic >= 0 picks that entry of cuBLASLt's list, otherwise its first.
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

}  // namespace fused_dense::core
