// The FP8 family's CUDA quantize pass into allocated outputs (cuda/fp8.cpp), for the CUDA kernels
// of other families that quantize what they produce (cuda/norm.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "torch/fp8.h"

namespace fused_dense {

// The quantize pass (core/elementwise/fp8_quantize.h) of x into res (empty_fp8_quantize's
// outputs), on x's device and current stream; scale: delayed scaling's, or null (current);
// known_amax: current scaling's amax of v, already recorded (fp8_linear_act's GEMM, norm_fp8's
// norm kernel), in place of the amax pass; pre_scale_inv: pre is e4m3 with that scale_inv;
// input_data / input_scale_inv: x's own e4m3 copy as well (forward with an activation).
void quantize_into(const at::Tensor& x, const std::optional<at::Tensor>& pre, int64_t activation, bool backward,
                   int64_t fp8_format, const float* scale, const float* known_amax, bool rowwise, bool columnwise,
                   bool column_sums, Fp8QuantizeResult& res, const float* pre_scale_inv = nullptr,
                   uint8_t* input_data = nullptr, float* input_scale_inv = nullptr);

}  // namespace fused_dense
